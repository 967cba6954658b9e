"""The guard: instruments one allocator in place and checks every call against its ledger.

The allocator keeps working for its callers: its methods are shadowed by wrappers that check,
forward and record under one lock (``shadowing``). Calls engines make all day take an inlined
fast path; anything unusual takes the careful path (``careful``), which reads the ids exactly
(``kvguard.ids``), checks them against the ledger (``checker``), acts per ``on_violation``
(``decisions``), and commits what the allocator did (``bookkeeping``). Reports are assembled by
``evidence``; counters, listeners and the throttled log live in ``telemetry``; ``quarantine``
holds freed blocks back; ``baseline`` is what ``check()`` compares against; ``roles`` guards an
engine's extra methods. ``front`` is the public ``Guard`` and its hook protocol.

``on_violation``: ``raise`` rejects a bad call before the allocator sees it; ``log`` records and
forwards the call untouched, and nothing the guard does, its own bugs included, raises into the
caller; ``repair`` records and forwards a sanitized call (plain ints, each once, only live ids).
"""

from __future__ import annotations

from ..logger import EMISSIONS, emit
from ..marks import guard_of
from .decisions import MODES, step_aside_when
from .front import LIMIT, Guard, guard
from .instances import engine_method, guards
from .telemetry import Stats, on_attach, subscribe

__all__ = ["EMISSIONS", "LIMIT", "MODES", "Guard", "Stats", "emit", "engine_method", "guard",
           "guard_of", "guards", "on_attach", "step_aside_when", "subscribe"]
