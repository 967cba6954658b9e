"""Staging's settings: the ``KVGUARD_*`` environment variables, read and checked.

A bad value raises ``ValueError`` naming the variable and what it accepts; ``start()`` turns
that into one error line and an unguarded process. ``KVGUARD_REGISTER`` names allocator classes
in the spec language (``pkg.mod.Class(free=free_blocks, size=num_blocks)``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

MODES = ("log", "raise", "repair")
STACKS = ("off", "cheap", "full")

VARIABLES = {
    "KVGUARD": "1 turns staging on at interpreter start (0, off, false or empty: off)",
    "KVGUARD_MODE": "log (default: record, never raise), repair (forward a sanitized call) or "
                    "raise",
    "KVGUARD_LOG": "where each process appends its JSON lines: a path template with {pid} "
                   "(and {host}), a directory (a path ending in /, an existing directory, or "
                   "a name with no suffix: kvguard-{pid}.jsonl inside), or one file shared by "
                   "all processes (a name with a suffix: all.jsonl); unset: the kvguard logger "
                   "only",
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
                                "default 5) and, in a Ray worker, of Ray's metrics and of the "
                                "checkpoints of its counts",
    "KVGUARD_RAY_HOOK": "set by kvguard run: a RAY_RUNTIME_ENV_HOOK the environment had "
                        "before, run before kvguard's own",
}
"""Every environment variable staging reads, with its meaning (``kvguard run --help`` too)."""


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

def parse_register(text: str) -> list:
    """Parse ``KVGUARD_REGISTER``: ``[(dotted class name, AllocatorSpec or None), ...]``, in the
    one spec language (``kvguard.specgrammar``): entries separated by commas, semicolons or
    new lines, each ``pkg.mod.Class`` (the spec registered already, such as a built-in, else
    the default ``allocate``/``free``), ``pkg.mod.Class(free=free_blocks, size=num_blocks,
    refcounted=true)`` or ``pkg.mod.Class=pkg.specs:SPEC`` (imports ``pkg.specs``, which should
    be light: it runs at interpreter start)."""
    from ..specgrammar import SpecSyntaxError, parse_entries
    try:
        return parse_entries(text)
    except SpecSyntaxError as exc:
        raise ValueError(f"KVGUARD_REGISTER: {exc}") from None
