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

The face's modules: ``config`` (the environment variables), ``sink`` (the JSON lines),
``lifecycle`` (``start``/``stop``, forks), ``run`` (``kvguard run``), ``records`` and ``logfiles``
(the lines' format and files), ``summary`` and ``report`` (``kvguard report``), ``replay``
(``kvguard replay``), ``metrics`` (prometheus_client) and ``reaper`` (its files of killed processes), and on a Ray cluster ``rayworker`` (in a
worker) and ``raysummary`` (the report's view of it), with ``kvguard.ray`` its public name. It
imports the core, never the conformance or cache faces.
"""

from .config import (
    MODES, STACKS, VARIABLES, StagingConfig, config_from_env, enabled, parse_register,
)
from .records import FORMAT_VERSION
from .sink import JsonLinesSink, guard_info, log_path
from .lifecycle import Staging, active, start, stop
from .run import run_command

__all__ = ["FORMAT_VERSION", "JsonLinesSink", "MODES", "STACKS", "Staging", "StagingConfig",
           "VARIABLES", "active", "config_from_env", "enabled", "guard_info", "log_path",
           "parse_register", "run_command", "start", "stop"]
