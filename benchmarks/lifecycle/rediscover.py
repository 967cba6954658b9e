"""Rediscovery: the lifecycle fuzzer, told nothing about a bug, finds it on the last release
before its fix, and finds nothing on the fixed release in the same budget; the regression test
it emits fails on the first and passes on the second. One command per row:

    python benchmarks/lifecycle/rediscover.py vllm-swa-inflight       # one row
    python benchmarks/lifecycle/rediscover.py all --budget 600        # every row

Needs ``python benchmarks/upstream/run.py setup`` once (a venv with vLLM 0.33.0 and its
non-CUDA dependencies, vLLM's tests, an offline HF config cache); this script then downloads
each old release itself: its wheel into a ``--target`` folder of its own (``--no-deps``, over the
same venv's dependencies) and its sdist's ``tests/``. PyPI's vLLM wheel is the CUDA build; the
old releases detect the CPU platform from a ``+cpu`` version only (newer ones read
``VLLM_TARGET_DEVICE``), so the folder's metadata says ``X+cpu``: nothing else is changed.
0.23.0 imports ``gguf`` at module level: it goes into the same folder. PyPI has no sdist of
0.15.x: that row runs 0.15.1 with the ``tests/`` of 0.16.0 (the release with the fix; its
``tests/v1/core/utils.py`` builds the scheduler through the same API).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "upstream"))
import run as upstream  # noqa: E402

WORK = upstream.WORK
FIXED = "0.33.0"
ROWS = {
    "vllm-swa-inflight": {
        "config": "swa-async", "buggy": "0.25.0", "fixed": FIXED, "pr": "vllm#47728",
        "bug": "sliding-window blocks freed on the optimistic token count while the in-flight "
               "step still reads them"},
    "vllm-chunked-local-inflight": {
        "config": "chunked-local-async", "buggy": "0.25.0", "fixed": FIXED, "pr": "vllm#47728",
        "bug": "chunked-local attention: the same premature free, its own manager"},
    "vllm-aborted-async-load": {
        "config": "pd-async-load", "buggy": "0.15.1", "tests": "0.16.0", "fixed": FIXED,
        "pr": "vllm#32255",
        "bug": "aborting a request whose asynchronous KV load is in flight returns the load's "
               "destination blocks to the pool at once"},
    "vllm-deferred-free": {
        "config": "pd-consumer-async", "buggy": "0.23.0", "fixed": FIXED, "pr": "vllm#45357",
        "bug": "a finished/aborted request's blocks returned to the pool while an in-flight "
               "step still writes them (async scheduling + KV-consumer connector)"},
}


def sh(*cmd, **kw):
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], **kw)


def sdist_tests(version: str) -> Path:
    """vLLM's source tree of ``version`` (tests/, requirements/, pyproject.toml)."""
    target = WORK / f"vllm-{version}"
    if (target / "tests").is_dir():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        sh(sys.executable, "-m", "pip", "download", "--no-clean", "--no-deps", "--no-binary",
           ":all:", "--no-build-isolation", f"vllm=={version}", "-d", tmp,
           env=dict(os.environ, TMPDIR=tmp))
        trees = glob.glob(f"{tmp}/pip-download-*/vllm_*")
        if not trees:
            sys.exit(f"rediscover: pip did not leave vLLM {version}'s unpacked sdist behind")
        target.mkdir(parents=True, exist_ok=True)
        for part in ("tests", "requirements"):
            shutil.copytree(Path(trees[0]) / part, target / part, dirs_exist_ok=True)
        shutil.copy(Path(trees[0]) / "pyproject.toml", target)
    return target


def release(version: str, python: Path) -> Path | None:
    """The folder holding vLLM ``version`` (None: the venv's own 0.33.0)."""
    if version == FIXED:
        return None
    target = WORK / "releases" / f"vllm-{version}"
    meta = target / f"vllm-{version}.dist-info" / "METADATA"
    if not meta.exists():
        sh(python, "-m", "pip", "install", "-q", "--no-deps", "--target", target,
           f"vllm=={version}", "gguf", check=True)
    text = meta.read_text()
    meta.write_text(re.sub(rf"^Version: {re.escape(version)}$", f"Version: {version}+cpu",
                           text, flags=re.M))
    return target


