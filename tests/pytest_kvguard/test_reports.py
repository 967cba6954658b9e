"""What a run tells: terminal summary, JSON report, junitxml, and the same under xdist."""

import json
import xml.etree.ElementTree as ET

import pytest

from .conftest import write

MIXED = """
    import pytest
    import kvguard
    from kvguard.examples import LinkedFreeList, RefcountedPool

    def test_clean_{n}():
        pool = LinkedFreeList(8)
        pool.free(pool.allocate(4))

    def test_swallowed_{n}():
        pool = LinkedFreeList(8)
        ids = pool.allocate(2)
        try:
            pool.free(ids + ids[:1])
        except ValueError:
            pass

    def test_expected_{n}():
        pool = RefcountedPool(8)
        ids = pool.allocate(2)
        with pytest.raises(kvguard.DoubleFreeError):
            pool.free(ids)
            pool.free(ids)

    def test_leaky_{n}():
        LinkedFreeList(8).allocate(3)
"""


def mixed(pytester, files=1):
    for n in range(files):
        write(pytester, MIXED.format(n=n), name=f"test_mixed_{n}")


def test_one_quiet_line_when_all_is_clean(suite):
    write(suite, """
        from kvguard.examples import LinkedFreeList, RefcountedPool

        def test_a():
            pool = LinkedFreeList(8)
            pool.free(pool.allocate(4))

        def test_b():
            pool = RefcountedPool(8)
            ids = pool.allocate(2)
            pool.share(ids)
            pool.free(ids)
            pool.free(ids)
    """)
    result = suite.runpytest("-p", "kvguard")
    result.assert_outcomes(passed=2)
    lines = [line for line in result.stdout.lines if "kvguard" in line and "plugins:" not in line]
    assert lines[1:] == ["kvguard: 2 allocators guarded (1 LinkedFreeList, 1 RefcountedPool), "
                         "2 alloc / 3 free calls: no violations, no leaks"]


def test_summary_counts_per_class_kind_and_lists_the_tests(suite):
    mixed(suite)
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=warn")
    result.assert_outcomes(passed=3, failed=1, warnings=1)
    result.stdout.fnmatch_lines([
        "*= kvguard =*",
        "kvguard: 4 allocators guarded (3 LinkedFreeList, 1 RefcountedPool), 4 alloc / 2 free "
        "calls",
        "  kvguard.examples.LinkedFreeList: 3 guarded, 3 alloc / 1 free / 0 share calls; "
        "violations: duplicate-id 1",
        "  kvguard.examples.RefcountedPool: 1 guarded, 1 alloc / 1 free / 0 share calls; "
        "violations: double-free 1",
        "violations: 1 (duplicate-id 1), in 1 test(s); 1 more were expected",
        "  test_mixed_0.py::test_swallowed_0 [[]call]: duplicate-id of block 0 on "
        "LinkedFreeList#* at *test_mixed_0.py:13 in test_swallowed_0",
        "leaks (warn): 3 block(s) in 1 test(s) still live after teardown",
        "  test_mixed_0.py::test_leaky_0: 3 block(s) of LinkedFreeList#* handed out at "
        "*test_mixed_0.py:25 in test_leaky_0",
    ])


def _check_json(path, files, import_time_guards=0, outside_kinds=()):
    """The report of ``files`` copies of MIXED (plus guards made at import time, and
    violations outside any test, of ``outside_kinds``)."""
    data = json.loads(path.read_text())
    s = data["summary"]
    assert data["settings"] == {"mode": "raise", "stacks": "cheap", "leaks": "warn"}
    assert s["allocators_guarded"] == 4 * files + import_time_guards
    assert (s["alloc_calls"], s["free_calls"]) == (4 * files, 2 * files)
    kinds = {"duplicate-id": files}
    for kind in outside_kinds:
        kinds[kind] = kinds.get(kind, 0) + 1
    assert s["violations"] == files + len(outside_kinds) and s["violations_by_kind"] == kinds
    assert s["expected_violations"] == files
    assert s["leaked_blocks"] == 3 * files and s["tests_with_leaks"] == files
    assert s["tests_failed_by_kvguard"] == sorted(
        f"test_mixed_{n}.py::test_swallowed_{n}" for n in range(files))
    assert data["allocators"]["kvguard.examples.LinkedFreeList"]["guards"] == (
        3 * files + import_time_guards)
    assert data["allocators"]["kvguard.examples.RefcountedPool"]["violations"] == {
        "double-free": files}
    by_test = {v["nodeid"]: v for v in data["violations"]}
    bad = by_test["test_mixed_0.py::test_swallowed_0"]
    assert (bad["kind"], bad["when"], bad["expected"], bad["block_ids"]) == (
        "duplicate-id", "call", False, [0])
    assert bad["call_stack"][0]["function"] == "test_swallowed_0"
    assert bad["owner"] == "test_mixed_0.py::test_swallowed_0"
    good = by_test["test_mixed_0.py::test_expected_0"]
    assert (good["kind"], good["expected"]) == ("double-free", True)
    leak = [v for v in data["leaks"] if v["nodeid"] == "test_mixed_0.py::test_leaky_0"]
    assert leak[0]["block_ids"] == [0, 1, 2] and leak[0]["mode"] == "warn"
    assert [v["kind"] for v in data["outside"]] == list(outside_kinds)
    return data


