"""kvguard's figures on prometheus_client's registry, with the real prometheus_client: scraped
over HTTP and parsed by its own parser, in one process and in multi-process mode, and a scrape
during concurrent allocator traffic that holds each guard's lock for one copy of its counters."""

import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import urllib.request

import pytest

import kvguard
from kvguard import kinds, staging
from kvguard.staging import metrics
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.guard import Stats

from .staging_env import staged_env, staged_python_fixture  # noqa: F401

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


class MetricsPool(LinkedFreeList):
    """A class of this module's own, so that other tests' guards never share its labels."""


CLS = f"{MetricsPool.__module__}.{MetricsPool.__qualname__}"


@pytest.fixture(autouse=True)
def _staging_off():
    gc.collect()  # other tests' MetricsPool guards, left in reference cycles, are gone
    yield
    staging.stop()


def scrape(port) -> dict:
    """``{(sample name, frozenset(labels)): value}`` of kvguard's samples for MetricsPool."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return parse(text)


def parse(text, cls=CLS) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvguard_") and s.labels.get("allocator") == cls:
                out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def expected(stats: dict, live: int, guards=1, cls=CLS, gauges=True, steps=0, leased=0) -> dict:
    """What the scrape must say, from ``Guard.stats`` (and the live block count); ``gauges``:
    whether the gauges are there at all (a class no longer guarded in this process has none)."""
    a = {"allocator": cls}
    out = {("kvguard_calls_checked_total", frozenset({**a, "method": m}.items())): float(n)
           for m, n in (("allocate", stats["alloc_calls"]), ("free", stats["free_calls"]))}
    for kind in kinds.MEANING:
        out[("kvguard_violations_total", frozenset({**a, "kind": kind}.items()))] = float(
            stats["violations"].get(kind, 0))
    out[("kvguard_ids_learned_total", frozenset(a.items()))] = float(stats["learned"])
    out[("kvguard_ids_seeded_total", frozenset(a.items()))] = 0.0
    out[("kvguard_internal_errors_total", frozenset(a.items()))] = float(
        stats["internal_errors"])
    if gauges:
        out[("kvguard_blocks_live", frozenset(a.items()))] = float(live)
        out[("kvguard_guards", frozenset(a.items()))] = float(guards)
        out[("kvguard_steps_in_flight", frozenset(a.items()))] = float(steps)
        out[("kvguard_blocks_leased", frozenset(a.items()))] = float(leased)
    return out


def misuse(pool):
    ids = pool.allocate(4)
    pool.free(ids[:2])
    try:
        pool.free([ids[2], ids[2]])
    except ValueError:
        pass
    try:
        pool.free([ids[0]])
    except ValueError:
        pass


@pytest.fixture(name="server")
def server_fixture():
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1")
    yield server.server_port
    server.shutdown()
    thread.join(10)


def test_staging_puts_the_figures_on_the_default_registry(server):
    assert staging.start({"KVGUARD": "1"})
    pool = MetricsPool(32)
    g = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="repair")
    misuse(pool)
    pool.allocate(3)
    stats = g.stats.to_dict()
    assert stats["violations"] == {"duplicate-id": 1, "double-free": 1}
    assert scrape(server) == expected(stats, live=len(g.live))

    staging.stop()  # taken off the registry again
    assert scrape(server) == {}


def test_kvguard_metrics_0_keeps_them_off(server):
    assert staging.start({"KVGUARD": "1", "KVGUARD_METRICS": "0"})
    pool = MetricsPool(8)
    kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="repair")
    pool.allocate(1)
    assert scrape(server) == {}


def test_counters_survive_their_guard_and_gauges_follow_the_guards():
    collector = metrics.Collector()
    pool = MetricsPool(16)
    g = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="repair")
    misuse(pool)
    registry_ = prometheus_client.CollectorRegistry()
    registry_.register(collector)
    stats = g.stats.to_dict()
    live = len(g.live)
    before = parse(prometheus_client.generate_latest(registry_).decode())
    assert before == expected(stats, live)
    g.unguard()  # still counted, no longer guarded
    assert parse(prometheus_client.generate_latest(registry_).decode()) == expected(
        stats, live, gauges=False)
    del g, pool
    gc.collect()  # collected: its counts are kept, never a counter going down
    after = parse(prometheus_client.generate_latest(registry_).decode())
    assert after == expected(stats, live, gauges=False)


def test_stale_frees_are_counted_by_kind_and_the_steps_in_flight_are_gauged():
    collector = metrics.Collector()
    registry_ = prometheus_client.CollectorRegistry()
    registry_.register(collector)
    pool = MetricsPool(16)
    g = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="repair")
    with kvguard.owner("R"):
        mine = pool.allocate(2)
        pool.free(mine)
    with kvguard.owner("Q"):
        theirs = pool.allocate(3)
    with kvguard.owner("R"):
        pool.free(mine)                      # stale: Q holds them (repair keeps them Q's)
    g.begin_step(7, theirs[:2], request="Q")
    g.begin_step(8, theirs, request="Q")     # two steps in flight over three blocks
    stats = g.stats.to_dict()
    assert stats["violations"] == {"stale-free": 1}
    scraped = parse(prometheus_client.generate_latest(registry_).decode())
    assert scraped == expected(stats, live=3, steps=2, leased=3)
    g.end_step(7)
    g.end_step(8)
    assert parse(prometheus_client.generate_latest(registry_).decode()) == expected(stats, 3)


def test_a_bad_interval_is_a_bad_setting():
    with pytest.raises(ValueError, match="KVGUARD_METRICS_INTERVAL='soon'"):
        staging.config_from_env({"KVGUARD": "1", "KVGUARD_METRICS_INTERVAL": "soon"})
    config = staging.config_from_env({"KVGUARD": "1", "KVGUARD_METRICS": "off",
                                      "KVGUARD_METRICS_INTERVAL": "0.5"})
    assert (config.metrics, config.metrics_interval) == (False, 0.5)


# --- a scrape never holds up the allocator --------------------------------------------------

class WatchedLock:
    """The guard's lock as a reader finds it (``guard.lock``), recording which functions run
    on the reader's thread while it is held. The wrappers keep the real lock they were built
    with, so the allocator threads and the reader still exclude each other through it."""

    def __init__(self, real):
        self.real = real
        self.holder = None
        self.ran = []

    def __enter__(self):
        self.real.acquire()
        self.holder = threading.get_ident()
        return self

    def __exit__(self, *exc):
        self.holder = None
        self.real.release()

    def profile(self, frame, event, arg):
        if self.holder == threading.get_ident() and event in ("call", "c_call"):
            self.ran.append(frame.f_code.co_name if event == "call" else arg.__name__)


def test_a_scrape_during_traffic_holds_each_guard_for_one_copy_of_its_counters():
    pool = MetricsPool(4096)
    g = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="repair")
    watched = WatchedLock(g.lock)
    g.lock = watched
    stop = threading.Event()
    errors = []

    def traffic(seed):
        held = []
        try:
            while not stop.is_set():
                held.append(pool.allocate(1 + seed % 3))
                if len(held) > 8:
                    pool.free(held.pop(0))
            for ids in held:
                pool.free(ids)
        except Exception as exc:  # pragma: no cover - would fail the test below
            errors.append(exc)

    threads = [threading.Thread(target=traffic, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    collector = metrics.Collector()
    registry_ = prometheus_client.CollectorRegistry()
    registry_.register(collector)
    calls = []
    sys.setprofile(watched.profile)
    try:
        for _ in range(30):
            scraped = parse(prometheus_client.generate_latest(registry_).decode())
            calls.append(sum(v for (name, _l), v in scraped.items()
                             if name == "kvguard_calls_checked_total"))
    finally:
        sys.setprofile(None)
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors
    assert calls == sorted(calls) and calls[-1] > calls[0] > 0, "scraped while it ran"
    # While the reader held the lock it ran Stats.to_dict (its comprehension, and the dict
    # copy of the violations) and the lock's own release: no scan, no formatting.
    assert "to_dict" in watched.ran
    assert set(watched.ran) <= {"to_dict", "<dictcomp>", "getattr", "__exit__", "release"}, (
        set(watched.ran))
    assert Stats.to_dict.__code__.co_name == "to_dict"
    stats = g.stats.to_dict()
    assert parse(prometheus_client.generate_latest(registry_).decode()) == expected(stats, 0)
    assert stats["violations"] == {} and stats["internal_errors"] == 0
    g.check()


# --- across processes -------------------------------------------------------------------------

PROGRAM = textwrap.dedent('''
    import json, sys
    import kvguard
    from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
    early = "prometheus_client" in sys.modules

    class MetricsPool(LinkedFreeList):
        pass

    pool = MetricsPool(64)
    g = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="repair")
    ids = pool.allocate(int(sys.argv[1]))
    pool.free(ids[:1])
    try:
        pool.free(ids[:1])
    except ValueError:
        pass
    import prometheus_client  # the engine imports it after staging started
    from kvguard import staging
    m = staging.active().metrics
    print(json.dumps({"early": early, "stats": g.stats.to_dict(), "live": len(g.live),
                      "collector": m.collector is not None, "writer": m.writer is not None}),
          flush=True)
    if sys.argv[2] == "serve":
        from prometheus_client import generate_latest
        print(generate_latest().decode(), flush=True)
    elif sys.argv[2] == "wait":
        sys.stdin.readline()
    elif sys.argv[2] == "fork":
        import multiprocessing as mp

        def child(queue):
            before = g.stats.to_dict()
            more = pool.allocate(2)
            pool.free(more)
            try:
                pool.free(more)
            except ValueError:
                pass
            after = g.stats.to_dict()
            queue.put({k: after[k] - before[k] for k in ("alloc_calls", "free_calls")} | {
                "double-free": after["violations"]["double-free"]
                - before["violations"]["double-free"], "live": len(g.live)})

        queue = mp.get_context("fork").Queue()
        p = mp.get_context("fork").Process(target=child, args=(queue,))
        p.start()
        print(json.dumps(queue.get(timeout=60)), flush=True)
        p.join(60)
''')
MAIN = "__main__.MetricsPool"


def program(python, tmp_path, env, *args, **popen):
    script = tmp_path / "serve.py"
    script.write_text(PROGRAM)
    return subprocess.Popen([python, str(script), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def finished(process) -> tuple:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    head, _, rest = out.partition("\n")
    return json.loads(head), rest


def test_the_collector_is_attached_when_the_engine_imports_prometheus_client(
        tmp_path, staged_python):
    env = staged_env(KVGUARD=1)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    info, text = finished(program(staged_python, tmp_path, env, "5", "serve"))
    assert info["early"] is False, "staging must not import prometheus_client itself"
    assert info["collector"] and not info["writer"]
    assert parse(text, MAIN) == expected(info["stats"], info["live"], cls=MAIN)


def test_multiprocess_mode_sums_every_process(tmp_path, staged_python):
    directory = tmp_path / "prom"
    directory.mkdir()
    env = staged_env(KVGUARD=1, PROMETHEUS_MULTIPROC_DIR=directory,
                     KVGUARD_METRICS_INTERVAL="0.05")
    registry_ = prometheus_client.CollectorRegistry()
    MultiProcessCollector(registry_, path=str(directory))

    def summed():
        return parse(prometheus_client.generate_latest(registry_).decode(), MAIN)

    def want(infos, running):
        total = {"alloc_calls": 0, "free_calls": 0, "learned": 0, "internal_errors": 0,
                 "violations": {}}
        for info in infos:
            for k in ("alloc_calls", "free_calls", "learned", "internal_errors"):
                total[k] += info["stats"][k]
            for kind, n in info["stats"]["violations"].items():
                total["violations"][kind] = total["violations"].get(kind, 0) + n
        return expected(total, sum(i["live"] for i in running), guards=len(running), cls=MAIN)

    # One process stays up: its figures reach the files while it runs, not only at exit.
    waiting = program(staged_python, tmp_path, env, "7", "wait", stdin=subprocess.PIPE)
    try:
        first = json.loads(waiting.stdout.readline())
        assert first["writer"] and not first["collector"], "files, not a collector"
        others = [finished(program(staged_python, tmp_path, env, str(n), "exit"))[0]
                  for n in (3, 4)]
        for _ in range(200):  # the writer's next tick
            if summed() == want([first, *others], [first]):
                break
            threading.Event().wait(0.05)
        assert summed() == want([first, *others], [first]), "the exited ones' gauges are zero"
    finally:
        _out, err = waiting.communicate(timeout=120)  # its stdin closed: it exits
    assert waiting.returncode == 0, err
    assert summed() == want([first, *others], [])


def test_docs_list_every_metric_with_its_type_and_labels():
    docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "staging.md")
    with open(docs, encoding="utf-8") as f:
        rows = {cells[0].strip("` "): cells[1:3] for cells in (
            [c.strip() for c in line.strip().strip("|").split("|")]
            for line in f if line.startswith("| `kvguard_"))}
    wanted = {name + ("_total" if kind == "counter" else ""): [
        kind, ", ".join(f"`{label}`" for label in labels)]
        for name, kind, labels, _help in metrics.METRICS}
    assert rows == wanted


def test_multiprocess_mode_a_forked_child_adds_only_its_own_calls(tmp_path, staged_python):
    _forked_child_adds_only_its_own_calls(tmp_path, staged_python, "0.05")


def test_a_child_forked_before_the_writers_first_push_adds_only_its_own_calls(
        tmp_path, staged_python):
    """The same with pushes an hour apart: the fork always comes before the writer's first
    push, which once made the child count the parent's calls again (3 where 2 are right),
    whenever the machine was idle enough for the fork to win that race."""
    _forked_child_adds_only_its_own_calls(tmp_path, staged_python, "3600")


def _forked_child_adds_only_its_own_calls(tmp_path, staged_python, interval):
    directory = tmp_path / "prom"
    directory.mkdir()
    env = staged_env(KVGUARD=1, PROMETHEUS_MULTIPROC_DIR=directory,
                     KVGUARD_METRICS_INTERVAL=interval)
    info, rest = finished(program(staged_python, tmp_path, env, "6", "fork"))
    child = json.loads(rest.splitlines()[0])
    registry_ = prometheus_client.CollectorRegistry()
    MultiProcessCollector(registry_, path=str(directory))
    total = dict(info["stats"])
    total["alloc_calls"] += child["alloc_calls"]
    total["free_calls"] += child["free_calls"]
    parent_double_frees = info["stats"]["violations"]["double-free"]
    total["violations"] = {"double-free": parent_double_frees + child["double-free"]}
    assert child == {"alloc_calls": 1, "free_calls": 2, "double-free": 1, "live": 5}
    assert parse(prometheus_client.generate_latest(registry_).decode(), MAIN) == expected(
        total, 0, guards=0, cls=MAIN), "both exited: counters summed once, gauges zero"


def test_vllms_own_block_pool_by_its_method_names():
    """vLLM 0.33.0's BlockPool, loaded from the wheel in the engine cache: calls are labelled by
    the pool's own methods, and the blocks it holds (and shares) are the ledger's."""
    from tests.kvguard.adapters import engines
    with engines.loaded("vllm") as vllm:
        class MetricsBlockPool(vllm.BlockPool):
            """vLLM's pool under a name no other test's guard has (its spec: the built-in)."""

        pool = MetricsBlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
        g = kvguard.guard(pool, on_violation="repair")
        a = pool.get_new_blocks(4)
        pool.touch(a[:2])
        pool.free_blocks(a[:2])
        pool.free_blocks([a[3], a[3]])  # duplicate-id, repaired
        registry_ = prometheus_client.CollectorRegistry()
        registry_.register(metrics.Collector())
        cls = f"{__name__}.{MetricsBlockPool.__qualname__}"
        scraped = parse(prometheus_client.generate_latest(registry_).decode(), cls)
        stats = g.stats.to_dict()
        assert g.allocator_class == cls and stats["violations"] == {"duplicate-id": 1}
        calls = {dict(labels)["method"]: v for (name, labels), v in scraped.items()
                 if name == "kvguard_calls_checked_total"}
        assert calls == {"get_new_blocks": 1.0, "free_blocks": 2.0, "touch": 1.0}
        assert scraped[("kvguard_blocks_live", frozenset({"allocator": cls}.items()))] == \
            len(g.live) == 3
        assert scraped[("kvguard_violations_total", frozenset(
            {"allocator": cls, "kind": "duplicate-id"}.items()))] == 1.0
        g.unguard()
