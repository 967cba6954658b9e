"""Real engine code: DeepSpeed 0.19.8, vLLM, SGLang, lmdeploy and aphrodite-engine, as
`pip download --no-deps` gets them.

.ci/run downloads them into $KVGUARD_ENGINE_CACHE (default ~/.cache/kvguard-engines);
without the download these tests skip and say what to run. DeepSpeed is checked whole
(every file through the analysis, no pre-filter); the KV-cache modules of the others
likewise, with generated deep files among them (depth.py). Their whole packages (6 to 68
MB of Python each) take minutes: set KVGUARD_LINT_WHOLE_PACKAGES=1 to run them too.
"""

import os
import tarfile
import zipfile
from pathlib import Path

import pytest

from flake8_kvguard import config, engine, fixer, index, project

from .helpers import run_cli, run_flake8

CACHE = Path(os.environ.get("KVGUARD_ENGINE_CACHE") or "~/.cache/kvguard-engines").expanduser()
WHOLE = os.environ.get("KVGUARD_LINT_WHOLE_PACKAGES") == "1"
KV_CACHE_MODULES = {
    "vllm": (
        "vllm/v1/core/",
        "vllm/v1/kv_offload/",
        "vllm/v1/simple_kv_offload/",
        "vllm/v1/hisparse/",
    ),
    "sglang": ("sglang/srt/mem_cache/", "sglang/srt/disaggregation/"),
    "lmdeploy": ("lmdeploy/pytorch/paging/",),
    "aphrodite": (
        "aphrodite/v1/core/",
        "aphrodite/v1/kv_offload/",
        "aphrodite/v1/simple_kv_offload/",
    ),
}

# Every finding on these packages, triaged in docs/lint.md ("Findings on five engines"):
EXPECTED = {
    "deepspeed": [
        "deepspeed/inference/v2/ragged/blocked_allocator.py:74:9: KVG201",
        "deepspeed/inference/v2/ragged/blocked_allocator.py:92:29: KVG202",
        "deepspeed/inference/v2/ragged/ragged_manager.py:118:33: KVG101",
    ],
    # On the whole packages, also the findings outside the KV-cache modules.
    "vllm": [
        "vllm/v1/core/block_pool.py:816:9: KVG204",
        "vllm/v1/hisparse/coordinator.py:244:50: KVG102",
        "vllm/v1/simple_kv_offload/manager.py:1353:45: KVG102",
    ],
    "sglang": [
        "sglang/srt/disaggregation/utils.py:395:9: KVG205",
        "sglang/srt/disaggregation/utils.py:396:32: KVG202",
        # Outside the KV-cache modules: found on the whole package only.
        "sglang/srt/hardware_backend/mlx/kv_cache/auxiliary_state.py:145:9: KVG204",
        "sglang/srt/layers/attention/minicpm/cache.py:155:33: KVG102",
        "sglang/srt/mem_cache/allocator/mamba.py:79:9: KVG204",
        "sglang/srt/mem_cache/allocator/token.py:65:9: KVG204",
        "sglang/srt/mem_cache/allocator/unified_sub_pool.py:1422:9: KVG204",
        "sglang/srt/mem_cache/memory_pool.py:454:9: KVG204",
        "sglang/srt/mem_cache/unified_radix_cache.py:3269:39: KVG102",
        "sglang/srt/mem_cache/unified_radix_cache.py:3287:25: KVG102",
    ],
    "lmdeploy": [
        "lmdeploy/pytorch/paging/block_manager/base_block_manager.py:112:9: KVG203",
        "lmdeploy/pytorch/paging/block_manager/base_block_manager.py:53:9: KVG204",
        "lmdeploy/pytorch/paging/state_manager.py:24:9: KVG205",
        "lmdeploy/pytorch/paging/state_manager.py:29:48: KVG202",
    ],
    "aphrodite": [
        "aphrodite/v1/core/block_pool.py:639:9: KVG204",
        "aphrodite/v1/simple_kv_offload/manager.py:954:45: KVG102",
    ],
}
# name -> (wheel file name, pip pin)
WHEELS = {
    "vllm": ("vllm-0.33.0-*.whl", "vllm==0.33.0"),
    "sglang": ("sglang-0.5.23-*.whl", "sglang==0.5.23"),
    "lmdeploy": ("lmdeploy-0.18.0-*.whl", "lmdeploy==0.18.0"),
    "aphrodite": ("aphrodite_engine-0.24.1-*.whl", "aphrodite-engine==0.24.1"),
}
# Generated input libcst cannot survive (see test_deep_input.py): skipped, never a crash.
DEEP_FILES = {
    "deep_and.py": "alloc.free(ids)\nx = " + " and ".join(["a"] * 20_000) + "\n",
    "deep_calls.py": "alloc.free(ids)\nx = a" + "()" * 20_000 + "\n",
    "deep_lambdas.py": "alloc.free(ids)\nx = " + "lambda: " * 5_000 + "a\n",
}


