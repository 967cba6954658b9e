"""The exceptions a guard raises: one class per violation kind under ``KVGuardError``."""

from __future__ import annotations

from . import kinds


class KVGuardError(Exception):
    """A violation raised into the caller; ``str()`` is the full ASan-style report."""

    kind: str = ""

    def __init__(self, violation, others=()) -> None:
        self.violation = violation
        self.others = tuple(others)
        """The other violations of the same call: recorded beside this one, not raised."""
        self.kind = violation.kind
        self.block_ids = violation.block_ids
        super().__init__(violation.headline())

    def __str__(self) -> str:
        return self.violation.render()


class BadFreeError(KVGuardError, ValueError):
    """Bad input to ``free()``: a ``ValueError`` as a correct allocator would raise."""


class DoubleFreeError(BadFreeError):
    kind = kinds.DOUBLE_FREE


class DuplicateIdError(BadFreeError):
    kind = kinds.DUPLICATE_ID


class BoolIdError(BadFreeError):
    kind = kinds.BOOL_ID


class TensorIdError(BadFreeError):
    kind = kinds.TENSOR_ID


class InvalidIdError(BadFreeError):
    kind = kinds.INVALID_ID


class ForeignIdError(BadFreeError):
    kind = kinds.FOREIGN_ID


class ConsumedIterableError(BadFreeError):
    kind = kinds.CONSUMED_ITERABLE


class StaleFreeError(BadFreeError):
    """A release by a request that holds no reference to a block another request holds: the
    late free of a request whose block was already handed on (an abort or a preemption racing
    the path that frees it)."""
    kind = kinds.STALE_FREE


class FreeInFlightError(KVGuardError):
    """A block that a step still in flight uses was handed out again before that step's
    output was processed."""
    kind = kinds.FREE_IN_FLIGHT


class SharedBlockError(KVGuardError):
    kind = kinds.SHARED_BLOCK


class StaleTableError(KVGuardError):
    kind = kinds.STALE_TABLE


class WriteAfterFreeError(KVGuardError):
    kind = kinds.WRITE_AFTER_FREE


class LeakError(KVGuardError):
    kind = kinds.LEAK


class InconsistentError(KVGuardError):
    kind = kinds.INCONSISTENT


ERROR_FOR_KIND = {
    cls.kind: cls
    for cls in (
        DoubleFreeError, DuplicateIdError, BoolIdError, TensorIdError, InvalidIdError,
        ForeignIdError, ConsumedIterableError, StaleFreeError, SharedBlockError,
        FreeInFlightError, StaleTableError,
        WriteAfterFreeError, LeakError, InconsistentError,
    )
}
assert set(ERROR_FOR_KIND) == set(kinds.ALL)
assert all(issubclass(ERROR_FOR_KIND[k], ValueError) == (k in kinds.BAD_INPUT) for k in kinds.ALL)


def error_for(violation, others=()) -> KVGuardError:
    return ERROR_FOR_KIND[violation.kind](violation, others)
