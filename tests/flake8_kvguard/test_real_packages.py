"""Real engine code: DeepSpeed 0.19.8, vLLM and SGLang, as `pip download --no-deps` gets them.

.ci/run downloads them into $KVGUARD_ENGINE_CACHE (default ~/.cache/kvguard-engines);
without the download these tests skip and say what to run. DeepSpeed is checked whole
(every file through the analysis, no pre-filter); vLLM's and SGLang's KV-cache modules
likewise. Their whole packages (50 MB and 68 MB of Python) take minutes: set
KVGUARD_LINT_WHOLE_PACKAGES=1 to run them too.
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
}

# Every finding on these packages, triaged (see the closing note of issue 3):
EXPECTED = {
    "deepspeed": [
        "deepspeed/inference/v2/ragged/blocked_allocator.py:74:9: KVG201",
        "deepspeed/inference/v2/ragged/blocked_allocator.py:92:29: KVG202",
        "deepspeed/inference/v2/ragged/ragged_manager.py:118:33: KVG101",
    ],
    # The same on the whole packages as on their KV-cache modules.
    "vllm": [
        "vllm/v1/hisparse/coordinator.py:244:50: KVG102",
        "vllm/v1/simple_kv_offload/manager.py:1353:45: KVG102",
    ],
    "sglang": [
        "sglang/srt/disaggregation/utils.py:396:32: KVG202",
        "sglang/srt/mem_cache/unified_radix_cache.py:3269:39: KVG102",
        "sglang/srt/mem_cache/unified_radix_cache.py:3287:25: KVG102",
    ],
}
VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}


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
    version = VERSIONS[name]
    wheel = _archive(f"{name}-{version}-*.whl", f"{name}=={version}")
    target = tmp_path_factory.mktemp(name)
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.endswith(".py") and (prefixes is None or member.startswith(prefixes)):
                archive.extract(member, target)
    (target / "setup.cfg").write_text("[metadata]\n")
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


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_kv_cache_modules(tmp_path_factory, name):
    root = _wheel(tmp_path_factory, name, None if WHOLE else KV_CACHE_MODULES[name])
    assert _check_every_file(root) > 10
    status, out, err = run_cli([name], root)
    assert (status, err) == (1, "")
    assert sorted(" ".join(line.split(" ")[:2]) for line in out.splitlines()) == EXPECTED[name]
