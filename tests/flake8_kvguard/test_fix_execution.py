"""`--fix` never changes what a correct program frees: each program runs before and
after fixing (with torch), against allocators that record what they are given, and
the two records must agree. Where the checker cannot prove a rewrite safe (a row of a
2-D table, a tensor of unknown rank, a method whose body takes tensors) it must not
rewrite at all."""

import textwrap

import pytest

from .helpers import fix

torch = pytest.importorskip("torch")

PRELUDE = '''
import torch


def _plain(ids):
    if isinstance(ids, torch.Tensor):
        return ("tensor", ids.tolist())
    if isinstance(ids, (list, tuple)):
        return [_plain(i) for i in ids]
    return ids


class Recorder:
    """Takes lists of int ids (or one int id), and records them."""

    def __init__(self):
        self.freed = []

    def free(self, ids: list):
        self.freed.append(("free", _plain(ids)))

    def free_block(self, block):
        self.freed.append(("free_block", _plain(block)))
'''

PROGRAMS = {
    "tensor_to_list": """
        def main(alloc):
            alloc.free(torch.arange(3))
    """,
    "proven_elements": """
        def main(alloc):
            ids = torch.arange(4, 8)
            alloc.free(ids[1])
            for block in ids:
                alloc.free_block(block)
            alloc.free([ids[0], ids[-1]])
    """,
    "rows_of_a_table": """
        def main(alloc):
            tables = torch.zeros(4, 8, dtype=torch.long)
            tables[0] = torch.arange(8)
            alloc.free(tables[0])
            for row in tables:
                alloc.free(row)
            alloc.free(tables[0, 3])
    """,
    "unknown_rank": """
        def drop(alloc, table: torch.Tensor):
            alloc.free(table[0])
            for row in table:
                alloc.free_block(row)

        def main(alloc):
            drop(alloc, torch.arange(6).view(2, 3))
    """,
    "tensor_taking_body": """
        class PageAllocator:
            def __init__(self):
                self.pages = torch.zeros(0, dtype=torch.long)
                self.freed = []

            def free(self, free_index):
                self.pages = torch.cat((self.pages, free_index.long()))
                self.freed.append(("free", self.pages.tolist()))

        def main(alloc):
            pages = PageAllocator()
            pages.free(torch.arange(3))
            pages.free(torch.arange(3, 5))
            alloc.freed.extend(pages.freed)
    """,
    "receiver_of_each_kind": """
        from typing import List

        class TokenAllocator:
            def __init__(self):
                self.pages = torch.zeros(0, dtype=torch.long)

            def free(self, free_index: torch.Tensor) -> None:
                self.pages = torch.cat((self.pages, free_index))

        class Scheduler:
            def __init__(self, pool: Recorder, tokens: TokenAllocator):
                self.pool = pool
                self.tokens = tokens

            def step(self, ids: torch.Tensor):
                self.pool.free(ids)
                self.tokens.free(ids)

        def main(alloc):
            tokens = TokenAllocator()
            Scheduler(alloc, tokens).step(torch.arange(2, 5))
            alloc.free(tokens.pages)
    """,
}


def _run(source):
    namespace = {}
    exec(compile(source, "<program>", "exec"), namespace)
    alloc = namespace["Recorder"]()
    namespace["main"](alloc)
    return alloc.freed


def _normalized(freed):
    """What was freed, with tensors and their 0-dim elements as the ints they hold."""

    def plain(value):
        if isinstance(value, tuple) and value and value[0] == "tensor":
            return plain(value[1])
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return [(name, plain(ids)) for name, ids in freed]


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_fixed_program_frees_what_the_original_freed(name):
    source = PRELUDE + textwrap.dedent(PROGRAMS[name])
    fixed = fix(source)
    before = _run(source)
    after = _run(fixed)  # a wrong int() or .tolist() raises here
    assert _normalized(after) == _normalized(before)


def test_what_is_and_is_not_rewritten():
    rewritten = {name: fix(PRELUDE + textwrap.dedent(src)) for name, src in PROGRAMS.items()}
    assert "alloc.free(torch.arange(3).tolist())" in rewritten["tensor_to_list"]
    assert "alloc.free(int(ids[1]))" in rewritten["proven_elements"]
    assert "alloc.free_block(int(block))" in rewritten["proven_elements"]
    rows = rewritten["rows_of_a_table"]
    assert "int(tables[0])" not in rows and "int(row)" not in rows
    assert "alloc.free(int(tables[0, 3]))" in rows
    assert "int(" not in rewritten["unknown_rank"].replace("isinstance", "")
    for name in ("tensor_taking_body",):
        assert rewritten[name] == PRELUDE + textwrap.dedent(PROGRAMS[name])
    receivers = rewritten["receiver_of_each_kind"]
    assert "self.pool.free(ids.tolist())" in receivers
    assert "self.tokens.free(ids)\n" in receivers
