"""Staging: guard the allocators of a running service without touching its code.

``KVGUARD=1`` in the environment of any Python process where kvguard is installed calls
``start()`` at interpreter start (the ``kvguard.pth`` start-up hook; without ``KVGUARD`` the hook
is one ``os.environ.get``). ``start()`` turns on ``kvguard.instrument()`` for every registered
allocator class, built-in engine specs included, with settings read from the environment
(``VARIABLES``), and appends each violation as one JSON line to a file per process, so that
``kvguard report`` can merge a fleet's worth of them and ``kvguard replay`` can re-run a report's
flight recorder offline. ``kvguard run -- python serve.py`` sets all of that up for one command.

Staging must never hurt the serving path: ``log`` is the default mode (the guard forwards every
call and never raises, not even on its own bugs), the JSON sink writes the first occurrence of
each (kind, call site) and then one in ``KVGUARD_LOG_EVERY``, stops at ``KVGUARD_LOG_MAX_MB``,
and swallows its own I/O errors. A bad setting leaves the process unguarded with one error line
on stderr: staging never stops a service from starting.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

logger = logging.getLogger("kvguard")

MODES = ("log", "raise", "repair")
STACKS = ("off", "cheap", "full")

VARIABLES = {
    "KVGUARD": "1 turns staging on at interpreter start (0, off, false or empty: off)",
    "KVGUARD_MODE": "log (default: record, never raise), repair (forward a sanitized call) or "
                    "raise",
    "KVGUARD_LOG": "where each process appends its JSON lines: a path template with {pid} "
                   "(and {host}), a directory (kvguard-{pid}.jsonl inside), or one file shared "
                   "by all processes; unset: the kvguard logger only",
    "KVGUARD_STACKS": "off, cheap or full: call sites kept per allocation and free (default "
                      "cheap; full when KVGUARD_SAMPLE is set)",
    "KVGUARD_SAMPLE": "N: keep the call site of one call in N (chosen at random); every call "
                      "is still checked and counted (default 1)",
    "KVGUARD_HISTORY": "operations in each report's flight recorder (default 32)",
    "KVGUARD_LOG_EVERY": "after its first report, the same kind at the same call site is logged "
                         "once per N occurrences (default 100)",
    "KVGUARD_LOG_MAX_MB": "stop writing violation lines past this size per file (default 64); "
                          "counts still reach the final stats lines",
    "KVGUARD_REGISTER": "allocator classes to guard besides the built-in engine specs, comma "
                        "separated: pkg.mod.Class (the default spec), pkg.mod.Class(alloc=get, "
                        "free=put, size=num_blocks, refcounted=true, ...) or "
                        "pkg.mod.Class=pkg.specs:SPEC (an AllocatorSpec object)",
    "KVGUARD_RUN": "set by kvguard run: an id written into each process's start line, so that "
                   "the run's closing summary counts only its own processes",
    "KVGUARD_METRICS": "0 keeps kvguard's figures off prometheus_client's registry (default: "
                       "on wherever the process has prometheus_client)",
    "KVGUARD_METRICS_INTERVAL": "seconds between updates of the metrics files in "
                                "prometheus_client's multi-process mode (PROMETHEUS_MULTIPROC_DIR; "
                                "default 5)",
}
"""Every environment variable staging reads, with its meaning (``kvguard run --help`` too)."""

from .records import FORMAT_VERSION  # noqa: E402  (the "kvguard" field of every JSON line)

_OFF = ("", "0", "off", "false", "no")


@dataclass(frozen=True)
class StagingConfig:
    """Staging's settings, as read from the environment by ``config_from_env``."""

    mode: str = "log"
    log: str | None = None
    stacks: str = "cheap"
    sample: int = 1
    history: int = 32
    log_every: int = 100
    log_max_bytes: int = 64 << 20
    register: tuple = field(default_factory=tuple)
    """``(dotted class name, AllocatorSpec or None)`` pairs; None: the spec registered already
    (a built-in), else the default one."""
    run: str | None = None
    """The ``kvguard run`` this process belongs to (``KVGUARD_RUN``), written in its start line."""
    metrics: bool = True
    metrics_interval: float = 5.0

    def guard_options(self) -> dict:
        """Keywords for every ``kvguard.guard()`` that ``instrument()`` makes."""
        return {"on_violation": self.mode, "stacks": self.stacks, "sample": self.sample,
                "history": self.history, "log_every": self.log_every}

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.guard_options().items()}
        d["log"] = self.log
        d["register"] = [name for name, _ in self.register]
        d["metrics"] = self.metrics
        return d


