"""Allocators that do to the process what no allocator should: hang, exit, fork. The fuzzer's
containment tests (``test_fuzz_contained.py``) fuzz them in a subprocess of their own, so that
a containment that fails hangs or ends that subprocess, never the test run."""

import os
import sys
import threading
import time

from kvguard import AllocatorSpec
from kvguard.conformance.lifecycle_example import ExampleDriver, ExampleScheduler


class Pool:
    """A correct pool; each subclass breaks one method."""

    def __init__(self, n: int = 4) -> None:
        self.n = n
        self.free_list = list(range(n))

    def allocate(self, k: int) -> list:
        if k > len(self.free_list):
            raise ValueError("not enough blocks")
        out, self.free_list = self.free_list[:k], self.free_list[k:]
        return out

    def free(self, ids) -> None:
        ids = list(ids)
        if len(set(ids)) != len(ids):
            raise ValueError("an id twice")
        for b in ids:
            if type(b) is not int or not 0 <= b < self.n or b in self.free_list:
                raise ValueError(f"bad id {b!r}")
        self.free_list.extend(ids)  # noqa: KVG202 -- type(b) is int above

    def count(self) -> int:
        return len(self.free_list)


SPEC = AllocatorSpec(size="n", free_count="count")
STOP = threading.Event()
"""Ends ``SpinInFree``'s loop: a thread left spinning must not outlive its test."""


class LoopInFree(Pool):
    def free(self, ids) -> None:
        while not STOP.is_set():
            pass


class SleepInFree(Pool):
    def free(self, ids) -> None:
        time.sleep(3600)


class ExitInFree(Pool):
    def free(self, ids) -> None:
        sys.exit(0)


class InterruptInAllocate(Pool):
    def allocate(self, k: int) -> list:
        raise KeyboardInterrupt


class GeneratorExitInFree(Pool):
    def free(self, ids) -> None:
        raise GeneratorExit


class ForkInFree(Pool):
    """Forks in its first ``free`` of the process; the child, were it let run, would leave a
    mark and go on fuzzing (once: never a chain of forks, whatever the containment does)."""

    MARK = os.environ.get("KVGUARD_TEST_FORK_MARK", "")
    forked = False

    def free(self, ids) -> None:
        if not ForkInFree.forked:
            ForkInFree.forked = True
            if os.fork() == 0 and self.MARK:
                with open(f"{self.MARK}.{os.getpid()}", "w") as out:
                    out.write("the child ran on\n")
        super().free(ids)


class ExitInInit(Pool):
    def __init__(self, n: int = 4) -> None:
        raise SystemExit(0)


class SlowPool(Pool):
    """Correct and slow: a run long enough for the user to press Ctrl-C in."""

    def free(self, ids) -> None:
        time.sleep(0.002)
        super().free(ids)


class HangingScheduler(ExampleScheduler):
    """The example scheduler, stuck in its third step."""

    def schedule(self):
        self.steps_scheduled = getattr(self, "steps_scheduled", 0) + 1
        if self.steps_scheduled >= 3:
            time.sleep(3600)
        return super().schedule()


class ExitingScheduler(ExampleScheduler):
    def abort_request(self, rid: str) -> None:
        sys.exit(0)


def hanging_engine():
    return HangingScheduler(4, 2, async_scheduling=True, defer_frees=True)


def exiting_engine():
    return ExitingScheduler(4, 2, async_scheduling=True, defer_frees=True)


class Driver(ExampleDriver):
    name = "TestScheduler"
