"""``kvguard.ray.runtime_env()`` and the hook ``kvguard run`` gives Ray: what a Ray worker's
environment gets from the driver's. These need no Ray: the dict is the whole contract (Ray
applies ``env_vars`` to each worker's environment before its interpreter starts)."""

import json
import os
import subprocess

import pytest

from kvguard import ray as kvray
from kvguard.staging import config_from_env

from .staging_env import staged_env, staged_python_fixture  # noqa: F401


def test_every_kvguard_setting_of_the_driver_is_carried_and_nothing_else():
    environ = {"KVGUARD": "1", "KVGUARD_MODE": "repair", "KVGUARD_SAMPLE": "7",
               "KVGUARD_REGISTER": "mypkg.pool.Pool(free=release)", "KVGUARD_RUN": "r-1",
               "KVGUARD_FUTURE_SETTING": "x", "PATH": "/bin", "HOME": "/root"}
    env = kvray.runtime_env(environ=environ)
    assert set(env) == {"env_vars"}
    assert env["env_vars"] == {**{k: v for k, v in environ.items() if k.startswith("KVGUARD")},
                               "KVGUARD_LOG": os.path.join(os.getcwd(), "kvguard-logs",
                                                           "kvguard-{host}-{pid}.jsonl")}
    config = config_from_env(env["env_vars"])
    assert (config.mode, config.sample, config.run) == ("repair", 7, "r-1")


def test_staging_is_turned_on_unless_the_driver_says_otherwise():
    assert kvray.runtime_env(environ={})["env_vars"]["KVGUARD"] == "1"
    assert kvray.runtime_env(environ={"KVGUARD": "0"})["env_vars"]["KVGUARD"] == "0"


@pytest.mark.parametrize("template, expected", [
    ("logs", "/srv/app/logs/kvguard-{host}-{pid}.jsonl"),
    ("logs/", "/srv/app/logs/kvguard-{host}-{pid}.jsonl"),
    ("/var/log/kv/", "/var/log/kv/kvguard-{host}-{pid}.jsonl"),
    ("out/run-{pid}.jsonl", "/srv/app/out/run-{host}-{pid}.jsonl"),
    ("out/{pid}/k.jsonl", "/srv/app/out/{host}-{pid}/k.jsonl"),
    ("out/{host}/k-{pid}.jsonl", "/srv/app/out/{host}/k-{pid}.jsonl"),
    ("../all.jsonl", "/srv/all.jsonl"),
])
def test_the_log_template_is_absolute_and_per_host(template, expected):
    assert kvray.worker_log_template(template, cwd="/srv/app") == expected


def test_a_relative_log_resolves_against_the_drivers_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = kvray.runtime_env(environ={"KVGUARD_LOG": "k/"})
    assert env["env_vars"]["KVGUARD_LOG"] == str(tmp_path / "k" / "kvguard-{host}-{pid}.jsonl")
    assert kvray.runtime_env(environ={}, log="/x/")["env_vars"]["KVGUARD_LOG"] == \
        "/x/kvguard-{host}-{pid}.jsonl"


def test_a_users_runtime_env_is_merged_not_changed():
    mine = {"pip": ["numpy"], "working_dir": ".", "env_vars": {"OMP_NUM_THREADS": "1",
                                                               "KVGUARD_MODE": "raise"}}
    before = {**mine, "env_vars": dict(mine["env_vars"])}
    env = kvray.runtime_env(mine, environ={"KVGUARD_MODE": "repair", "KVGUARD_LOG": "/l/"})
    assert mine == before
    assert env["pip"] == ["numpy"] and env["working_dir"] == "."
    assert env["env_vars"]["OMP_NUM_THREADS"] == "1"
    assert env["env_vars"]["KVGUARD_MODE"] == "raise"  # the explicit setting wins
    assert env["env_vars"]["KVGUARD_LOG"] == "/l/kvguard-{host}-{pid}.jsonl"


