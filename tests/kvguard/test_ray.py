"""Staging across a Ray cluster, on a real one: a head node started with ``ray start`` on the
loopback interface, in an environment without any kvguard setting (as a cluster an operator
started), so that a worker is staged only through what the driver gives it.

Two drivers run on it. docs/staging.md's "On Ray" recipe, as written: three actors, one with a
planted double free, ``kvguard.ray.runtime_env()`` passed to ``ray.init``. Then a driver that
does not know about kvguard, run by ``kvguard run`` (whose hook gives its ``ray.init`` the same
runtime_env): four actors on this file's own allocator, one planted double free, one actor
killed with ``ray.kill``, and the violation read back from Ray's own metrics endpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.test_docs import blocks, console_commands

from .staging_env import ROOT, staged_env, staged_python_fixture  # noqa: F401

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[test]')")

DOC = os.path.join(ROOT, "docs", "staging.md")
RAY_ENV = {
    # one node on the loopback interface; no usage reports, no tokens (nothing leaves it)
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
}
POOL = "tests.kvguard.ray_workload.TrustingPool"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_agent_installed() -> bool:
    """Ray exports custom metrics through its per-node agent, which comes with ``ray[default]``
    only (a plain ``pip install ray`` starts the cluster without it)."""
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in ("aiohttp", "opencensus"))


def clean_env(**variables) -> dict:
    env = {k: v for k, v in staged_env().items()
           if not k.startswith("KVGUARD") and k not in ("RAY_ADDRESS", "RAY_RUNTIME_ENV_HOOK")}
    env.update(RAY_ENV)
    env.update({k: str(v) for k, v in variables.items()})
    return env


@pytest.fixture(scope="module")
def cluster(staged_python):
    """``ray start --head --block`` in its own process group, ended by its pid (it stops the
    processes it started) and, should any be left, by that group."""
    temp = tempfile.mkdtemp(prefix="kvg-ray-", dir="/tmp")  # short: Ray's socket paths
    port, metrics = free_port(), free_port()
    log = open(os.path.join(temp, "start.log"), "w+")
    head = subprocess.Popen(
        [staged_python, "-c", "from ray.scripts.scripts import main; main()", "start", "--head",
         "--block", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=1",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}",
         f"--metrics-export-port={metrics}",
         '--system-config={"metrics_report_interval_ms": 200}'],
        env=clean_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        cwd=temp)
    try:
        deadline = time.monotonic() + 120
        while True:
            log.seek(0)
            if "will now block" in log.read():
                break
            if head.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"ray start did not come up:\n{log.read()[-3000:]}")
            time.sleep(0.2)
        yield {"address": f"127.0.0.1:{port}", "metrics_port": metrics, "temp": temp}
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def report(logs, cwd, *args):
    out = subprocess.run([sys.executable, "-m", "kvguard", "report", str(logs), *args],
                         capture_output=True, text=True, timeout=120, cwd=cwd,
                         env=clean_env())
    return out


def doc_recipe():
    """The "On Ray" section's files and console commands, as written."""
    page = blocks(Path(DOC))
    found = [b for b in page
             if "skip" in b.marks and "tests/kvguard/test_ray.py" in b.marks["skip"][0]]
    assert len(found) == 1, "the On Ray console block of docs/staging.md"
    files = {b.marks["file"][0]: b.text for b in page
             if "file" in b.marks and b.line < found[0].line and b.marks["file"][0] in
             ("pool.py", "driver.py")}
    return files, console_commands(found[0].text)


