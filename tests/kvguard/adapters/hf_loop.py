"""The whole Hugging Face continuous-batching loop on CPU, for the lifecycle tests: a tiny random
Llama (2 layers, hidden size 32, no download), a cache tight enough that requests are preempted
(soft reset and requeued), prompts that share a prefix (prefix-cache hits), forks
(``num_return_sequences=2``, sampling with ``top_k=1`` so every token is still the argmax),
cancellations, and one manager reused across sessions. Steps are counted in the engine's own
generation thread, where hooks run after each ``update_batch`` (the planted bugs)."""

from __future__ import annotations

import contextlib
import random

import kvguard

MAX_NEW = 8
LONG = 400  # a request that is cancelled before it could finish


def tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def generation_config(forks: bool):
    from transformers import GenerationConfig

    if forks:
        return GenerationConfig(do_sample=True, top_k=1, num_return_sequences=2,
                                max_new_tokens=MAX_NEW, eos_token_id=-1, pad_token_id=0)
    return GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=-1,
                            pad_token_id=0)


def batching_config(**overrides):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    options = dict(page_size=8, num_blocks=24, max_batch_tokens=128, max_requests_per_batch=16,
                   use_cuda_graph=False, use_async_batching=False, auto_switch_to_flash=False,
                   seed=0)
    options.update(overrides)
    return ContinuousBatchingConfig(**options)


def prompts(n: int, seed: int = 0, prefix: str = "r") -> dict:
    """``n`` prompts, every other one opening with the same 24 tokens (three full pages)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 64) for _ in range(24)]
    return {f"{prefix}{i}": (shared if i % 2 else []) + [rng.randrange(1, 64)
                                                         for _ in range(rng.randrange(4, 30))]
            for i in range(n)}


class Loop:
    """One ``ContinuousBatchingManager``, reused by every ``session``. ``hooks`` run in the
    generation thread after each step's ``update_batch`` with ``(processor, step)``;
    ``counts`` says what the engine did (steps, requests preempted, forks, cancellations)."""

    def __init__(self, model, monkeypatch, *, forks: bool = False, **config) -> None:
        from transformers.generation.continuous_batching import continuous_api, offloading_manager

        self.hooks: list = []
        self.step = 0
        self.counts = {"steps": 0, "preempted": 0, "prefix hits": 0}
        processor = continuous_api.ContinuousBatchProcessor
        update_batch = processor.update_batch

        def counted_update(proc):
            update_batch(proc)
            self.step += 1
            self.counts["steps"] += 1
            for hook in list(self.hooks):
                hook(proc, self.step)

        offloading = offloading_manager.OffloadingManager
        offload = offloading._offload_to_cpu

        def counted_offload(manager, offloaded, tables):
            self.counts["preempted"] += len(offloaded)
            return offload(manager, offloaded, tables)

        cache = continuous_api.PagedAttentionCache
        search = cache.search_prefix_match

        def counted_search(paged_cache, request_id, prompt_ids):
            matched = search(paged_cache, request_id, prompt_ids)
            self.counts["prefix hits"] += bool(matched)
            return matched

        monkeypatch.setattr(cache, "search_prefix_match", counted_search)
        monkeypatch.setattr(processor, "update_batch", counted_update)
        monkeypatch.setattr(offloading, "_offload_to_cpu", counted_offload)
        self.forks = forks
        self.model = model
        model.destroy_cached_continuous_batching_manager()  # a manager another Loop kept
        self.manager = model.init_continuous_batching(
            generation_config=generation_config(forks),
            continuous_batching_config=batching_config(**config))

    def session(self, batch: dict, *, cancel=(), cancel_at: int = 3) -> dict:
        """Run ``batch`` (request id -> prompt) to completion; the ids in ``cancel`` ask for
        ``LONG`` tokens and are cancelled at step ``cancel_at`` of this session. Returns request
        id -> generated tokens, forks included, for the requests that finished."""
        manager = self.manager
        first = self.step
        if cancel:
            def cancelling(proc, step):
                if step - first == cancel_at:
                    self.hooks.remove(cancelling)
                    for rid in cancel:
                        manager.cancel_request(rid)
            self.hooks.append(cancelling)
        manager.start()
        with manager.pause():  # every request in before the first step: the same batches each run
            for rid, prompt in batch.items():
                manager.add_request(prompt, request_id=rid,
                                    max_new_tokens=LONG if rid in cancel else MAX_NEW)
        expected = (len(batch) - len(cancel)) * (2 if self.forks else 1)
        results = {}
        idle = 0
        while len(results) < expected and idle < 60:
            result = manager.get_result(timeout=1)
            if result is None:
                idle += 1
                if not manager.is_running():
                    break
            elif result.is_finished():
                results[result.request_id] = list(result.generated_tokens)
        manager.stop(block=True, keep_for_next_session=True)
        return results

    @property
    def cache(self):
        return self.manager.batch_processor.cache

    @property
    def guard(self):
        return kvguard.guard_of(self.cache.pool)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.model.destroy_cached_continuous_batching_manager()


class LateFree:
    """A hook planting a stale free: when ``victim`` finishes (all its tokens generated), its
    block tables are kept; ``after`` steps later, once its blocks went to other requests, a
    late path frees them again on its behalf (``PagedAttentionCache.free_blocks(victim)``, as
    ``finish_request`` does), in the engine's own thread. ``raised`` keeps what that call raised
    (the engine's loop would otherwise end on it); ``handed_on`` says whether another request held
    one of those blocks when it ran."""

    def __init__(self, loop: Loop, victim: str, after: int = 2) -> None:
        self.loop, self.victim, self.after = loop, victim, after
        self.kept = None
        self.finished_at = None
        self.raised = None
        self.handed_on = False
        self.done = False
        loop.hooks.append(self)

    def __call__(self, proc, step) -> None:
        if self.done:
            return
        tables = proc.cache.cache_allocators
        if self.kept is None:
            state = proc.scheduler.active_requests.get(self.victim)
            if state is not None and len(state.generated_tokens) >= MAX_NEW - 1:
                self.kept = {name: list(a.block_table.get(self.victim, ()))
                             for name, a in tables.items()}
            return
        if self.finished_at is None:
            if self.victim not in proc.scheduler.active_requests:
                self.finished_at = step
            return
        if step - self.finished_at < self.after:
            return
        guard = kvguard.guard_of(proc.cache.pool)
        for name, allocator in tables.items():
            for b in self.kept[name]:
                record = guard.live.get((allocator.index, b)) if guard is not None else None
                if record is not None and record.holder not in (None, self.victim):
                    self.handed_on = True
            allocator.block_table[self.victim] = list(self.kept[name])
        self.done = True
        try:
            proc.cache.free_blocks(self.victim)
        except kvguard.KVGuardError as exc:  # raise mode: the late path's caller sees it
            self.raised = exc