@pytest.mark.parametrize("environ, base, error, words", [
    ({"KVGUARD_MODE": "loud"}, None, ValueError, "KVGUARD_MODE='loud'"),
    ({"KVGUARD_HISTORY": "-1"}, None, ValueError, "KVGUARD_HISTORY"),
    ({}, {"env_vars": {"KVGUARD_SAMPLE": 3}}, TypeError, "KVGUARD_SAMPLE=3"),
    ({}, ["env_vars"], TypeError, "expected a dict"),
    ({}, {"env_vars": [("KVGUARD", "1")]}, TypeError, "env_vars is a list"),
])
def test_a_bad_setting_is_one_clear_error_here(environ, base, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(")):
        kvray.runtime_env(base, environ=environ)


def test_the_hook_merges_into_what_ray_init_was_given(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVGUARD"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVGUARD_MODE", "repair")
    monkeypatch.setenv("KVGUARD_LOG", "/logs/")
    assert kvray.runtime_env_hook(None)["env_vars"]["KVGUARD_MODE"] == "repair"
    env = kvray.runtime_env_hook({"env_vars": {"A": "b"}, "pip": ["x"]})
    assert env["pip"] == ["x"] and env["env_vars"]["A"] == "b"
    assert env["env_vars"]["KVGUARD_LOG"] == "/logs/kvguard-{host}-{pid}.jsonl"


def test_the_hook_runs_a_hook_the_environment_had_first(monkeypatch):
    monkeypatch.setenv(kvray.PREVIOUS_HOOK, f"{__name__}.users_hook")
    env = kvray.runtime_env_hook({"env_vars": {}})
    assert env["env_vars"]["FROM_USERS_HOOK"] == "1" and env["env_vars"]["KVGUARD"] == "1"


def users_hook(runtime_env):
    return {**runtime_env, "env_vars": {**runtime_env["env_vars"], "FROM_USERS_HOOK": "1"}}


def test_a_bad_setting_leaves_ray_init_working_with_one_error_line(monkeypatch, caplog):
    monkeypatch.setenv("KVGUARD_MODE", "loud")
    given = {"env_vars": {"A": "b"}}
    assert kvray.runtime_env_hook(given) is given
    assert [r.getMessage() for r in caplog.records] == [
        "kvguard: Ray workers not staged: KVGUARD_MODE='loud': expected one of log, raise, "
        "repair"]


NO_RAY = '''
import sys
from kvguard.examples import LinkedFreeList

pool = LinkedFreeList(8)
ids = pool.allocate(2)
pool.free([ids[0], ids[0]])  # a duplicate-id: written, logged
pool.free([ids[1]])
import kvguard.ray  # the public module itself imports no ray either
kvguard.ray.runtime_env()
loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith(("ray.", "kvguard.ray",
                                                                      "kvguard.staging.ray")))
print("loaded:", loaded, "staged:", __import__("kvguard.staging").staging.active() is not None)
'''


def test_no_ray_module_is_imported_where_the_program_does_not_import_ray(tmp_path,
                                                                         staged_python):
    """Staging in a process without Ray: no Ray module, and none of kvguard's Ray parts, is
    imported at start, at a guard's attach, at a violation or at exit (ray is installed here
    when the test extra is)."""
    (tmp_path / "prog.py").write_text(NO_RAY)
    env = staged_env(KVGUARD=1, KVGUARD_LOG=str(tmp_path / "logs") + "/",
                     KVGUARD_REGISTER="kvguard.examples.LinkedFreeList(size=_num_blocks)")
    out = subprocess.run([staged_python, "-X", "importtime", "prog.py"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded: ['kvguard.ray'] staged: True" in out.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:")]
    assert "kvguard.staging" in {name.strip() for name in imported}
    assert not [name for name in imported if name.strip().split(".")[0] == "ray"]
    (log,) = (tmp_path / "logs").iterdir()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["event"] for r in records] == ["start", "violation", "stats"]
    assert not [r for r in records if "ray" in r]


def kvguard_run(tmp_path, staged_python, *command, **variables):
    env = staged_env(**variables)
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_RUNTIME_ENV_HOOK", None)
    env.update({k: str(v) for k, v in variables.items()})
    return subprocess.run([staged_python, "-m", "kvguard", "run", "--log", "logs", "--",
                           *command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_kvguard_run_gives_rays_hook_and_keeps_one_the_environment_had(tmp_path, staged_python):
    show = ("import os; print(os.environ['RAY_RUNTIME_ENV_HOOK'], "
            "os.environ.get('KVGUARD_RAY_HOOK'))")
    out = kvguard_run(tmp_path, staged_python, staged_python, "-c", show)
    assert out.stdout.split() == ["kvguard.ray.runtime_env_hook", "None"]
    out = kvguard_run(tmp_path, staged_python, staged_python, "-c", show,
                      RAY_RUNTIME_ENV_HOOK="mine.hook")
    assert out.stdout.split() == ["kvguard.ray.runtime_env_hook", "mine.hook"]


FOREIGN = '''
import os, subprocess, sys
# a worker of a cluster started outside the run, with KVGUARD=1 and the same log directory of
# its own: its environment has no KVGUARD_RUN
env = {k: v for k, v in os.environ.items() if k != "KVGUARD_RUN"}
subprocess.run([sys.executable, "-c", """
from kvguard.examples import LinkedFreeList
pool = LinkedFreeList(8)
ids = pool.allocate(2)
pool.free([ids[0], ids[0]])
"""], env=env, check=True)
'''


def test_kvguard_run_says_who_wrote_when_not_its_own_processes(tmp_path, staged_python):
    """Workers of a cluster the run did not configure wrote violations into its log directory:
    the closing line says so, never "nothing reported"."""
    (tmp_path / "foreign.py").write_text(FOREIGN)
    out = kvguard_run(tmp_path, staged_python, staged_python, "foreign.py",
                      KVGUARD_REGISTER="kvguard.examples.LinkedFreeList")
    assert out.returncode == 0, out.stderr
    (last,) = [line for line in out.stderr.splitlines() if line.startswith("kvguard: ")][-1:]
    assert "nothing reported" not in out.stderr
    assert last.startswith("kvguard: none of the processes this run started reported, but 1 "
                           "process(es) it did not start wrote 1 violation(s) under "), last
    assert last.endswith(f"see: kvguard report {tmp_path / 'logs'}")


def test_kvguard_run_on_a_cluster_it_did_not_start_says_what_it_cannot_reach(
        tmp_path, staged_python):
    out = kvguard_run(tmp_path, staged_python, staged_python, "-c", "pass",
                      RAY_ADDRESS="127.0.0.1:9")
    assert out.returncode == 0
    assert "nothing reported" not in out.stderr
    assert "RAY_ADDRESS names a Ray cluster kvguard run did not start (127.0.0.1:9)" in \
        out.stderr
    assert "those on other hosts write under the same path on their own disks" in out.stderr
