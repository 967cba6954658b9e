import torch

from .release_by_behaviour import PagePool


class TokenAllocator:
    def free(self, free_index: torch.Tensor) -> None:
        if torch.unique(free_index).numel() != free_index.numel():
            raise ValueError("repeated ids")
        self.free_tokens = torch.cat((self.free_tokens, free_index))


class ListAllocator:
    def free(self, blocks: list) -> None:
        if len(set(blocks)) != len(blocks):
            raise ValueError("repeated ids")
        self.free_list.extend(blocks)


def make_pool():
    return PagePool(16)


class Runner:
    def __init__(self, cache: TokenAllocator):
        self.pool = make_pool()
        self._cache = cache

    def finish(self, ids: torch.Tensor) -> None:
        self.pool.deallocate_pages(ids.tolist())
        self._cache.free(ids)
