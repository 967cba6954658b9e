"""What the Ray tests run on their cluster's workers: an allocator of this file's own and an
actor that serves requests with it. Workers import this module by its dotted name, so it holds
no test code and imports nothing from pytest.

``TrustingPool`` checks nothing on ``free()`` (as DeepSpeed 0.19.8's ``BlockedAllocator``
checks nothing within one call): a double free goes through silently, and only kvguard sees it.
"""

from __future__ import annotations

import os

import ray

POOL = "tests.kvguard.ray_workload.TrustingPool"
"""The dotted name staging registers (``KVGUARD_REGISTER``)."""


class TrustingPool:
    """A stack of free block ids that takes back whatever it is given."""

    def __init__(self, num_blocks: int) -> None:
        self.free_ids = list(range(num_blocks))

    def allocate(self, n: int) -> list:
        taken, self.free_ids = self.free_ids[-n:], self.free_ids[:-n]
        return taken[::-1]

    def free(self, ids) -> None:
        self.free_ids.extend(ids)


@ray.remote(num_cpus=0)
class CacheWorker:
    """One engine worker: a request takes two blocks and gives them back; ``plant`` frees the
    last request's blocks a second time."""

    def __init__(self) -> None:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            import prometheus_client  # noqa: F401  (as an engine serving /metrics does)
        self.pool = TrustingPool(64)

    def serve(self, requests: int, plant: bool = False) -> int:
        ids = []
        for _ in range(requests):
            ids = self.pool.allocate(2)
            self.pool.free(ids)
        if plant:
            self.pool.free(ids)  # the planted double free
        return os.getpid()
