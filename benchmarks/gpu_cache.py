"""guard_cache on CUDA at full size: time per decode step and host syncs, raw vs guarded.

    python benchmarks/gpu_cache.py [--steps 200] [--rounds 3]

The decode model of benchmarks/bench_cache.py at a real model's size: 32 layers, K and V as
separate bf16 tensors of 4096 blocks x 16 tokens x 8 heads x 128 (64 tensors, 8 GiB), a batch of
64 sequences. Each run is timed from one device sync to the next, with none in between, so a
guard that makes the host wait for the device pays for it as an engine would. Host syncs are
counted in a separate, untimed pass with ``torch.cuda.set_sync_debug_mode("warn")``, which flags
every wait (a blocking copy either way, ``.item()``, ``.tolist()``). Without a GPU it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def count_syncs(workload, make, schedule, torch):
    from bench_cache import run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(workload, make, schedule, lambda: None, time.perf_counter, per_step=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("torch is not installed: skipped")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    from bench_cache import DecodeWorkload, compare, make_schedule, variants

    sizes = dict(layers=args.layers, blocks=args.blocks, block_size=16, heads=8, dim=128,
                 batch=args.batch)
    workload = DecodeWorkload(**sizes, dtype=torch.bfloat16, device="cuda", torch=torch)
    schedule = make_schedule(args.steps, args.batch, sizes["block_size"])
    gib = sum(t.numel() * t.element_size() for t in workload.k + workload.v) / 2**30
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {args.layers} layers x "
          f"K,V bf16 [{args.blocks}, 16, 8, 128] ({2 * args.layers} tensors, {gib:.1f} GiB), "
          f"batch {args.batch}, {args.steps} steps")
    sync = torch.cuda.synchronize
    compare(workload, schedule[:20], 1, sync, time.perf_counter, per_step=False)  # warm up
    for label, compute in (("decode step", True), ("allocator calls alone", False)):
        workload.compute = compute
        medians, _, stats = compare(workload, schedule, args.rounds, sync, time.perf_counter,
                                    per_step=False)
        raw = medians["raw"]
        print(f"{label}: raw {raw / args.steps * 1e3:.3f} ms/step")
        for name, t in medians.items():
            if name == "raw":
                continue
            s = stats.get(name) or {}
            calls = s.get("verify_calls", 0) / args.steps
            print(f"  {name:<28} {t / args.steps * 1e3:8.3f} ms/step  {t / raw:5.2f}x  "
                  f"(verify calls/step {calls:.2f})")
    workload.compute = True
    print("host syncs per step (sync debug mode, untimed pass):")
    for name, make in variants(workload).items():
        n = count_syncs(workload, make, schedule, torch)
        print(f"  {name:<28} {n / args.steps:.2f}  ({n} in {args.steps} steps)")
    return 0


if __name__ == "__main__":
    import results  # --write-docs: what this prints becomes its section of docs/cost.md
    sys.exit(results.main(main))
