"""No input crashes the checker: broken, odd, new, huge and generated programs."""

import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flake8_kvguard import config, engine, fixer, index

from .helpers import lint


def _strict(source, prefilter=False):
    """Findings without the pre-filter, so that every input reaches the analysis."""
    return engine.lint_source(source, config.DEFAULT, index.EMPTY, use_prefilter=prefilter)


@pytest.mark.parametrize(
    "source",
    [
        "",
        "\n\n\n",
        "# only a comment",
        "def free(self, blocks:\n",
        "alloc.free(ids",
        "\x00\x00alloc.free(x)",
        "if True:\n  alloc.free(x)\n\tpass\n",
        "alloc.free(x)\\",
        "def f():\n\treturn alloc.free(*, x)\n",
        "print 'python 2'\nalloc.free(x)\n",
        "\ufeffalloc.free(True)\n",
        "x = '''\nalloc.free(True)\n",
        "\f\nalloc.free(True)\n",
        "lambda: alloc.free(True)\n",
    ],
)
def test_broken_and_odd_sources_do_not_crash(source):
    _strict(source)
    _strict(source.encode("utf-8", "surrogatepass"))


def test_syntax_errors_report_nothing():
    assert _strict("import torch\nalloc.free(torch.arange(3)\n") == []


def test_bytes_in_other_encodings():
    assert [f.code for f in _strict(b"# -*- coding: latin-1 -*-\n# \xe9\nalloc.free(True)\n")] == [
        "KVG103"
    ]
    assert _strict(b"alloc.free(True)\n# \xff\xfe not utf-8\n") == []


def test_new_syntax_is_analyzed():
    source = """\
        import torch

        type Ids = list[int]

        def release[T](allocator, ids: torch.Tensor, event: T) -> None:
            match event:
                case {"kind": "abort", **rest}:
                    allocator.free(ids)
                case [first, *others] if first:
                    allocator.free(True)
                case _:
                    pass

        class Pool[T]:
            async def drop(self, ids: torch.Tensor) -> None:
                async with self.lock as held:
                    if (n := len(ids)) > 0:
                        await self.allocator.free(ids[0])
                try:
                    pass
                except* ValueError:
                    self.allocator.free(ids)
                print(f"{ids!r:>{n}} {"nested"}")
    """
    assert lint(source) == ["8:28 KVG101", "10:28 KVG103", "18:43 KVG106", "22:33 KVG101"]


