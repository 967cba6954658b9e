"""engine-error in transformers 5.24.0 continuous batching (async): KeyError: 'r0'.

Found by kvguard.testing.check_lifecycle (seed 0). Uses only the engine; the invariants are checked after every event.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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


def hf_make(options, model=None):
    """A ``ContinuousBatchingManager`` with its batch processor, over a tiny random model."""
    from unittest.mock import patch

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config
    from transformers import Qwen2ForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api
    if model is None:
        torch.manual_seed(0)
        shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
        if options.get("hybrid"):
            model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True,
                                                 sliding_window=8, layer_types=[
                                                     "full_attention", "sliding_attention"]))
        else:
            model = LlamaForCausalLM(LlamaConfig(**shape))
        model.eval()
    sizes = {k: options[k] for k in ("num_blocks", "page_size", "max_batch_tokens",
                                      "max_requests_per_batch") if k in options}
    config = ContinuousBatchingConfig(
        **sizes, use_cuda_graph=False, use_async_batching=bool(options.get("use_async_batching")),
        allow_block_sharing=options.get("allow_block_sharing", True))
    generation = GenerationConfig(do_sample=False, max_new_tokens=4, eos_token_id=1,
                                  pad_token_id=0)
    manager = continuous_api.ContinuousBatchingManager(model, generation, config)
    with patch.object(continuous_api, "ContinuousBatchingAsyncIOs", HfCpuAsyncIOs):
        manager.batch_processor = manager._create_batch_processor()
    manager.kv_options = options
    pool = manager.batch_processor.cache.pool
    pool.owners = {}  # sector -> allocator index, to read which allocator a sector serves
    allocate_sector = pool.allocate_sector

    def allocate_sector_owned(index):
        pool.owners[pool.free_sectors[-1]] = index
        allocate_sector(index)
    pool.allocate_sector = allocate_sector_owned
    return manager


class HfCpuAsyncIOs:
    """``ContinuousBatchingAsyncIOs`` on CPU: two IO pairs, the same transfers, no streams."""

    def __new__(cls, **kwargs):
        from transformers.generation.continuous_batching import input_outputs as io

        class CpuAsyncIOs(io.ContinuousBatchingAsyncIOs):
            def __init__(self, cache, **kw):
                class Done:
                    def synchronize(self):
                        pass
                self.current_pair, self.io_pairs = 0, []
                for _ in range(2):
                    pair = object.__new__(io.HostDeviceIOPair)
                    pair.host_io = io.ContinuousBatchingIOs(cache=cache, **kw)
                    pair.device_io = io.ContinuousBatchingIOs(cache=cache, **kw)
                    pair.h2d_over = pair.compute_over = pair.d2h_over = Done()
                    self.io_pairs.append(pair)
                self.h2d_stream = self.d2h_stream = self.compute_stream = None
                self.max_batch_tokens = cache.max_batch_tokens

            def get_model_kwargs(self, use_padding=False):
                pair = self.io_pairs[self.current_pair]
                pair.transfer_inputs_h2d(None)
                return pair.device_io.get_model_kwargs(use_padding=use_padding)

            def retrieve_device_outputs(self):
                self.io_pairs[self.current_pair].transfer_outputs_d2h(None)
                self.swap_io_pairs()

            def prepare_batch_update(self):
                return self.io_pairs[self.current_pair].host_io.prepare_batch_update()

        return CpuAsyncIOs(**kwargs)


def hf_prompt(doc, length):
    """The first ``length`` tokens of document ``doc``: requests of one document share a prefix."""
    return [3 + (doc * 19 + i * 7) % 60 for i in range(length)]


def hf_schedule(engine):
    """One step of the generation loop: prepare the next batch (queued requests and
    cancellations applied, preemption) and run the model on it. The batch, or None."""
    processor = engine.batch_processor
    if not processor.prepare_next_batch():
        return None
    io = processor.inputs_and_outputs
    batch = (io.io_pairs[io.current_pair].host_io if hasattr(io, "io_pairs") else io)
    batch = batch.requests_in_batch
    if engine.kv_options.get("forward", True):
        processor._generation_step(engine.model)
    else:  # the fuzzer's tokens replace the model's anyway: only the outputs' transfer
        io.retrieve_device_outputs()
    return batch


def hf_process(engine, batch, eos):
    """Process ``batch``'s output: requests in ``eos`` sample token 1 (EOS), the others token 2.
    A batch with no later one launched is processed as the loop does when it stops."""
    processor = engine.batch_processor
    io = processor.inputs_and_outputs
    flush = hasattr(io, "io_pairs") and io.io_pairs[io.current_pair].host_io.requests_in_batch \
        is not batch
    if flush:
        io.swap_io_pairs()
    host = io.io_pairs[io.current_pair].host_io if hasattr(io, "io_pairs") else io
    sampled = [f.state.request_id for f in batch if f.has_new_token]
    for i, rid in enumerate(sampled):
        host.output_ids[0, i] = 1 if rid in eos else 2
    try:
        processor.update_batch()
    finally:
        if flush:
            io.swap_io_pairs()


def hf_key(cache, index, block):
    return block if len(cache.cache_allocators) == 1 else (index, block)


def hf_tables(engine):
    cache = engine.batch_processor.cache
    tables = {}
    for allocator in cache.cache_allocators.values():
        for rid, ids in list(allocator.block_table.items()):
            if ids:
                tables.setdefault(rid, []).extend(hf_key(cache, allocator.index, b) for b in ids)
    return tables


def hf_refcount(engine, key):
    """References on a block: 0 when it is free in the pool (its sector free, or serving another
    allocator, or the block on its allocator's free list: less than 0 when it is there twice)
    or kept cached with no reference; else one, or the ledger's count for a shared block."""
    cache = engine.batch_processor.cache
    index, block = key if isinstance(key, tuple) else (0, key)
    pool = cache.pool
    sector = block // pool.blocks_per_sector[index]
    if sector in pool.free_sectors or pool.owners.get(sector) != index:
        return 0
    on_free_list = pool._free_blocks[index].trees.get(sector, []).count(block)
    if on_free_list:
        return 1 - on_free_list  # negative: freed more often than handed out
    ledger = [a for a in cache.cache_allocators.values() if a.index == index][0].ledger
    return 0 if block in ledger.cached_blocks else ledger.shared_ref_counts.get(block, 1)


def hf_generation(engine, rid):
    """None once the request ended; 0 while it is queued, waiting (also preempted) or active."""
    scheduler = engine.batch_processor.scheduler
    queued = [s.request_id for s in list(engine.input_queue.queue)]
    alive = rid in scheduler.active_requests or rid in scheduler.waiting_requests
    return 0 if alive or rid in queued else None


def hf_reads(engine, batch):
    """The blocks a sync step uses for each request it runs: its table (async: none, see the
    module's docstring)."""
    if engine.batch_processor.use_async_batching:
        return {}
    tables = hf_tables(engine)
    return {f.state.request_id: tables.get(f.state.request_id, []) for f in batch}


def hf_held(engine):
    """Blocks handed out by the pool and neither free nor cached: held by a request."""
    cache = engine.batch_processor.cache
    pool = cache.pool
    held = []
    for allocator in cache.cache_allocators.values():
        index, per = allocator.index, pool.blocks_per_sector[allocator.index]
        for sector, owner in sorted(pool.owners.items()):
            if owner != index or sector in pool.free_sectors:
                continue
            for block in range(sector * per, (sector + 1) * per):
                if hf_refcount(engine, hf_key(cache, index, block)):
                    held.append(hf_key(cache, index, block))
    return held


def test_lifecycle_engine_error():
    engine = hf_make({'num_blocks': 8, 'page_size': 4, 'max_batch_tokens': 16, 'max_requests_per_batch': 4, 'use_async_batching': True})
    leases = {}

    def check():
        problem = check_invariants(hf_tables(engine),
                                   lambda b: hf_refcount(engine, b),
                                   leases, lambda rid: hf_generation(engine, rid),
                                   False, hf_held(engine), None)
        assert problem is None, problem[2]

    engine.add_request(hf_prompt(0, 4), request_id='r0', max_new_tokens=2, eos_token_id=1)
    check()
    s1 = hf_schedule(engine)
    leases[1] = {rid: (hf_generation(engine, rid), ids) for rid, ids in hf_reads(engine, s1).items()}
    check()
    engine.cancel_request('r0')
    check()
    hf_schedule(engine)
    check()
    hf_process(engine, s1, set())
    leases.pop(1, None)
    check()
