"""The lifecycle driver of vLLM's v1 ``Scheduler``, on CPU with no model weights.

The scheduler is built the way vLLM's own ``tests/v1/core`` builds one: ``create_scheduler`` from
``tests/v1/core/utils.py`` of the same release's source tree (a ``ModelConfig`` read from an
offline Hugging Face config cache, see ``benchmarks/upstream/run.py setup``), then rebuilt with
the KV cache groups of the configuration (full, sliding-window, chunked-local attention), and
fed fake ``ModelRunnerOutput``s. Building the model config takes seconds, so one template
scheduler is built per configuration and each event sequence gets a fresh ``Scheduler`` over its
configs (about a millisecond).

What the driver holds vLLM to (its contract, as its own tests state it):

- a block in a running request's table is referenced by the pool (refcount >= holders);
- a block an in-flight step reads for a request that is still running stays out of the pool
  until that step's output is processed (``tests/v1/core/test_swa_inflight_window_free.py``:
  out-of-window frees wait for in-flight steps);
- with overlapping batches and a KV-consumer connector (P/D disaggregation), the blocks an
  in-flight step reads stay out of the pool even after their request finishes, is aborted or
  preempted (``test_deferred_block_free.py``): a KV load into a reallocated block is not
  ordered against the in-flight step. Without such a connector vLLM frees at once, and the
  device's stream order makes that safe: the driver does not ask for more.

The helpers below are pasted into the regression tests a finding emits, so they import what
they use and read only vLLM's objects.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .lifecycle import LifecycleDriver

CONFIGS = {
    "full": {},
    "full-async": {"async_scheduling": True},
    "prefix-async": {"async_scheduling": True, "enable_prefix_caching": True},
    "prefix": {"enable_prefix_caching": True},
    "swa-async": {"async_scheduling": True, "groups": [("sliding_window", 8)]},
    "chunked-local-async": {"async_scheduling": True, "groups": [("chunked_local", 8)]},
    "hybrid-async": {"async_scheduling": True, "enable_prefix_caching": True,
                     "groups": [("full", 0), ("sliding_window", 8)]},
    "pd-consumer-async": {"async_scheduling": True, "kv_consumer": True},
    "pd-async-load": {"kv_consumer": True, "async_load": 8},
}
"""Named configurations: ``kvguard fuzz --lifecycle vllm --config NAME``."""

SIZES = {"num_blocks": 16, "block_size": 4, "max_num_batched_tokens": 32, "max_model_len": 128,
         "max_num_seqs": 4}


def vllm_make(options):
    """A scheduler as vLLM's tests build one, with ``options``' KV cache groups."""
    from unittest.mock import PropertyMock, patch

    import torch

    from tests.v1.core.utils import create_scheduler, mock_kv
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager
    kwargs = {k: v for k, v in options.items()
              if k not in ("groups", "kv_consumer", "async_load")}
    if options.get("kv_consumer"):  # async_load: that many prompt tokens loaded asynchronously
        kwargs["use_kv_connector"] = mock_kv(matched_tokens=options.get("async_load", 0),
                                             is_async=bool(options.get("async_load")))
    concurrent = 2 if options.get("async_scheduling") else 1
    # CPU turns async scheduling off in the config: overlapping batches are said explicitly.
    with patch.object(VllmConfig, "max_concurrent_batches", new_callable=PropertyMock,
                      create=True, return_value=concurrent):
        scheduler = create_scheduler(**kwargs)
        if not options.get("groups"):
            return scheduler
        size = options["block_size"]
        specs = []
        for kind, width in options["groups"]:
            common = dict(block_size=size, num_kv_heads=1, head_size=1, dtype=torch.float32)
            if kind == "sliding_window":
                specs.append(SlidingWindowSpec(**common, sliding_window=width))
            elif kind == "chunked_local":
                specs.append(ChunkedLocalAttentionSpec(**common, attention_chunk_size=width))
            else:
                specs.append(FullAttentionSpec(**common))
        config = KVCacheConfig(num_blocks=options["num_blocks"], kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], spec)
                                                for i, spec in enumerate(specs)])
        return type(scheduler)(vllm_config=scheduler.vllm_config, kv_cache_config=config,
                               block_size=size, log_stats=True,
                               structured_output_manager=StructuredOutputManager(
                                   scheduler.vllm_config))


def vllm_request(rid, doc, length, max_tokens, block_size):
    """A request whose prompt is ``length`` tokens of document ``doc`` (token ``doc`` repeated:
    requests of one document share their prefix blocks)."""
    from tests.v1.core.utils import create_requests
    ids = [f"{rid}~{i}" for i in range(doc)] + [rid]
    return create_requests(num_requests=doc + 1, num_tokens=length, max_tokens=max_tokens,
                           block_size=block_size, req_ids=ids)[doc]


def vllm_partial(scheduler, output):
    """Requests whose prefill the step leaves unfinished: they sample nothing."""
    return {rid for rid in output.num_scheduled_tokens
            if scheduler.requests[rid].num_computed_tokens < scheduler.requests[rid].num_tokens}


def vllm_output(output, eos, partial, loaded=()):
    """The fake model output of a step: token 0, or EOS for the requests in ``eos``; the
    connector reports the asynchronous KV loads of ``loaded`` done."""
    from tests.v1.core.utils import EOS_TOKEN_ID
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    req_ids = list(output.num_scheduled_tokens)
    result = ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[] if rid in partial else [EOS_TOKEN_ID if rid in eos else 0]
                           for rid in req_ids],
        logprobs=None, prompt_logprobs_dict={}, pooler_output=[])
    if loaded:
        result.kv_connector_output = KVConnectorOutput(finished_recving=set(loaded))
    return result


def vllm_loads(scheduler, loads):
    """Add the requests whose asynchronous KV load began (``WAITING_FOR_REMOTE_KVS``) to
    ``loads`` (request id -> the blocks the load writes; once reported done, the request's
    preemption count then: only a preempted request starts a second load); returns the loads in
    flight now, which the step's output reports done."""
    from vllm.v1.request import RequestStatus
    for rid, request in scheduler.requests.items():
        known = loads.get(rid)
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and (
                known is None or (type(known) is int and known != request.num_preemptions)):
            loads[rid] = [b for b in vllm_tables(scheduler).get(rid, [])]
    return {rid for rid, ids in loads.items() if type(ids) is list}