def test_the_docs_recipe_stages_every_worker_of_a_cluster_it_did_not_start(
        tmp_path, cluster, staged_python):
    files, commands = doc_recipe()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    python_dir = os.path.dirname(staged_python)
    env = clean_env(RAY_ADDRESS=cluster["address"],
                    PATH=os.pathsep.join([python_dir, os.path.dirname(sys.executable),
                                          os.environ.get("PATH", "")]))
    runs = [subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=180) for command in commands]
    driver, shown = runs[0], runs[-1]
    assert driver.returncode == 0, driver.stderr[-3000:]
    assert shown.returncode == 1, shown.stderr  # a violation was found
    text = shown.stdout
    # "at least" where engine-1's final line lost the race with Ray's kill (see below)
    assert re.search(r"^kvguard report: (at least )?1 violation\(s\) in 1 of 3 process\(es\)",
                     text), text
    summary = json.loads(report(tmp_path / "kvguard-logs", tmp_path, "--format", "json").stdout)
    actors = {a["name"]: a for a in summary["by_ray_actor"].values()}
    assert set(actors) == {"engine-0", "engine-1", "engine-2"}, actors
    assert actors["engine-1"]["violations"] == {"double-free": 1}
    assert actors["engine-1"]["class"] == "driver.Engine"
    for name in ("engine-0", "engine-2"):
        # a bare ray.shutdown(): their final lines race Ray's kill (docs/staging.md says so),
        # so their counts are exact or those of a checkpoint
        assert actors[name]["violations"] == {} and actors[name]["calls"] in (0, 20)
    (line,) = [line for line in text.split("by Ray actor:")[1].split("\n\n")[0].splitlines()
               if '"engine-1"' in line]
    assert line.startswith("  driver.Engine ") and "double-free 1" in line, line


DRIVER = textwrap.dedent('''
    import json
    import sys
    import time
    import urllib.request

    import ray

    from tests.kvguard.ray_workload import CacheWorker

    # RAY_ADDRESS names the cluster; kvguard run's hook adds its settings to this runtime_env
    ray.init(runtime_env={"env_vars": {"PROMETHEUS_MULTIPROC_DIR": sys.argv[2]}})
    faulty = CacheWorker.options(name="faulty").remote()
    clean = [CacheWorker.options(name=f"clean-{n}").remote() for n in range(2)]
    victim = CacheWorker.options(name="victim").remote()
    pids = ray.get([faulty.serve.remote(5, plant=True), clean[0].serve.remote(10),
                    clean[1].serve.remote(11), victim.serve.remote(3)])
    ray.kill(victim)
    for worker in clean:  # ended as an actor ends itself: atexit runs, the final lines written
        worker.__ray_terminate__.remote()
    for worker in clean:
        try:
            ray.get(worker.serve.remote(0))
        except ray.exceptions.RayActorError:
            pass

    found, port = [], int(sys.argv[1])
    deadline = time.monotonic() + (40 if port else 0)
    while port and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                body = r.read().decode()
        except OSError:
            body = ""
        found = [line for line in body.splitlines()
                 if line.startswith("ray_kvguard_violations_total{")
                 and 'kind="double-free"' in line and not line.endswith(" 0.0")]
        if found:
            break
        time.sleep(0.3)
    print(json.dumps({"pids": pids, "metrics": found}))
    ray.shutdown()
''')


