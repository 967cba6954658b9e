"""The regression test the lifecycle fuzzer emitted for vLLM's deferred-free bug (vllm#45357,
found on 0.23.0 by ``benchmarks/lifecycle/rediscover.py vllm-deferred-free``), kept in
``lifecycle_emitted/``: it fails on vLLM 0.23.0 and passes on 0.33.0, each run in the venv of
``benchmarks/upstream/run.py setup``. Each run builds vLLM's ``ModelConfig`` (about a minute on a
busy machine), so it runs only with ``KVGUARD_LIFECYCLE_ENGINES=1`` and the releases present."""

import os
import subprocess
from pathlib import Path

import pytest

ENGINE_CACHE = Path(os.environ.get("KVGUARD_ENGINE_CACHE") or "~/.cache/kvguard-engines")
WORK = ENGINE_CACHE.expanduser() / "upstream"
VENV = Path(os.environ.get("KVGUARD_UPSTREAM_VENV", "/work/venv-upstream"))
EMITTED = Path(__file__).parent / "lifecycle_emitted" / "vllm_deferred_free.py"


def run_emitted(tests_tree: Path, release: Path | None, tmp: Path) -> subprocess.CompletedProcess:
    """The emitted test run as a user runs it: pasted beside nothing of kvguard's (this
    project's own ``tests`` package must not shadow vLLM's)."""
    pasted = tmp / f"test_emitted_{'buggy' if release else 'fixed'}.py"
    pasted.write_text(EMITTED.read_text())
    env = dict(os.environ, HF_HOME=str(WORK / "hf"), HF_HUB_OFFLINE="1",
               VLLM_TARGET_DEVICE="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(release) if release else None,
                                                      str(tests_tree)]))
    return subprocess.run([str(VENV / "bin" / "python"), "-m", "pytest", "-q", "-p",
                           "no:cacheprovider", "-p", "no:kvguard", str(pasted)],
                          cwd=tests_tree, env=env, capture_output=True, text=True)


@pytest.mark.skipif(os.environ.get("KVGUARD_LIFECYCLE_ENGINES") != "1",
                    reason="runs vLLM twice (minutes): set KVGUARD_LIFECYCLE_ENGINES=1")
def test_the_emitted_vllm_test_fails_on_the_buggy_release_and_passes_on_the_fixed_one(tmp_path):
    old, new = WORK / "releases" / "vllm-0.23.0", WORK / "vllm-0.33.0"
    for need in (VENV / "bin" / "python", old, WORK / "vllm-0.23.0" / "tests", new / "tests"):
        if not need.exists():
            pytest.skip(f"{need} is missing: run benchmarks/upstream/run.py setup and "
                        "benchmarks/lifecycle/rediscover.py vllm-deferred-free")
    buggy = run_emitted(WORK / "vllm-0.23.0", old, tmp_path)
    assert buggy.returncode == 1, buggy.stdout[-1500:] + buggy.stderr[-1500:]
    assert "is back in the pool while step 1" in buggy.stdout
    fixed = run_emitted(new, None, tmp_path)
    assert fixed.returncode == 0, fixed.stdout[-2000:]