def enabled(environ=None) -> bool:
    """Whether ``KVGUARD`` asks for staging."""
    environ = os.environ if environ is None else environ
    return environ.get("KVGUARD", "").strip().lower() not in _OFF


def config_from_env(environ=None) -> StagingConfig | None:
    """Read the ``KVGUARD_*`` variables; None when ``KVGUARD`` is off. A bad value raises
    ``ValueError`` naming the variable and what it accepts."""
    environ = os.environ if environ is None else environ
    if not enabled(environ):
        return None
    from ..guard import LIMIT
    mode = _choice(environ, "KVGUARD_MODE", MODES, "log")
    sample = _count(environ, "KVGUARD_SAMPLE", 1, 1, LIMIT)
    stacks = _choice(environ, "KVGUARD_STACKS", STACKS, "full" if sample > 1 else "cheap")
    history = _count(environ, "KVGUARD_HISTORY", 32, 0, LIMIT)
    log_every = _count(environ, "KVGUARD_LOG_EVERY", 100, 1, LIMIT)
    max_mb = _count(environ, "KVGUARD_LOG_MAX_MB", 64, 1, 1 << 20)
    log = environ.get("KVGUARD_LOG", "").strip() or None
    register = tuple(parse_register(environ.get("KVGUARD_REGISTER", "")))
    run = environ.get("KVGUARD_RUN", "").strip() or None
    metrics = (environ.get("KVGUARD_METRICS", "").strip().lower() or "1") not in _OFF
    interval = _seconds(environ, "KVGUARD_METRICS_INTERVAL", 5.0)
    return StagingConfig(mode=mode, log=log, stacks=stacks, sample=sample, history=history,
                         log_every=log_every, log_max_bytes=max_mb << 20, register=register,
                         run=run, metrics=metrics, metrics_interval=interval)


def _choice(environ, name, choices, default) -> str:
    value = environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={environ.get(name)!r}: expected one of {', '.join(choices)}")
    return value


def _count(environ, name, default, least, most) -> int:
    """A whole-number setting inside its range: a value past it would pass here and then fail
    every guard() (``KVGUARD_HISTORY=10**20`` overflows the flight recorder)."""
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise ValueError(f"{name}={text!r}: expected a whole number >= {least}")
    if value > most:
        raise ValueError(f"{name}={text!r}: expected a whole number >= {least} and <= {most}")
    return value


def _seconds(environ, name, default) -> float:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{name}={text!r}: expected a number of seconds > 0")
    return value


# --- KVGUARD_REGISTER -------------------------------------------------------------------------

_ENTRY = re.compile(r"\s*([A-Za-z_][\w.]*)\s*(?:\((.*?)\)|=\s*([A-Za-z_][\w.]*):([A-Za-z_]\w*))?"
                    r"\s*(?:[,;]|$)", re.S)
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*([^,]*?)\s*(?:,|$)")


