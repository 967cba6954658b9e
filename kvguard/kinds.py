"""The violation kinds, each with the one-line meaning reports print (docs/reference.md).

The first seven, and ``stale-free``, are bad input to ``free()``: their exceptions are also ``ValueError`` so callers
that expect ``ValueError`` from a correct allocator keep working.
"""

DOUBLE_FREE = "double-free"
DUPLICATE_ID = "duplicate-id"
BOOL_ID = "bool-id"
TENSOR_ID = "tensor-id"
INVALID_ID = "invalid-id"
FOREIGN_ID = "foreign-id"
CONSUMED_ITERABLE = "consumed-iterable"
SHARED_BLOCK = "shared-block"
STALE_FREE = "stale-free"
FREE_IN_FLIGHT = "free-in-flight"
STALE_TABLE = "stale-table"
WRITE_AFTER_FREE = "write-after-free"
LEAK = "leak"
INCONSISTENT = "inconsistent"

MEANING = {
    DOUBLE_FREE: "an id that is currently free is freed again",
    DUPLICATE_ID: "the same id appears more than once in one call",
    BOOL_ID: "a bool is given as a block id",
    TENSOR_ID: "a torch tensor reaches a free() that does not take tensors",
    INVALID_ID: "a negative, out-of-range or non-integer block id",
    FOREIGN_ID: "an in-range id this allocator never handed out",
    CONSUMED_ITERABLE: "a one-shot iterator was passed where the allocator iterates twice",
    STALE_FREE: "a request frees a block it no longer holds, which another request now holds",
    SHARED_BLOCK: "one block is held by two owners at once",
    FREE_IN_FLIGHT: "a block a step still in flight uses is handed out again",
    STALE_TABLE: "a block table references a block that is free or someone else's",
    WRITE_AFTER_FREE: "the contents of a freed block changed before it was handed out again",
    LEAK: "blocks still live at a checkpoint",
    INCONSISTENT: "the allocator's own free count disagrees with the ledger",
}

BAD_INPUT = frozenset(
    (DOUBLE_FREE, DUPLICATE_ID, BOOL_ID, TENSOR_ID, INVALID_ID, FOREIGN_ID, CONSUMED_ITERABLE,
     STALE_FREE)
)

ALL = tuple(MEANING)

# When one call carries several faults, the report leads with the one whose cause is earliest:
# a malformed argument explains the bad ids that follow from it.
PRECEDENCE = {kind: rank for rank, kind in enumerate((
    CONSUMED_ITERABLE, TENSOR_ID, BOOL_ID, INVALID_ID, DUPLICATE_ID, FOREIGN_ID, DOUBLE_FREE,
    STALE_FREE, SHARED_BLOCK, FREE_IN_FLIGHT, STALE_TABLE, WRITE_AFTER_FREE, INCONSISTENT, LEAK,
))}