def vllm_loads_done(scheduler, loads, done):
    """Mark the loads of ``done`` reported."""
    for rid in done:
        request = scheduler.requests.get(rid)
        loads[rid] = request.num_preemptions if request is not None else -1


def vllm_tables(scheduler):
    tables = {}
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        for rid, blocks in list(manager.req_to_blocks.items()):
            ids = [b.block_id for b in blocks if not b.is_null]
            if ids:
                tables.setdefault(rid, []).extend(ids)
    return tables


def vllm_refcount(scheduler, block):
    return scheduler.kv_cache_manager.block_pool.blocks[block].ref_cnt


def vllm_generation(scheduler, rid):
    request = scheduler.requests.get(rid)
    if request is None or request.is_finished():
        return None
    return request.num_preemptions


def vllm_reads(scheduler, output):
    """The blocks the step reads or writes for each request it runs: every block below its last
    token for full attention; from ``first - window + 1`` for a sliding window, from the start of
    the first token's chunk for chunked-local attention (``first``: the step's first token)."""
    reads = {}
    for rid, n in output.num_scheduled_tokens.items():
        end = scheduler.requests[rid].num_computed_tokens  # schedule() counted the step in
        start, ids = end - n, []
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
            spec = manager.kv_cache_spec
            kind = type(spec).__name__
            first = 0
            if kind == "SlidingWindowSpec":
                first = max(0, start - spec.sliding_window + 1)
            elif kind == "ChunkedLocalAttentionSpec":
                first = start // spec.attention_chunk_size * spec.attention_chunk_size
            blocks = manager.req_to_blocks.get(rid, [])
            last = min(len(blocks), -(-end // spec.block_size))
            ids += [b.block_id for b in blocks[first // spec.block_size:last] if not b.is_null]
        reads[rid] = ids
    return reads


def vllm_held(scheduler):
    return [b.block_id for b in scheduler.kv_cache_manager.block_pool.blocks
            if not b.is_null and b.ref_cnt != 0]


def tests_root(version: str | None = None) -> Path:
    """The vLLM source tree whose ``tests/`` builds the scheduler: ``KVGUARD_VLLM_TESTS``, else
    ``benchmarks/upstream/run.py setup``'s copy for the installed release."""
    if os.environ.get("KVGUARD_VLLM_TESTS"):
        return Path(os.environ["KVGUARD_VLLM_TESTS"])
    if version is None:
        from importlib.metadata import version as installed
        version = installed("vllm")
    cache = Path(os.environ.get("KVGUARD_ENGINE_CACHE") or "~/.cache/kvguard-engines")
    return cache.expanduser() / "upstream" / f"vllm-{version}"


def prepare() -> None:
    """Make ``tests.v1.core.utils`` importable and keep Hugging Face offline (before vLLM is
    imported)."""
    root = tests_root()
    if not (root / "tests" / "v1" / "core" / "utils.py").is_file():
        raise FileNotFoundError(f"vLLM's tests/ not found under {root}: run "
                                "`python benchmarks/upstream/run.py setup` or set "
                                "KVGUARD_VLLM_TESTS to a vLLM source tree")
    if sys.path[:1] != [str(root)]:  # first: another project's tests/ package must not win
        sys.path.insert(0, str(root))
    hf = Path(os.environ.get("KVGUARD_ENGINE_CACHE") or "~/.cache/kvguard-engines")
    os.environ.setdefault("HF_HOME", str(hf.expanduser() / "upstream" / "hf"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


class VllmFactory:
    """Fresh schedulers of one configuration: the first from ``vllm_make``, the rest rebuilt
    over its configs."""

    def __init__(self, config: str = "full-async", **overrides) -> None:
        if config not in CONFIGS:
            raise ValueError(f"unknown vLLM configuration {config!r}: {', '.join(CONFIGS)}")
        self.config = config
        self.options = {**SIZES, **CONFIGS[config], **overrides}
        self.template = None

    def __call__(self):
        from unittest.mock import PropertyMock, patch
        if self.template is None:
            prepare()
            self.template = vllm_make(self.options)
            return self.template
        from vllm.config import VllmConfig
        from vllm.v1.structured_output import StructuredOutputManager
        t = self.template
        concurrent = 2 if self.options.get("async_scheduling") else 1
        with patch.object(VllmConfig, "max_concurrent_batches", new_callable=PropertyMock,
                          create=True, return_value=concurrent):
            fresh = type(t)(vllm_config=t.vllm_config, kv_cache_config=t.kv_cache_config,
                            block_size=self.options["block_size"], log_stats=True,
                            structured_output_manager=StructuredOutputManager(t.vllm_config))
        fresh.options = self.options
        return fresh


class VllmDriver(LifecycleDriver):
    """vLLM v1 ``Scheduler`` (or ``AsyncScheduler``): ``add_request``, ``schedule``,
    ``update_from_output`` with a fake output, ``finish_requests(..., FINISHED_ABORTED)``,
    ``reset_prefix_cache``."""

    documents = 3
    max_prompt = 40
    max_tokens = 8

    def __init__(self, scheduler) -> None:
        super().__init__(scheduler)
        self.options = getattr(scheduler, "options", None) or {}
        self.loads: dict = {}
        self.min_prompt = self.options.get("async_load", 0) + 1  # the mock loads that many
        self.async_scheduling = bool(self.options.get("async_scheduling"))
        self.max_in_flight = 2 if self.async_scheduling else 1
        self.leases_outlive_requests = self.async_scheduling and bool(
            self.options.get("kv_consumer"))
        import vllm
        self.name = f"vLLM {vllm.__version__} {type(scheduler).__name__}"

    def prompt_length(self, length):
        return max(length, self.min_prompt)

    def add(self, rid, doc, length, max_tokens):
        self.engine.add_request(vllm_request(rid, doc, length, max_tokens,
                                             self.options.get("block_size", 16)))

    def schedule(self):
        output = self.engine.schedule()
        loaded = vllm_loads(self.engine, self.loads)
        if not output.num_scheduled_tokens and not loaded:
            return None  # (with loads pending, the empty step still carries the connector's)
        handle = (output, vllm_partial(self.engine, output), loaded)
        return handle, vllm_reads(self.engine, output)

    def process(self, handle, eos):
        output, partial, loaded = handle
        self.engine.update_from_output(output, vllm_output(output, eos, partial, loaded))
        vllm_loads_done(self.engine, self.loads, loaded)

    def transfers(self):
        return {rid: ids for rid, ids in self.loads.items() if type(ids) is list}

    def abort(self, rid):
        from vllm.v1.request import RequestStatus
        self.engine.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self):
        self.engine.reset_prefix_cache()

    def tables(self):
        return vllm_tables(self.engine)

    def refcount(self, block):
        return vllm_refcount(self.engine, block)

    def generation(self, rid):
        return vllm_generation(self.engine, rid)

    def held(self):
        return vllm_held(self.engine)

    def allocator(self):
        return self.engine.kv_cache_manager.block_pool

    # --- the regression test -------------------------------------------------------------------

    imports = "from vllm.v1.request import RequestStatus"
    helpers = (vllm_make, vllm_request, vllm_partial, vllm_output, vllm_loads, vllm_loads_done,
               vllm_tables, vllm_refcount, vllm_generation, vllm_reads, vllm_held)
    setup_source = ("loads = {}",)
    transfers_source = "{rid: ids for rid, ids in loads.items() if type(ids) is list}"

    def make_source(self) -> str:
        return f"vllm_make({self.options!r})"

    def event_source(self, event) -> str:
        kind = event[0]
        if kind == "add":
            _, rid, doc, length, max_tokens = event
            size = self.options.get("block_size", 16)
            return (f"engine.add_request(vllm_request({rid!r}, {doc}, {length}, {max_tokens}, "
                    f"{size}))")
        if kind == "schedule":
            return "engine.schedule()"
        if kind == "process":
            step, eos = event[1], set(event[2]) or set()
            return (f"engine.update_from_output(s{step}, vllm_output(s{step}, {eos!r}, "
                    f"p{step}, l{step}))")
        if kind == "abort":
            return f"engine.finish_requests({event[1]!r}, RequestStatus.FINISHED_ABORTED)"
        if kind == "reset":
            return "engine.reset_prefix_cache()"
        return ""

    def schedule_extra(self, step: int) -> str:
        return f"p{step}, l{step} = vllm_partial(engine, s{step}), vllm_loads(engine, loads)"

    def process_extra(self, step: int) -> str:
        return f"vllm_loads_done(engine, loads, l{step})"
