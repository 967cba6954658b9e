"""The engines' own test suites, plain and under ``pytest -p kvguard``: what an engine developer
sees first. Not part of the project's test command (it takes many minutes).

    python benchmarks/upstream/run.py setup      # once: venv, test sources, offline HF cache
    python benchmarks/upstream/run.py run        # every suite plain, then guarded: the table

``setup`` builds what the suites need from the pinned packages, never touching the project's own
environment:

- ``--venv`` (default ``/work/venv-upstream``): a new virtual environment that sees the calling
  interpreter's site-packages through a ``.pth`` (torch, numpy, pytest, kvguard's own deps), with
  the vLLM 0.33.0 wheel installed ``--no-deps`` and vLLM's non-CUDA requirements
  (``requirements/common.txt`` of its sdist), torch pinned to the one already there.
- vLLM's ``tests/`` from the 0.33.0 sdist: ``pip download --no-binary :all: --no-clean`` fetches
  and unpacks it, its metadata build fails (it needs a Rust toolchain), and the unpacked tree is
  left behind for us to copy ``tests/`` out of.
- An offline Hugging Face cache holding only a ``config.json`` for each model id vLLM's
  ``tests/v1/core`` builds a ``ModelConfig`` from (``MODELS``: OPT, Llava and five Qwen ids),
  written by transformers' own config classes: their defaults, with the real checkpoint's sizes
  where those differ (see ``MODELS``); ``HF_HUB_OFFLINE=1`` keeps every other lookup local.
- For SGLang's allocator tests (``sglang.test.test_utils`` imports the world): IPython and
  ``datasets`` in the venv, ``gguf`` and PyPI's torchvision in a folder of their own with
  stand-ins for the two CUDA libraries that torchvision's compiled ops link against (see
  ``sglang_deps``).

SGLang's and DeepSpeed's suites are taken from where they are found (``--sglang-tests``,
``--deepspeed-tests``: a checkout's test file or folder); a suite whose sources are missing is
reported as such. ``run`` prints, per suite: tests, failures plain and guarded, the failures only
the guarded run has (each one listed), tests with leaks reported, and guarded/plain wall time.
``--together`` runs each suite's plain and guarded run at the same time (one core each: the same
load on both, and half the wall time on a busy machine); ``--only`` picks suites.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("KVGUARD_ENGINE_CACHE") or "~/.cache/kvguard-engines").expanduser()
WORK = CACHE / "upstream"
VLLM_PIN = "vllm==0.33.0"
# The model ids vLLM's tests/v1/core builds a ModelConfig from (``Qwen/Qwen3-0.6B`` is
# ModelConfig's own default): the transformers config class, the architecture, and the real
# checkpoint's published values wherever the class default differs in what vLLM derives the KV
# cache's shape or the length limit from (layers, heads, head size, hidden size, the position
# limit, mrope). Everything else is the class default; the tests build their own KV cache specs,
# so those defaults only have to make a valid config. No weights, no tokenizer.
MODELS = {
    "facebook/opt-125m": ("OPTConfig", "OPTForCausalLM", {}),  # the default is this checkpoint
    "facebook/opt-350m": ("OPTConfig", "OPTForCausalLM", {
        "hidden_size": 1024, "ffn_dim": 4096, "num_hidden_layers": 24,
        "num_attention_heads": 16, "word_embed_proj_dim": 512, "do_layer_norm_before": False}),
    "llava-hf/llava-1.5-7b-hf": ("LlavaConfig", "LlavaForConditionalGeneration", {
        "text_config": {"model_type": "llama", "max_position_embeddings": 4096}}),
    "Qwen/Qwen3-0.6B": ("Qwen3Config", "Qwen3ForCausalLM", {
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "max_window_layers": 28, "tie_word_embeddings": True,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}),
    "Qwen/Qwen1.5-7B": ("Qwen2Config", "Qwen2ForCausalLM", {
        "intermediate_size": 11008, "max_window_layers": 28,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}),
    "Qwen/Qwen2.5-VL-3B-Instruct": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", {
        "tie_word_embeddings": True, "text_config": {
            "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
            "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
            "max_position_embeddings": 128000,
            "tie_word_embeddings": True, "rope_parameters": {
                "rope_theta": 1000000.0, "rope_type": "default", "mrope_section": [16, 24, 24]}},
        "vision_config": {"out_hidden_size": 2048}}),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "rope_type": "default"}}),
}


def sh(*cmd, env=None, cwd=None, check=True) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, check=check)


# --- setup ----------------------------------------------------------------------------------


def setup(args) -> None:
    venv = Path(args.venv)
    python = venv / "bin" / "python"
    if not python.exists():
        sh(sys.executable, "-m", "venv", venv)
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / ver / "site-packages" / "_kvguard_base.pth").write_text(f"{site}\n")
    src = vllm_sdist()
    wheel = sorted(CACHE.glob("vllm-0.33.0-*.whl"))
    if not wheel:
        sh(python, "-m", "pip", "download", "--no-deps", VLLM_PIN, "-d", CACHE)
        wheel = sorted(CACHE.glob("vllm-0.33.0-*.whl"))
    sh(python, "-m", "pip", "install", "--no-deps", wheel[-1])
    import torch

    constraints = WORK / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    sh(python, "-m", "pip", "install", "-c", constraints, "-r",
       src / "requirements" / "common.txt", "tblib", "pytest-asyncio", "pytest-timeout")
    sh(python, __file__, "hf-cache")  # transformers is in the new venv only
    # SGLang's and DeepSpeed's packages, for their suites (their tests come from a checkout).
    sglang = sorted(CACHE.glob("sglang-0.5.23-*.whl"))
    if sglang:
        sh(python, "-m", "pip", "install", "--no-deps", sglang[-1])
        sh(python, "-m", "pip", "install", "-c", constraints, "IPython", "datasets")
        sglang_deps(python, torch.__version__)
    deepspeed = CACHE / "deepspeed-0.19.8.tar.gz"
    if deepspeed.exists():
        sh(python, "-m", "pip", "install", "-c", constraints, "hjson", "msgpack", "einops")
        sh(python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", deepspeed,
           env=dict(os.environ, DS_BUILD_OPS="0"))


def vllm_sdist() -> Path:
    """vLLM's source tree, for its tests (``tests/``, ``requirements/`` and ``pyproject.toml``,
    which holds its pytest settings, are kept)."""
    target = WORK / "vllm-0.33.0"
    if (target / "tests").is_dir():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TMPDIR=tmp)
        sh(sys.executable, "-m", "pip", "download", "--no-clean", "--no-deps", "--no-binary",
           ":all:", "--no-build-isolation", VLLM_PIN, "-d", tmp, env=env, check=False)
        trees = glob.glob(f"{tmp}/pip-download-*/vllm_*")
        if not trees:
            sys.exit("setup: pip did not leave vLLM's unpacked sdist behind")
        target.mkdir(parents=True, exist_ok=True)
        for part in ("tests", "requirements"):
            shutil.copytree(Path(trees[0]) / part, target / part, dirs_exist_ok=True)
        shutil.copy(Path(trees[0]) / "pyproject.toml", target)  # its pytest settings
    return target


def sglang_deps(python: Path, torch_version: str) -> None:
    """What SGLang's ``sglang.test.test_utils`` (imported by its allocator tests) needs beyond its
    wheel and the venv: ``gguf`` and ``torchvision``. They go into a folder of their own, put on
    the SGLang suite's ``PYTHONPATH`` only: transformers imports torchvision whenever it finds it,
    which would change what vLLM's suite runs. (It would let ``ModelConfig`` inspect the Llava
    and Qwen2.5-VL architectures, but vLLM's multimodal scheduler tests then need those models'
    tokenizer and image-processor files, which are not config: they stay out.)

    PyPI's torchvision is a CUDA build: its ``_C.so`` needs ``libc10_cuda.so`` and
    ``libtorch_cuda.so``, which CPU torch lacks, and without ``_C`` ``import torchvision`` fails
    ("operator torchvision::nms does not exist"; older releases fail the same way). The CPU
    builds are not on PyPI. So the suite gets stand-ins for those two libraries (on its
    ``LD_LIBRARY_PATH`` only): one library defining each symbol ``_C.so`` takes from them, every
    function aborting if it is ever called (nothing on CPU calls them; the allocator tests never
    touch torchvision), and the wheel's bundled ``libcudart`` under the name ``_C.so`` asks for."""
    minor = int(torch_version.split(".")[1])
    torchvision = f"torchvision==0.{minor + 15}.*"  # torch 2.N pairs with torchvision 0.(N+15)
    target = WORK / "sglang-deps"
    sh(python, "-m", "pip", "install", "--no-deps", "--upgrade", "--target", target, torchvision,
       "gguf")
    stubs = target / "cuda-stubs"
    stubs.mkdir(exist_ok=True)
    ext = target / "torchvision" / "_C.so"
    torch_lib = subprocess.run([python, "-c", "import os, torch; print(os.path.dirname("
                                "torch.__file__))"], capture_output=True, text=True,
                               check=True).stdout.strip() + "/lib"
    found = subprocess.run(["ldd", ext], capture_output=True, text=True,
                           env=dict(os.environ, LD_LIBRARY_PATH=torch_lib)).stdout
    provided = set()  # every symbol the libraries that do resolve (torch's, the system's) define
    for lib in re.findall(r"=> (/\S+)", found):
        provided |= set(subprocess.run(["nm", "-D", "--defined-only", "--format=just-symbols",
                                        lib], capture_output=True, text=True).stdout.split())
    mangled, demangled = (subprocess.run(
        ["nm", "-D", "--undefined-only", *flag, ext], capture_output=True, text=True,
        check=True).stdout.splitlines() for flag in ([], ["-C"]))
    source = ["#include <stdlib.h>"]
    for line, readable in zip(mangled, demangled):
        kind, name = line.split()[-2:]
        if kind != "U" or "@" in name or name in provided:
            continue  # weak, a versioned system symbol, or one torch itself has
        source.append(f"void {name}(void) {{ abort(); }}" if "(" in readable
                      else f"void *{name} = 0;")  # a variable: c10's CUDA allocator pointer
    (stubs / "stubs.c").write_text("\n".join(source) + "\n")
    sh("cc", "-shared", "-fPIC", "-o", stubs / "libtorch_cuda.so", stubs / "stubs.c")
    sh("cc", "-shared", "-fPIC", "-o", stubs / "libc10_cuda.so", "-x", "c", "/dev/null")
    dynamic = subprocess.run(["readelf", "-d", ext], capture_output=True, text=True).stdout
    for needed in re.findall(r"Shared library: \[(libcudart[^]]*)\]", dynamic):
        bundled = sorted((target / "torchvision.libs").glob("libcudart*.so*"))
        shutil.copy(bundled[-1], stubs / needed)


