"""The conformance face: does the allocator itself keep the contract?

- ``clauses``: the contract as named clauses, and the values a run is made of;
- ``probes``: the calls a correct allocator must reject (or survive);
- ``run``: one call sequence run against the clauses; ``judge``: whether its break counts;
  ``shrink``: the shrinker;
- ``search``: ``check_allocator``, the hypothesis search (public as ``kvguard.testing``);
- ``harm``: after a break, driving on until the corruption shows;
- ``findings``: a broken clause made a finding, its regression test run before it is shown;
- ``report``: the findings, one per bug, as text, a dict and JUnit XML;
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
from .judge import judge
from .run import Run
from .shrink import shrink

__all__ = ["CLAUSES", "PROBES", "PROBE_CLAUSES", "VALID_CLAUSES", "Broken", "Clause", "Driver",
           "Run", "Step", "applicable", "judge", "shrink"]