def env_for(version: str, python: Path, tests: str | None = None) -> tuple[dict, Path]:
    tree = sdist_tests(tests or version)
    env = dict(os.environ, KVGUARD_VLLM_TESTS=str(tree), HF_HOME=str(WORK / "hf"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    folder = release(version, python)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder) if folder else None,
                                                      str(ROOT), str(tree)]))
    return env, tree


def fuzz(python, version, config, budget, emit: Path, tests=None) -> tuple[bool, float, str]:
    env, tree = env_for(version, python, tests)
    start = time.monotonic()
    done = sh(python, "-m", "kvguard", "fuzz", "--lifecycle", "vllm", "--config", config,
              "--examples", "100000", "--budget", budget, "--emit", emit, cwd=tree, env=env,
              capture_output=True, text=True)
    seconds = time.monotonic() - start
    report = done.stdout
    print(report.split("    regression test:")[0], flush=True)
    if done.returncode not in (0, 1) or "kvguard lifecycle:" not in report:
        sys.exit(f"rediscover: the fuzzer failed on vLLM {version}:\n{done.stderr[-2000:]}")
    return done.returncode == 1, seconds, report


def emitted_passes(python, version, test: Path, tests=None) -> bool:
    env, tree = env_for(version, python, tests)
    done = sh(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:kvguard", test,
              cwd=tree, env=env, capture_output=True, text=True)
    print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:])
    return done.returncode == 0


def row(name: str, args) -> str:
    spec = ROWS[name]
    python = Path(args.venv) / "bin" / "python"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    test = out / f"test_{name.replace('-', '_')}.py"
    found, seconds, report = fuzz(python, spec["buggy"], spec["config"], args.budget, test,
                                  spec.get("tests"))
    clean_emit = out / f"unexpected_{name}.py"
    found_fixed, fixed_seconds, _ = fuzz(python, spec["fixed"], spec["config"], args.budget,
                                         clean_emit)
    fails_buggy = found and not emitted_passes(python, spec["buggy"], test, spec.get("tests"))
    passes_fixed = found and emitted_passes(python, spec["fixed"], test)
    events = re.findall(r"^      (add .*|schedule .*|process .*|abort .*|reset .*|end: .*)$",
                        report, flags=re.M)
    return (f"| {name} | {spec['pr']} | {spec['buggy']} | {spec['fixed']} | "
            f"{'found in %.0f s' % seconds if found else 'NOT FOUND'} | "
            f"{'0 findings in %.0f s' % fixed_seconds if not found_fixed else 'FOUND on fixed'}"
            f" | {'; '.join(events)} | fails on {spec['buggy']}: {fails_buggy}, passes on "
            f"{spec['fixed']}: {passes_fixed} ({test.name}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("row", choices=[*ROWS, "all"])
    parser.add_argument("--budget", default="600", help="seconds per search (default 600)")
    parser.add_argument("--venv", default="/work/venv-upstream",
                        help="the venv benchmarks/upstream/run.py setup made")
    parser.add_argument("--out", default=str(WORK / "lifecycle"),
                        help="where the emitted tests go")
    args = parser.parse_args()
    if not (Path(args.venv) / "bin" / "python").exists():
        sys.exit(f"rediscover: no venv at {args.venv}: run "
                 f"`python benchmarks/upstream/run.py setup --venv {args.venv}` first")
    python = Path(args.venv) / "bin" / "python"
    if sh(python, "-c", "import hypothesis", capture_output=True).returncode:
        sh(python, "-m", "pip", "install", "-q", "hypothesis", "pytest", check=True)
    names = list(ROWS) if args.row == "all" else [args.row]
    lines = ["| row | fix | last buggy | fixed | buggy release | fixed release | shrunk events "
             "| emitted test |", "|---|---|---|---|---|---|---|---|"]
    lines += [row(name, args) for name in names]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