def parse_register(text: str) -> list:
    """Parse ``KVGUARD_REGISTER``: ``[(dotted class name, AllocatorSpec or None), ...]``.

    Three forms, comma separated: ``pkg.mod.Class`` (the spec registered already, such as a
    built-in, else the default ``allocate``/``free``), ``pkg.mod.Class(free=free_blocks,
    size=num_blocks, refcounted=true)`` (``AllocatorSpec`` keywords; values are names, whole
    numbers, true/false or none) and ``pkg.mod.Class=pkg.specs:SPEC`` (imports ``pkg.specs``,
    which should be light: it runs at interpreter start).
    """
    from ..spec import AllocatorSpec
    entries, pos, text = [], 0, text.strip()
    while pos < len(text):
        m = _ENTRY.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"KVGUARD_REGISTER: cannot read {text[pos:]!r}; expected "
                             "pkg.mod.Class, pkg.mod.Class(keyword=value, ...) or "
                             "pkg.mod.Class=pkg.module:SPEC")
        pos = m.end()
        name, keywords, module, attr = m.groups()
        if "." not in name:
            raise ValueError(f"KVGUARD_REGISTER: {name!r} is not a dotted class name "
                             "(package.module.Class)")
        spec = None
        if keywords is not None:
            try:
                spec = AllocatorSpec(**_spec_keywords(name, keywords))
            except TypeError as exc:
                raise ValueError(f"KVGUARD_REGISTER: {name}: {exc}") from None
        elif module is not None:
            spec = _import_spec(name, module, attr)
        entries.append((name, spec))
    return entries


def _spec_keywords(name: str, text: str) -> dict:
    from ..spec import AllocatorSpec
    allowed = set(AllocatorSpec.keywords()) - {"skip"}
    out, pos, text = {}, 0, text.strip()
    while pos < len(text):
        m = _KEYWORD.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"KVGUARD_REGISTER: {name}({text}): cannot read {text[pos:]!r}; "
                             "expected keyword=value")
        pos = m.end()
        key, raw = m.groups()
        if key not in allowed:
            hint = (" (a callable: use pkg.mod.Class=pkg.module:SPEC)" if key == "skip" else
                    f"; AllocatorSpec takes {', '.join(sorted(allowed))}")
            raise ValueError(f"KVGUARD_REGISTER: {name}: no keyword {key!r}{hint}")
        out[key] = _value(raw)
    return out


def _value(raw: str):
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    if re.fullmatch(r"-?\d+", raw):
        return int(raw)
    return raw


def _import_spec(name: str, module: str, attr: str):
    import importlib

    from ..spec import AllocatorSpec
    try:
        spec = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"KVGUARD_REGISTER: {name}={module}:{attr}: {exc}") from None
    if not isinstance(spec, AllocatorSpec):
        raise ValueError(f"KVGUARD_REGISTER: {name}={module}:{attr} is a "
                         f"{type(spec).__name__}, not a kvguard.AllocatorSpec")
    return spec


# --- the JSON-lines sink ----------------------------------------------------------------------

def log_path(template: str, pid: int | None = None) -> str:
    """Where one process writes: ``{pid}``/``{host}`` filled in; a directory gets
    ``kvguard-{pid}.jsonl`` inside it."""
    pid = os.getpid() if pid is None else pid
    if template.endswith(("/", os.sep)) or os.path.isdir(template):
        template = os.path.join(template, "kvguard-{pid}.jsonl")
    return template.replace("{pid}", str(pid)).replace("{host}", socket.gethostname())


def guard_info(guard) -> dict:
    """What a JSON line says about the guard: enough for ``kvguard report`` to group by
    allocator and to say when ids were learned lazily rather than seen handed out."""
    adopted = sum(ledger.adopted for ledger in guard.ledgers.values())
    learned = guard.stats.learned
    return {
        "name": guard.name,
        "class": guard.allocator_class,
        "address": guard.address,
        "mode": guard.mode,
        "stacks": guard.stacks,
        "sample": getattr(guard, "sample", 1),
        "learning": guard.learning,
        "learned": learned,
        "seeded": max(adopted - learned, 0),
    }


