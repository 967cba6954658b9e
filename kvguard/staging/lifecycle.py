"""Turning staging on and off in a process: ``start()`` (the start-up hook's call), ``stop()``,
and what a fork does to it.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

from .config import StagingConfig, config_from_env
from .sink import JsonLinesSink, OneLineReports

logger = logging.getLogger("kvguard")


class Staging:
    """What ``start()`` turned on, so that ``stop()`` can turn it off again."""

    def __init__(self, config: StagingConfig) -> None:
        self.config = config
        self.sink = None
        self.metrics = None
        self.ray = None
        """The Ray worker part (``rayworker.RayWorker``), in a Ray worker."""
        self._unsubscribe = None
        self._untrack = None
        self._one_line = None
        self._unwatch = None

    def start(self) -> None:
        from .. import registry
        from ..guard import guards, on_attach, subscribe
        for name, spec in self.config.register:
            if spec is None:
                spec = registry.registered().get(name)
            if spec is None:
                from ..spec import DEFAULT_SPEC
                spec = DEFAULT_SPEC
            registry.register(name, spec)
        if self.config.log:
            self.sink = JsonLinesSink(self.config.log, every=self.config.log_every,
                                      max_bytes=self.config.log_max_bytes,
                                      config=self.config.to_dict(), run=self.config.run)
            self._unsubscribe = subscribe(self.sink)
            self._one_line = OneLineReports(self.sink)
            logger.addFilter(self._one_line)
            self._untrack = on_attach(self.sink.track)
            for guard in guards():
                self.sink.track(guard)
        self._unwatch = on_attach(self._first_guard)
        registry.instrument(**self.config.guard_options())
        if self.config.metrics:
            from . import metrics
            self.metrics = metrics.install(self.config.metrics_interval)
        atexit.register(self.close)

    def _first_guard(self, guard) -> None:
        """At the first guard of a process that has imported Ray: its Ray worker part. Costs
        one dictionary lookup per guard attached where Ray is not imported."""
        if self._unwatch is not None and "ray" in sys.modules:
            self._unwatch()
            self._unwatch = None
            from .rayworker import engage
            self.ray = engage(self)

    def close(self, wait: bool = True) -> None:
        """Write the final stats lines and metrics (at exit, at ``stop()``, or when Ray ends
        a worker: then without ``wait``, see ``JsonLinesSink.close``)."""
        if self.sink is not None:
            from ..guard import guards
            self.sink.close(guards(), wait=wait)
        if self.metrics is not None:
            self.metrics.close()
        if self.ray is not None:
            self.ray.close()

    def stop(self) -> None:
        from .. import registry
        atexit.unregister(self.close)
        self.close()
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._untrack is not None:
            self._untrack()
        if self._one_line is not None:
            logger.removeFilter(self._one_line)
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        registry.uninstrument()

    def after_fork_in_child(self) -> None:
        if self.metrics is not None:
            self.metrics.after_fork_in_child()
        if self.sink is None and self.metrics is None:
            return
        if self.sink is not None:
            from ..guard import guards
            self.sink.after_fork_in_child(guards())
        util = sys.modules.get("multiprocessing.util")
        if util is not None:
            # A multiprocessing child ends in os._exit(): atexit never runs there, but
            # multiprocessing's own finalizers do. Its registry is cleared after this hook, so
            # the finalizer is registered from its after-fork callbacks, which run later.
            util.register_after_fork(self, Staging._register_finalizer)

    def _register_finalizer(self) -> None:
        util = sys.modules.get("multiprocessing.util")
        if util is not None:
            util.Finalize(self, Staging.close, args=(self,), exitpriority=100)


_active: Staging | None = None
_failed = False
_fork_hook = False


def active() -> Staging | None:
    """The staging started in this process, or None."""
    return _active


def start(environ=None) -> bool:
    """Turn staging on from the environment; the start-up hook calls this. Returns whether it
    is on. Never raises: a bad setting is one error line and an unguarded process. Only the
    first call acts (``site`` may run a ``.pth`` file twice, as in a venv with system site
    packages) until ``stop()``."""
    global _active, _failed, _fork_hook
    if _active is not None or _failed:
        return _active is not None
    try:
        config = config_from_env(environ)
    except Exception as exc:  # ValueError: a bad setting, said in one line
        _failed = True
        logger.error("kvguard: staging not started: %s", exc)
        return False
    if config is None:
        return False
    staging = Staging(config)
    try:
        staging.start()
    except Exception as exc:
        _failed = True
        logger.error("kvguard: staging not started: %r", exc)
        try:
            staging.stop()
        except Exception:
            pass
        return False
    _active = staging
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook = True
    return True


def stop() -> None:
    """Turn staging off: final stats lines written, instrumentation off, sink closed. Guards
    already attached stay until their ``unguard()``."""
    global _active, _failed
    staging, _active, _failed = _active, None, False
    if staging is not None:
        staging.stop()


def _after_fork_in_child() -> None:
    staging = _active
    if staging is not None:
        try:
            staging.after_fork_in_child()
        except Exception as exc:
            logger.error("kvguard: staging after fork: %r", exc)
