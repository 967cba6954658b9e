"""Owner labels: who a block was handed out for (a request id, a test's node id).

``with kvguard.owner(label):`` makes a label active in the current context (thread or task);
every site the guard captures inside carries its interned number, so reports, ``Guard.live``
and the pytest plugin's leak checks can say whose a block is. Labels are interned to small ints
so a site key stays a tuple of ints and the ledger stores no label per block.
"""

from __future__ import annotations

from contextvars import ContextVar

ACTIVE_OWNER: ContextVar = ContextVar("kvguard_owner", default=0)
"""The interned number of the owner active in this context (0: none). The guard's fast paths
read it with ``ACTIVE_OWNER.get()`` rather than through ``current_owner()``, which looks the
label up."""


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


class owner:
    """``with kvguard.owner("req-7"):`` blocks handed out inside belong to "req-7".

    Reports name the owner of a block, and ``Guard.live`` / leak checks can filter by it. The
    pytest plugin sets each test's node id as the owner while it runs.
    """

    def __init__(self, label) -> None:
        self._index = OWNERS.intern(label)
        self._token = None

    def __enter__(self):
        self._token = ACTIVE_OWNER.set(self._index)
        return self

    def __exit__(self, *exc) -> None:
        ACTIVE_OWNER.reset(self._token)


def current_owner() -> object:
    """The label active in this context (None outside any ``kvguard.owner`` block)."""
    return OWNERS.labels[ACTIVE_OWNER.get()]
