"""vLLM 0.33.0's real v1 ``Scheduler`` on CPU, built the way its own ``tests/v1/core/utils.py``
builds one (no model; fake ``ModelRunnerOutput``s), with kvguard's request and step boundaries
installed (``kvguard.instrument()``, as ``pytest -p kvguard`` does).

vLLM frees chunked-local (and sliding-window) blocks that fell out of the attention window on the
*processed*-token basis: with async scheduling, step N+1 is scheduled before N's output is
processed, and N still reads the blocks below the optimistic boundary. Undoing that fix (freeing
on the optimistic count: ``num_in_flight_tokens`` read as 0 inside ``allocate_slots``) lets the
scheduler hand those blocks to another request while N is in flight: ``free-in-flight``. The
fixed code reports nothing on the same schedule.

Needs vLLM importable and its tests' sources (``benchmarks/upstream/run.py setup`` builds both);
skipped otherwise, with the reason.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import kvguard

CACHE = Path(os.environ.get("KVGUARD_ENGINE_CACHE") or "~/.cache/kvguard-engines").expanduser()
SOURCES = CACHE / "upstream" / "vllm-0.33.0"


@pytest.fixture(scope="module")
def vllm_tests():
    # Before vLLM is imported: huggingface_hub reads these once, at import, and vLLM infers
    # its device from VLLM_TARGET_DEVICE (the CPU wheel has no vllm._C to tell it).
    os.environ.setdefault("HF_HOME", str(CACHE / "upstream" / "hf"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    pytest.importorskip("vllm.v1.core.sched.scheduler",
                        reason="vLLM is not installed (benchmarks/upstream/run.py setup)")
    if not (SOURCES / "tests" / "v1" / "core" / "utils.py").is_file():
        pytest.skip(f"vLLM 0.33.0's tests are not under {SOURCES} (run.py setup)")
    # vLLM's test helpers import their own ``tests`` package, a name this suite's package
    # holds: theirs is imported under it for the moment, then ours is put back.
    ours = {name: mod for name, mod in sys.modules.items()
            if name == "tests" or name.startswith("tests.")}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(SOURCES))
    try:
        import importlib
        utils = importlib.import_module("tests.v1.core.utils")
    finally:
        sys.path.remove(str(SOURCES))
        sys.modules.pop("tests", None)
        sys.modules.update(ours)
    return utils


@pytest.fixture
def instrumented():
    kvguard.instrument()
    yield
    kvguard.uninstrument()


def output_for(scheduler_output):
    from vllm.v1.outputs import ModelRunnerOutput
    ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[0] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=[])


def chunked_scheduler(utils, num_blocks):
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec
    return utils.create_scheduler(
        block_size=16, async_scheduling=True, num_blocks=num_blocks,
        kv_cache_spec=ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=1,
                                                dtype=torch.float32, attention_chunk_size=32))


def optimistic_frees(monkeypatch):
    """Undo vLLM's fix: ``allocate_slots`` sees no tokens in flight, so it frees out-of-chunk
    blocks on the optimistic count while the step that still reads them is in flight."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    allocate = KVCacheManager.allocate_slots

    def allocate_slots(self, request, *args, **kwargs):
        saved = request.num_in_flight_tokens
        request.num_in_flight_tokens = 0
        try:
            return allocate(self, request, *args, **kwargs)
        finally:
            request.num_in_flight_tokens = saved
    monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate_slots)


def run_two_requests(utils):
    """R prefills (in flight), R's decode is scheduled (async), then Q arrives while R's prefill
    is still in flight and needs every free block."""
    scheduler = chunked_scheduler(utils, num_blocks=9)
    guard = kvguard.guard_of(scheduler.kv_cache_manager.block_pool)
    r, q = utils.create_requests(num_requests=2, num_tokens=100, block_size=16)
    scheduler.add_request(r)
    out0 = scheduler.schedule()          # R's prefill: in flight from here on
    scheduler.add_request(q)
    out1 = scheduler.schedule()          # R's decode, and Q's prefill if it fits
    scheduler.update_from_output(out0, output_for(out0))
    scheduler.update_from_output(out1, output_for(out1))
    return guard


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "fix-undone"])
def test_freeing_on_the_optimistic_count_is_free_in_flight(vllm_tests, instrumented,
                                                           monkeypatch, fixed):
    if not fixed:
        optimistic_frees(monkeypatch)
        with pytest.raises(kvguard.FreeInFlightError) as info:
            run_two_requests(vllm_tests)
        assert info.value.violation.extra["in_flight_steps"]
    else:
        guard = run_two_requests(vllm_tests)
        assert guard is not None and guard.violations == []
