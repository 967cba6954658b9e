"""The lifecycle driver of Hugging Face transformers' continuous batching, on CPU.

The engine is the real thing: a ``ContinuousBatchingManager`` over a tiny randomly initialised
model built in-process (no download), with its ``PagedAttentionCache``, ``CacheAllocator``s,
``BlockLedger`` (prefix sharing), scheduler and offloading manager. The driver runs the body of
the manager's generation loop by hand, one step at a time, as its background thread does:
``prepare_next_batch()`` (new requests and cancellations are taken from the manager's queues,
cancelled requests freed, a batch scheduled, requests preempted by memory pressure) and the
model's forward pass are a step; ``update_batch()`` processes it, with the sampled tokens
replaced by the fuzzer's (a request in ``eos`` samples its end token, the others token 2). A
request is added with ``add_request`` and aborted with ``cancel_request``, as a user does: both
are queued and take effect at the next step, whenever they are called.

Asynchronous batching (``use_async_batching``: batch N+1 is prepared and launched before batch N
is processed) needs CUDA streams. On CPU the ``async`` configurations replace the two IO pairs'
stream and event plumbing with plain copies (``HfCpuAsyncIOs``): the processor, scheduler and
cache code that decides what is freed when is the engine's own. Processing a batch with no
later batch launched is what the loop does when it stops (switch pairs, update); the driver
switches back so that the next batch goes to the other pair.

What the driver holds the engine to: every block in a request's table is referenced (not free
in the pool, not kept as an unreferenced cached block), shared blocks carry one reference per
table, nothing stays held once every request ended, and the engine never raises on a valid
sequence of calls. HF orders every device use of a block on one compute stream, so a block
freed while a step that reads it is in flight can only be rewritten after that step: the
driver opens no lease in async mode (sync mode processes a step before the next one).

The helpers below are pasted into the regression tests a finding emits: they read only the
engine's objects and import what they use.
"""

from __future__ import annotations

import os

from .lifecycle import LifecycleDriver

CONFIGS = {
    "sync": {},
    "sync-no-sharing": {"allow_block_sharing": False},
    "sync-hybrid": {"hybrid": True},
    "async": {"use_async_batching": True},
    "async-no-sharing": {"use_async_batching": True, "allow_block_sharing": False},
    "async-hybrid": {"use_async_batching": True, "hybrid": True},
}
"""Named configurations: ``kvguard fuzz --lifecycle hf --config NAME``. ``hybrid``: a model with
a full-attention and a sliding-window (8 tokens) layer, two allocators, no prefix sharing. Any
configuration takes ``forward=False`` (``HfFactory(config, forward=False)``): each step skips the
model's forward pass (only the outputs' transfer runs), several times faster, for tests."""

SIZES = {"num_blocks": 8, "page_size": 4, "max_batch_tokens": 16, "max_requests_per_batch": 4}

EOS, TOKEN = 1, 2


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
            layers = ["full_attention", "sliding_attention"]
            model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True,
                                                 sliding_window=8, layer_types=layers))
        else:
            model = LlamaForCausalLM(LlamaConfig(**shape))
        model.eval()
    names = ("num_blocks", "page_size", "max_batch_tokens", "max_requests_per_batch")
    sizes = {k: options[k] for k in names if k in options}
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
    module's docstring; none either for a step that scheduled nothing)."""
    if batch is None or engine.batch_processor.use_async_batching:
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


def quiet() -> None:
    """transformers' continuous batching logs an error per manager on CPU without psutil."""
    import logging
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)


class HfFactory:
    """Fresh managers of one configuration over one tiny model (built once, ~0.1 s), the device's
    free memory read once (the cache is sized by ``num_blocks``, not by it)."""

    def __init__(self, config: str = "sync", **overrides) -> None:
        if config not in CONFIGS:
            raise ValueError(f"unknown transformers configuration {config!r}: "
                             f"{', '.join(CONFIGS)}")
        self.config = config
        self.options = {**SIZES, **CONFIGS[config], **overrides}
        self.model = self.memory = None

    def __call__(self):
        from unittest.mock import patch
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        quiet()
        from transformers.generation.continuous_batching import cache
        if self.memory is None:  # read once: on CPU it walks /sys for NUMA nodes (~20 ms)
            self.memory = cache.get_device_and_memory_breakdown()
        with patch.object(cache, "get_device_and_memory_breakdown", lambda: self.memory):
            manager = hf_make(self.options, self.model)
        self.model = manager.model
        manager.options = self.options
        return manager


