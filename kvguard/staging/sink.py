"""The JSON-lines sink: each violation staging reports, appended as one line to a file per
process, with a ``start`` line first and one ``stats`` line per guard at the end.

The sink writes the first occurrence of each (kind, call site) and then one in
``KVGUARD_LOG_EVERY``, stops at ``KVGUARD_LOG_MAX_MB``, and swallows its own I/O errors: staging
must never hurt the serving path. It writes inside the guarded call, under the guard's lock, so
it never waits: the file is opened non-blocking (a FIFO with no reader), and a line that cannot
be written at once (a full pipe, a full disk) is dropped and counted (``dropped``, in each
``stats`` line). A regular file's write is one ``os.write``; POSIX has no non-blocking write to
a regular file, so a disk that stalls every write (a hung network mount) still stalls it.
"""

from __future__ import annotations

import collections
import errno
import functools
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref

from .records import FORMAT_VERSION

_OPEN_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_NOCTTY", 0))
_DROP_ERRORS = frozenset(getattr(errno, name) for name in (
    "EAGAIN", "EWOULDBLOCK", "EPIPE", "ENXIO", "ENOSPC", "EDQUOT", "EFBIG", "EIO")
    if hasattr(errno, name))
"""A write that fails with one of these drops its line (counted in ``dropped``): the pipe is
full or has no reader, or the disk is full. Anything else stops the sink with one error."""


def names_directory(template: str) -> bool:
    """Whether ``KVGUARD_LOG`` (or ``kvguard run --log``) names a directory: it ends with a
    separator, is an existing directory, or its last part has no suffix and no ``{pid}`` or
    ``{host}`` (``logs`` is a directory, ``logs.jsonl`` and ``logs/{pid}`` are files)."""
    if template.endswith(("/", os.sep)) or os.path.isdir(template):
        return True
    last = os.path.basename(template)
    return "{pid}" not in last and "{host}" not in last and not os.path.splitext(last)[1]


