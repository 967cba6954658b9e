"""free-in-flight in vLLM 0.23.0 AsyncScheduler: block 1 is back in the pool while step 1, still in flight, reads it for r0 (which ended).

Found by kvguard.testing.check_lifecycle (seed 0). Uses only the engine; the invariants are checked after every event.
"""

from vllm.v1.request import RequestStatus


def check_invariants(tables, refcount, leases, generation, outlive, held=(), transfers=None):
    """The first lifecycle invariant broken now, as ``(kind, block, message)``, or None.

    ``tables``: request id -> block ids it holds; ``refcount(block)``: the pool's count;
    ``leases``: step -> {request id: (generation, block ids)} for every step in flight;
    ``generation(rid)``: None once the request ended, else its preemption count; ``outlive``:
    whether the engine promises to keep in-flight blocks out of the pool after their request
    ends; ``held``: the blocks whose refcount is not 0; ``transfers``: request id -> blocks an
    asynchronous KV load still writes (they stay out of the pool until the load reports done,
    whoever ends the request). Self-contained (it is pasted into emitted regression tests).
    """
    for block in held:
        if refcount(block) < 0:
            return ("double-free", block, f"block {block} was released more often than it was "
                    f"handed out (refcount {refcount(block)})")
    holders = {}
    for rid in sorted(tables):
        for block in set(tables[rid]):
            holders.setdefault(block, []).append(rid)
    for block in sorted(holders):
        count = refcount(block)
        who = holders[block]
        if count < 1:
            return ("stale-table", block, f"block {block} is in the table of {', '.join(who)} "
                    f"but back in the pool (refcount {count})")
        if count < len(who):
            return ("shared-block", block, f"block {block} is in the tables of {', '.join(who)} "
                    f"with refcount {count}: one release frees it under the other")
    for step in sorted(leases):
        for rid in sorted(leases[step]):
            gen, blocks = leases[step][rid]
            if not outlive and generation(rid) != gen:
                continue  # the request ended or lost its blocks: its lease ended with it
            for block in sorted(blocks):
                if refcount(block) < 1:
                    state = "ended" if generation(rid) is None else (
                        "was preempted" if generation(rid) != gen else "is running")
                    return ("free-in-flight", block, f"block {block} is back in the pool while "
                            f"step {step}, still in flight, reads it for {rid} (which {state})")
    for rid in sorted(transfers or {}):
        for block in sorted(transfers[rid]):
            if refcount(block) < 1:
                return ("free-in-flight", block, f"block {block} is back in the pool while an "
                        f"asynchronous KV load for {rid} still writes it")
    return None


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
    ``loads`` (request id -> the blocks the load writes); returns the loads in flight now, which
    the step's output reports done."""
    from vllm.v1.request import RequestStatus
    for rid, request in scheduler.requests.items():
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in loads:
            loads[rid] = [b for b in vllm_tables(scheduler).get(rid, [])]
    return set(loads)


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


def test_lifecycle_free_in_flight():
    engine = vllm_make({'num_blocks': 16, 'block_size': 4, 'max_num_batched_tokens': 32, 'max_model_len': 128, 'max_num_seqs': 4, 'async_scheduling': True, 'kv_consumer': True})
    leases = {}
    loads = {}

    def check():
        problem = check_invariants(vllm_tables(engine),
                                   lambda b: vllm_refcount(engine, b),
                                   leases, lambda rid: vllm_generation(engine, rid),
                                   True, vllm_held(engine), loads)
        assert problem is None, problem[2]

    engine.add_request(vllm_request('r0', 0, 1, 2, 4))
    check()
    s1 = engine.schedule()
    p1, l1 = vllm_partial(engine, s1), vllm_loads(engine, loads)
    leases[1] = {rid: (vllm_generation(engine, rid), ids) for rid, ids in vllm_reads(engine, s1).items()}
    check()
    engine.finish_requests('r0', RequestStatus.FINISHED_ABORTED)
    check()