class HfDriver(LifecycleDriver):
    """transformers' ``ContinuousBatchingManager``: ``add_request``, ``cancel_request``, and the
    generation loop's body (``prepare_next_batch`` + forward, ``update_batch``) stepped by
    hand."""

    documents = 3
    max_prompt = 24
    max_tokens = 6

    def __init__(self, manager) -> None:
        super().__init__(manager)
        self.options = getattr(manager, "options", None) or {}
        self.async_scheduling = bool(manager.batch_processor.use_async_batching)
        self.max_in_flight = 2 if self.async_scheduling else 1
        self.leases_outlive_requests = False
        import transformers
        self.name = (f"transformers {transformers.__version__} continuous batching "
                     f"({'async' if self.async_scheduling else 'sync'})")
        self._hold_requests()

    def _hold_requests(self) -> None:
        """kvguard's request boundaries for HF (``kvguard.adapters.huggingface``) on this
        engine's allocators only: each method that acts for a request runs as its holder."""
        from ..adapters.huggingface import BOUNDARIES
        for allocator in self.engine.batch_processor.cache.cache_allocators.values():
            for cls in type(allocator).__mro__:
                for method, (_, make) in BOUNDARIES.get(f"{cls.__module__}.{cls.__qualname__}",
                                                        {}).items():
                    if method not in allocator.__dict__:
                        original = getattr(type(allocator), method)
                        setattr(allocator, method, make(original).__get__(allocator))

    def close(self) -> None:
        """The batch processor's ``__del__`` runs a full ``gc.collect()`` (a second or more in a
        process holding torch and transformers): fine once per serving session, not once per
        event sequence. The processor this driver made is dropped without it."""
        processor = self.engine.batch_processor
        if processor is not None and "__del__" in type(processor).__dict__:
            processor.__class__ = type(type(processor).__name__, (type(processor),),
                                       {"__del__": lambda self: None})

    def add(self, rid, doc, length, max_tokens):
        self.engine.add_request(hf_prompt(doc, length), request_id=rid,
                                max_new_tokens=max_tokens, eos_token_id=EOS)

    def schedule(self):
        batch = hf_schedule(self.engine)
        if batch is None:
            return None
        return batch, hf_reads(self.engine, batch)

    def process(self, handle, eos):
        hf_process(self.engine, handle, eos)

    def abort(self, rid):
        self.engine.cancel_request(rid)

    def tables(self):
        return hf_tables(self.engine)

    def refcount(self, block):
        return hf_refcount(self.engine, block)

    def generation(self, rid):
        return hf_generation(self.engine, rid)

    def held(self):
        return hf_held(self.engine)

    def allocator(self):
        return self.engine.batch_processor.cache.pool

    # --- the regression test -------------------------------------------------------------------

    imports = "import os\n\nos.environ.setdefault(\"HF_HUB_OFFLINE\", \"1\")"
    helpers = (hf_make, HfCpuAsyncIOs, hf_prompt, hf_schedule, hf_process, hf_key, hf_tables,
               hf_refcount, hf_generation, hf_reads, hf_held)

    def make_source(self) -> str:
        return f"hf_make({self.options!r})"

    def event_source(self, event) -> str:
        kind = event[0]
        if kind == "add":
            _, rid, doc, length, max_tokens = event
            return (f"engine.add_request(hf_prompt({doc}, {length}), request_id={rid!r}, "
                    f"max_new_tokens={max_tokens}, eos_token_id=1)")
        if kind == "schedule":
            return "hf_schedule(engine)"
        if kind == "process":
            return f"hf_process(engine, s{event[1]}, {set(event[2]) or set()!r})"
        if kind == "abort":
            return f"engine.cancel_request({event[1]!r})"
        return ""
