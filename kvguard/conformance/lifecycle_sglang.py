"""The lifecycle driver of SGLang's ``Scheduler`` on CPU (checked against 0.5.23): a first cut.

SGLang's real ``Scheduler`` is built the way ``run_scheduler_process`` builds it, on CPU
(``device="cpu"``, ``load_format="dummy"``: random weights; the config of Qwen3-0.6B from an
offline Hugging Face cache, shrunk to two layers of width 64; a KV pool of 64 tokens; the
non-overlap loop). The driver runs the body of ``event_loop_normal`` by hand:
``get_next_batch_to_run`` and ``run_batch`` (the forward pass, ``torch_native`` attention) are
a step, ``process_batch_result`` with the fuzzer's tokens processes it (token 1 is a stop token
of every request), ``on_idle`` runs when nothing is scheduled. Requests go in by
``handle_generate_request`` and out by ``abort_request``, as the tokenizer manager sends them.

Building a Scheduler takes 30 to 100 s, so one is built per factory and each event sequence gets
it back after ``flush_cache()`` (radix tree, request rows and KV slots reset), which SGLang does
only when fully idle: a sequence that broke off at a finding is settled first (everything
aborted, stepped until idle). Unlike the other drivers, sequences share one engine object.

What it checks: kvguard's guard on the token allocator (double frees, foreign and invalid ids),
exceptions the engine raises, and SGLang's own pool invariants (``_check_all_pools``, the check
``on_idle`` runs) once every request ended. It reads no block tables yet (radix-shared slots
need the tree's lock counts), so ``stale-table``/``shared-block`` are not checked here.
"""

from __future__ import annotations

import os
from pathlib import Path

from .lifecycle import LifecycleDriver

SHRUNK = ('{"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, '
          '"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, '
          '"vocab_size": 512}')
OPTIONS = {"model_path": "Qwen/Qwen3-0.6B", "max_total_tokens": 64, "max_running_requests": 4,
           "json_model_override_args": SHRUNK}


def sgl_make(options):
    """A Scheduler built as ``run_scheduler_process`` builds one, on CPU."""
    from sglang.srt.managers import scheduler as sched
    from sglang.srt.server_args import PortArgs, ServerArgs
    args = ServerArgs(device="cpu", load_format="dummy", skip_tokenizer_init=True,
                      disable_cuda_graph=True, mem_fraction_static=0.3,
                      disable_overlap_schedule=True, **options)
    port_args = PortArgs.init_new(args)
    sched.publish(args, role="scheduler", ranks=sched.SpawnRanks(
        world_rank=sched.spawn_world_rank(args, tp_rank=0, pp_rank=0), dp_rank=None, gpu_id=0))
    sched.configure_scheduler_process(args, 0, display_tp_rank=None, display_dp_rank=None,
                                      display_moe_ep_rank=None)
    return sched.Scheduler(args, port_args)


def sgl_add(engine, rid, doc, length, max_tokens):
    from array import array

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, stop_token_ids=[1])
    params.normalize(None)
    params.verify(512)
    prompt = array("q", [3 + (doc * 19 + i * 7) % 60 for i in range(length)])
    engine.handle_generate_request(TokenizedGenerateReqInput(
        rid=rid, input_text=None, input_ids=prompt, input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=params, return_logprob=False,
        logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False))


def sgl_abort(engine, rid):
    from sglang.srt.managers.io_struct import AbortReq
    engine.abort_request(AbortReq(rid=rid))


def sgl_schedule(engine):
    """One step of ``event_loop_normal``: the batch and its forward pass, or None (idle)."""
    plan = engine.get_next_batch_to_run(running_batch=engine.running_batch,
                                        last_batch=engine.last_batch)
    engine.running_batch = plan.running_batch
    batch = plan.batch_to_run
    if not batch:
        engine.on_idle()
        engine.last_batch = None
        return None
    return batch, engine.run_batch(batch)


def sgl_process(engine, step, eos):
    batch, result = step
    ids = getattr(result, "next_token_ids", None)
    if ids is not None and len(ids) == len(batch.reqs):
        for i, req in enumerate(batch.reqs):
            ids[i] = 1 if req.rid in eos else 2
    engine.process_batch_result(batch, result)
    engine.last_batch = batch


def sgl_generation(engine, rid):
    reqs = list(engine.waiting_queue) + list(engine.running_batch.reqs)
    if engine.chunked_req is not None:
        reqs.append(engine.chunked_req)
    if engine.last_batch is not None:
        reqs += list(engine.last_batch.reqs)
    alive = any(r.rid == rid and not r.finished() for r in reqs)
    return 0 if alive else None


def sgl_tables(engine):
    return {}


