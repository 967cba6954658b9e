"""The lifecycle fuzzer on Hugging Face transformers' continuous batching (``HfDriver``): a
lifecycle bug planted in the engine is found, shrunk and emitted as a regression test that fails
while it is planted and passes without it; the real bug it found in transformers 5.24.0
(cancelling a request while its batch is in flight under async batching crashes the generation
loop) is kept in ``lifecycle_emitted/hf_async_cancel.py`` and checked here against the fix it
proposes.

These tests need transformers (and torch) and skip without them: CI installs neither, so there
they skip. The engine runs on CPU over a tiny random model, without its forward pass
(``forward=False``): the fuzzer's tokens replace the model's anyway. The long searches on real
releases live in ``benchmarks/lifecycle/`` and are recorded in docs/findings.md.
"""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the HF driver needs torch")
pytest.importorskip("transformers", reason="the HF driver needs transformers (CI installs none)")

from kvguard.conformance.lifecycle_hf import HfDriver, HfFactory  # noqa: E402
from kvguard.testing import check_lifecycle  # noqa: E402

EMITTED = Path(__file__).parent / "lifecycle_emitted" / "hf_async_cancel.py"


def has_continuous_batching() -> bool:
    return importlib.util.find_spec(
        "transformers.generation.continuous_batching.cache_allocators") is not None


pytestmark = pytest.mark.skipif(not has_continuous_batching(),
                                reason="this transformers has no paged CacheAllocator")


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny engine's small tensor ops run several times faster on one thread."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def plant_stale_free_after_cancel(monkeypatch):
    """The bug engines ship (SGLang's overlap loop had one): a cancelled request's blocks are
    freed at the cancellation, and a late path (here, once the step has scheduled its batch)
    frees them again on the request's behalf, after they may have gone to another request."""
    from transformers.generation.continuous_batching import continuous_api, scheduler

    clear, prepare = (scheduler.Scheduler.clear_cancelled_requests,
                      continuous_api.ContinuousBatchProcessor.prepare_next_batch)

    def clear_cancelled_requests(self):
        stale = self.__dict__.setdefault("kv_stale", {})
        for rid in self._requests_to_cancel:
            stale[rid] = {name: list(a.block_table.get(rid, ()))
                          for name, a in self.cache.cache_allocators.items()}
        return clear(self)

    def prepare_next_batch(self):
        scheduled = prepare(self)
        for rid, tables in self.scheduler.__dict__.pop("kv_stale", {}).items():
            for name, ids in tables.items():
                allocator = self.cache.cache_allocators[name]
                allocator.block_table[rid] = ids
                allocator.free_blocks(rid)
        return scheduled

    monkeypatch.setattr(scheduler.Scheduler, "clear_cancelled_requests", clear_cancelled_requests)
    monkeypatch.setattr(continuous_api.ContinuousBatchProcessor, "prepare_next_batch",
                        prepare_next_batch)


def run_emitted(source: str) -> None:
    scope = {}
    exec(compile(source, "emitted", "exec"), scope)
    next(v for k, v in scope.items() if k.startswith("test_lifecycle_"))()


def test_a_stale_free_after_cancel_is_found_shrunk_and_emitted(monkeypatch):
    plant_stale_free_after_cancel(monkeypatch)
    report = check_lifecycle(HfFactory("sync", forward=False), HfDriver, examples=40,
                             raise_on_finding=False)
    (finding,) = report.findings
    assert finding.kind in ("stale-free", "double-free"), finding.render()
    kinds = [e[0] for e in finding.events]
    assert len(kinds) <= 8, finding.event_lines()
    at = 0
    for want in ("add", "schedule", "abort", "schedule"):  # in this order
        at = kinds.index(want, at) + 1
    assert "engine.cancel_request(" in finding.test and "import kvguard" not in finding.test

    with pytest.raises(AssertionError, match="back in the pool|released more often"):
        run_emitted(finding.test)          # the guard is not there: the invariants catch it
    monkeypatch.undo()
    run_emitted(finding.test)              # the engine without the planted bug passes


def test_the_sync_engine_is_clean_in_a_short_search():
    report = check_lifecycle(HfFactory("sync", forward=False), HfDriver, examples=20, steps=16)
    assert report.findings == [] and "transformers" in report.engine


def fix_cancel_in_flight(monkeypatch):
    """The fix docs/findings.md proposes: a cancelled request leaves the scheduler FINISHED, so
    the update of a batch still in flight skips it (as it skips a preempted one)."""
    from transformers.generation.continuous_batching import scheduler
    from transformers.generation.continuous_batching.requests import RequestStatus

    clear = scheduler.Scheduler.clear_cancelled_requests

    def clear_cancelled_requests(self):
        cancelled = clear(self)
        for state in cancelled:
            state.status = RequestStatus.FINISHED
        return cancelled

    monkeypatch.setattr(scheduler.Scheduler, "clear_cancelled_requests", clear_cancelled_requests)


def test_the_kept_async_cancel_test_fails_on_5_24_and_passes_with_the_fix(monkeypatch):
    import transformers
    if transformers.__version__ != "5.24.0":
        pytest.skip(f"kept for transformers 5.24.0, not {transformers.__version__}")
    with pytest.raises(KeyError):
        run_emitted(EMITTED.read_text())
    fix_cancel_in_flight(monkeypatch)
    run_emitted(EMITTED.read_text())


def test_the_command_line_builds_the_hf_engine(capsys):
    from kvguard.cli import main
    assert main(["fuzz", "--lifecycle", "hf", "--config", "sync-no-sharing", "--examples", "3",
                 "--steps", "8"]) == 0
    assert "transformers" in capsys.readouterr().out
    assert main(["fuzz", "--lifecycle", "hf", "--config", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown transformers configuration" in err[0]