def _calls(source) -> tuple:
    """Findings and the number of Python calls the checker made: work counted, not timed."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        found = _strict(source)
    finally:
        sys.setprofile(None)
    return found, calls


def test_huge_file_is_linear():
    block = textwrap.dedent("""\
        def f{n}(allocator, ids: torch.Tensor, seqs) -> None:
            collected = []
            for seq in seqs:
                collected.extend(seq.blocks)
            if ids.numel():
                allocator.free(collected)
            elif seqs:
                allocator.free(ids)
            else:
                allocator.free(set(ids))
        """)
    small, large = (
        "import torch\n" + "".join(block.format(n=n) for n in range(count)) for count in (40, 400)
    )
    assert len(large.splitlines()) > 4000
    found_small, work_small = _calls(small)
    found_large, work_large = _calls(large)
    assert len(found_small) == 40 * 3  # KVG102, KVG101, KVG105 (set(ids))
    assert len(found_large) == 400 * 3
    # Ten times the code costs about ten times the work; anything quadratic costs a hundred.
    assert work_large < 14 * work_small, (work_small, work_large)


def test_long_elif_chains_and_deep_nesting():
    def chain(length):
        return "if x == 0:\n    alloc.free(True)\n" + "".join(
            f"elif x == {i}:\n    alloc.free(True)\n" for i in range(1, length)
        )

    found_short, work_short = _calls(chain(300))
    found_long, work_long = _calls(chain(3000))
    assert (len(found_short), len(found_long)) == (300, 3000)
    assert work_long < 14 * work_short, (work_short, work_long)
    nested = "alloc.free(" + "(" * 150 + "True" + ")" * 150 + ")\n"
    _strict(nested)
    long_sum = "alloc.free(" + " + ".join(["[a]"] * 3000) + ")\n"
    _strict(long_sum)
    deep_blocks = (
        "".join("    " * i + f"for i{i} in range(3):\n" for i in range(90))
        + "    " * 90
        + "alloc.free(True)\n"
    )
    _strict(deep_blocks)


# ---------------------------------------------------------------- generated programs

NAMES = st.sampled_from(["ids", "t", "seq", "blocks", "mask", "seen", "n", "self.ids"])
EXPRESSIONS = st.sampled_from(
    [
        "torch.arange(n)",
        "torch.cat([ids, t])",
        "ids[0]",
        "ids[1:]",
        "ids.tolist()",
        "t == 0",
        "[a, b]",
        "a + b",
        "[*a, *b]",
        "set(ids)",
        "{b for b in ids}",
        "seq.all_block_ids()",
        "list(ids)",
        "ids.cuda()",
        "True",
        "n",
        "[]",
        "dict.fromkeys(t)",
        "ids[mask]",
        "int(ids[0])",
        "torch.zeros(n, dtype=torch.bool)",
        "itertools.chain(a, b)",
        "x if c else y",
        "(yield ids)",
        "lambda q: alloc.free(q)",
        "[alloc.free(i) for i in ids]",
        "await alloc.free(ids)",
        "ids.sort().indices",
        "torch.where(t)",
        "torch.where(t)[0]",
        "f'{ids}'",
        "None",
    ]
)
CALLS = st.sampled_from(
    ["alloc.free", "self.pool.release", "free_blocks", "pool.deallocate", "seen.add", "print"]
)


@st.composite
def statements(draw, depth=0):
    kind = draw(st.integers(0, 11 if depth < 3 else 5))
    name, expr, call = draw(NAMES), draw(EXPRESSIONS), draw(CALLS)
    if kind == 0:
        return [f"{name} = {expr}"]
    if kind == 1:
        return [f"{call}({expr})"]
    if kind == 2:
        return [f"{call}({name})"]
    if kind == 3:
        return [f"{name}.append({expr})", f"{name}.extend({expr})"][: draw(st.integers(1, 2))]
    if kind == 4:
        return (
            [f"if {name} in {draw(NAMES)}:", "    continue"]
            if depth
            else [f"{name}: torch.Tensor = {expr}"]
        )
    if kind == 5:
        return ["pass"]
    body = draw(st.lists(statements(depth + 1), min_size=1, max_size=4))
    inner = ["    " + line for block in body for line in block]
    if kind == 6:
        return [f"for {draw(NAMES).replace('self.', '')} in {expr}:"] + inner
    if kind == 7:
        return [f"if {expr}:"] + inner + ["else:"] + inner
    if kind == 8:
        return ["while True:"] + inner + ["    break"]
    if kind == 9:
        return ["try:"] + inner + ["except Exception:"] + inner
    if kind == 10:
        return (
            [f"def g{depth}(self, ids: torch.Tensor, blocks, *args, n: int = 0):"]
            + inner
            + ["    return ids"]
        )
    return [f"class C{depth}:", "    ids: torch.Tensor", "    def free(self, blocks):"] + [
        "    " + line for line in inner
    ]


@st.composite
def programs(draw):
    body = draw(st.lists(statements(), min_size=1, max_size=8))
    lines = [
        "import itertools",
        "import torch",
        "def main(alloc, pool, seq, a, b, c, x, y, n: int, ids: torch.Tensor, t):",
    ]
    lines += ["    " + line for block in body for line in block]
    return "\n".join(lines) + "\n"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_generated_programs(source):
    try:
        compile(source, "<generated>", "exec")
        compiles = True
    except SyntaxError:
        compiles = False  # `continue` outside a loop: parsed, but not compiled
    found = _strict(source)
    line_count = len(source.splitlines())
    for finding in found:
        assert 1 <= finding.line <= line_count and finding.col >= 0
        assert finding.message.startswith(finding.code + " ")
    # The pre-filter never hides a finding.
    assert [f.key() for f in _strict(source, prefilter=True)] == [f.key() for f in found]
    # Fixes give valid code, and fixing again changes nothing.
    fixed, count = fixer.fix_source(source.encode(), config.DEFAULT, index.EMPTY)
    if count and compiles:
        compile(fixed, "<fixed>", "exec")
        assert fixer.fix_source(fixed, config.DEFAULT, index.EMPTY)[0] == fixed
    assert not any(f.fix for f in _strict(fixed.decode())), "a fix left a fixable finding behind"


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_mutated_fixtures(data):
    from .helpers import FIXTURES

    paths = sorted(FIXTURES.glob("*/*/*.py"))
    source = data.draw(st.sampled_from(paths)).read_text()
    lines = source.splitlines(True)
    start = data.draw(st.integers(0, max(0, len(lines) - 1)))
    stop = data.draw(st.integers(start, len(lines)))
    mutated = "".join(lines[:start] + lines[stop:])
    cut = data.draw(st.integers(0, len(mutated)))
    _strict(
        mutated[:cut]
        + data.draw(st.sampled_from(["", "(", ")", ":", "\n    ", "'", "[", "if x"]))
        + mutated[cut:]
    )


def test_pythons_warnings_about_the_code_are_not_the_checkers_output(recwarn):
    """`"\\("` in a file makes Python's compiler warn (SyntaxWarning from 3.12 on, shown
    by default): kvguard lint prints findings, not that."""
    source = 'import torch\npattern = "\\\\("\nalloc.free(torch.arange(3))\n'.replace("\\\\", "\\")
    found = _strict(source, prefilter=True)
    assert [f.code for f in found] == ["KVG101"]
    assert [str(w.message) for w in recwarn.list] == []
