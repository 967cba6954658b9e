"""Prometheus metrics: kvguard's figures on the engine's own ``/metrics`` endpoint.

vLLM and SGLang serve ``prometheus_client``'s default registry; a staged process that has
``prometheus_client`` gets a collector on it (no configuration), so the figures show up where
operators already look. The collector reads every guard's counters when it is scraped
(``Guard.snapshot()``: the guard's lock is held for one copy of its counters, the ledgers are
counted after it), so the guarded call path pays nothing.

``prometheus_client``'s multi-process mode (``PROMETHEUS_MULTIPROC_DIR``, which vLLM uses with
several API servers) serves ``/metrics`` from files each process writes, and a custom collector
in another process is never asked. There each staged process keeps ``prometheus_client``
``Counter``/``Gauge`` objects (live gauges summed over live processes) and a daemon thread copies
the guards' figures into them every ``KVGUARD_METRICS_INTERVAL`` seconds and once at exit.

``prometheus_client`` is never imported to find out whether it is there: it picks single- or
multi-process mode once, at its import, so importing it before the engine has set
``PROMETHEUS_MULTIPROC_DIR`` would change the engine's own metrics. The collector is attached
when the engine imports it (a post-import hook), or at start when the directory is already set.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import threading
import weakref

from .totals import Totals

logger = logging.getLogger("kvguard")

METRICS = (
    # (name, type, labels, help): counters are exposed with a _total suffix
    ("kvguard_violations", "counter", ("allocator", "kind"),
     "Allocator misuses kvguard found, by violation kind"),
    ("kvguard_calls_checked", "counter", ("allocator", "method"),
     "Allocator calls kvguard checked, by method"),
    ("kvguard_blocks_live", "gauge", ("allocator",),
     "Blocks handed out and not freed, as the guards' ledgers say"),
    ("kvguard_guards", "gauge", ("allocator",),
     "Allocator instances guarded now"),
    ("kvguard_steps_in_flight", "gauge", ("allocator",),
     "Engine steps scheduled whose output is not processed yet (open in-flight leases)"),
    ("kvguard_blocks_leased", "gauge", ("allocator",),
     "Blocks the steps in flight use: handing one out again is free-in-flight"),
    ("kvguard_ids_learned", "counter", ("allocator",),
     "Ids accepted on their first free as handed out before the guard attached"),
    ("kvguard_ids_seeded", "counter", ("allocator",),
     "Ids made live at attach from the allocator's own list of live blocks"),
    ("kvguard_internal_errors", "counter", ("allocator",),
     "Errors inside kvguard itself; those calls were forwarded unchecked"),
)
"""Every metric kvguard exposes: docs/staging.md lists them from here."""

_SPEC = {name: (kind, labels) for name, kind, labels, _help in METRICS}


class Collector:
    """A ``prometheus_client`` custom collector over ``Totals``: everything is read at scrape
    time."""

    def __init__(self, totals: Totals | None = None) -> None:
        self.totals = totals or Totals()

    def describe(self):
        return list(self._families({}, {}))

    def collect(self):
        counters, gauges = self.totals.read()
        return list(self._families(counters, gauges))

    @staticmethod
    def _families(counters, gauges):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        for name, kind, labels, help_ in METRICS:
            if kind == "counter":
                family, values = CounterMetricFamily(name, help_, labels=labels), counters
            else:
                family, values = GaugeMetricFamily(name, help_, labels=labels), gauges
            for (metric, label_values), value in sorted(values.items()):
                if metric == name:
                    family.add_metric(list(label_values), value)
            yield family


class MultiprocessWriter:
    """Multi-process mode: the figures copied into ``prometheus_client`` metric objects (which
    write this process's files under ``PROMETHEUS_MULTIPROC_DIR``) by a daemon thread, every
    ``interval`` seconds, off the guarded call path."""

    def __init__(self, interval: float, totals: Totals | None = None) -> None:
        self.interval = interval
        self.totals = totals or Totals()
        self._metrics = self.make_metrics()
        self._pushed: dict = {}
        self._gauges: set = set()
        self._push_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._failed = False
        self._reaped: set = set()
        _hold_at_fork(self)

    def make_metrics(self) -> dict:
        """``{name: metric}`` for every entry of ``METRICS``, each with ``labels(*values)``
        giving a child with ``inc``/``set``: here ``prometheus_client``'s (a Ray worker's
        writer makes Ray's)."""
        import prometheus_client
        made = {}
        for name, kind, labels, help_ in METRICS:
            if kind == "counter":
                made[name] = prometheus_client.Counter(name, help_, labels, registry=None)
            else:  # summed over the processes alive (exited ones are zeroed at exit)
                made[name] = prometheus_client.Gauge(name, help_, labels, registry=None,
                                                     multiprocess_mode="livesum")
        return made

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvguard-metrics", daemon=True)
        self._thread.start()

    reaps = True
    """Whether this writer also marks dead the files of staged processes killed outright."""

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.push()
            if self.reaps:
                from .reaper import reap_dead
                reap_dead(self._reaped)

    def push(self, final: bool = False) -> None:
        """Copy the figures into the metric objects: counters by their increase since the last
        push, gauges as they are (zero for allocators gone, and for all of them when ``final``)."""
        try:
            counters, gauges = self.totals.read()  # the guards' locks: outside the push lock
            with self._push_lock:
                for key, value in counters.items():
                    name, labels = key
                    child = self._metrics[name].labels(*labels)  # there from zero on
                    delta = value - self._pushed.get(key, 0)
                    if delta > 0:
                        child.inc(delta)
                        self._pushed[key] = value
                for key in self._gauges | set(gauges):
                    name, labels = key
                    self._metrics[name].labels(*labels).set(0 if final else gauges.get(key, 0))
                self._gauges |= set(gauges)
        except Exception as exc:  # a metrics bug never reaches the service
            if not self._failed:
                self._failed = True
                logger.error("kvguard: cannot update the Prometheus metrics files: %r", exc)

    def after_fork_in_child(self) -> None:
        """A forked child writes its own files: it counts only what it does from now on."""
        self._push_lock = threading.Lock()
        self._stop = threading.Event()
        self._pushed = self.totals.after_fork_in_child()
        self.start()

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(1.0, self.interval))
        self.push(final=True)


