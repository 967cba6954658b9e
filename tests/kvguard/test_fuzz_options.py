"""``kvguard fuzz`` with a user's own pieces, written in the spec language: ``--factory
pkg.mod:function(k=v)`` (called with the class and those keywords) and ``--lifecycle
pkg.mod:make_engine(k=v) --driver pkg.mod:Driver`` (the lifecycle fuzzer on an engine kvguard
was never shown). Every mistake is one line and exit status 2."""

from __future__ import annotations

import pytest

from kvguard.cli import main
from kvguard.conformance.lifecycle_example import ExampleScheduler

HERE = __name__
MADE: list = []


class CheckedPool:
    """A correct allocator: rejects repeats, double frees, bools and ids it never handed out."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.free_ids = list(range(n))
        self.live: set = set()

    def allocate(self, k: int) -> list:
        if k > len(self.free_ids):
            raise ValueError("out of blocks")
        out, self.free_ids = self.free_ids[:k], self.free_ids[k:]
        self.live.update(out)
        return out

    def free(self, ids) -> None:
        ids = list(ids)
        if any(type(b) is not int for b in ids) or len(set(ids)) != len(ids) or \
                not self.live.issuperset(ids):
            raise ValueError(f"bad ids {ids!r}")
        self.live.difference_update(ids)
        self.free_ids.extend(ids)


def make_pool(cls, n: int = 4, label: str = ""):
    MADE.append((cls, n, label))
    return cls(n)


def make_scheduler(num_blocks: int = 8, bugs=()):
    return ExampleScheduler(num_blocks, 2, async_scheduling=True, defer_frees=True,
                            bugs=tuple(bugs))


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_factory_in_the_spec_language_gets_the_class_and_its_keywords(capsys):
    MADE.clear()
    assert main(["fuzz", f"{HERE}.CheckedPool", "--factory",
                 f"{HERE}:make_pool(n=6, label='x')", "--examples", "5",
                 "--clause", "double-free", "--spec", "size=n"]) == 0
    assert MADE and all(m == (CheckedPool, 6, "x") for m in MADE)
    assert main(["fuzz", f"{HERE}.CheckedPool", "--factory", f"{HERE}:make_pool",
                 "--examples", "3", "--clause", "double-free", "--spec", "size=n"]) == 0
    assert MADE[-1] == (CheckedPool, 4, "")


@pytest.mark.parametrize("factory, says", [
    (f"{HERE}:nowhere", "has no attribute 'nowhere'"),
    ("kvg_no_such_module:make", "No module named 'kvg_no_such_module'"),
    (f"{HERE}:make_pool(n=)", "--factory"),
    (f"{HERE}:make_pool(n=3, n=4)", "n given twice"),
    (f"{HERE}:make_pool(size=3)", "cannot build a CheckedPool"),
])
def test_a_factory_mistake_is_one_line_and_exit_2(capsys, factory, says):
    assert main(["fuzz", f"{HERE}.CheckedPool", "--factory", factory]) == 2
    line = one_line(capsys)
    assert line.startswith("kvguard fuzz: error: ") and says in line


def test_the_lifecycle_fuzzer_on_an_engine_of_ones_own(capsys, tmp_path):
    driver = "kvguard.conformance.lifecycle_example:ExampleDriver"
    assert main(["fuzz", "--lifecycle", f"{HERE}:make_scheduler(num_blocks=6)",
                 "--driver", driver, "--examples", "10"]) == 0
    assert "nothing found" in capsys.readouterr().out
    emitted = tmp_path / "test_found.py"
    assert main(["fuzz", "--lifecycle", f"{HERE}:make_scheduler(bugs=[free-in-flight])",
                 "--driver", driver, "--examples", "100", "--emit", str(emitted)]) == 1
    assert "free-in-flight" in capsys.readouterr().out and emitted.exists()


@pytest.mark.parametrize("argv, says", [
    (["--lifecycle", f"{HERE}:make_scheduler"], "needs --driver"),
    (["--lifecycle", "nonsense"], "or a factory pkg.mod:make_engine(k=v, ...)"),
    (["--lifecycle", f"{HERE}:make_scheduler", "--driver", f"{HERE}:CheckedPool"],
     "not a kvguard.testing.LifecycleDriver subclass"),
    (["--lifecycle", f"{HERE}:make_scheduler", "--driver", f"{HERE}.CheckedPool"],
     "name the class as pkg.mod:Driver"),
    (["--lifecycle", f"{HERE}:make_scheduler(blocks=3)", "--driver",
      "kvguard.conformance.lifecycle_example:ExampleDriver"], "cannot build an engine"),
])
def test_a_lifecycle_mistake_is_one_line_and_exit_2(capsys, argv, says):
    assert main(["fuzz", *argv]) == 2
    line = one_line(capsys)
    assert line.startswith("kvguard fuzz: error: ") and says in line, line
