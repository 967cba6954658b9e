"""Violations a test meant to cause: caught by ``pytest.raises``, or declared with ``expect()``.

While the plugin runs, the ``__enter__`` and ``__exit__`` of pytest's raises contexts and of
unittest's ``assertRaises``/``assertRaisesRegex`` (their callable forms run through the same
context managers) are wrapped, and each thread keeps the stack of the contexts it is inside.

A context that kvguard's error would satisfy (``pytest.raises(kvguard.DoubleFreeError)``, the
fixture's ``with kvguard.expect(kind):``, and ``pytest.raises(ValueError)`` too: the bad-input
kinds are ``ValueError``s, as DeepSpeed's own tests expect from its validation) gets it: when it
catches an exception, every ``KVGuardError`` in it (its cause and context chain, exception
groups included) has its violation marked ``expected``. The exception carries the violation,
so the mark is exact.

A context that kvguard's error would not satisfy (``assertRaises(AssertionError)`` around
SGLang's debug-mode check), entered by code that does not know kvguard (an engine's own suite:
no module between the context and the guarded call holds anything of kvguard's, where
kvguard-aware code may turn kvguard's error into its own) tests the engine's own defence, so the
guards step aside inside it (``kvguard.guard.step_aside_when``): the misuse is recorded and
the call reaches the allocator, whose own exception is what the test sees; the ledger then
follows the allocator. The violations stepped aside for are ``expected`` only if the context
catches an exception: one that leaves its block without the exception the test asked for (the
engine had no defence: pytest's "DID NOT RAISE") fails the test with kvguard's report too.
"""

from __future__ import annotations

import builtins
import importlib
import sys
import threading
import types

from kvguard import KVGuardError, kinds
from kvguard.guard import step_aside_when

# pytest >= 8.4 has RaisesExc and RaisesGroup; before, RaisesContext; unittest everywhere.
_CONTEXTS = (
    ("_pytest.raises", "RaisesExc"),
    ("_pytest.raises", "RaisesGroup"),
    ("_pytest.python_api", "RaisesContext"),
    ("unittest.case", "_AssertRaisesContext"),
)
_GROUP = getattr(builtins, "BaseExceptionGroup", ())


def kvguard_errors(exc: BaseException) -> list[KVGuardError]:
    """Every KVGuardError in ``exc``: itself, its ``__cause__``/``__context__`` chain, and the
    members of exception groups."""
    found, seen, stack = [], set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, KVGuardError):
            found.append(e)
        if _GROUP and isinstance(e, _GROUP):
            stack.extend(e.exceptions)
        stack.append(e.__cause__)
        stack.append(e.__context__)
    return found


def expected_types(context) -> tuple:
    """The exception classes a raises context waits for (nested matchers of a RaisesGroup
    included); empty when it names none (``pytest.raises(check=...)``)."""
    found, stack = [], [context]
    while stack:
        item = stack.pop()
        if isinstance(item, type):
            found.append(item)
            continue
        if isinstance(item, tuple):
            stack.extend(item)
            continue
        for attr in ("expected_exceptions", "expected_exception", "expected"):
            value = getattr(item, attr, None)
            if value is not None and value is not item:
                stack.append(value)
                break
    return tuple(found)


_OWN = ("kvguard", "pytest_kvguard")


def _is_kvguards(value) -> bool:
    if isinstance(value, types.ModuleType):
        name = value.__name__
    else:
        name = getattr(value, "__module__", None)
    return isinstance(name, str) and name.partition(".")[0] in _OWN


def knows_kvguard(namespace: dict) -> bool:
    """Whether a module's globals hold kvguard, or anything of it (``KVGuardError``, an example
    allocator): code there may catch kvguard's errors and raise its own."""
    try:
        # (dunders skipped: a module imported while kvguard instruments has its loader)
        return any(_is_kvguards(v) for k, v in list(namespace.items()) if k[:2] != "__")
    except Exception:
        return True


def aware_between(frame, outer) -> bool:
    """Whether a frame from ``frame`` up to ``outer`` (the one that entered a raises context)
    runs code that knows kvguard; kvguard's own frames do not count."""
    while frame is not None:
        namespace = frame.f_globals
        if str(namespace.get("__name__", "")).partition(".")[0] not in _OWN \
                and knows_kvguard(namespace):
            return True
        if frame is outer:
            return False
        frame = frame.f_back
    return False


class Expecting:
    """One raises context a thread is inside."""

    __slots__ = ("context", "types", "stepped", "frame")

    def __init__(self, context, types, frame=None) -> None:
        self.context = context
        self.frame = frame
        """The frame that entered it: the walk for kvguard-aware code stops there."""
        self.types = types
        """The exception classes it waits for; None for ``kvguard.expect()`` (kvguard's own)."""
        self.stepped: list = []
        """Violations the guards stepped aside for inside it."""

    def steps_aside_for(self, error_class) -> bool:
        """Whether kvguard's ``error_class`` would not satisfy this context (one that names no
        class waits for any exception)."""
        types = self.types
        if types is None or not types:
            return False
        return not any(issubclass(error_class, t) for t in types)


