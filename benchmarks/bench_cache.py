"""Cost of guarding the KV cache itself on a decode-step trace: prints guarded/raw median ratios.

    python benchmarks/bench_cache.py [--rounds 7] [--steps 150] [--layers 8] [--batch 16]

A continuous batch of sequences decodes one token per step. Each step does what an engine's step
does: finished sequences free their blocks, new ones get their prompt blocks, a sequence whose
last block is full gets one more (LinkedFreeList: DeepSpeed's allocator logic), then every layer
writes the new K and V through a slot mapping and runs paged attention over each sequence's
blocks (gathered through a padded block table; out-of-context V zeroed, as vLLM's kernels do).
The raw and guarded runs replay the same schedule, alternated round by round, gc off while
timing, each step timed in this process's CPU time (torch on one thread), so that the other
processes of a shared machine do not count. Variants: the allocator guard alone, + guard_cache
(poison on free, one batched check per hand-out), + poison=False (checksums), + quarantine,
+ guard_writes on every layer's write.
Target: guard_cache <= 1.3x the unguarded step. CPU sizes are scaled down; benchmarks/gpu_cache.py
runs the full-size model on CUDA.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvguard  # noqa: E402
from kvguard.cache.guard_cache import _WATCHERS  # noqa: E402
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList  # noqa: E402
from kvguard.cache.writes import guard_writes  # noqa: E402


def make_schedule(steps, batch, block_size, seed=0):
    """Per step: (sequences finishing, prompt blocks of those admitted). Ids are not drawn here:
    the allocator hands them out during the replay, so quarantine can change them."""
    rng = random.Random(seed)
    schedule = []
    running = batch
    for _ in range(steps):
        finishing = [i for i in range(running) if rng.random() < 1 / 128]
        prompts = [rng.randint(2, 12) for _ in finishing]
        schedule.append((finishing, prompts))
    return schedule


class DecodeWorkload:
    """An engine's decode loop over per-layer K and V caches ``[blocks, block_size, heads,
    dim]``."""

    def __init__(self, *, layers, blocks, block_size, heads, dim, batch, dtype, device, torch):
        self.torch = torch
        self.layers, self.blocks, self.block_size = layers, blocks, block_size
        self.heads, self.dim, self.batch = heads, dim, batch
        self.dtype, self.device = dtype, torch.device(device)
        torch.manual_seed(0)

        def randn(*shape):  # made on the device: 8 GiB of CPU randn would take a minute
            return torch.randn(*shape, dtype=dtype, device=self.device)

        self.k = [randn(blocks, block_size, heads, dim) for _ in range(layers)]
        self.v = [randn(blocks, block_size, heads, dim) for _ in range(layers)]
        self.q = randn(batch, heads, dim)
        self.new = randn(batch, heads, dim)
        self.write = self._write
        self.compute = True

    def _write(self, key, value, key_cache, value_cache, slot_mapping):
        key_cache.view(-1, self.heads, self.dim).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, self.heads, self.dim).index_copy_(0, slot_mapping, value)

    def upload(self, values):
        torch = self.torch
        t = torch.tensor(values, dtype=torch.long, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def reset(self, allocator):
        self.allocator = allocator
        self.null = allocator.allocate(1)[0]  # the padding block (vLLM's null block)
        self.seqs = []
        for _ in range(self.batch):
            self.admit(6)

    def admit(self, prompt_blocks):
        blocks = self.allocator.allocate(prompt_blocks)
        self.seqs.append([blocks, prompt_blocks * self.block_size - 3])

    def step(self, plan):
        torch = self.torch
        finishing, prompts = plan
        for i in sorted(finishing, reverse=True):
            blocks, _ = self.seqs.pop(i)
            self.allocator.free(blocks)
        for n in prompts:
            self.admit(n)
        bs = self.block_size
        slots, lens = [], []
        for seq in self.seqs:
            blocks, length = seq
            if length == len(blocks) * bs:
                blocks += self.allocator.allocate(1)
            slots.append(blocks[length // bs] * bs + length % bs)
            seq[1] = length + 1
            lens.append(length + 1)
        width = max(len(seq[0]) for seq in self.seqs)
        table = [seq[0] + [self.null] * (width - len(seq[0])) for seq in self.seqs]
        if not self.compute:
            return None
        slot_mapping = self.upload(slots)
        table_t = self.upload(table)
        lens_t = self.upload(lens)
        positions = torch.arange(width * bs, device=self.device)
        valid = positions.unsqueeze(0) < lens_t.unsqueeze(1)  # [batch, tokens]
        scale = 1 / math.sqrt(self.dim)
        out = None
        for k_cache, v_cache in zip(self.k, self.v):
            self.write(self.new, self.new, k_cache, v_cache, slot_mapping)
            k = k_cache[table_t].flatten(1, 2)  # [batch, tokens, heads, dim]
            v = v_cache[table_t].flatten(1, 2)
            v = v.masked_fill(~valid[:, :, None, None], 0)
            scores = torch.einsum("bhd,bthd->bht", self.q, k) * scale
            scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
            out = torch.einsum("bht,bthd->bhd", scores.softmax(-1), v)
        return out


def variants(workload):
    def raw():
        return LinkedFreeList(workload.blocks)

    def guard_only():
        a = LinkedFreeList(workload.blocks)
        kvguard.guard(a, LINKED_FREE_LIST_SPEC, stacks="cheap")
        return a

    def cached(**options):
        def make():
            a = guard_only()
            kvguard.guard_cache(workload.k + workload.v, kvguard.guard_of(a), **options)
            return a
        return make

    def writes():
        a = cached()()
        workload.write = guard_writes(workload._write, kvguard.guard_of(a), slots=4,
                                      block_size=workload.block_size)
        return a

    return {
        "raw": raw,
        "guard": guard_only,
        "guard_cache": cached(),
        "guard_cache poison=False": cached(poison=False),
        "guard_cache quarantine=64": cached(quarantine=64),
        "guard_cache + guard_writes": writes,
    }


def run(workload, make, schedule, sync, clock, per_step=True):
    workload.write = workload._write
    allocator = make()
    workload.reset(allocator)
    guard = kvguard.guard_of(allocator)
    gc.collect()
    gc.disable()
    times = []
    try:
        sync()
        if per_step:
            for plan in schedule:
                t0 = clock()
                workload.step(plan)
                sync()
                times.append(clock() - t0)
        else:  # one wait at the end: the host runs ahead of the device as an engine's does
            t0 = clock()
            for plan in schedule:
                workload.step(plan)
            sync()
            times.append(clock() - t0)
    finally:
        gc.enable()
    stats = None
    if guard is not None:
        watcher = _WATCHERS.get(guard)
        stats = watcher.stats.to_dict() if watcher is not None else None
        assert not guard.violations, guard.violations[0].render()
        guard.unguard()
    return times, stats


def compare(workload, schedule, rounds, sync=lambda: None, clock=time.process_time,
            per_step=True):
    """Per variant: the median total over rounds, and the sum over steps of each step's fastest
    round. A step does the same work every round, so its fastest round is its cost without the
    other processes of a shared machine; the medians are printed beside it."""
    makers = variants(workload)
    times = {name: [] for name in makers}
    stats = {}
    names = list(makers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # no variant always first
            measured, stats[name] = run(workload, makers[name], schedule, sync, clock,
                                        per_step)
            times[name].append(measured)
    medians = {name: statistics.median(sum(r) for r in runs) for name, runs in times.items()}
    fastest = {name: sum(min(step) for step in zip(*runs)) for name, runs in times.items()}
    return medians, fastest, stats


def report(medians, fastest, stats, steps, what="step"):
    raw, raw_fast = medians["raw"], fastest["raw"]
    print(f"  raw {what}: {raw_fast / steps * 1e3:.3f} ms (fastest rounds), "
          f"{raw / steps * 1e3:.3f} ms (median)")
    print(f"  {'variant':<28} {'fastest':>7} {'median':>7}")
    for name, t in medians.items():
        if name == "raw":
            continue
        extra = (fastest[name] - raw_fast) / steps * 1e6
        line = (f"  {name:<28} {fastest[name] / raw_fast:6.2f}x {t / raw:6.2f}x   "
                f"({extra:+.0f} us/step)")
        s = stats.get(name)
        if s:
            line += (f"   verify calls/step {s['verify_calls'] / steps:.2f}, "
                     f"host syncs/step {s['host_syncs'] / steps:.2f}")
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    sizes = dict(layers=args.layers, blocks=1024, block_size=16, heads=2, dim=32,
                 batch=args.batch)
    workload = DecodeWorkload(**sizes, dtype=torch.float32, device="cpu", torch=torch)
    schedule = make_schedule(args.steps, args.batch, sizes["block_size"])
    print(f"decode trace on CPU: {args.steps} steps, batch {args.batch}, {args.layers} layers x "
          f"K,V float32 [{sizes['blocks']}, {sizes['block_size']}, {sizes['heads']}, "
          f"{sizes['dim']}] ({2 * args.layers} cache tensors), 1 thread")
    medians, fastest, stats = compare(workload, schedule, args.rounds)
    report(medians, fastest, stats, args.steps)
    step = fastest["raw"] / args.steps
    print("the same schedule, allocator calls and guard work alone (no attention, no writes):")
    workload.compute = False
    medians, fastest, stats = compare(workload, schedule, args.rounds * 3)
    report(medians, fastest, stats, args.steps, "allocator calls per step")
    added = (fastest["guard_cache"] - fastest["raw"]) / args.steps
    print(f"guard_cache adds {added * 1e6:.0f} us of guard work per step: "
          f"{(step + added) / step:.3f}x a {step * 1e3:.2f} ms decode step")
    return 0


if __name__ == "__main__":
    import results  # --write-docs: what this prints becomes its section of docs/cost.md
    sys.exit(results.main(main))
