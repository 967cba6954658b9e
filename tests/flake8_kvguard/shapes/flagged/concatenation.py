"""Two id lists that may share a block, concatenated into one free."""


def finish(allocator, seq, fork) -> None:
    allocator.free(seq.block_ids + fork.block_ids)  # KVG102
