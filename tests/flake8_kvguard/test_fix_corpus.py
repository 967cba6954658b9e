"""`kvguard lint --fix` never turns a working program into a failing one.

A corpus of small working programs that the fixable rules (KVG101 `.tolist()` for a tensor
passed as ids, KVG105 `.tolist()` before hashing, KVG106 `int()` of a tensor element) reach
through aliasing, comments, multi-line calls, decorators, nested frees, tensors used after the
free, generators and loops: each runs as a script before and after `kvguard lint --fix` (in
subprocesses), and prints and exits the same. Where a rewrite could change what a program does
(the set's elements used as tensors afterwards; a `free()` annotated `list` whose body calls
tensor methods on its argument, or hands it to a helper that does) the finding stays and the
fix is not made. Each program is a project of its own (its own index). The corpus checks both:
which programs the fixer rewrites, and that none of them changes behaviour.
"""

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

LISTS = '''import functools
import torch


class Pool:
    """A pool that takes ids as a list of ints (or any iterable of ints)."""

    def __init__(self, n=8):
        self.free_list = list(range(n))

    def allocate(self, k):
        out, self.free_list = self.free_list[:k], self.free_list[k:]
        return out

    def free(self, ids):
        for b in ids:
            self.free_list.append(int(b))

    def free_block(self, block):
        self.free_list.append(int(block))


def show(pool):
    print(sorted(int(b) for b in pool.free_list))
'''

ANNOTATED = LISTS.replace("    def free(self, ids):\n", "    def free(self, ids: list):\n").replace(
    "    def free_block(self, block):\n", "    def free_block(self, block: int):\n")
"""The same pool, its methods annotated to take lists and ints: KVG101 reaches its callers."""

TAIL = """

if __name__ == "__main__":
    main()
"""

PROGRAMS = {
    "alias_method": (LISTS, """
def main():
    pool = Pool()
    pool.allocate(4)
    give_back = pool.free
    give_back(torch.arange(3))
    show(pool)
"""),
    "comments_multiline": (LISTS, """
def main():
    pool = Pool()
    pool.allocate(4)
    pool.free(  # give them back
        torch.tensor(
            [1, 2],  # the ids
        ),
    )
    show(pool)
"""),
    "decorated_tensor_free": (LISTS, """
def traced(fn):
    @functools.wraps(fn)
    def wrapper(self, ids):
        return fn(self, ids)
    return wrapper


class TensorPool(Pool):
    @traced
    def free(self, ids):
        self.free_list.extend(ids.tolist())


def main():
    pool = TensorPool()
    pool.allocate(4)
    pool.free(torch.arange(2))
    show(pool)
"""),
    "dict_keys_used_as_tensors": (LISTS, """
def main():
    t = torch.arange(3)
    owners = dict.fromkeys(t, "r0")
    print(sorted(k.item() for k in owners))
"""),
    "element_index": (LISTS, """
def main():
    pool = Pool()
    pool.allocate(5)
    table = torch.arange(4)
    pool.free_block(table[0])
    pool.free([table[1], table[-1]])
    show(pool)
"""),
    "generator_of_elements": (LISTS, """
def main():
    pool = Pool()
    pool.allocate(4)
    t = torch.arange(3)
    pool.free(b for b in t)
    show(pool)
"""),
    "lambda_alias": (LISTS, """
def main():
    pool = Pool()
    pool.allocate(4)
    put = lambda ids: pool.free(ids)
    put(torch.arange(2))
    show(pool)
"""),
    "len_of_a_set": (LISTS, """
def main():
    t = torch.tensor([3, 1, 2])  # distinct: a program that works either way
    unique = set(t)
    print(len(unique), 9 in unique)
    print(len(set(t[:2])))
"""),
    "list_used_after_free": (LISTS, """
def main():
    pool = Pool()
    pool.allocate(4)
    ids = torch.arange(3)
    pool.free(ids)
    print(ids.sum().item(), ids.dtype)
    show(pool)
"""),
    "loop_element_used_as_tensor": (LISTS, """
def main():
    pool = Pool()
    pool.allocate(4)
    t = torch.arange(3)
    for b in t:
        pool.free_block(b)
        print(b.item(), b.dim())
    show(pool)
"""),
    "nested_frees": (LISTS, """
class Seq:
    def __init__(self, blocks):
        self.blocks = blocks


def release(pool, seqs):
    for seq in seqs:
        pool.free(seq.blocks)


def main():
    pool = Pool()
    pool.allocate(6)
    release(pool, [Seq(torch.tensor([0, 1])), Seq(torch.tensor([4]))])
    show(pool)
"""),
    "set_elements_used_as_tensors": (LISTS, """
def main():
    t = torch.arange(4)
    total = 0
    for x in set(t):
        total += x.item()
    print(total)
"""),
    "tensor_method_in_body": (LISTS, """
class TensorPool(Pool):
    def free(self, ids):
        assert ids.numel() > 0
        self.free_list.extend(ids.tolist())


def main():
    pool = TensorPool()
    pool.allocate(4)
    pool.free(torch.arange(2))
    show(pool)
"""),
    "tensor_passed_on": (LISTS, """
def keep(ids):
    return ids.clone()


class Forwarding(Pool):
    def free(self, ids):
        self.last = keep(ids)
        super().free(ids)


def main():
    pool = Forwarding()
    pool.allocate(4)
    pool.free(torch.arange(2))
    print(pool.last.shape)
    show(pool)
"""),
    "ann_alias_tensor": (ANNOTATED, """
def main():
    pool = Pool()
    pool.allocate(4)
    t = torch.arange(3)
    same = t
    pool.free(same)
    same.add_(10)
    print(t.tolist())
    show(pool)
"""),
    "ann_body_numel": (ANNOTATED, """
class TensorPool(Pool):
    def free(self, ids: list):
        if ids.numel():
            super().free(ids)


def main():
    pool = TensorPool()
    pool.allocate(4)
    pool.free(torch.arange(2))
    show(pool)
"""),
    "ann_comments_multiline": (ANNOTATED, """
def main():
    pool = Pool()
    pool.allocate(4)
    pool.free(  # give them back
        torch.tensor(
            [1, 2],  # the ids
        ),
    )
    show(pool)
"""),
    "ann_decorated_body_takes_tensor": (ANNOTATED, """
def traced(fn):
    @functools.wraps(fn)
    def wrapper(self, ids):
        return fn(self, ids)
    return wrapper


class TensorPool(Pool):
    @traced
    def free(self, ids: list):
        self.free_list.extend(ids.tolist())


def main():
    pool = TensorPool()
    pool.allocate(4)
    pool.free(torch.arange(2))
    show(pool)
"""),
    "ann_element_then_tensor_use": (ANNOTATED, """
def main():
    pool = Pool()
    pool.allocate(4)
    t = torch.arange(3)
    first = t[0]
    pool.free_block(first)
    print(first.item())
    show(pool)
"""),
    "ann_generator": (ANNOTATED, """
def main():
    pool = Pool()
    pool.allocate(4)
    t = torch.arange(3)
    pool.free(b for b in t)
    pool.free_block(t[0] + 3)
    show(pool)
"""),
    "ann_list_after_free": (ANNOTATED, """
def main():
    pool = Pool()
    pool.allocate(4)
    ids = torch.arange(3)
    pool.free(ids)
    print(ids.sum().item(), ids.dtype)
    show(pool)
"""),
    "ann_loop_elements_as_tensors": (ANNOTATED, """
def main():
    pool = Pool()
    pool.allocate(4)
    t = torch.arange(3)
    for b in t:
        pool.free_block(b)
        print(b.item(), b.dim())
    show(pool)
"""),
    "ann_nested": (ANNOTATED, """
class Seq:
    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks


def release(pool: Pool, seqs):
    for seq in seqs:
        pool.free(seq.blocks)


def main():
    pool = Pool()
    pool.allocate(6)
    release(pool, [Seq(torch.tensor([0, 1])), Seq(torch.tensor([4]))])
    show(pool)
"""),
    "ann_staticmethod_free": (ANNOTATED, """
class Static(Pool):
    registry = []

    @staticmethod
    def free(ids: list):
        Static.registry.append(ids.shape)


def main():
    pool = Static()
    pool.free(torch.arange(2))
    print(Static.registry)
"""),
}

