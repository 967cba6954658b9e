"""``check_allocator`` and ``kvguard fuzz`` as tools: the budget, what was not run, the
robustness tier on typed APIs, verdicts that do not depend on what was imported before, and the
command line's formats and mistakes."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from kvguard import AllocatorSpec
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.testing import check_allocator


class NeverAllocates:
    """A pool whose ``allocate`` always fails: no probe can ever be made on it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def allocate(self, k: int) -> list:
        raise RuntimeError("out of memory")

    def free(self, ids) -> None:
        pass

    def num_free(self) -> int:
        return self.n


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.refs = 0


class ObjectPool:
    """Blocks travel as objects (``id_attr``): a typed API. It rejects a block that is not
    live, but reads whatever it is given as a block (a bool fails on ``.refs`` after earlier
    blocks of the call were released): a robustness matter, not a broken promise."""

    def __init__(self, n: int) -> None:
        self.blocks = [Block(i) for i in range(n)]
        self.free_list = list(self.blocks)

    def get(self, k: int) -> list:
        if k > len(self.free_list):
            raise ValueError("not enough blocks")
        out, self.free_list = self.free_list[:k], self.free_list[k:]
        for b in out:
            b.refs = 1
        return out

    def put(self, blocks) -> None:
        blocks = list(blocks)
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("a block twice")
        if any(isinstance(b, Block) and b.refs <= 0 for b in blocks):
            raise ValueError("not live")
        for b in blocks:  # planted: a bool among them fails here, after earlier releases
            b.refs -= 1
            self.free_list.append(b)

    def count(self) -> int:
        return len(self.free_list)


OBJECT_SPEC = AllocatorSpec(alloc="get", free="put", id_attr="block_id", size=lambda a: 6,
                            free_count="count")


def test_clauses_that_never_ran_are_not_run_never_kept():
    report = check_allocator(lambda: NeverAllocates(4), AllocatorSpec(size="n",
                             free_count="num_free"), examples=10, budget=600,
                             raise_on_broken=False)
    assert "valid-trace" in report.broken
    probes = {"duplicate-id", "double-free", "bool-id", "generator"}  # each needs a live block
    assert not probes & set(report.passed), report.render()
    assert probes <= {c for c, _ in report.not_run}, report.render()


def test_the_budget_bounds_a_clause_and_keeps_what_finished():
    report = check_allocator(lambda: LinkedFreeList(4), LINKED_FREE_LIST_SPEC,
                             examples=100_000, budget=3.0, raise_on_broken=False,
                             clauses=["valid-trace", "free-count"])
    assert report.seconds < 10, report.render()
    assert not (set(report.passed) & {c for c, _ in report.not_run})
    assert report.not_run, report.render()


def test_robustness_clauses_are_off_by_default_on_a_typed_api_and_reported_apart_when_on():
    off = check_allocator(lambda: ObjectPool(6), OBJECT_SPEC, examples=30, budget=600,
                          raise_on_broken=False)
    assert "bool-id" not in off.broken and "bool-id" not in off.passed
    assert any(c == "bool-id" and "robustness" in why for c, why in off.not_run), off.render()
    on = check_allocator(lambda: ObjectPool(6), OBJECT_SPEC, examples=30, budget=600,
                         raise_on_broken=True, robustness=True)  # never raises for them
    assert [f.clause for f in on.robustness] == ["bool-id"], on.render()
    assert not on.broken_promises and "robustness" in on.render()


def test_the_bool_mask_verdict_does_not_depend_on_torch_being_imported_first():
    code = """if 1:
        import sys
        {pre}
        from kvguard.testing import check_allocator
        from tests.kvguard.test_conformance import Pool, POOL_SPEC
        r = check_allocator(lambda: Pool(4, 'bool-mask'), POOL_SPEC, examples=20, budget=600,
                            seed={seed}, raise_on_broken=False, clauses=['bool-mask'])
        print(sorted(r.broken), [f.calls for f in r.findings])
    """
    for seed in (0, 1):
        outs = [subprocess.run([sys.executable, "-c", code.format(pre=pre, seed=seed)],
                               capture_output=True, text=True)
                for pre in ("", "import torch")]
        assert outs[0].returncode == 0, outs[0].stderr
        assert outs[0].stdout == outs[1].stdout


def _fuzz(*argv, **kwargs):
    return subprocess.run([sys.executable, "-m", "kvguard", "fuzz", *argv], capture_output=True,
                          text=True, **kwargs)


FUZZ = ["kvguard.examples.LinkedFreeList", "--factory", "cls(4)", "--spec",
        "kvguard.examples.LINKED_FREE_LIST_SPEC", "--examples", "20", "--budget", "600"]


def test_cli_json_format():
    out = _fuzz(*FUZZ, "--format", "json")
    assert out.returncode == 1, out.stderr
    data = json.loads(out.stdout)
    assert {"allocator", "findings", "passed", "not_run", "seconds"} <= set(data)
    first = data["findings"][0]
    assert {"clause", "harm", "calls", "test", "same_bug", "promised"} <= set(first)


def test_cli_junit_file(tmp_path):
    path = tmp_path / "fuzz.xml"
    out = _fuzz(*FUZZ, "--junit", str(path))
    assert out.returncode == 1, out.stderr
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["duplicate-id"].find("failure") is not None
    assert cases["valid-trace"].find("failure") is None


def test_cli_without_hypothesis_is_one_line_naming_the_extra(tmp_path):
    (tmp_path / "hypothesis.py").write_text("raise ImportError('No module named hypothesis')\n")
    import os
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = _fuzz(*FUZZ, env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "hypothesis" in out.stderr and "kvguard[fuzz]" in out.stderr


def test_cli_progress_on_stderr_for_a_long_run():
    out = _fuzz("kvguard.examples.LinkedFreeList", "--factory", "cls(4)", "--spec",
                "kvguard.examples.LINKED_FREE_LIST_SPEC", "--examples", "100000", "--budget",
                "6", "--clause", "valid-trace", "--clause", "free-count")
    assert "kvguard fuzz:" in out.stderr and "free-count" in out.stderr, out.stderr


@pytest.mark.parametrize("argv,message", [
    (["kvguard.examples.LinkedFreeList", "--factory", "cls(4)", "--spec",
      "kvguard.examples.LINKED_FREE_LIST_SPEC", "--format", "xml"], "--format"),
    (["kvguard.examples.LinkedFreeList", "--factory", "cls(4)", "--spec",
      "kvguard.examples.LINKED_FREE_LIST_SPEC", "--budget", "0"], "--budget"),
])
def test_cli_mistakes_are_one_line_and_exit_2(capsys, argv, message):
    from kvguard.cli import main
    assert main(["fuzz", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
