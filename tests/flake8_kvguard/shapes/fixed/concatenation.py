def finish(allocator, seq, fork) -> None:
    allocator.free(list(dict.fromkeys(seq.block_ids + fork.block_ids)))
