"""kvguard: AddressSanitizer for the paged KV caches of LLM inference engines.

Guard a block allocator and every misuse of its ids (a double free, a duplicated id, a bool or a
tensor passed as ids, a drained generator, a block handed to two owners) fails at the faulty
call with an ASan-style report, instead of silently handing one KV block to two requests.

    import kvguard
    g = kvguard.guard(allocator)          # in place; the same object keeps working
    allocator.free([0, 0, 1])             # kvguard.DuplicateIdError (a ValueError), nothing freed

This module imports only the standard library: torch and numpy are read only when the guarded
code itself passes them, and the pytest/flake8 faces live in their own packages.

PYTEST_DONT_REWRITE: pytest marks an installed plugin's packages for assertion rewriting and
warns when they are already imported (a pytester run inside a session that imported them);
this is library code, not test code, so it is never rewritten and never warned about.
"""

from . import kinds
from .errors import (
    BadFreeError, BoolIdError, ConsumedIterableError, DoubleFreeError, DuplicateIdError,
    ForeignIdError, FreeInFlightError, InconsistentError, InvalidIdError, KVGuardError, LeakError,
    SharedBlockError, StaleFreeError, StaleTableError, TensorIdError, WriteAfterFreeError,
)
from .guard import Guard, Stats, guard, guard_of, guards, subscribe
from .ledger import LiveBlock
from .owners import current_holder, current_owner, owner
from .registry import instrument, instrumented, register, registered, uninstrument, unregister
from .violation import Violation
from .spec import AllocatorSpec

__version__ = "0.1.0"

__all__ = [
    "AllocatorSpec", "BadFreeError", "BoolIdError", "ConsumedIterableError", "DoubleFreeError",
    "DuplicateIdError", "ForeignIdError", "FreeInFlightError", "Guard", "InconsistentError",
    "InvalidIdError", "KVGuardError", "LeakError", "LiveBlock", "SharedBlockError",
    "StaleFreeError", "StaleTableError", "Stats", "TensorIdError", "Violation",
    "WriteAfterFreeError", "current_holder", "current_owner", "guard", "guard_cache", "guard_of",
    "guard_writes", "guards", "instrument", "instrumented", "kinds", "owner", "register",
    "registered", "subscribe", "uninstrument", "unregister",
]


def __getattr__(name):
    # guard_cache and guard_writes live with the tensor code; importing it here would cost
    # every user.
    if name == "guard_cache":
        from .cache.guard_cache import guard_cache
        return guard_cache
    if name == "guard_writes":
        from .cache.writes import guard_writes
        return guard_writes
    raise AttributeError(f"module 'kvguard' has no attribute {name!r}")
