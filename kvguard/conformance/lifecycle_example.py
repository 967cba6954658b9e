"""A small scheduler shaped like vLLM's v1 ``Scheduler``, and its lifecycle driver.

It is the worked example of ``docs/conformance.md`` (how to write a ``LifecycleDriver`` for your
own engine) and the target of the lifecycle fuzzer's own tests, which plant the bugs engines
have shipped (``BUGS``) and check that the fuzzer finds each one, and nothing on the fixed twin.

The model: a refcounted block pool; requests wait, run (a prefill of the whole prompt, then one
token per step) and finish by EOS or length; ``schedule()`` preempts the newest running request
when the pool runs dry; with ``async_scheduling`` a step is scheduled before the previous one's
output is processed (the scheduler runs one token ahead); with ``defer_frees`` the blocks of a
request that ends while a step still reads them go back to the pool only once that step is
processed (vLLM's deferred frees).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .lifecycle import LifecycleDriver
from ..spec import AllocatorSpec

BUGS = {
    "stale-free-after-abort": "processing a step frees the blocks of a request aborted while it "
                              "was in flight, a second time",
    "free-in-flight": "an abort returns the blocks at once, though a step still in flight reads "
                      "them and frees are meant to be deferred",
    "preempt-double-free": "preemption frees the victim's blocks but leaves them in its table; "
                           "ending the request frees them again",
}


class ExamplePool:
    """Refcounted blocks; ``free`` drops one reference per id and queues a block at zero,
    without validating (as vLLM's ``BlockPool``)."""

    def __init__(self, num_blocks: int) -> None:
        self.refcount = [0] * num_blocks
        self.free_list = list(range(num_blocks))

    def allocate(self, n: int) -> list:
        if n > len(self.free_list):
            raise ValueError(f"{n} blocks asked, {len(self.free_list)} free")
        got, self.free_list = self.free_list[:n], self.free_list[n:]
        for b in got:
            self.refcount[b] = 1
        return got

    def free(self, ids) -> None:  # noqa: KVG204 -- unvalidated on purpose, as vLLM's
        for b in ids:
            self.refcount[b] -= 1  # noqa: KVG202
            if self.refcount[b] == 0:
                self.free_list.append(b)


EXAMPLE_POOL_SPEC = AllocatorSpec(alloc="allocate", free="free", refcounted=True,
                                  size=lambda pool: len(pool.refcount))


@dataclass
class ExampleRequest:
    prompt: list
    max_tokens: int
    computed: int = 0       # tokens scheduled (optimistic under async scheduling)
    output: int = 0         # tokens sampled and processed
    blocks: list = field(default_factory=list)
    status: str = "waiting"  # waiting, running, finished, aborted
    preemptions: int = 0
    last_step: int = 0
    stale: list = field(default_factory=list)  # what an abort freed (for the planted bug)


@dataclass
class ExampleStep:
    step: int
    tokens: dict            # request id -> tokens scheduled


class ExampleScheduler:
    def __init__(self, num_blocks: int = 8, block_size: int = 4, *,
                 async_scheduling: bool = False, defer_frees: bool = False, bugs=()) -> None:
        unknown = set(bugs) - set(BUGS)
        if unknown:
            raise ValueError(f"unknown bug(s) {sorted(unknown)}: the bugs are {sorted(BUGS)}")
        self.pool = ExamplePool(num_blocks)
        self.block_size = block_size
        self.async_scheduling = async_scheduling
        self.defer_frees = defer_frees
        self.bugs = set(bugs)
        self.requests: dict = {}
        self.waiting: list = []
        self.running: list = []
        self.scheduled = 0   # steps scheduled
        self.processed = 0   # steps processed
        self.deferred: list = []  # (fence step, blocks)

    def add_request(self, rid: str, prompt: list, max_tokens: int) -> None:
        self.requests[rid] = ExampleRequest(list(prompt), max_tokens)
        self.waiting.append(rid)

    def _needed(self, req: ExampleRequest, n: int) -> int:
        total = -(-(req.computed + n) // self.block_size)
        return total - len(req.blocks)

    def _release(self, req: ExampleRequest) -> None:
        """Give the request's blocks back, deferred past the newest step that reads them."""
        blocks, req.blocks = req.blocks, []
        if self.defer_frees and req.last_step > self.processed:
            self.deferred.append((self.scheduled, blocks))
        else:
            self.pool.free(blocks)

    def _preempt(self, rid: str) -> None:
        req = self.requests[rid]
        self.running.remove(rid)
        if "preempt-double-free" in self.bugs:
            self.pool.free(req.blocks)
        else:
            self._release(req)
        req.computed, req.status = 0, "waiting"
        req.preemptions += 1
        self.waiting.insert(0, rid)

    def schedule(self) -> ExampleStep:
        step = self.scheduled + 1  # counted only when it runs something (deferral fences)
        tokens = {}
        for rid in list(self.running):
            req = self.requests[rid]
            if rid not in self.running or req.computed >= len(req.prompt) + req.max_tokens - 1:
                continue
            if not self.async_scheduling and req.computed > len(req.prompt) + req.output - 1:
                continue
            while self._needed(req, 1) > len(self.pool.free_list) and len(self.running) > 1:
                victim = self.running[-1]
                self._preempt(victim)
                tokens.pop(victim, None)
                if victim == rid:
                    break
            if rid not in self.running or self._needed(req, 1) > len(self.pool.free_list):
                continue
            req.blocks += self.pool.allocate(self._needed(req, 1))
            req.computed += 1
            req.last_step = step
            tokens[rid] = 1
        while self.waiting:
            rid = self.waiting[0]
            req = self.requests[rid]
            n = len(req.prompt) + req.output - req.computed
            if self._needed(req, n) > len(self.pool.free_list):
                break
            self.waiting.pop(0)
            req.blocks += self.pool.allocate(self._needed(req, n))
            req.computed += n
            req.status = "running"
            req.last_step = step
            self.running.append(rid)
            tokens[rid] = n
        if tokens:
            self.scheduled = step
        return ExampleStep(step, tokens)

    def update_from_output(self, step: ExampleStep, eos=()) -> None:
        self.processed = max(self.processed, step.step)
        for rid in step.tokens:
            req = self.requests[rid]
            if req.status == "aborted" and "stale-free-after-abort" in self.bugs:
                self.pool.free(req.stale)
                continue
            if req.status != "running" or req.computed < len(req.prompt):
                continue
            req.output += 1
            if rid in eos or req.output >= req.max_tokens:
                req.status = "finished"
                self.running.remove(rid)
                self._release(req)
        while self.deferred and self.deferred[0][0] <= self.processed:
            self.pool.free(self.deferred.pop(0)[1])

    def abort_request(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None or req.status in ("finished", "aborted"):
            return
        if rid in self.running:
            self.running.remove(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)
        req.status = "aborted"
        req.stale = list(req.blocks)
        if "free-in-flight" in self.bugs:
            blocks, req.blocks = req.blocks, []
            self.pool.free(blocks)
        else:
            self._release(req)


# --- reading the scheduler: plain functions, pasted into the regression tests the fuzzer emits


def example_prompt(doc: int, length: int) -> list:
    """The first ``length`` tokens of document ``doc``: requests of one document share a prefix."""
    return [100 * doc + i for i in range(length)]


def example_tables(engine) -> dict:
    return {rid: list(r.blocks) for rid, r in engine.requests.items() if r.blocks}


def example_refcount(engine, block: int) -> int:
    return engine.pool.refcount[block]


def example_generation(engine, rid: str):
    req = engine.requests.get(rid)
    return None if req is None or req.status in ("finished", "aborted") else req.preemptions


def example_reads(engine, step) -> dict:
    return {rid: list(engine.requests[rid].blocks) for rid in step.tokens}


def example_held(engine) -> list:
    return [b for b, count in enumerate(engine.pool.refcount) if count != 0]


class ExampleDriver(LifecycleDriver):
    """The lifecycle driver of ``ExampleScheduler``: each method one call on it."""

    name = "ExampleScheduler"
    documents = 2
    max_prompt = 6
    max_tokens = 4

    def __init__(self, engine: ExampleScheduler) -> None:
        super().__init__(engine)
        self.async_scheduling = engine.async_scheduling
        self.max_in_flight = 2 if engine.async_scheduling else 1
        self.leases_outlive_requests = engine.defer_frees

    def add(self, rid, doc, length, max_tokens):
        self.engine.add_request(rid, example_prompt(doc, length), max_tokens)

    def schedule(self):
        step = self.engine.schedule()
        if not step.tokens:
            return None
        return step, example_reads(self.engine, step)

    def process(self, handle, eos):
        self.engine.update_from_output(handle, eos)

    def abort(self, rid):
        self.engine.abort_request(rid)

    def tables(self):
        return example_tables(self.engine)

    def refcount(self, block):
        return example_refcount(self.engine, block)

    def generation(self, rid):
        return example_generation(self.engine, rid)

    def held(self):
        return example_held(self.engine)

    def allocator(self):
        return self.engine.pool

    def allocator_spec(self):
        return EXAMPLE_POOL_SPEC

    # --- how the regression test writes the same calls ---------------------------------------

    imports = "from kvguard.conformance.lifecycle_example import ExampleScheduler"
    helpers = (example_prompt, example_tables, example_refcount, example_generation,
               example_reads, example_held)

    def make_source(self) -> str:
        e = self.engine
        args = [f"num_blocks={len(e.pool.refcount)}", f"block_size={e.block_size}"]
        args += ["async_scheduling=True"] * e.async_scheduling
        args += ["defer_frees=True"] * e.defer_frees
        args += [f"bugs={sorted(e.bugs)!r}"] * bool(e.bugs)
        return f"ExampleScheduler({', '.join(args)})"

    def event_source(self, event) -> str:
        kind = event[0]
        if kind == "add":
            _, rid, doc, length, max_tokens = event
            return f"engine.add_request({rid!r}, example_prompt({doc}, {length}), {max_tokens})"
        if kind == "schedule":
            return "engine.schedule()"
        if kind == "process":
            return f"engine.update_from_output(s{event[1]}, eos={set(event[2]) or set()!r})"
        if kind == "abort":
            return f"engine.abort_request({event[1]!r})"
        return ""