def test_json_report_has_every_violation_with_its_test(suite):
    mixed(suite)
    suite.runpytest("-p", "kvguard", "--kvguard-report=out/report.json")
    result = suite.runpytest("-p", "kvguard", "--kvguard-leaks=warn",
                             "--kvguard-report=report.json")
    result.stdout.fnmatch_lines(["kvguard: JSON report written to *report.json"])
    _check_json(suite.path / "report.json", files=1)


def test_junitxml_has_the_report_and_a_property(suite):
    mixed(suite)
    suite.runpytest("-p", "kvguard", "--kvguard-leaks=warn", "--junitxml=junit.xml")
    root = ET.parse(suite.path / "junit.xml").getroot()
    cases = {c.get("name"): c for c in root.iter("testcase")}
    bad = cases["test_swallowed_0"]
    failure = bad.find("failure")
    assert failure.get("message").startswith("kvguard: duplicate-id of block 0 on LinkedFreeList")
    assert "SUMMARY: kvguard: duplicate-id" in failure.text
    props = {p.get("name"): p.get("value") for p in bad.iter("property")}
    assert props == {"kvguard_violations": "1"}
    leaky = {p.get("name"): p.get("value") for p in cases["test_leaky_0"].iter("property")}
    assert leaky == {"kvguard_leaks": "3"}
    assert cases["test_clean_0"].find("properties") is None


def test_xdist_fails_the_right_tests_and_sums_up_on_the_controller(suite):
    pytest.importorskip("xdist")
    mixed(suite, files=3)
    write(suite, """
        from kvguard.examples import LinkedFreeList

        POOL = LinkedFreeList(4)
        try:
            POOL.free([3])          # at import: every worker collects it
        except ValueError:
            pass

        def test_here():
            pass
    """, name="test_import_time")
    result = suite.runpytest("-p", "kvguard", "-n", "2", "--kvguard-leaks=warn",
                             "--kvguard-report=report.json",
                             "-p", "no:randomly", "-p", "no:benchmark")
    result.assert_outcomes(passed=10, failed=3, warnings=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines_random([
        "FAILED test_mixed_0.py::test_swallowed_0*",
        "FAILED test_mixed_1.py::test_swallowed_1*",
        "FAILED test_mixed_2.py::test_swallowed_2*",
        # 12 in the tests, and the import-time POOL once per worker
        "kvguard: 14 allocators guarded (11 LinkedFreeList, 3 RefcountedPool), 12 alloc / 6 free "
        "calls",
        "outside any test: 1 violation(s); they fail the run",
        "during collection of test_import_time.py (workers gw?, gw?):",
    ])
    data = _check_json(suite.path / "report.json", files=3, import_time_guards=2,
                       outside_kinds=["foreign-id"])
    assert sorted(data["outside"][0]["workers"]) == ["gw0", "gw1"]


def test_a_report_that_cannot_be_written_is_one_line_not_a_crash(suite):
    write(suite, """
        def test_fine():
            pass
    """)
    (suite.path / "taken").mkdir()
    result = suite.runpytest("-p", "kvguard", "--kvguard-report=taken")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["kvguard: could not write the JSON report to *taken: *"])
    assert "INTERNALERROR" not in result.stdout.str()


SHORT_SUITE = """
    from kvguard.examples import LinkedFreeList

    def test_raised():
        pool = LinkedFreeList(8)
        ids = pool.allocate(2)
        pool.free([ids[0], ids[0]])

    def test_swallowed():
        pool = LinkedFreeList(8)
        ids = pool.allocate(2)
        try:
            pool.free([ids[1], ids[1]])
        except ValueError:
            pass
"""


def test_short_style_shows_summary_lines_not_whole_reports(suite):
    """``--kvguard-report=short``, pytest's ``--tb=short`` for kvguard: each failing test shows
    its violations' headline and SUMMARY line, whether the violation escaped the test or the
    code under test caught it; the JSON report can be asked for beside it."""
    write(suite, SHORT_SUITE)
    result = suite.runpytest("-p", "kvguard", "--kvguard-report=short",
                             "--kvguard-report=out.json")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "ERROR: kvguard" not in out and "was called here" not in out, out
    assert out.count("SUMMARY: kvguard: duplicate-id ") == 2
    result.stdout.fnmatch_lines([
        "*kvguard: duplicate-id of block 0 on LinkedFreeList#*",
        "*SUMMARY: kvguard: duplicate-id *test_suite.py:6 in test_raised",
        "*(--kvguard-report=full shows the whole reports)",
    ])
    result.stdout.fnmatch_lines(["*SUMMARY: kvguard: duplicate-id *test_suite.py:12 in "
                                 "test_swallowed"])
    assert len(json.loads((suite.path / "out.json").read_text())["violations"]) == 2

    full = suite.runpytest("-p", "kvguard")
    full.assert_outcomes(failed=2)
    assert full.stdout.str().count("ERROR: kvguard: duplicate-id") >= 2, "full is the default"


def test_two_json_reports_are_a_usage_error(suite):
    write(suite, SHORT_SUITE)
    result = suite.runpytest("-p", "kvguard", "--kvguard-report=a.json",
                             "--kvguard-report=b.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvguard-report b.json: one JSON report per run*"])
