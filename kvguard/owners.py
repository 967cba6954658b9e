"""Owner labels: who a block was handed out for (a request id, a test's node id).

Two things are told apart, because they answer two questions:

- the *label* a site carries (``ACTIVE_OWNER``): whose work it was, for reports and for the
  pytest plugin's leak checks (a test's node id). Every site the guard captures inside carries
  its interned number.
- the *holder* (``ACTIVE_HOLDER``): the request that takes a reference to a block and must be
  the one that gives it back. The ledger keeps it per block (one uint32), and a release by a
  holder that holds no reference while another holder does is a ``stale-free``: the late
  free of a request whose block was already handed on.

``with kvguard.owner(label):`` sets both (a user's own request label). The engines' adapters
set the holder alone at the request boundary (``holding``, ``Boundary``), so a test's label
still attributes what its requests leak; the plugin sets the label alone (``labelled``). Labels
are interned to small ints so a site key stays a tuple of ints.

A boundary is synchronous: nothing else runs on its thread until it returns. So it sets the
holder in a per-thread slot (one C integer saved and restored with the compiled part, else a
``threading.local``), not in the context variable, whose set and reset allocate and cost as
much as the manager's own work per request. ``holder_now()`` reads the slot, else the context
variable; ``kvguard.owner`` entered inside a boundary clears the slot for its block, so the
innermost of the two decides. Asyncio tasks and threads inherit the context variable
(``follow_threads`` carries the holder in force).
"""

from __future__ import annotations

from contextvars import ContextVar

import threading

from .compiled import FASTPATH

ACTIVE_OWNER: ContextVar = ContextVar("kvguard_owner", default=0)
"""The interned number of the owner active in this context (0: none). The guard's fast paths
read it with ``ACTIVE_OWNER.get()`` rather than through ``current_owner()``, which looks the
label up."""

ACTIVE_HOLDER: ContextVar = ContextVar("kvguard_holder", default=0)
"""The interned number of the holder active in this context (0: none, and then no ownership
check is made). Read on the guard's fast paths (the closures and the compiled wrappers)."""


class _Owners:
    """Interns owner labels (a request id, a test's node id) to small ints; 0 is "no owner".

    Bounded: a server labelling every request would otherwise grow it forever. Past
    ``capacity`` labels, new ones share one overflow label (reports then say so)."""

    OVERFLOW = "<more owners than kvguard keeps>"

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.capacity = capacity
        self.labels: list = [None]
        self.index: dict = {}

    def intern(self, label) -> int:
        if label is None:
            return 0
        try:
            return self.index[label]
        except KeyError:
            if len(self.labels) > self.capacity:
                label = self.OVERFLOW
                if label in self.index:
                    return self.index[label]
            self.index[label] = n = len(self.labels)
            self.labels.append(label)
            return n
        except TypeError:
            return self.intern(repr(label))


OWNERS = _Owners()
"""One table per process: ``OWNERS.labels[n]`` is label number ``n``, ``OWNERS.index`` the
reverse."""
_INDEX = OWNERS.index


class owner:
    """``with kvguard.owner("req-7"):`` blocks handed out inside belong to "req-7".

    Reports name the owner of a block, and ``Guard.live`` / leak checks can filter by it. It
    is also the blocks' holder: a free inside ``kvguard.owner("req-9")`` of a block "req-7"
    holds (and "req-9" does not) is a ``stale-free``. ``owner(None)`` clears both inside.
    """

    _sets_label = True
    _sets_holder = True

    def __init__(self, label) -> None:
        self._index = OWNERS.intern(label)
        self._tokens = None

    def __enter__(self):
        holder = self._sets_holder
        self._tokens = (ACTIVE_OWNER.set(self._index) if self._sets_label else None,
                        ACTIVE_HOLDER.set(self._index) if holder else None,
                        swap_holder(-1) if holder else None)  # inside a boundary: this decides
        return self

    def __exit__(self, *exc) -> None:
        label, holder, slot = self._tokens
        if holder is not None:
            swap_holder(slot)
            ACTIVE_HOLDER.reset(holder)
        if label is not None:
            ACTIVE_OWNER.reset(label)


