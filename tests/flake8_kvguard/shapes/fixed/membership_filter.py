import torch


def still_used(allocator, block_table: torch.Tensor, freed: set[int]) -> list:
    kept = [b for b in block_table.tolist() if b not in freed]
    allocator.free(list(freed))
    return kept