REWRITTEN = {"comments_multiline", "element_index", "generator_of_elements", "len_of_a_set",
             "list_used_after_free", "loop_element_used_as_tensor", "ann_alias_tensor",
             "ann_comments_multiline", "ann_element_then_tensor_use", "ann_generator",
             "ann_list_after_free", "ann_loop_elements_as_tensors"}
"""Where the fixer rewrites something (else it reports, or finds nothing to fix)."""


def _run(path: Path):
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                         timeout=120)
    return out.returncode, out.stdout, out.stderr.strip().splitlines()[-1:]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """name -> (source, fixed source, before, after): the whole corpus fixed in one run."""
    root = tmp_path_factory.mktemp("fix_corpus")
    before = {}
    for name, (head, body) in PROGRAMS.items():  # each a project of its own (its own index)
        (root / name).mkdir()
        (root / name / "setup.cfg").write_text(f"[metadata]\nname = {name}\n")
        path = root / name / "program.py"
        path.write_text(head + body + TAIL)
        before[name] = (path.read_text(), _run(path))
    fixed = subprocess.run([sys.executable, "-m", "kvguard", "lint", "--fix", str(root)],
                           capture_output=True, text=True, timeout=600)
    assert "Traceback" not in fixed.stderr, fixed.stderr
    return {name: (source, (root / name / "program.py").read_text(), ran,
                   _run(root / name / "program.py")) for name, (source, ran) in before.items()}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_fixed_program_runs_as_it_did(corpus, name):
    source, fixed, before, after = corpus[name]
    assert before[0] == 0, before  # a working program
    assert after == before, f"--fix changed what {name} does:\n{fixed}"


def test_the_corpus_exercises_the_fixes(corpus):
    rewritten = {name for name, (source, fixed, _, _) in corpus.items() if fixed != source}
    assert rewritten == REWRITTEN
    tensor_bodies = ("ann_body_numel", "ann_decorated_body_takes_tensor",
                     "ann_staticmethod_free", "set_elements_used_as_tensors",
                     "dict_keys_used_as_tensors", "tensor_passed_on")
    assert not rewritten & set(tensor_bodies)
