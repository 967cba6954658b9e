"""A filter testing tensor elements for membership in a set."""
import torch


def still_used(allocator, block_table: torch.Tensor, freed: set[int]) -> list:
    kept = [b for b in block_table if b not in freed]  # KVG105
    allocator.free(list(freed))
    return kept
