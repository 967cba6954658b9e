"""Staging inside a Ray worker: which actor a record is about, records that outlive a worker
Ray kills, one console line per violation, and the figures on Ray's own metrics.

Ray ends an actor whose job is over by force (a worker's own exit path, not Python's) at about
the moment it sends SIGTERM, and ``ray.kill`` without any warning: ``atexit`` never runs, and
staging's final ``stats`` lines would never be written. So in a Ray worker the file is opened,
its ``start`` line written, when the first guard attaches; a ``stats`` checkpoint (``"final":
false``) follows whenever the counters moved, every ``KVGUARD_METRICS_INTERVAL`` seconds; the
final lines are written first thing in Ray's SIGTERM, and, at an actor's own end, before Ray's
own ``atexit`` handler lets go of the worker. A file without a final line then says the worker
was killed, with its counts as of its last checkpoint. (Everything a worker writes on stderr is
echoed on the driver's console: staging's one-line log of a violation, ``sink.OneLineReports``,
keeps that to one line each.) ``ray.util.metrics`` puts kvguard's figures on Ray's own metrics endpoint, the
one Ray's dashboard and a Prometheus scrape of the cluster already read.

Staging imports this module only in a process that has imported ``ray`` already, at the first
guard it attaches there.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading

from .metrics import METRICS, MultiprocessWriter

logger = logging.getLogger("kvguard")

_process: dict = {}  # what holds for the whole process, read once (a pooled worker that
# becomes an actor adds its actor's fields then)


def context(live: bool = True) -> dict | None:
    """The Ray worker or driver this process is, as staging records it: ``node_id``,
    ``job_id``, ``worker_id``, and in an actor ``actor_id``, ``actor_class`` and
    ``actor_name`` (a named actor's); ``live``, also ``task``, the running task's name. None
    when Ray is not imported or not initialized here; never raises. Without ``live`` nothing
    is asked of Ray once the process's part is known: a final record written while Ray ends
    the worker must not wait on it."""
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    if not live and _process:
        return {k: v for k, v in _process.items() if v}
    try:
        if not ray.is_initialized():
            return None
        now = ray.get_runtime_context()
        if "node_id" not in _process:
            _process.update(node_id=now.get_node_id(), job_id=now.get_job_id(),
                            worker_id=now.get_worker_id())
        actor = now.get_actor_id()
        if actor and _process.get("actor_id") != actor:
            function = now.get_task_function_name()
            _process.update(actor_id=actor, actor_class=(function or "").rpartition(".")[0],
                            actor_name=now.get_actor_name() or "")
        out = dict(_process)
        if live:
            out["task"] = now.get_task_name()
        return {k: v for k, v in out.items() if isinstance(v, str) and v}
    except Exception:  # a Ray that answers otherwise costs the context, never the record
        return None


def in_worker(ray_context: dict | None) -> bool:
    """Whether a context is a worker's (it runs a task or is an actor), not a driver's."""
    return bool(ray_context) and ("actor_id" in ray_context or "task" in ray_context)


class _Tagged:
    """A ``ray.util.metrics`` metric read through ``prometheus_client``'s ``labels()``."""

    def __init__(self, metric, keys) -> None:
        self.metric = metric
        self.keys = keys

    def labels(self, *values):
        return _Child(self.metric, dict(zip(self.keys, values)))


class _Child:
    def __init__(self, metric, tags) -> None:
        self.metric = metric
        self.tags = tags

    def inc(self, amount) -> None:
        self.metric.inc(amount, tags=self.tags)

    def set(self, value) -> None:
        self.metric.set(value, tags=self.tags)


class RayMetricsWriter(MultiprocessWriter):
    """The multi-process writer's figures, into ``ray.util.metrics`` ``Counter``s and
    ``Gauge``s: Ray's metrics agent on each node exports them, as ``ray_kvguard_...``, and
    drops a dead worker's series itself."""

    reaps = False

    def make_metrics(self) -> dict:
        from ray.util.metrics import Counter, Gauge
        out = {}
        for name, kind, labels, help_ in METRICS:
            metric = (Counter if kind == "counter" else Gauge)(name, description=help_,
                                                               tag_keys=labels)
            out[name] = _Tagged(metric, labels)
        return out


class RayWorker:
    """What staging adds in a Ray worker; ``close()`` runs with staging's own."""

    def __init__(self, staging) -> None:
        self.staging = staging
        self.metrics = None
        self._previous = None
        self._stop = threading.Event()
        self._thread = None
        self._closed = False

    def start(self) -> None:
        sink = self.staging.sink
        if sink is not None:
            sink.keep_idle_guards = True  # a clean actor's record, even with no calls
            sink.open_now()
            self._thread = threading.Thread(target=self._checkpoints, daemon=True,
                                            name="kvguard-checkpoints")
            self._thread.start()
        if self.staging.config.metrics:
            try:
                self.metrics = RayMetricsWriter(self.staging.config.metrics_interval)
                self.metrics.start()
            except Exception as exc:
                logger.error("kvguard: Ray metrics not started: %r", exc)
        self._chain_sigterm()
        # At an actor's own end (exit_actor, __ray_terminate__, its handles gone) atexit runs,
        # last in first out: staging's final lines go before Ray's own handler disconnects
        # the worker, so that whoever waits for the actor to end finds them written.
        atexit.unregister(self.staging.close)
        atexit.register(self.staging.close)

    def _checkpoints(self) -> None:
        from ..guard import guards
        while not self._stop.wait(self.staging.config.metrics_interval):
            self.staging.sink.checkpoint(guards())

    def _chain_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.info("kvguard: the first guard attached off the main thread: at Ray's "
                        "SIGTERM this worker leaves its last checkpoint, not a final record")
            return
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        # Ray may end the process any moment now (an actor whose owner died is force-killed
        # at once): the final lines first, right here, without waiting on a lock.
        self.staging.close(wait=False)
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def close(self) -> None:
        """The final figures: Ray's gauges to zero, and in ``prometheus_client``'s
        multi-process mode this process's live gauge files marked dead."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.metrics is not None:
            self.metrics.stop()
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory and "prometheus_client" in sys.modules:
            try:
                from prometheus_client import multiprocess
                multiprocess.mark_process_dead(os.getpid(), directory)
            except Exception as exc:
                logger.error("kvguard: cannot mark this worker's metrics files dead: %r", exc)


def engage(staging) -> RayWorker | None:
    """Staging's Ray part, when this process is a Ray worker; else None."""
    if not in_worker(context()):
        return None
    worker = RayWorker(staging)
    worker.start()
    return worker
