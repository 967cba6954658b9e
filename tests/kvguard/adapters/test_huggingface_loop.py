"""Hugging Face transformers continuous batching, the whole loop on CPU: a tiny random Llama run
by the real ``ContinuousBatchingManager`` (its generation thread, scheduler, preemption, prefix
cache, forks, cancellation; ``hf_loop.py``), under ``kvguard.instrument()`` and under
``pytest -p kvguard``. Correct runs report nothing; a late free on behalf of a finished request,
after its blocks went to other requests, is a ``stale-free`` at that call in every mode, and
repair mode keeps every request's tokens what they are without the planted free; a leak in the
engine's own generation thread fails its test under ``--kvguard-leaks=fail``.

This needs transformers itself, installed with its dependencies (tokenizers, safetensors,
huggingface_hub, regex): the library does not import from the wheel alone. The test extra
installs it (``transformers==5.24.0``); without it these tests skip, and the allocator-level
tests in ``test_huggingface_lifecycle.py`` still run, on the wheel's files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvguard

pytest.importorskip("transformers", minversion="5.24", reason=(
    "the continuous-batching loop needs transformers>=5.24 installed with its dependencies "
    "(`pip install transformers==5.24.0`, which the test extra installs)"))

from . import hf_loop  # noqa: E402


@pytest.fixture(scope="module")
def model():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 30-request loop in seconds on a small, shared machine
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield hf_loop.tiny_model()
    finally:
        torch.set_num_threads(threads)
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved


@pytest.fixture(scope="module")
def unplanted(model):
    """Every request's tokens on the run the planted tests repeat, without the planted free
    and without kvguard."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        loop = hf_loop.Loop(model, monkeypatch)
        try:
            return loop.session(hf_loop.prompts(24))
        finally:
            loop.close()


def test_correct_runs_with_preemption_prefix_hits_forks_cancels_and_reuse_report_nothing(
        model, monkeypatch):
    kvguard.instrument()
    forking = hf_loop.Loop(model, monkeypatch, forks=True)
    first = forking.session(hf_loop.prompts(16))
    again = forking.session(hf_loop.prompts(16, seed=1, prefix="s"))   # the manager reused
    assert len(first) == len(again) == 32                               # each forked once
    assert forking.guard.violations == []
    cancelling = hf_loop.Loop(model, monkeypatch)
    finished = cancelling.session(hf_loop.prompts(20), cancel=("r3", "r8"))
    assert len(finished) == 18 and "r3" not in finished
    assert cancelling.guard.violations == []
    counts = {k: forking.counts[k] + cancelling.counts[k] for k in forking.counts}
    assert counts["preempted"] > 0 and counts["prefix hits"] > 0, counts
    forking.close()
    cancelling.close()


def planted_run(model, monkeypatch, mode):
    kvguard.instrument(on_violation=mode)
    loop = hf_loop.Loop(model, monkeypatch)
    plant = hf_loop.LateFree(loop, "r6")
    tokens = loop.session(hf_loop.prompts(24))
    loop.close()
    assert plant.done and plant.handed_on, "the victim's blocks must have gone to others"
    return loop, plant, tokens


@pytest.mark.parametrize("mode", ["raise", "log", "repair"])
def test_a_late_free_after_reuse_is_reported_at_that_free(model, monkeypatch, unplanted, mode,
                                                          quiet_kvguard_log):
    loop, plant, tokens = planted_run(model, monkeypatch, mode)
    first = loop.guard.violations[0]
    assert first.kind == "stale-free" and "'r6'" in first.message
    frames = [f["function"] for f in first.to_dict()["call_stack"]]
    assert "PagedAttentionCache.free_blocks" in frames and "LateFree.__call__" in frames
    if mode == "raise":
        assert isinstance(plant.raised, kvguard.StaleFreeError)
    if mode != "log":  # the late free never reached the engine's books: nothing else to report
        assert [v.kind for v in loop.guard.violations] == ["stale-free"]
        assert tokens == unplanted


def test_unguarded_the_late_free_changes_tokens(model, monkeypatch, unplanted):
    """The control: without kvguard the same planted free makes requests produce other tokens
    (the repair test above would pass vacuously otherwise)."""
    loop = hf_loop.Loop(model, monkeypatch)
    hf_loop.LateFree(loop, "r6")
    tokens = loop.session(hf_loop.prompts(24))
    loop.close()
    assert set(tokens) == set(unplanted)
    assert any(tokens[rid] != unplanted[rid] for rid in unplanted)


SUITE = """
    import pytest
    import hf_loop

    @pytest.fixture(scope="module")
    def model():
        import torch
        torch.set_num_threads(1)
        return hf_loop.tiny_model()

    def run(model, monkeypatch, hook=None, **config):
        loop = hf_loop.Loop(model, monkeypatch, **config)
        if hook is not None:
            loop.hooks.append(hook)
        tokens = loop.session(hf_loop.prompts(12))
        loop.close()
        return tokens

    def test_planted_late_free(model, monkeypatch):
        loop = hf_loop.Loop(model, monkeypatch)
        plant = hf_loop.LateFree(loop, "r6")
        loop.session(hf_loop.prompts(24))
        loop.close()
        assert plant.done and plant.raised is not None   # the late path swallowed it

    def test_engine_thread_leaks(model, monkeypatch):
        leaked = []
        def leak(proc, step):                            # in the generation thread
            if not leaked and proc.cache.pool.count_free_blocks(0):
                leaked.extend(proc.cache.pool.get_free_blocks(0, 1))
        run(model, monkeypatch, leak, allow_block_sharing=False)

    def test_engine_thread_tidy(model, monkeypatch):
        assert len(run(model, monkeypatch, allow_block_sharing=False)) == 12
"""


def test_under_the_plugin_the_stale_free_and_a_leak_in_the_engine_thread_fail(pytester,
                                                                              monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytester.makepyfile(hf_loop=Path(hf_loop.__file__).read_text(),
                        test_suite=SUITE.replace("\n    ", "\n"))
    result = pytester.runpytest("-p", "kvguard", "--kvguard-leaks=fail", "-rA")
    result.assert_outcomes(passed=2, failed=1, errors=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_engine_thread_leaks*"])
    assert "FAILED test_suite.py::test_planted_late_free - kvguard: stale-free" in out
    assert "PASSED test_suite.py::test_engine_thread_tidy" in out
