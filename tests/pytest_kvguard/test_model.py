"""Model-based: random suites of misbehaving tests, and the plugin's verdict on each.

Each test in a generated suite does one thing (clean work, a swallowed or escaping misuse, an
expected one, a leak, a misuse in its fixture); the model says how pytest must report it under
the drawn mode and leak setting, and what the JSON report must count.
"""

import itertools
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import CONFTEST

# Each misuse is a double free: rejected in raise mode, passed through in log mode, and in
# neither does it leave a block live or disturb the ledger for what follows.
BODIES = {
    "clean": "pool.free(pool.allocate(2))",
    "swallowed": "ids = pool.allocate(1)\n    pool.free(ids)\n    try:\n        pool.free(ids)\n"
                 "    except ValueError:\n        pass",
    "escaping": "ids = pool.allocate(1)\n    pool.free(ids)\n    pool.free(ids)",
    "raises": "ids = pool.allocate(1)\n    pool.free(ids)\n    with pytest.raises(ValueError):\n"
              "        pool.free(ids)",
    "expect": "ids = pool.allocate(1)\n    pool.free(ids)\n"
              "    with kvguard.expect('double-free'):\n        pool.free(ids)",
    "leak": "pool.allocate(3)",
    "bad_fixture": "pass",
}

HEADER = """
import pytest
from kvguard.examples import RefcountedPool


@pytest.fixture
def pool():
    return RefcountedPool(16)   # validates nothing itself: only the guard sees misuse


@pytest.fixture
def bad_fixture(pool):
    ids = pool.allocate(1)
    pool.free(ids)
    try:
        pool.free(ids)
    except ValueError:
        pass
"""


def expected_outcome(kind, mode, leaks):
    """(pytest outcome of the test, its teardown error?, unexpected violations, expected
    ones, leaked blocks)."""
    if kind == "clean":
        return "passed", False, 0, 0, 0
    if kind in ("swallowed", "escaping"):
        return "failed", False, 1, 0, 0
    if kind == "raises":
        # in log mode nothing raises: DID NOT RAISE, and the misuse is unexpected
        return ("passed", False, 0, 1, 0) if mode == "raise" else ("failed", False, 1, 0, 0)
    if kind == "expect":
        return "passed", False, 0, 1, 0
    if kind == "leak":
        return "passed", leaks == "fail", 0, 0, 3
    if kind == "bad_fixture":
        return "error", False, 1, 0, 0
    raise AssertionError(kind)


_serial = itertools.count()


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(kinds=st.lists(st.sampled_from(sorted(BODIES)), min_size=1, max_size=8),
       mode=st.sampled_from(["raise", "log"]), leaks=st.sampled_from(["warn", "fail"]))
def test_verdicts_match_the_model(pytester, kinds, mode, leaks):
    pytester.makeconftest(CONFTEST)
    n = next(_serial)
    source = [HEADER]
    for i, kind in enumerate(kinds):
        args = {"expect": "pool, kvguard", "bad_fixture": "pool, bad_fixture"}.get(kind, "pool")
        source.append(f"\ndef test_{i}_{kind}({args}):\n    {BODIES[kind]}\n")
    pytester.makepyfile(**{f"test_model_{n}": "\n".join(source)})
    report = pytester.path / f"report_{n}.json"
    result = pytester.runpytest(f"test_model_{n}.py", "-p", "kvguard", f"--kvguard-mode={mode}",
                                f"--kvguard-leaks={leaks}", f"--kvguard-report={report}",
                                "-p", "no:randomly")
    outcomes = {}
    for rep in result.reprec.getreports("pytest_runtest_logreport"):
        name = rep.nodeid.split("::")[-1]
        entry = outcomes.setdefault(name, {"outcome": "passed", "teardown_error": False})
        if rep.when == "call":
            entry["outcome"] = rep.outcome
        elif rep.failed and rep.when == "setup":
            entry["outcome"] = "error"
        elif rep.failed and rep.when == "teardown":
            entry["teardown_error"] = True
    data = json.loads(report.read_text())
    total = {"violations": 0, "expected": 0, "leaked": 0}
    for i, kind in enumerate(kinds):
        name = f"test_{i}_{kind}"
        outcome, teardown_error, unexpected, expected, leaked = expected_outcome(kind, mode, leaks)
        assert outcomes[name] == {"outcome": outcome, "teardown_error": teardown_error}, name
        mine = [v for v in data["violations"] if v["nodeid"].endswith(f"::{name}")]
        assert sum(not v["expected"] for v in mine) == unexpected, name
        assert sum(v["expected"] for v in mine) == expected, name
        assert sum(len(v["block_ids"]) for v in data["leaks"]
                   if v["nodeid"].endswith(f"::{name}")) == leaked, name
        total["violations"] += unexpected
        total["expected"] += expected
        total["leaked"] += leaked
    s = data["summary"]
    assert (s["violations"], s["expected_violations"], s["leaked_blocks"]) == (
        total["violations"], total["expected"], total["leaked"])
    assert s["allocators_guarded"] == len(kinds)
    assert data["outside"] == []
