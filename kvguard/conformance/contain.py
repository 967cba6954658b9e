"""Containment: the fuzzers run the allocator's code, and that code may hang, exit or fork.

``contained(fn, hang=..., deadline=...)`` runs one piece of fuzzing (a clause's search, the
set-up, a lifecycle search) and turns what the allocator does to the process into an
``Escape`` the report shows, never into the end of the run:

- **a hang**: a call sequence (marked by ``note()``, once per fresh allocator) that runs longer
  than ``hang`` seconds, or any call still running at ``deadline`` (the clause's share of the
  budget plus ``GRACE``), is interrupted;
- **a BaseException** the allocator raises (``SystemExit`` from ``sys.exit(0)``,
  ``KeyboardInterrupt``, ``GeneratorExit``, any other class outside ``Exception``);
- **a fork**: a child forked inside the allocator is stopped at once (``os._exit`` in the
  child's at-fork hook, before it runs a line of the fuzzer), and the parent reports it.

A real Ctrl-C is told apart from a ``KeyboardInterrupt`` the allocator raises: while a block
runs, SIGINT raises ``UserInterrupt`` (and sets a flag an allocator that swallows it cannot
clear); where kvguard cannot own SIGINT (another handler, another thread), a
``KeyboardInterrupt`` counts as the allocator's only when a ``raise`` in the allocator's own
code threw it. The user's Ctrl-C always goes on up, with what finished.

Why in-process, with a signal: the factories, drivers and allocators the fuzzer is given are
live objects (lambdas, classes defined in a test), which a subprocess could only get by
``fork``, and forking a process that holds torch's or the host's threads is not safe. On the
main thread a repeating ``ITIMER_REAL`` timer (SIGALRM) interrupts Python code wherever it is
(a loop, ``time.sleep``, a lock wait, a C call that returns on EINTR), and interrupts it again
if the allocator swallows the first. Where that cannot be used (not the main thread, no
``setitimer``, or SIGALRM already taken by the host, such as pytest-timeout's signal method),
the block runs in a daemon thread the caller waits for: a hang is then reported and the thread
abandoned, still running. Not contained either way: a C call that never returns to Python
while holding the GIL, and ``os._exit`` (the process is gone before any code can report).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from .escaped import (
    USER, Escape, Interrupted, UserInterrupt, classify, entry, frames_of, merge,
    raised_by_allocator, stack, where,
)

__all__ = ["DEFAULT_HANG", "GRACE", "Cutoff", "Escape", "Interrupted", "UserInterrupt",
           "contained", "interrupted", "merge", "note"]

DEFAULT_HANG = 10.0
"""Seconds one call sequence (a fresh allocator and up to a dozen calls) may run."""
GRACE = 2.0
"""Past its soft deadline (where the search stops between two examples), a block may finish
what it started (shrinking, the harm, the test check) for this long before it is interrupted."""
_SWALLOWED = {"__del__", "gc_callback", "_remove", "callback"}
"""Functions (finalizers, the collector's and weakrefs' callbacks) whose exceptions Python
prints and drops: the timer never raises in them."""


@dataclass
class _Limit:
    hang: float
    deadline: float | None
    thread: int
    pid: int
    mark: float = 0.0
    run: object = None
    forked: str | None = None
    done: bool = False
    tick: float = 0.05
    who: str = "the allocator"


_ACTIVE: dict = {}
"""Thread id -> the limit of the block running on it."""


def note(run=None) -> None:
    """A fresh call sequence starts (``run``: the ``Run`` it is made of, for the report): the
    hang limit counts from here. Free when no block is running."""
    limit = _ACTIVE.get(threading.get_ident())
    if limit is not None:
        limit.mark = time.monotonic()
        limit.run = run


def _after_fork_child() -> None:
    limit = _ACTIVE.get(threading.get_ident())
    if limit is not None and limit.pid != os.getpid() and not limit.done:
        os._exit(0)  # the allocator's child: a second copy of the fuzzer must never run on


def _after_fork_parent() -> None:
    limit = _ACTIVE.get(threading.get_ident())
    if limit is None or limit.done or limit.pid != os.getpid():
        return
    limit.forked = where(stack(sys._getframe(1))) or "the allocator"
    if limit.thread == threading.main_thread().ident and hasattr(signal, "setitimer"):
        try:
            signal.setitimer(signal.ITIMER_REAL, 1e-4, limit.tick)  # stop it at the next tick
        except (ValueError, OSError):
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_child, after_in_parent=_after_fork_parent)


def _signals_usable() -> bool:
    if threading.current_thread() is not threading.main_thread():
        return False
    if not hasattr(signal, "setitimer"):
        return False
    if signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, signal.SIG_IGN, None):
        return False
    return signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


class Cutoff(Exception):
    """The deadline came while the fuzzer's own code ran (not a call of the allocator's)."""


def contained(fn, *, hang: float = DEFAULT_HANG, deadline: float | None = None,
              what: str = "", who: str = "the allocator"):
    """``fn()`` contained: ``(value, None)``, or ``(None, Escape)`` when the allocator hung,
    raised a BaseException or forked. ``Cutoff`` when ``deadline`` came in the fuzzer's own
    code; an ``Exception`` of the fuzzer's goes on up; the user's Ctrl-C goes on up as
    ``UserInterrupt``. ``what`` names the place when it is known (``its factory``), ``who``
    the code run (``the engine``)."""
    limit = _Limit(hang, deadline, 0, os.getpid(), time.monotonic(), who=who)
    limit.tick = max(0.01, min(0.25, hang / 10))
    USER["interrupted"] = False
    if _signals_usable():
        return _with_signals(fn, limit, what)
    return _with_thread(fn, limit, what)


def _expired(limit: _Limit):
    now = time.monotonic()
    if limit.forked:
        return "fork"
    if now - limit.mark > limit.hang:
        return "hang"
    if limit.deadline is not None and now > limit.deadline:
        return "deadline"
    return None


def _with_signals(fn, limit: _Limit, what: str):
    limit.thread = threading.get_ident()

    def on_alarm(signum, frame):
        if frame is not None and frame.f_code.co_name in _SWALLOWED:
            return  # raised there it would be printed and ignored: the next tick does it
        if limit.done:
            return
        if USER["interrupted"]:
            raise UserInterrupt()  # again: the first was swallowed (a finalizer, the allocator)
        reason = _expired(limit)
        if reason == "hang" and entry(stack(frame)) is None:
            return  # the fuzzer's own work is slow (an import): not the allocator's hang
        if reason is not None:
            raise Interrupted(reason)

    def on_sigint(signum, frame):
        USER["interrupted"] = True
        raise UserInterrupt()

    old_alarm = signal.getsignal(signal.SIGALRM)
    old_int = signal.getsignal(signal.SIGINT)
    own_int = old_int is signal.default_int_handler
    try:  # a Ctrl-C may land anywhere here: the finally puts every handler back
        signal.signal(signal.SIGALRM, on_alarm)
        if own_int:
            signal.signal(signal.SIGINT, on_sigint)
        _ACTIVE[limit.thread] = limit
        signal.setitimer(signal.ITIMER_REAL, limit.tick, limit.tick)
        try:
            value = fn()
            limit.done = True
        except BaseException as exc:
            limit.done = True
            outcome = _caught(exc, limit, frames_of(exc.__traceback__), what)
        else:
            outcome = (value, classify(Interrupted("fork"), limit, [], what)
                       if limit.forked else None)
    finally:
        limit.done = True
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        _ACTIVE.pop(limit.thread, None)
        signal.signal(signal.SIGALRM, old_alarm)
        if own_int:
            signal.signal(signal.SIGINT, old_int)
    if USER["interrupted"]:
        raise UserInterrupt()
    return outcome


def _caught(exc: BaseException, limit: _Limit, frames: list, what: str):
    if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, UserInterrupt) and \
            not raised_by_allocator(exc):
        raise UserInterrupt() from exc
    if isinstance(exc, UserInterrupt):
        raise exc
    if isinstance(exc, Exception) and not limit.forked:
        raise exc
    escape = classify(exc, limit, frames, what)
    if escape is None:
        raise Cutoff("the time for this search ran out") from None
    return None, escape


def _with_thread(fn, limit: _Limit, what: str):
    """The fallback: ``fn`` in a daemon thread, waited for; a hang is reported and the thread
    abandoned (it cannot be interrupted from here)."""
    box: dict = {}

    def body():
        limit.thread = threading.get_ident()
        _ACTIVE[limit.thread] = limit
        try:
            box["value"] = fn()
        except BaseException as exc:  # carried to the waiting thread
            box["error"] = exc
        finally:
            limit.done = True
            _ACTIVE.pop(limit.thread, None)

    worker = threading.Thread(target=body, name="kvguard-contained", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(limit.tick)
            reason = _expired(limit) if worker.is_alive() else None
            if reason is not None and reason != "fork":
                frames = stack(sys._current_frames().get(worker.ident))
                if reason == "hang" and entry(frames) is None:
                    continue  # the fuzzer's own work is slow: not the allocator's hang
                limit.done = True  # abandoned: its late fork or note() is no longer ours
                escape = classify(Interrupted(reason), limit, frames, what)
                if escape is None:
                    raise Cutoff("the time for this search ran out")
                escape.text += " (left running in a thread: not on the main thread, it " \
                               "could not be interrupted)"
                return None, escape
    except KeyboardInterrupt as exc:  # the waiting thread runs no allocator code: the user's
        limit.done = True
        raise UserInterrupt() from exc
    if "error" in box:
        exc = box["error"]
        return _caught(exc, limit, frames_of(exc.__traceback__), what)
    if limit.forked:
        return box.get("value"), classify(Interrupted("fork"), limit, [], what)
    return box.get("value"), None


def interrupted(report, command: str) -> int:
    """The user's Ctrl-C: what finished, then one line; the status a shell gives SIGINT."""
    if report is not None:
        sys.stdout.write(report.render() + "\n")
        sys.stdout.flush()
    said = "the report above holds what finished" if report is not None else "nothing finished"
    sys.stderr.write(f"kvguard {command}: interrupted (Ctrl-C): {said}\n")
    return 130