def sgl_refcount(engine, block):
    return 1


def sgl_reads(engine, step):
    return {}


def sgl_held(engine):
    """SGLang's own idle check of its pools, once every request ended: the leak messages."""
    if engine.waiting_queue or engine.chunked_req is not None or \
            not engine.running_batch.is_empty():
        return []  # (the last batch, processed, may still be set: the next step clears it)
    leak, messages = engine.invariant_checker._check_all_pools(
        engine.pool_stats_observer.get_pool_stats())
    return list(messages) if leak else []


def prepare() -> None:
    """The setup's offline HF cache, its SGLang dependencies' folder (``torchvision``,
    ``gguf``), before SGLang is imported. Raises ``ImportError`` when SGLang is missing."""
    import importlib.util
    import sys
    cache = Path(os.environ.get("KVGUARD_ENGINE_CACHE") or "~/.cache/kvguard-engines")
    upstream = cache.expanduser() / "upstream"
    os.environ.setdefault("HF_HOME", str(upstream / "hf"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    deps = upstream / "sglang-deps"
    if deps.is_dir() and str(deps) not in sys.path:
        sys.path.append(str(deps))
    if importlib.util.find_spec("sglang") is None:
        raise ImportError("SGLang is not installed")


def settle(engine) -> None:
    """Bring the scheduler back to idle after an event sequence (one that broke off at a
    finding keeps its requests): abort everything, step until idle, flush."""
    from sglang.srt.managers.io_struct import AbortReq
    for _ in range(32):
        if engine.is_fully_idle():
            break
        engine.abort_request(AbortReq(rid="", abort_all=True))
        try:
            step = sgl_schedule(engine)
            if step is not None:
                sgl_process(engine, step, set())
        except Exception:  # what the last sequence broke (already reported): flushed below
            engine.last_batch = None
    if not engine.is_fully_idle():  # a broken state: drop the requests, the flush resets pools
        engine.waiting_queue.clear()
        engine.running_batch.reqs.clear()
        engine.chunked_req = engine.last_batch = None
    if not engine.flush_cache(empty_cache=False):
        raise RuntimeError("SGLang's scheduler did not come back to idle: it cannot be flushed")


class SglangFactory:
    """One Scheduler, built once, flushed for each event sequence."""

    def __init__(self, config: str = "sync", **overrides) -> None:
        if config != "sync":
            raise ValueError(f"unknown SGLang configuration {config!r}: sync")
        self.options = {**OPTIONS, **overrides}
        self.scheduler = None

    def __call__(self):
        if self.scheduler is None:
            prepare()
            self.scheduler = sgl_make(self.options)
        else:
            settle(self.scheduler)
        self.scheduler.kv_options = self.options
        return self.scheduler


class SglangDriver(LifecycleDriver):
    """SGLang's ``Scheduler``: ``handle_generate_request``, ``abort_request`` and the body of
    ``event_loop_normal`` stepped by hand."""

    documents = 3
    max_prompt = 24
    max_tokens = 6

    def __init__(self, scheduler) -> None:
        super().__init__(scheduler)
        self.options = getattr(scheduler, "kv_options", None) or dict(OPTIONS)
        import sglang
        self.name = f"SGLang {sglang.__version__} Scheduler (non-overlap)"

    def add(self, rid, doc, length, max_tokens):
        sgl_add(self.engine, rid, doc, length, max_tokens)

    def schedule(self):
        step = sgl_schedule(self.engine)
        return None if step is None else (step, {})

    def process(self, handle, eos):
        sgl_process(self.engine, handle, eos)

    def abort(self, rid):
        sgl_abort(self.engine, rid)

    def tables(self):
        return {}

    def refcount(self, block):
        return 1

    def generation(self, rid):
        return sgl_generation(self.engine, rid)

    def held(self):
        return sgl_held(self.engine)

    def allocator(self):
        return self.engine.token_to_kv_pool_allocator

    imports = ""
    helpers = (sgl_make, sgl_add, sgl_abort, sgl_schedule, sgl_process, sgl_generation,
               sgl_tables, sgl_refcount, sgl_reads, sgl_held)

    def make_source(self) -> str:
        return f"sgl_make({self.options!r})"

    def event_source(self, event) -> str:
        kind = event[0]
        if kind == "add":
            _, rid, doc, length, max_tokens = event
            return f"sgl_add(engine, {rid!r}, {doc}, {length}, {max_tokens})"
        if kind == "schedule":
            return "sgl_schedule(engine)"
        if kind == "process":
            return f"sgl_process(engine, s{event[1]}, {set(event[2]) or set()!r})"
        if kind == "abort":
            return f"sgl_abort(engine, {event[1]!r})"
        return ""