def _hold_at_fork(writer) -> None:
    """Fork only while ``writer`` is outside ``prometheus_client``: its push lock is taken
    before the fork and let go after it (in the child, the child's writer makes a new one), so
    a child never inherits a lock of ``prometheus_client``'s that our thread held half-way
    through a push (its first write would wait forever). The push lock is held only around
    the metric objects' updates, never while a guard's lock is waited for, so taking it here
    waits for one update at most (and gives up after 10 s rather than hang a fork)."""
    if not hasattr(os, "register_at_fork"):
        return
    ref = weakref.ref(writer)
    taken = []

    def before() -> None:
        w = ref()
        if w is not None and w._push_lock.acquire(timeout=10):
            taken.append(w._push_lock)

    def after() -> None:
        while taken:
            taken.pop().release()

    def in_child() -> None:
        taken.clear()
        w = ref()
        if w is not None:
            w._push_lock = threading.Lock()

    os.register_at_fork(before=before, after_in_parent=after, after_in_child=in_child)


def _multiprocess(prometheus_client) -> bool:
    values = prometheus_client.values
    return values.ValueClass is not values.MutexValue


class Metrics:
    """What ``install()`` set up in this process, so that staging can close it at exit."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.collector = None
        self.writer = None
        self.registry = None
        self._hook = None

    def attach(self) -> None:
        """Register the collector (or start the writer, in multi-process mode); once."""
        if self.collector is not None or self.writer is not None:
            return
        try:
            import prometheus_client
            if _multiprocess(prometheus_client):
                self.writer = MultiprocessWriter(self.interval)
                self.writer.start()
            else:
                self.collector = Collector()
                self.registry = prometheus_client.REGISTRY
                self.registry.register(self.collector)
        except Exception as exc:
            logger.error("kvguard: Prometheus metrics not started: %r", exc)

    def hook(self) -> None:
        """Attach once the engine imports ``prometheus_client``."""
        self._hook = _ImportHook("prometheus_client", self.attach)
        sys.meta_path.insert(0, self._hook)

    def after_fork_in_child(self) -> None:
        if self.writer is not None:
            self.writer.after_fork_in_child()

    def close(self) -> None:
        """Unhook, unregister, and write the final figures (multi-process mode)."""
        if self._hook is not None and self._hook in sys.meta_path:
            sys.meta_path.remove(self._hook)
        self._hook = None
        if self.collector is not None and self.registry is not None:
            try:
                self.registry.unregister(self.collector)
            except KeyError:
                pass
            self.collector = None
        if self.writer is not None:
            self.writer.stop()
            self.writer = None


def install(interval: float = 5.0) -> Metrics:
    """Expose the guards' figures to Prometheus in this process: now if ``prometheus_client`` is
    imported already (or ``PROMETHEUS_MULTIPROC_DIR`` is set and it can be imported), else as soon
    as the engine imports it. Staging calls this unless ``KVGUARD_METRICS=0``."""
    metrics = Metrics(interval)
    if "prometheus_client" in sys.modules:
        metrics.attach()
    elif os.environ.get("PROMETHEUS_MULTIPROC_DIR") and \
            importlib.util.find_spec("prometheus_client") is not None:
        metrics.attach()
    else:
        metrics.hook()
    return metrics


def register(registry=None) -> Collector:
    """Register a collector of every guard's figures on ``registry`` (default: the default
    ``REGISTRY``) by hand, outside staging; returns it (``registry.unregister`` takes it off)."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    collector = Collector()
    registry.register(collector)
    return collector


class _ImportHook(importlib.abc.MetaPathFinder):
    """Lets the real finders find one module, then calls ``then()`` once it has run."""

    def __init__(self, fullname: str, then) -> None:
        self.fullname = fullname
        self.then = then
        self._finding = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.fullname or getattr(self._finding, "on", False):
            return None
        self._finding.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            self._finding.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenLoader(spec.loader, self)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, loader, hook: _ImportHook) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        hook = self._hook
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
            try:
                hook.then()
            except Exception as exc:
                logger.error("kvguard: Prometheus metrics not started: %r", exc)

    def __getattr__(self, name):
        return getattr(self._loader, name)