class JsonLinesSink:
    """A ``kvguard.subscribe`` listener that appends one JSON line per reported violation.

    Each line is one ``os.write`` on an ``O_APPEND`` descriptor, so processes sharing one file
    never interleave within a line. The file is opened at the first line to write, so processes
    that never guard an allocator leave no file. After a fork the child opens its own file (its
    own ``{pid}``) and reports only what happened after the fork.
    """

    def __init__(self, template: str, *, every: int = 100, max_bytes: int = 64 << 20,
                 config: dict | None = None, run: str | None = None) -> None:
        self.template = template
        self.run = run
        self.every = max(1, every)
        self.max_bytes = max_bytes
        self.config = config or {}
        self._tracked = weakref.WeakKeyDictionary()
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._collected: collections.deque = collections.deque()
        self._fd = None
        self._pid = os.getpid()
        self.path = None
        self.written = 0
        self.dropped = 0
        self.failed = False
        self.closed = False
        self._seen: dict = {}
        self._baseline = weakref.WeakKeyDictionary()

    # -- subscribe() callback --

    def __call__(self, guard, violation) -> None:
        try:
            if self._pid != os.getpid():  # forked without the at-fork hook (a C extension)
                self.after_fork_in_child(())
            key = (guard.name, violation.kind, violation.summary())
            with self._lock:
                n = self._seen[key] = self._seen.get(key, 0) + 1
                if n != 1 and n % self.every:
                    return
                if self.written >= self.max_bytes:
                    self.dropped += 1
                    return
                record = {"kvguard": FORMAT_VERSION, "event": "violation", "time": time.time(),
                          "pid": os.getpid(), "host": socket.gethostname(), "occurrence": n,
                          "guard": guard_info(guard), "violation": violation.to_dict()}
                self._write(record)
                self._write_collected()
        except Exception as exc:  # never into the guarded call
            self._fail(exc)

    # -- guards collected before exit --

    def track(self, guard) -> None:
        """Write ``guard``'s stats line when it is collected, not only at exit: the guard of a
        short-lived allocator would otherwise take what it checked with it. Each guard gets
        one line: from here, or from ``close()`` if it is alive then."""
        if guard in self._tracked:
            return
        remains = _Remains(guard)
        finalizer = weakref.finalize(guard, self._on_collected, remains)
        finalizer.atexit = False  # alive at exit: close() writes it
        self._tracked[guard] = (remains, finalizer)

    def _on_collected(self, remains) -> None:
        """The finalizer: it may run inside this sink's own call (garbage collection strikes
        anywhere), so it writes only if the lock is free and otherwise leaves the line to the
        lock's holder (the next violation or ``close()`` at the latest)."""
        try:
            if self.closed or self._pid != os.getpid():
                return
            self._collected.append(remains)
            if self._lock.acquire(blocking=False):
                try:
                    self._write_collected()
                finally:
                    self._lock.release()
        except Exception as exc:
            self._fail(exc)

    def _write_collected(self) -> None:
        while self._collected and not self.closed:
            remains = self._collected.popleft()
            self._write_stats(remains, remains.baseline)

    # -- lifecycle --

    def after_fork_in_child(self, guards) -> None:
        """A forked child writes its own file and counts only its own calls."""
        fd = self._fd
        self._reset()
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        for guard in guards:
            self._baseline[guard] = guard.stats.to_dict()
            tracked = self._tracked.get(guard)
            if tracked is not None:
                tracked[0].baseline = self._baseline[guard]

    def close(self, guards=()) -> None:
        """Write one ``stats`` line per guard (what it checked, learned and found since this
        process started or forked), then close the file. Once per process."""
        try:
            with self._lock:
                if self.closed or self._pid != os.getpid():
                    return
                self._write_collected()
                self.closed = True
                for _, finalizer in list(self._tracked.values()):
                    finalizer.detach()
                for guard in guards:
                    self._write_stats(guard, self._baseline.get(guard))
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
        except Exception as exc:
            self._fail(exc)

    def _write_stats(self, guard, baseline) -> None:
        """One guard's ``stats`` line (``guard``: a Guard, or the _Remains of a collected one);
        none for a guard that did nothing."""
        stats = _minus(guard.stats.to_dict(), baseline)
        if not any(v for k, v in stats.items() if k != "violations") and \
                not stats["violations"]:
            return
        self._write({"kvguard": FORMAT_VERSION, "event": "stats", "time": time.time(),
                     "pid": os.getpid(), "host": socket.gethostname(),
                     "guard": guard_info(guard), "stats": stats, "dropped": self.dropped},
                    force=True)

    def _write(self, record: dict, force: bool = False) -> None:
        if self.failed:
            return
        if self._fd is None:
            self._open()
        data = (json.dumps(record, default=repr) + "\n").encode()
        os.write(self._fd, data)
        self.written += len(data)

    def _open(self) -> None:
        self.path = log_path(self.template)
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        from .. import __version__
        start = {"kvguard": FORMAT_VERSION, "event": "start", "time": time.time(),
                 "pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname(),
                 "argv": list(getattr(sys, "argv", ())), "python": sys.version.split()[0],
                 "version": __version__, "config": self.config}
        if self.run is not None:
            start["run"] = self.run
        data = (json.dumps(start, default=repr) + "\n").encode()
        os.write(self._fd, data)
        self.written += len(data)

    def _fail(self, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            from ..logger import emit
            emit(logging.ERROR, "kvguard: cannot write violation reports to %s (staging goes "
                 "on without its JSON lines): %r", self.path or self.template, exc)


class _Remains:
    """What a guard's stats line needs, kept past the guard's collection: the same attributes
    ``guard_info`` reads, the live counters and ledgers (not the guard, which would never be
    collected then), and the counters at the last fork."""

    def __init__(self, guard) -> None:
        self.name = guard.name
        self.allocator_class = guard.allocator_class
        self.address = guard.address
        self.mode = guard.mode
        self.stacks = guard.stacks
        self.sample = getattr(guard, "sample", 1)
        self.learning = guard.learning
        self.ledgers = guard.ledgers
        self.stats = guard.stats
        self.baseline = None


def _minus(now: dict, before: dict | None) -> dict:
    if not before:
        return now
    out = {k: v - before.get(k, 0) for k, v in now.items() if k != "violations"}
    old = before.get("violations", {})
    out["violations"] = {k: v - old.get(k, 0) for k, v in now["violations"].items()
                         if v - old.get(k, 0)}
    return out


# --- turning it on ----------------------------------------------------------------------------

class Staging:
    """What ``start()`` turned on, so that ``stop()`` can turn it off again."""

    def __init__(self, config: StagingConfig) -> None:
        self.config = config
        self.sink = None
        self.metrics = None
        self._unsubscribe = None
        self._untrack = None

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
            self._untrack = on_attach(self.sink.track)
            for guard in guards():
                self.sink.track(guard)
        registry.instrument(**self.config.guard_options())
        if self.config.metrics:
            from . import metrics
            self.metrics = metrics.install(self.config.metrics_interval)
        atexit.register(self.close)

    def close(self) -> None:
        """Write the final stats lines and metrics (at exit, or at ``stop()``)."""
        if self.sink is not None:
            from ..guard import guards
            self.sink.close(guards())
        if self.metrics is not None:
            self.metrics.close()

    def stop(self) -> None:
        from .. import registry
        atexit.unregister(self.close)
        self.close()
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._untrack is not None:
            self._untrack()
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


# --- kvguard run ------------------------------------------------------------------------------

def run_command(argv) -> int:
    """``kvguard run [options] -- COMMAND...``: run one command with staging on."""
    import signal
    import subprocess

    from ..cli import Parser, UsageError
    parser = Parser(prog="kvguard run", description=(
        "Run COMMAND with kvguard staging on (KVGUARD=1): every registered allocator in every "
        "Python process it starts is guarded, and each process appends its violations as JSON "
        "lines under --log. Then: kvguard report DIR."),
        epilog="environment variables: " + "; ".join(f"{k}: {v}" for k, v in VARIABLES.items()))
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="log (default): record and forward; repair: forward a sanitized "
                             "call; raise: reject the bad call")
    parser.add_argument("--log", metavar="DIR|FILE.jsonl|TEMPLATE", default=None,
                        help="a directory (default ./kvguard-logs, one file per process), one "
                             "file for all processes, or a path template with {pid}")
    parser.add_argument("--stacks", choices=STACKS, default=None)
    parser.add_argument("--sample", type=int, metavar="N", default=None,
                        help="keep the call site of one call in N")
    parser.add_argument("--history", type=int, metavar="N", default=None,
                        help="operations in each report's flight recorder (default 32)")
    parser.add_argument("--register", action="append", default=[], metavar="ENTRY",
                        help="an allocator class to guard (KVGUARD_REGISTER syntax); repeatable")
    parser.add_argument("command", nargs="...", help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("kvguard run: error: no command given (kvguard run -- python "
                         "serve.py ...)")
    env = dict(os.environ)
    env["KVGUARD"] = "1"
    env["KVGUARD_RUN"] = run = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    log = args.log or env.get("KVGUARD_LOG") or "kvguard-logs"
    if "{pid}" not in log and not log.endswith(".jsonl"):
        log = os.path.join(log, "kvguard-{pid}.jsonl")
    env["KVGUARD_LOG"] = os.path.abspath(log)
    for name, value in (("KVGUARD_MODE", args.mode), ("KVGUARD_STACKS", args.stacks),
                        ("KVGUARD_SAMPLE", args.sample), ("KVGUARD_HISTORY", args.history)):
        if value is not None:
            env[name] = str(value)
    if args.register:
        env["KVGUARD_REGISTER"] = ",".join(filter(None, [env.get("KVGUARD_REGISTER", "")]
                                                  + args.register))
    try:
        config_from_env(env)
    except ValueError as exc:
        raise UsageError(f"kvguard run: error: {exc}") from None
    started = time.time()
    # Ctrl-C reaches the whole foreground process group: the command gets it from the terminal
    # (a second copy from here would look like a double Ctrl-C). A supervisor's SIGTERM or
    # SIGHUP comes to this process alone: pass it on. The handlers go in before the command
    # starts, so a signal that comes while it is starting is held and passed on, never lost
    # with this process (which would leave the command running on its own).
    child = None
    held = []

    def forward(signum, _frame):
        if child is None:
            held.append(signum)
        else:
            child.send_signal(signum)

    previous = {}

    def install(sig, handler):
        try:
            previous.setdefault(sig, signal.signal(sig, handler))
        except (OSError, ValueError):
            pass

    install(signal.SIGTERM, forward)
    install(signal.SIGHUP, forward)
    try:
        try:
            child = subprocess.Popen(command, env=env)
        except OSError as exc:
            print(f"kvguard run: error: cannot run {command[0]!r}: {exc.strerror or exc}",
                  file=sys.stderr)
            return 127
        install(signal.SIGINT, signal.SIG_IGN)  # after the start: an ignored signal is inherited
        for signum in held:
            child.send_signal(signum)
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        _run_summary(env["KVGUARD_LOG"], started, run, code)
    except Exception as exc:  # the summary is a courtesy: the command's status is what counts
        print(f"kvguard: no summary of this run: {exc!r}", file=sys.stderr)
    return code if code >= 0 else 128 - code


def _exit_text(code: int) -> str:
    if code < 0:
        import signal
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _run_summary(template: str, since: float, run: str, code: int = 0) -> None:
    """One line on stderr after the command: what the processes it ran reported (only those:
    the directory may hold earlier runs' files, or one file shared by every run)."""
    from .summary import collect_files, load, of_run, summarize
    if "{pid}" in template or "{host}" in template:
        where = os.path.dirname(template)
        try:
            files = [f for f in collect_files([where]) if os.path.getmtime(f) >= since - 1]
        except (OSError, ValueError):
            files = []
    else:
        where = template
        files = [template] if os.path.isfile(template) else []
    records = of_run(load(files), run) if files else None
    if records is None or not records.starts:
        if code:
            # The command failed before any guarded allocator wrote a line: its own error
            # (above, on its stderr) is the news, not kvguard's silence.
            print(f"kvguard: the command {_exit_text(code)} and reported nothing under {where}: "
                  "see its own error output above", file=sys.stderr)
        else:
            print(f"kvguard: nothing reported under {where}: no registered allocator was used, "
                  "or the command's Python does not have kvguard installed", file=sys.stderr)
        return
    summary = summarize(records)
    n = summary["violations"]
    found = f"{n} violation(s)" if n else "no violations"
    print(f"kvguard: {found} in {len(summary['processes'])} guarded process(es); see: "
          f"kvguard report {where}", file=sys.stderr)