class labelled(owner):
    """``owner`` for attribution alone: sites carry the label, no holder is set (the pytest
    plugin's test labels: a block a module-scoped fixture allocated in one test may well be
    freed in the next)."""

    _sets_holder = False


class _Slot(threading.local):
    value = -1


_SLOT = _Slot()


def _py_holder_now() -> int:
    """The holder in force on this thread (0: none): a boundary's, else ``ACTIVE_HOLDER``'s."""
    value = _SLOT.value
    return value if value >= 0 else ACTIVE_HOLDER.get()


def _py_swap_holder(value: int) -> int:
    """Set this thread's boundary holder (-1: none, the context variable decides); the old."""
    old, _SLOT.value = _SLOT.value, value
    return old


class _PyHolding:
    """``holding`` without the compiled part: the same slot, a ``threading.local``."""

    __slots__ = ("index", "_saved")

    def __init__(self, label) -> None:
        try:
            index = _INDEX.get(label)
        except TypeError:  # unhashable: interned by its repr
            index = None
        self.index = index if index is not None else OWNERS.intern(label)

    def __enter__(self):
        self._saved, _SLOT.value = _SLOT.value, self.index
        return self

    def __exit__(self, *exc) -> None:
        _SLOT.value = self._saved


def _py_boundary(original, skip: int = 1, position: int = -1, name=None, attr=None):
    """``Boundary`` without the compiled part: ``original`` run as the holder its argument at
    ``skip + position`` (or passed as ``name``; its attribute ``attr``) names."""
    at = skip + position

    def boundary(*args, **kwargs):
        try:
            value = args[at] if position >= 0 and len(args) > at else kwargs.get(name, None) \
                if name is not None else None
            label = value if attr is None or value is None else getattr(value, attr, None)
            index = None if label is None else _PyHolding(label).index
        except Exception:  # not this engine's request: the method decides
            index = None
        if index is None:
            return original(*args, **kwargs)
        saved, _SLOT.value = _SLOT.value, index
        try:
            return original(*args, **kwargs)
        finally:
            _SLOT.value = saved
    return boundary


if FASTPATH is not None and hasattr(FASTPATH, "Boundary"):
    FASTPATH.bind_holders(ACTIVE_HOLDER, _INDEX, OWNERS.intern)
    holder_now, swap_holder = FASTPATH.holder_now, FASTPATH.swap_holder
    holding, Boundary = FASTPATH.Holding, FASTPATH.Boundary
else:
    holder_now, swap_holder = _py_holder_now, _py_swap_holder
    holding, Boundary = _PyHolding, _py_boundary
# ``with holding(request_id):`` the holder alone, for a synchronous block: what the engines'
# adapters set at the request boundary, leaving the label (a test's node id) in place. Entered
# once per request per engine step: one dictionary read and a slot saved and restored.


def current_holder() -> object:
    """The holder active in this context (None outside any holder)."""
    return OWNERS.labels[holder_now()]


_thread_start = None


def follow_threads() -> None:
    """Threads started from now on run under the label and holder active where ``start()`` was
    called, as asyncio tasks already do: a leak or a violation in an engine's own worker thread
    is attributed to the test (or request) that started it. Idempotent; ``unfollow_threads``
    undoes it."""
    global _thread_start
    if _thread_start is not None:
        return
    original = threading.Thread.start

    def start(self, *args, **kwargs):
        label, holder = ACTIVE_OWNER.get(), holder_now()
        if label or holder:
            run = self.run

            def run_as_started():
                ACTIVE_OWNER.set(label)
                ACTIVE_HOLDER.set(holder)
                return run()
            self.run = run_as_started
        return original(self, *args, **kwargs)

    start.__wrapped__ = original
    start.__kvguard_follow__ = True
    _thread_start = original
    threading.Thread.start = start


def unfollow_threads() -> None:
    global _thread_start
    if _thread_start is None:
        return
    if getattr(threading.Thread.start, "__kvguard_follow__", False):
        threading.Thread.start = _thread_start
    _thread_start = None


def current_owner() -> object:
    """The label active in this context (None outside any ``kvguard.owner`` block)."""
    return OWNERS.labels[ACTIVE_OWNER.get()]