def log_path(template: str, pid: int | None = None) -> str:
    """Where one process writes: ``{pid}``/``{host}`` filled in; a directory (see
    ``names_directory``) gets ``kvguard-{pid}.jsonl`` inside it."""
    pid = os.getpid() if pid is None else pid
    if names_directory(template):
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
        self.keep_idle_guards = False
        """Write a stats line for a guard that checked nothing too (a Ray worker's file says
        by its final line that the worker ended, not killed)."""
        self._tracked = weakref.WeakKeyDictionary()
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._take_now = _taker(self._lock, False)
        self._take_waiting = _taker(self._lock, True)
        self._collected: collections.deque = collections.deque()
        self._fd = None
        self._started = False
        """Whether the open file has this process's ``start`` line: no other line goes before
        it (a start line dropped by a full pipe is written again before the next line)."""
        self._pid = os.getpid()
        self.path = None
        self.written = 0
        self.dropped = 0
        self.failed = False
        self.closed = False
        self._no_reader_said = False
        self._seen: dict = {}
        self._baseline = weakref.WeakKeyDictionary()
        self._checkpointed = weakref.WeakKeyDictionary()

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
                _add_ray_context(record)
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
        """The finalizer: run inside this sink's own call maybe (a collection), it writes only
        if the lock is free, else leaves it to the lock's holder (or ``close()``)."""
        try:
            if self.closed or self._pid != os.getpid():
                return
            self._collected.append(remains)
            with self._take_now as got:  # no bytecode between taking the lock and the try
                try:
                    got and self._write_collected()
                finally:
                    got and self._lock.release()
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

    def close(self, guards=(), wait: bool = True) -> None:
        """Write one ``stats`` line per guard (what it checked, learned and found since this
        process started or forked), then close the file. Once per process. Without ``wait``
        (a signal handler, which may have interrupted this very sink) nothing is written if
        another call holds the sink."""
        try:
            with self._take_waiting if wait else self._take_now as got:
                try:
                    if not got or self.closed or self._pid != os.getpid():
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
                        self._started = False
                finally:
                    got and self._lock.release()
        except Exception as exc:
            self._fail(exc)

    def checkpoint(self, guards) -> None:
        """A ``stats`` line marked ``"final": false`` for each guard whose counters moved since
        its last one: what a process that is killed outright (a Ray worker at the end of its
        job) leaves instead of its final line."""
        try:
            with self._lock:
                if self.closed or self._pid != os.getpid() or self.failed:
                    return
                for guard in guards:
                    stats = guard.stats.to_dict()
                    if self._checkpointed.get(guard) != stats:
                        self._checkpointed[guard] = stats
                        self._write_stats(guard, self._baseline.get(guard), final=False)
        except Exception as exc:
            self._fail(exc)

    def _write_stats(self, guard, baseline, final: bool = True) -> None:
        """One guard's ``stats`` line (``guard``: a Guard, or the _Remains of a collected one);
        none for a guard that did nothing (unless ``keep_idle_guards``). Not ``final``: a
        checkpoint, marked so."""
        stats = _minus(guard.stats.to_dict(), baseline)
        if not any(v for k, v in stats.items() if k != "violations") and \
                not stats["violations"] and not self.keep_idle_guards:
            return
        record = {"kvguard": FORMAT_VERSION, "event": "stats", "time": time.time(),
                  "pid": os.getpid(), "host": socket.gethostname(),
                  "guard": guard_info(guard), "stats": stats, "dropped": self.dropped}
        if not final:
            record["final"] = False
        _add_ray_context(record, live=False)  # ask Ray nothing while it may be ending us
        self._write(record, force=True)

    def _write(self, record: dict, force: bool = False) -> None:
        if self.failed:
            return
        if not self._started and not self._open(record.get("time")):
            self.dropped += 1
            return
        self._put((json.dumps(record, default=repr) + "\n").encode())

    def open_now(self) -> None:
        """Write the ``start`` line now rather than at the first line to write: a process that
        may be killed outright (a Ray worker) is then known to have run."""
        try:
            with self._lock:
                if not self._started and not self.failed and not self.closed:
                    self._open()
        except Exception as exc:
            self._fail(exc)

    def _put(self, data: bytes) -> bool:
        """One line, written at once or dropped and counted: never waited for. This runs
        inside the guarded call, under the guard's lock: a full pipe, a reader gone, a full
        disk cost the line, not the engine's time."""
        try:
            os.write(self._fd, data)
        except OSError as exc:
            if exc.errno not in _DROP_ERRORS:
                raise
            self.dropped += 1
            if exc.errno in (errno.EPIPE, errno.ENXIO):  # a FIFO's reader left: open again
                self._close_fd()                         # at the next line
            return False
        self.written += len(data)
        return True

    def _open(self, first: float | None = None) -> bool:
        """Open the file (non-blocking: a FIFO with no reader is an error at once, not a
        wait) unless it is open, and write the ``start`` line; False when there is nobody to
        read it yet, or it was dropped. The start line is stamped no later than ``first``, the
        time of the line it goes before (stamped before this was called): sorted by time, as
        a log store shows them, a process's lines still begin with its start."""
        if self._fd is None:
            self.path = log_path(self.template)
            directory = os.path.dirname(self.path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            try:
                self._fd = os.open(self.path, _OPEN_FLAGS, 0o644)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                if not self._no_reader_said:
                    self._no_reader_said = True
                    from ..logger import emit
                    emit(logging.WARNING, "kvguard: %s is a FIFO with no reader: violation "
                         "records are dropped (and counted) until one opens it", self.path)
                return False
        from .. import __version__
        now = time.time()
        if type(first) is float and first < now:
            now = first
        start = {"kvguard": FORMAT_VERSION, "event": "start", "time": now,
                 "pid": os.getpid(), "ppid": os.getppid(), "host": socket.gethostname(),
                 "argv": list(getattr(sys, "argv", ())), "python": sys.version.split()[0],
                 "version": __version__, "config": self.config}
        if self.run is not None:
            start["run"] = self.run
        _add_ray_context(start)
        self._started = self._put((json.dumps(start, default=repr) + "\n").encode())
        return self._started

    def _close_fd(self) -> None:
        self._started = False
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _fail(self, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            from ..logger import emit
            emit(logging.ERROR, "kvguard: cannot write violation reports to %s (staging goes "
                 "on without its JSON lines): %r", self.path or self.template, exc)


def _add_ray_context(record: dict, live: bool = True) -> None:
    """The Ray worker (node, job, actor, and with ``live`` the running task) a record comes
    from, in a process that has imported Ray; nothing is imported, nor read, in one that has
    not."""
    if "ray" in sys.modules:
        from .rayworker import context
        found = context(live)
        if found:
            record["ray"] = found


def _taker(lock, blocking: bool):
    """``with taker as got:`` takes ``lock`` (waiting if ``blocking``), the block lets it go.
    ``__enter__`` is the C ``acquire`` itself (a partial, called as is): no signal handler runs
    between it and the block's ``try``, as one did after ``if lock.acquire(blocking=False):``."""
    return type("_Take", (), {"__enter__": functools.partial(lock.acquire, blocking),
                              "__exit__": lambda self, *exc: False})()


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


class OneLineReports(logging.Filter):
    """On the ``kvguard`` logger while a sink is writing: a logged violation becomes one line,
    its headline and SUMMARY with the file that holds its full report. The report is in the
    JSON lines already; the full text on stderr as well made 812 lines in 5 s on a real
    engine. Records of anything else pass unchanged."""

    def __init__(self, sink: JsonLinesSink) -> None:
        super().__init__()
        self.sink = sink

    def filter(self, record: logging.LogRecord) -> bool:
        violation = getattr(record, "kvguard_violation", None)
        if violation is not None:
            try:
                where = self.sink.path or log_path(self.sink.template)
                record.msg = "kvguard: %s; %s (full report in %s)"
                record.args = (violation.headline(), violation.summary(), where)
            except Exception:  # keep the full report rather than lose the line
                pass
        return True
