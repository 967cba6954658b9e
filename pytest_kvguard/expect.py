"""Violations a test meant to cause: caught by ``pytest.raises``, or declared with ``expect()``.

A test that says ``with pytest.raises(kvguard.KVGuardError):`` (or ``ValueError``, which the
bad-input kinds also are, as DeepSpeed's own tests say for invalid frees) asserts the misuse it
provokes. While the plugin runs, the ``__exit__`` of pytest's raises contexts (and of
unittest's ``assertRaises``) is wrapped: when it catches an exception, every ``KVGuardError`` in
it (its cause and context chain, exception groups included) has its violation marked
``expected``. The exception object itself carries the violation, so the mark is exact: a
violation swallowed elsewhere in the same block is still unexpected.
"""

from __future__ import annotations

import builtins
import importlib

from kvguard import KVGuardError, kinds

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


class RaisesHook:
    """Wraps the raises contexts' ``__exit__`` while installed; ``on_caught(violation)`` runs
    for each violation whose exception a context caught."""

    def __init__(self, on_caught) -> None:
        self._on_caught = on_caught
        self._saved: list = []

    def install(self) -> None:
        for module_name, class_name in _CONTEXTS:
            try:
                cls = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError):
                continue
            original = cls.__dict__.get("__exit__")
            if original is None:
                continue
            self._saved.append((cls, original))
            cls.__exit__ = self._wrap(original)

    def uninstall(self) -> None:
        while self._saved:
            cls, original = self._saved.pop()
            cls.__exit__ = original

    def _wrap(self, original):
        on_caught = self._on_caught

        def __exit__(self, exc_type, exc_value, traceback):
            __tracebackhide__ = True
            caught = original(self, exc_type, exc_value, traceback)
            if caught and exc_value is not None:
                try:
                    for error in kvguard_errors(exc_value):
                        on_caught(error.violation)
                except Exception:  # never break the test's own assertion
                    pass
            return caught

        __exit__.__wrapped__ = original
        return __exit__


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

    def __init__(self, state, kind) -> None:
        self.kind = kind_of(kind)
        self._state = state
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
        return self

    def __exit__(self, exc_type, exc_value, traceback):
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
