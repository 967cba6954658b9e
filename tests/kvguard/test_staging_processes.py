"""Staging across processes, as a fleet would run it: ``KVGUARD=1`` in the environment, no code
change in the program, one JSON-lines file per process, merged by ``kvguard report``.

The DeepSpeed test runs DeepSpeed 0.19.8's own ``blocked_allocator.py`` from the sdist in the
engine cache (``KVGUARD_ENGINE_CACHE``), imported under its real dotted name so that the built-in
spec applies with no configuration; its package ``__init__`` is a stand-in that lets CPU torch
ignore ``pin_memory`` (nothing else of DeepSpeed is needed by that file).
"""

import json
import os
import subprocess
import sys
import tarfile
import textwrap

import pytest

from .staging_env import staged_env, staged_python_fixture  # noqa: F401

EXAMPLE_SPEC = "kvguard.examples.LinkedFreeList(size=_num_blocks, free_count=free_blocks)"
ENGINES = os.environ.get("KVGUARD_ENGINE_CACHE", os.path.expanduser("~/.cache/kvguard-engines"))


def run(python, args, env, cwd, timeout=180):
    return subprocess.run([python, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def kvguard_cli(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "KVGUARD"}
    return subprocess.run([sys.executable, "-m", "kvguard", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)


WORKERS = textwrap.dedent('''
    import multiprocessing as mp
    import sys

    from kvguard.examples import LinkedFreeList  # the program never imports kvguard itself


    def worker(k):
        a = LinkedFreeList(16)
        held = []
        for _ in range(50):
            held.append(a.allocate(2))
            if len(held) > 3:
                a.free(held.pop(0))
        if k in (1, 2):
            ids = a.allocate(2)
            a.free([ids[0], ids[0], ids[1]])  # duplicate-id: logged, forwarded untouched
        if k == 3:
            ids = a.allocate(1)
            a.free(ids)
            try:
                a.free(ids)  # double-free: the allocator refuses it too
            except ValueError:
                pass


    if __name__ == "__main__":
        ctx = mp.get_context(sys.argv[1])
        parent = LinkedFreeList(16)  # guarded in the parent; a forked child inherits it
        parent.free(parent.allocate(2))
        children = [ctx.Process(target=worker, args=(k,)) for k in range(4)]
        for c in children:
            c.start()
        for c in children:
            c.join()
        print("exit codes", [c.exitcode for c in children])
''')


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_four_processes_write_their_lines_and_report_merges_them(tmp_path, staged_python,
                                                                 method):
    (tmp_path / "serve.py").write_text(WORKERS)
    logs = tmp_path / "logs"
    env = staged_env(KVGUARD=1, KVGUARD_LOG=str(logs / "kvguard-{pid}.jsonl"),
                     KVGUARD_REGISTER=EXAMPLE_SPEC)
    out = run(staged_python, ["serve.py", method], env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "exit codes [0, 0, 0, 0]" in out.stdout
    assert "kvguard: duplicate-id of block " in out.stderr, "log mode says so on stderr too"
    assert "ERROR: kvguard" not in out.stderr, "in one line: the full report is in the log"
    files = sorted(os.listdir(logs))
    assert len(files) == 5, files  # the parent and 4 workers, one file each

    report = kvguard_cli("report", str(logs), "--format", "json", cwd=tmp_path)
    assert report.returncode == 1, report.stderr  # violations found
    summary = json.loads(report.stdout)
    assert summary["exact"], "every process left its stats line"
    assert summary["violations"] == 3
    assert {k: (v["count"], v["processes"]) for k, v in summary["by_kind"].items()} == {
        "duplicate-id": (2, 2), "double-free": (1, 1)}
    (alloc,) = summary["by_allocator"].values()
    # the parent's 2 calls, once: a forked child reports only its own calls
    assert alloc["calls"] == 2 + 97 + 99 * 3 and alloc["guards"] == 5
    assert alloc["modes"] == ["log"] and alloc["learned"] == 0
    assert [s["kind"] for s in summary["top_sites"]] == ["duplicate-id", "double-free"]
    assert summary["top_sites"][0]["site"].startswith(str(tmp_path / "serve.py") + ":")
    assert set(summary["first"]) == {"duplicate-id", "double-free"}

    text = kvguard_cli("report", str(logs), cwd=tmp_path)
    assert text.returncode == 1
    assert "kvguard report: 3 violation(s) in 3 of 5 process(es)" in text.stdout
    assert "duplicate-id        2  in 2 process(es)" in text.stdout
    assert "first duplicate-id (pid" in text.stdout and "SUMMARY: kvguard: duplicate-id" in \
        text.stdout


def test_one_shared_file_works_too(tmp_path, staged_python):
    (tmp_path / "serve.py").write_text(WORKERS)
    shared = tmp_path / "all.jsonl"
    env = staged_env(KVGUARD=1, KVGUARD_LOG=str(shared), KVGUARD_REGISTER=EXAMPLE_SPEC)
    out = run(staged_python, ["serve.py", "spawn"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in shared.read_text().splitlines()]
    assert sum(r["event"] == "start" for r in records) == 5
    summary = json.loads(kvguard_cli("report", str(shared), "--format", "json",
                                     cwd=tmp_path).stdout)
    assert summary["violations"] == 3 and len(summary["processes"]) == 5


PROGRAM = textwrap.dedent('''
    from kvguard.examples import LinkedFreeList  # no kvguard import, no guard() call

    allocator = LinkedFreeList(8)
    ids = allocator.allocate(3)
    try:
        allocator.free([ids[0], ids[0], ids[1]])  # the DeepSpeed bug pattern
        print("forwarded")
    except ValueError as exc:
        print("rejected:", type(exc).__name__)
    print("free blocks", allocator.free_blocks)
''')


@pytest.mark.parametrize("mode, printed, free_blocks", [
    ("log", "forwarded", 8),  # untouched: the allocator counts block 0 twice, as unguarded
    ("repair", "forwarded", 7),  # sanitized to [0, 1]
    ("raise", "rejected: DuplicateIdError", 5),  # never reached the allocator
])
def test_a_registered_allocator_is_guarded_with_no_code_change(tmp_path, staged_python, mode,
                                                               printed, free_blocks):
    (tmp_path / "serve.py").write_text(PROGRAM)
    env = staged_env(KVGUARD=1, KVGUARD_MODE=mode, KVGUARD_REGISTER=EXAMPLE_SPEC,
                     KVGUARD_LOG=str(tmp_path))
    out = run(staged_python, ["serve.py"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert printed in out.stdout and f"free blocks {free_blocks}" in out.stdout
    (name,) = [f for f in os.listdir(tmp_path) if f.endswith(".jsonl")]
    records = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
    (violation,) = [r for r in records if r["event"] == "violation"]
    assert violation["violation"]["kind"] == "duplicate-id"
    assert violation["violation"]["call_stack"][0]["file"] == str(tmp_path / "serve.py")
    assert violation["guard"]["mode"] == mode


SHORT_LIVED = textwrap.dedent('''
    import gc

    from kvguard.examples import LinkedFreeList

    kept = LinkedFreeList(8)
    kept.free(kept.allocate(1))
    for request in range(3):  # a pool per request, gone before exit
        pool = LinkedFreeList(8)
        pool.free(pool.allocate(request + 1))
        del pool
        gc.collect()
    print("done")
''')


def test_guards_collected_before_exit_leave_one_stats_line_each(tmp_path, staged_python):
    (tmp_path / "serve.py").write_text(SHORT_LIVED)
    env = staged_env(KVGUARD=1, KVGUARD_REGISTER=EXAMPLE_SPEC, KVGUARD_LOG=str(tmp_path))
    out = run(staged_python, ["serve.py"], env, tmp_path)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    (name,) = [f for f in os.listdir(tmp_path) if f.endswith(".jsonl")]
    records = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
    stats = [r for r in records if r["event"] == "stats"]
    names = sorted(r["guard"]["name"] for r in stats)
    assert names == [f"LinkedFreeList#{n}" for n in range(1, 5)]
    assert sorted(r["stats"]["blocks_freed"] for r in stats) == [1, 1, 2, 3]
    summary = json.loads(kvguard_cli("report", str(tmp_path), "--format", "json",
                                     cwd=tmp_path).stdout)
    assert summary["exact"] and summary["violations"] == 0


def test_without_kvguard_nothing_is_imported(tmp_path, staged_python):
    code = "import sys; print('kvguard' in sys.modules)"
    out = run(staged_python, ["-c", code], staged_env(), tmp_path)
    assert out.stdout.strip() == "False"
    out = run(staged_python, ["-c", code], staged_env(KVGUARD="0"), tmp_path)
    assert out.stdout.strip() == "False"
    out = run(staged_python, ["-c", code], staged_env(KVGUARD="1"), tmp_path)
    assert out.stdout.strip() == "True"


def test_a_bad_setting_is_one_line_and_the_program_still_runs(tmp_path, staged_python):
    out = run(staged_python, ["-c", "print('served')"],
              staged_env(KVGUARD="1", KVGUARD_SAMPLE="often"), tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "served"
    assert out.stderr.strip() == ("kvguard: staging not started: KVGUARD_SAMPLE='often': "
                                  "expected a whole number >= 1")


def _deepspeed_tree(tmp_path):
    sdist = os.path.join(ENGINES, "deepspeed-0.19.8.tar.gz")
    if not os.path.exists(sdist):
        pytest.skip(f"DeepSpeed 0.19.8 sdist not in {ENGINES} (.ci/run downloads it)")
    member = "deepspeed-0.19.8/deepspeed/inference/v2/ragged/blocked_allocator.py"
    with tarfile.open(sdist) as tar:
        source = tar.extractfile(member).read().decode()
    package = tmp_path / "engine" / "deepspeed"
    ragged = package / "inference" / "v2" / "ragged"
    ragged.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import torch\n"
        "if not torch.cuda.is_available():  # CPU torch refuses pinned memory\n"
        "    _arange = torch.arange\n"
        "    torch.arange = lambda *a, pin_memory=False, **k: _arange(*a, **k)\n")
    for d in (package / "inference", package / "inference" / "v2", ragged):
        (d / "__init__.py").write_text("")
    (ragged / "blocked_allocator.py").write_text(source)
    return tmp_path / "engine"


def test_deepspeeds_own_allocator_is_guarded_by_kvguard_1_alone(tmp_path, staged_python):
    engine = _deepspeed_tree(tmp_path)
    (tmp_path / "serve.py").write_text(textwrap.dedent('''
        from deepspeed.inference.v2.ragged.blocked_allocator import BlockedAllocator

        allocator = BlockedAllocator(4)
        blocks = allocator.allocate(3)
        allocator.free([0, 0, 1])  # the seed bug, in log mode: reported, then it happens
        print(allocator.allocate(2).tolist(), allocator.allocate(2).tolist())
    '''))
    env = staged_env(KVGUARD=1, KVGUARD_LOG=str(tmp_path / "logs") + "/")
    env["PYTHONPATH"] = os.pathsep.join([str(engine), env["PYTHONPATH"]])
    out = run(staged_python, ["serve.py"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1, 0] [0, -1]", "log mode changes nothing"
    summary = json.loads(kvguard_cli("report", str(tmp_path / "logs"), "--format", "json",
                                     cwd=tmp_path).stdout)
    assert set(summary["by_kind"]) == {"duplicate-id", "invalid-id", "shared-block"}
    assert list(summary["by_allocator"]) == [
        "deepspeed.inference.v2.ragged.blocked_allocator.BlockedAllocator"]

    replay = kvguard_cli("replay", *[str(p) for p in (tmp_path / "logs").iterdir()],
                         cwd=tmp_path)
    assert replay.returncode == 0, replay.stderr
    assert "state first went wrong at call #3: free [0, 0, 1]" in replay.stdout