def hf_cache() -> None:
    import transformers

    hub = WORK / "hf" / "hub"
    for model, (config_class, arch, real) in MODELS.items():
        snap = hub / f"models--{model.replace('/', '--')}" / "snapshots" / "offline"
        snap.mkdir(parents=True, exist_ok=True)
        # Built by the class itself, so what follows from a real value (layer_types from the
        # layer count, a sub-config's other defaults) is derived as for the checkpoint.
        config = getattr(transformers, config_class)(**real).to_dict()
        config["architectures"] = [arch]
        (snap / "config.json").write_text(json.dumps(config, indent=1, default=str))
        refs = snap.parents[1] / "refs"
        refs.mkdir(exist_ok=True)
        (refs / "main").write_text("offline")


# --- run ------------------------------------------------------------------------------------


def suites(args) -> list[dict]:
    out = [{
        "name": "vLLM 0.33.0 tests/v1/core",
        "cwd": WORK / "vllm-0.33.0",
        "args": args.vllm_tests or ["tests/v1/core"],
        "env": {"VLLM_TARGET_DEVICE": "cpu", "HF_HOME": str(WORK / "hf"), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1"},
    }]
    if args.sglang_tests:
        path = Path(args.sglang_tests).resolve()
        deps = WORK / "sglang-deps"  # see sglang_deps: on this suite's paths only
        out.append({"name": "SGLang 0.5.23 test_allocator_cpu.py", "cwd": path.parent,
                    "args": [path.name], "path": [str(deps)],
                    "env": {"LD_LIBRARY_PATH": str(deps / "cuda-stubs")}})
    if args.deepspeed_tests:
        path = Path(args.deepspeed_tests).resolve()  # .../tests, whose pytest.ini it needs
        out.append({"name": "DeepSpeed 0.19.8 tests/unit/inference/v2/ragged", "cwd": path,
                    "args": ["unit/inference/v2/ragged", "-m", "inference_v2", "-p",
                             "no_pin_memory"], "env": {}})
    return out


def run_suite(suite, python, guarded: bool, out: Path) -> dict:
    junit = out / ("guarded.xml" if guarded else "plain.xml")
    report = out / "kvguard.json"
    cmd = [python, "-m", "pytest", *suite["args"], "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", "-o", "junit_family=xunit2", "--timeout=300"]
    if guarded:
        cmd += ["-p", "kvguard", f"--kvguard-report={report}"]
    env = dict(os.environ, **suite["env"])
    paths = [str(ROOT), str(Path(__file__).parent), str(suite["cwd"]), *suite.get("path", ()),
             env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    start = time.perf_counter()
    subprocess.run([str(c) for c in cmd], cwd=suite["cwd"], env=env,
                   stdout=open(out / ("guarded.log" if guarded else "plain.log"), "w"),
                   stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "cases": {}}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            nodeid = f"{case.get('classname')}::{case.get('name')}"
            bad = case.find("failure") is not None or case.find("error") is not None
            result["cases"][nodeid] = "failed" if bad else (
                "skipped" if case.find("skipped") is not None else "passed")
    if guarded and report.exists():
        data = json.loads(report.read_text())
        result["kvguard"] = data["summary"]
        result["leaks"] = data["leaks"]
        result["violations"] = data["violations"]
    return result


def run(args) -> None:
    python = Path(args.venv) / "bin" / "python"
    rows = []
    for suite in suites(args):
        if args.only and suite["name"].split()[0].lower() not in args.only:
            continue
        if not Path(suite["cwd"]).is_dir():
            rows.append((suite["name"], "missing: run setup / pass its tests"))
            continue
        out = Path(args.out) / suite["name"].split()[0].lower()
        out.mkdir(parents=True, exist_ok=True)
        if args.together:  # same load on both runs, and half the wall time on a busy machine
            with ThreadPoolExecutor(2) as pool:
                plain, guarded = pool.map(lambda g: run_suite(suite, python, g, out), (False, True))
        else:
            plain = run_suite(suite, python, False, out)
            guarded = run_suite(suite, python, True, out)
        (out / "results.json").write_text(json.dumps({"plain": plain, "guarded": guarded}))
        rows.append((suite["name"], plain, guarded))
    print(table(rows))


def table(rows) -> str:
    lines = ["| suite | tests | plain fail | guarded fail | kvguard-only failures | "
             "leaks reported (tests) | guarded/plain time |", "|---|---|---|---|---|---|---|"]
    details = []
    for row in rows:
        if len(row) == 2:
            lines.append(f"| {row[0]} | {row[1]} | | | | | |")
            continue
        name, plain, guarded = row
        pf = {k for k, v in plain["cases"].items() if v == "failed"}
        gf = {k for k, v in guarded["cases"].items() if v == "failed"}
        only = sorted(gf - pf)
        leaks = {v["nodeid"] for v in guarded.get("leaks", ())}
        ratio = guarded["seconds"] / plain["seconds"] if plain["seconds"] else float("nan")
        lines.append(f"| {name} | {len(plain['cases'])} | {len(pf)} | {len(gf)} | {len(only)} | "
                     f"{len(leaks)} | {ratio:.2f}x ({plain['seconds']:.0f} s -> "
                     f"{guarded['seconds']:.0f} s) |")
        kinds = {}  # junit names tests by class, kvguard by path: matched on the test's name
        for v in guarded.get("violations", ()):
            if not v.get("expected"):
                kinds.setdefault(v["nodeid"].rpartition("::")[2], set()).add(v["kind"])
        for nodeid in only:
            found = kinds.get(nodeid.rpartition("::")[2], ())
            details.append(f"- {name}: {nodeid}: {', '.join(sorted(found)) or 'not kvguard'}")
    return "\n".join(lines + [""] + details)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("setup", "run", "hf-cache"))
    parser.add_argument("--venv", default="/work/venv-upstream")
    parser.add_argument("--out", default=str(WORK / "results"))
    parser.add_argument("--together", action="store_true",
                        help="run each suite plain and guarded at the same time (one core each)")
    parser.add_argument("--only", nargs="*", choices=("vllm", "sglang", "deepspeed"),
                        help="run these suites only")
    parser.add_argument("--vllm-tests", nargs="*", default=None,
                        help="paths inside vLLM's sdist to run instead of tests/v1/core")
    parser.add_argument("--sglang-tests", default=None,
                        help="SGLang's test/registered/unit/mem_cache/test_allocator_cpu.py")
    parser.add_argument("--deepspeed-tests", default=None,
                        help="DeepSpeed's tests/ folder (its pytest.ini and conftest.py; the "
                             "suite is unit/inference/v2/ragged)")
    args = parser.parse_args()
    {"setup": setup, "run": run, "hf-cache": lambda args: hf_cache()}[args.command](args)


if __name__ == "__main__":
    main()
