"""The conformance face: does the allocator itself keep the contract?

- ``clauses``: the contract as named clauses, and the values a run is made of;
- ``probes``: the calls a correct allocator must reject (or survive);
- ``run``: a judge that runs one call sequence against the clauses, and the shrinker;
- ``search``: ``check_allocator``, the hypothesis search (public as ``kvguard.testing``);
- ``regression``: a broken clause's calls written as a pytest regression test;
- ``fuzz``: ``kvguard fuzz`` and the built-in factories of engine classes;
- ``replay_emit``: ``kvguard replay --emit-test``, a staging log's calls as a regression test.

It imports the core, never the staging or cache faces. Everything here is plain Python; torch
and numpy are touched only when a probe needs one of their values.
"""

from .clauses import (
    CLAUSES, PROBE_CLAUSES, VALID_CLAUSES, Broken, Clause, Driver, Step, applicable,
)
from .probes import PROBES
from .run import Run, judge, shrink

__all__ = ["CLAUSES", "PROBES", "PROBE_CLAUSES", "VALID_CLAUSES", "Broken", "Clause", "Driver",
           "Run", "Step", "applicable", "judge", "shrink"]