def _archive(pattern, pin):
    found = sorted(CACHE.glob(pattern)) if CACHE.is_dir() else []
    if not found:
        pytest.skip(
            f"{pin} is not downloaded: run `pip download --no-deps {pin} -d {CACHE}` (.ci/run does)"
        )
    return found[-1]


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory):
    sdist = _archive("deepspeed-0.19.8.tar.gz", "deepspeed==0.19.8")
    target = tmp_path_factory.mktemp("engines")
    with tarfile.open(sdist) as archive:
        members = [
            m for m in archive.getmembers() if m.name.endswith((".py", "setup.cfg", "setup.py"))
        ]
        archive.extractall(target, members=members, filter="data")
    return target / "deepspeed-0.19.8"


def _wheel(tmp_path_factory, name, prefixes):
    wheel = _archive(*WHEELS[name])
    target = tmp_path_factory.mktemp(name)
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.endswith(".py") and (prefixes is None or member.startswith(prefixes)):
                archive.extract(member, target)
    (target / "setup.cfg").write_text("[metadata]\n")
    for deep, text in DEEP_FILES.items():
        (target / name / deep).parent.mkdir(parents=True, exist_ok=True)
        (target / name / deep).write_text(text)
    return target


def _check_every_file(root):
    """Every file through parse and analysis (no pre-filter); fixes stay valid, and the
    pre-filter with its slicing finds exactly what the full analysis finds."""
    project_index = index.for_root(str(root))
    count = 0
    for path in project.iter_python_files(str(root)):
        data = Path(path).read_bytes()
        module = engine.parse(data)
        count += 1
        if module is None:
            continue
        findings = engine.analyze(module, config.DEFAULT, project_index)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None and "\r" not in text:
            fast = engine.lint_source(text, config.DEFAULT, project_index)
            assert [f.key() for f in fast] == [f.key() for f in findings], path
        if any(f.fix for f in findings):
            fixed, _ = fixer.fix_source(data, config.DEFAULT, project_index)
            assert engine.parse(fixed) is not None, path
            assert fixer.fix_source(fixed, config.DEFAULT, project_index)[0] == fixed, path
    return count


def test_deepspeed_findings(deepspeed):
    # flake8 on the ragged package (flake8 also runs pycodestyle and pyflakes: the
    # whole package takes it 15 s), `kvguard lint` on the whole package: the same.
    status, lines = run_flake8(["--select", "KVG", "deepspeed/inference/v2/ragged"], deepspeed)
    assert status == 1
    assert [" ".join(line.split(" ")[:2]) for line in lines] == EXPECTED["deepspeed"]
    status, out, err = run_cli(["deepspeed"], deepspeed)
    assert (status, err) == (1, "")
    assert [" ".join(line.split(" ")[:2]) for line in out.splitlines()] == EXPECTED["deepspeed"]


def test_deepspeed_every_file_analyzed_without_a_crash(deepspeed):
    assert _check_every_file(deepspeed / "deepspeed") > 700


@pytest.mark.parametrize("name", ["vllm", "sglang", "lmdeploy", "aphrodite"])
def test_kv_cache_modules(tmp_path_factory, name):
    root = _wheel(tmp_path_factory, name, None if WHOLE else KV_CACHE_MODULES[name])
    assert _check_every_file(root) > 5
    status, out, err = run_cli([name], root)
    assert (status, err) == (1, "")
    found = sorted(" ".join(line.split(" ")[:2]) for line in out.splitlines())
    deep = sorted(f"{name}/{deep}:2:1: KVG000" for deep in DEEP_FILES)
    expected = [f for f in EXPECTED[name] if WHOLE or f.startswith(KV_CACHE_MODULES[name])]
    assert found == sorted(expected + deep)