class RaisesHook:
    """Wraps the raises contexts' ``__enter__``/``__exit__`` while installed and keeps, per
    thread, the stack of those a test is inside; ``on_caught(violation)`` runs for each
    violation whose exception a context caught, or that was stepped aside for inside a context
    that caught an exception."""

    def __init__(self, on_caught) -> None:
        self._on_caught = on_caught
        self._saved: list = []
        self._local = threading.local()
        self._unset = None

    def install(self) -> None:
        for module_name, class_name in _CONTEXTS:
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError):
                continue
            enter, exit_ = cls.__dict__.get("__enter__"), cls.__dict__.get("__exit__")
            if exit_ is None:
                continue
            if enter is not None:
                self._saved.append((cls, "__enter__", enter))
                cls.__enter__ = self._wrap_enter(enter)
            self._saved.append((cls, "__exit__", exit_))
            cls.__exit__ = self._wrap_exit(exit_)
        self._unset = step_aside_when(self.stepping_aside)

    def uninstall(self) -> None:
        while self._saved:
            cls, name, original = self._saved.pop()
            setattr(cls, name, original)
        if self._unset is not None:
            self._unset()
            self._unset = None

    # --- the stack of open contexts, per thread ---

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def push(self, context, types, frame=None) -> None:
        self._stack().append(Expecting(context, types, frame))

    def pop(self, context):
        """The entry of ``context`` (and any left open inside it), or None."""
        stack = self._stack()
        for n in range(len(stack) - 1, -1, -1):
            if stack[n].context is context:
                entry = stack[n]
                for inner in stack[n + 1:]:
                    entry.stepped += inner.stepped
                del stack[n:]
                return entry
        return None

    def stepping_aside(self, error_class) -> bool:
        """Whether the innermost context this thread is inside waits for an exception that
        kvguard's ``error_class`` is not (the guards' ``step_aside_when`` predicate)."""
        stack = getattr(self._local, "stack", None)
        if not stack or not stack[-1].steps_aside_for(error_class):
            return False
        return not aware_between(sys._getframe(1), stack[-1].frame)

    def attach(self, violation) -> None:
        """A guard stepped aside for ``violation``: it is expected if the innermost context
        catches an exception."""
        stack = getattr(self._local, "stack", None)
        if stack:
            stack[-1].stepped.append(violation)

    def _wrap_enter(self, original):
        hook = self

        def __enter__(self):
            __tracebackhide__ = True
            result = original(self)
            try:
                hook.push(self, expected_types(self), sys._getframe(1))
            except Exception:  # never break the test's own assertion
                pass
            return result

        __enter__.__wrapped__ = original
        return __enter__

    def _wrap_exit(self, original):
        hook = self
        on_caught = self._on_caught

        def __exit__(self, exc_type, exc_value, traceback):
            __tracebackhide__ = True
            try:
                entry = hook.pop(self)
            except Exception:
                entry = None
            caught = original(self, exc_type, exc_value, traceback)
            try:
                if caught and exc_value is not None:
                    for error in kvguard_errors(exc_value):
                        on_caught(error.violation)
                    for violation in entry.stepped if entry is not None else ():
                        on_caught(violation)
                elif entry is not None and entry.stepped and exc_value is not None:
                    # The exception goes on to an enclosing context, which may expect it.
                    hook.carry(entry.stepped)
            except Exception:  # never break the test's own assertion
                pass
            return caught

        __exit__.__wrapped__ = original
        return __exit__

    def carry(self, violations) -> None:
        stack = getattr(self._local, "stack", None)
        if stack:
            stack[-1].stepped += violations


def kind_of(kind) -> str:
    """A kind given as its name or as its exception class (``kvguard.DoubleFreeError``)."""
    if isinstance(kind, type) and issubclass(kind, KVGuardError) and kind.kind:
        return kind.kind
    if isinstance(kind, str) and kind in kinds.MEANING:
        return kind
    raise ValueError(f"expect() takes a violation kind ({', '.join(kinds.ALL)}) or its "
                     f"exception class, not {kind!r}")


class Expectation:
    """``kvguard.expect(kind)``. Called plainly it covers the whole test: violations of that
    kind are expected, and the test fails if none happens. As a context manager it covers its
    block only: it swallows the ``KVGuardError`` of that kind (so the block reads the same in
    raise and log mode) and fails at the block's end if none was recorded inside it."""

    def __init__(self, state, kind, frames: RaisesHook | None = None) -> None:
        self.kind = kind_of(kind)
        self._state = state
        self._frames = frames
        """The plugin's raises hook: inside this block the guards raise (no stepping aside)."""
        self._start = None
        self.scoped = False
        self.met = False
        self.reported = False

    def __repr__(self) -> str:
        return f"<kvguard.expect {self.kind!r}{' (block)' if self.scoped else ''}>"

    def claim(self, records) -> None:
        for record in records:
            if record.violation.kind == self.kind:
                record.violation.expected = True
                self.met = True

    def __enter__(self):
        self.scoped = True
        self._start = len(self._state.records)
        if self._frames is not None:
            self._frames.push(self, None)
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if self._frames is not None:
            self._frames.pop(self)
        self.claim(self._state.records[self._start:])
        if exc_value is not None:
            if isinstance(exc_value, KVGuardError) and exc_value.kind == self.kind:
                exc_value.violation.expected = True
                self.met = True
                return True
            return False  # anything else goes on, unchanged
        if not self.met:
            __tracebackhide__ = True
            raise AssertionError(f"kvguard.expect({self.kind!r}): no {self.kind} violation "
                                 "happened in this block")
        return False
