"""Staging on a Ray cluster: every worker guarded, one report, one metrics view.

Ray starts its workers from the raylet of each node, not from the driver, so a ``KVGUARD*``
setting in the driver's environment reaches them only through a ``runtime_env``.
``runtime_env()`` builds one that carries every such setting of the driver, with a log template
that every node resolves the same way (absolute, one file per host and process), for
``ray.init(runtime_env=...)`` or an actor's ``.options(runtime_env=...)``. ``kvguard run`` names
``runtime_env_hook`` in Ray's ``RAY_RUNTIME_ENV_HOOK``, so that a program's own ``ray.init()``
gets it with no code change, on a cluster the run started or one it did not.

``ray`` is imported by none of this at import time, and staging imports this module only in a
process that has imported ``ray`` already.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping

logger = logging.getLogger("kvguard")

__all__ = ["PREVIOUS_HOOK", "runtime_env", "runtime_env_hook", "worker_log_template"]

PREVIOUS_HOOK = "KVGUARD_RAY_HOOK"
"""Where ``kvguard run`` keeps a ``RAY_RUNTIME_ENV_HOOK`` the environment had already: the
kvguard hook calls it first, so that both apply."""

DEFAULT_LOG = "kvguard-logs"


def worker_log_template(template: str, cwd: str | None = None) -> str:
    """``KVGUARD_LOG`` as every node reads it the same way: absolute (a relative path would
    resolve against the directory each raylet was started in), and for a directory or a
    per-process template, one file per host and process (pids repeat across hosts)."""
    template = os.path.expanduser(template.strip())
    if not os.path.isabs(template):
        template = os.path.join(cwd or os.getcwd(), template)
    template = os.path.normpath(template) + (os.sep if template.endswith(("/", os.sep)) else "")
    if "{pid}" not in template and not template.endswith(".jsonl"):
        return os.path.join(template, "kvguard-{host}-{pid}.jsonl")
    if "{pid}" in template and "{host}" not in template:
        head, tail = os.path.split(template)
        if "{pid}" in tail:
            return os.path.join(head, tail.replace("{pid}", "{host}-{pid}", 1))
        return template.replace("{pid}", "{host}-{pid}", 1)
    return template


def runtime_env(base: Mapping | None = None, *, log: str | None = None,
                environ: Mapping | None = None) -> dict:
    """A Ray ``runtime_env`` that stages every worker started with it as this process is staged.

    ``env_vars`` gets every ``KVGUARD*`` variable of ``environ`` (default: this process's
    environment), ``KVGUARD=1`` unless it says otherwise, and ``KVGUARD_LOG`` (``log``, else the
    environment's, else ``./kvguard-logs``) as an absolute template with ``{host}`` and
    ``{pid}``. ``base``, a runtime_env of your own, is merged, not changed: its other fields are
    kept, and a ``KVGUARD*`` variable it sets itself wins over the environment's. A bad setting
    is a ``ValueError`` naming the variable, here rather than in every worker."""
    from .staging import config_from_env
    if base is not None and not isinstance(base, Mapping):
        raise TypeError(f"runtime_env: expected a dict (a Ray runtime_env) or None, got "
                        f"{type(base).__name__}")
    environ = os.environ if environ is None else environ
    own = (base or {}).get("env_vars") or {}
    if not isinstance(own, Mapping):
        raise TypeError(f"runtime_env: env_vars is a {type(own).__name__}, not a dict")
    settings = {"KVGUARD": "1"}
    settings.update((k, v) for k, v in environ.items() if k.startswith("KVGUARD"))
    settings.update((k, v) for k, v in own.items() if k.startswith("KVGUARD"))
    for name, value in settings.items():
        if not isinstance(value, str):
            raise TypeError(f"runtime_env: {name}={value!r}: Ray takes environment variables "
                            "as strings")
    settings["KVGUARD_LOG"] = worker_log_template(
        log or settings.get("KVGUARD_LOG", "").strip() or DEFAULT_LOG)
    config_from_env(settings)  # ValueError: KVGUARD_MODE='loud': expected one of ...
    merged = dict(base or {})
    merged["env_vars"] = {**own, **settings}
    return merged


def runtime_env_hook(runtime_env_of_init):
    """Ray's ``RAY_RUNTIME_ENV_HOOK``: called by ``ray.init()`` with its ``runtime_env`` (or
    None), returns it with this process's staging settings merged in (``runtime_env()``).
    ``kvguard run`` sets it up. A hook the environment named before (``KVGUARD_RAY_HOOK``) runs
    first. A bad setting leaves the workers unstaged with one error line, never a failed
    ``ray.init()``."""
    previous = os.environ.get(PREVIOUS_HOOK, "").strip()
    if previous:
        runtime_env_of_init = _load(previous)(runtime_env_of_init)
    try:
        return runtime_env(runtime_env_of_init)
    except (TypeError, ValueError) as exc:
        logger.error("kvguard: Ray workers not staged: %s", exc)
        return runtime_env_of_init


def _load(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)