@pytest.fixture(scope="module")
def kvguard_run(cluster, staged_python, tmp_path_factory):
    """A driver that knows nothing of kvguard, run by ``kvguard run`` on the cluster."""
    tmp = tmp_path_factory.mktemp("ray-run")
    (tmp / "driver.py").write_text(DRIVER)
    (tmp / "prometheus").mkdir()
    port = cluster["metrics_port"] if metrics_agent_installed() else 0
    env = clean_env(RAY_ADDRESS=cluster["address"], KVGUARD_METRICS_INTERVAL="0.2")
    out = subprocess.run([staged_python, "-m", "kvguard", "run", "--log", "logs", "--register",
                          POOL, "--", staged_python, "driver.py", str(port),
                          str(tmp / "prometheus")], cwd=tmp, env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = json.loads(out.stdout.strip().splitlines()[-1])
    summary = json.loads(report(tmp / "logs", tmp, "--format", "json").stdout)
    text = report(tmp / "logs", tmp).stdout
    return {"out": out, "printed": printed, "summary": summary, "text": text, "dir": tmp}


def test_kvguard_run_stages_the_workers_of_a_cluster_it_did_not_start(kvguard_run):
    assert "kvguard: 1 violation(s) in 4 guarded process(es)" in kvguard_run["out"].stderr, \
        kvguard_run["out"].stderr[-2000:]


def test_the_report_names_the_faulty_actor(kvguard_run):
    actors = {a["name"]: a for a in kvguard_run["summary"]["by_ray_actor"].values()}
    assert set(actors) == {"faulty", "clean-0", "clean-1", "victim"}
    faulty = actors["faulty"]
    # ended by ray.shutdown(): Ray force-kills an actor whose driver is gone, which may come
    # before its SIGTERM handler writes the final line; the violation line is there either way
    assert faulty["violations"] == {"double-free": 1}
    assert faulty["class"] == "tests.kvguard.ray_workload.CacheWorker"
    assert faulty["pid"] == kvguard_run["printed"]["pids"][0]
    assert len(faulty["actor_id"]) == 32 and faulty["node_id"] and faulty["job_id"]
    section = kvguard_run["text"].split("by Ray actor:")[1].split("\n\n")[0]
    (line,) = [line for line in section.splitlines() if '"faulty"' in line]
    assert "tests.kvguard.ray_workload.CacheWorker" in line and "double-free 1" in line
    assert faulty["actor_id"][:12] in line
    first = kvguard_run["text"].split("first double-free")[1].splitlines()[0]
    assert '"faulty"' in first and "CacheWorker.serve" in first


def test_clean_actors_report_their_calls(kvguard_run):
    actors = {a["name"]: a for a in kvguard_run["summary"]["by_ray_actor"].values()}
    # each request: one allocate and one free, checked and counted at Ray's SIGTERM
    assert (actors["clean-0"]["calls"], actors["clean-1"]["calls"]) == (20, 22)
    assert actors["clean-0"]["violations"] == actors["clean-1"]["violations"] == {}
    section = kvguard_run["text"].split("by Ray actor:")[1].split("\n\n")[0]
    (line,) = [line for line in section.splitlines() if '"clean-0"' in line]
    assert "no violations, 20 calls" in line


def test_killed_actors_are_reported_as_killed(kvguard_run):
    actors = {a["name"]: a for a in kvguard_run["summary"]["by_ray_actor"].values()}
    assert actors["victim"]["final"] is False
    assert actors["clean-0"]["final"] is actors["clean-1"]["final"] is True
    section = kvguard_run["text"].split("by Ray actor:")[1].split("\n\n")[0]
    (line,) = [line for line in section.splitlines() if '"victim"' in line]
    assert "ended without a final record: killed?" in line


def test_one_console_line_per_violation_under_ray(kvguard_run, cluster):
    """What a worker writes on stderr, Ray echoes on the driver's console: read at its source,
    the worker's own log file under the cluster's session directory."""
    pid = kvguard_run["printed"]["pids"][0]
    logs = os.path.join(cluster["temp"], "session_latest", "logs")
    (err,) = [os.path.join(logs, f) for f in os.listdir(logs) if f.endswith(f"-{pid}.err")]
    with open(err, encoding="utf-8", errors="replace") as f:
        said = [line for line in f if "kvguard" in line]
    assert len(said) == 1, said
    assert said[0].startswith("kvguard: double-free of blocks ") and "TrustingPool#1" in said[0]
    assert "ray_workload.py:" in said[0] and "full report in " in said[0]
    assert str(kvguard_run["dir"] / "logs") in said[0]


@pytest.mark.skipif(not metrics_agent_installed(),
                    reason="Ray's metrics agent comes with ray[default] (pip install -e "
                           "'.[ray]'); a plain ray has no metrics endpoint")
def test_the_violation_reaches_rays_own_metrics(kvguard_run):
    (line,) = kvguard_run["printed"]["metrics"]
    assert 'allocator="tests.kvguard.ray_workload.TrustingPool"' in line
    assert line.endswith(" 1.0")


def test_workers_that_end_mark_their_multiprocess_files_dead(kvguard_run):
    """With ``PROMETHEUS_MULTIPROC_DIR`` in the runtime_env, each worker also writes
    ``prometheus_client``'s files; one that ends drops its live gauges from the sums."""
    files = os.listdir(kvguard_run["dir"] / "prometheus")
    for pid in kvguard_run["printed"]["pids"][1:3]:  # the clean actors, ended by themselves
        assert f"counter_{pid}.db" in files, files
        assert not [f for f in files if f.startswith("gauge_live") and f.endswith(f"_{pid}.db")]
