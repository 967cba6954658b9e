"""``kvguard spec suggest``: a spec read from a class, printed in the spec language and checked
against an instance; on the seven engine classes with built-in specs, it gives theirs or says
where it differs and why (the engines' own code, loaded as tests/kvguard/adapters do)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvguard
from kvguard import registry, specgrammar
from kvguard.specreview import differences, self_check
from kvguard.specsuggest import suggest

from .adapters import engines
from .shape_classes import SEQ_SPEC, SeqBlockManager, SingleIdPool

ENGINE_CLASSES = {
    ("deepspeed", "BlockedAllocator"): {"live_ids"},
    ("vllm", "BlockPool"): {"skip", "live_ids", "adapter"},
    ("sglang", "TokenToKVPoolAllocator"): {"size", "free_count", "live_ids", "adapter"},
    ("sglang", "PagedTokenToKVPoolAllocator"): {"alloc", "free", "size", "free_count",
                                                "live_ids", "adapter"},
    ("sglang", "ReqToTokenPool"): {"alloc", "free", "size", "live_ids", "adapter"},
    ("transformers", "CachePool"): {"size", "adapter"},
    ("lmcache", "PagedTensorMemoryAllocator"): {"size", "free_count", "skip", "live_ids",
                                                "adapter"},
}
"""Where a reading of each class's source differs from its hand-written built-in spec: the
engine knowledge a source does not show (computed sizes and live sets, skipped items, extra
methods through adapters, the inner method where ids really change hands). What a source does
show is read: vLLM's ``free_blocks(ordered_blocks: Iterable[...])`` iterated once
(``iterator_ok``; DeepSpeed's ``free`` reads its argument twice), LMCache's page index at
``obj.meta.address`` (``id_attr``) and its ``ref_count`` set at hand-out but never counted by the
pool (not ``refcounted``)."""


@pytest.mark.parametrize("engine, name", list(ENGINE_CLASSES))
def test_on_the_engines_it_gives_the_built_in_spec_or_says_where_and_why(engine, name):
    with engines.loaded(engine) as ns:
        cls = getattr(ns, name)
        suggested, _ = suggest(cls)
        dotted = f"{cls.__module__}.{cls.__qualname__}"
        found = differences(suggested, registry.registered()[dotted], cls)
    assert {key for key, *_ in found} == ENGINE_CLASSES[engine, name]
    assert all(why for *_, why in found)
    for key, ours, theirs, why in found:
        if key in ("alloc", "free"):  # a method name differs: the reason names where ids move
            assert theirs is None or theirs in why or ours in why, (key, why)


def test_a_class_with_ids_in_its_sequences_reads_as_its_spec():
    spec, _ = suggest(SeqBlockManager)
    assert spec == SEQ_SPEC.replace(free_count="num_free")


def test_a_single_id_refcounted_pool_reads_and_checks():
    spec, _ = suggest(SingleIdPool)
    assert (spec.alloc, spec.free, spec.share, spec.refcounted, spec.refcounts) == (
        "allocate_one", "release", "retain", True, "refs")
    lines = self_check(SingleIdPool, spec)
    assert "confirmed: retain() took a reference" in lines
    assert any(line.startswith("could not confirm a free count") for line in lines)


def test_the_self_check_says_what_it_could_not_confirm():
    lines = self_check(SeqBlockManager, SEQ_SPEC)
    assert lines and lines[0].startswith("could not confirm allocate(seq.block_table)")


def test_the_command_prints_a_spec_the_language_reads_back(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvguard", "spec", "suggest",
                          "tests.kvguard.shape_classes.SingleIdPool"], capture_output=True,
                         text=True, cwd=str(engines_root()), check=True).stdout
    first, *comments = out.splitlines()
    (name, spec), = specgrammar.parse_entries(first)
    assert name == "tests.kvguard.shape_classes.SingleIdPool" and spec.share == "retain"
    assert all(line.startswith("# ") for line in comments) and comments


def test_a_class_that_cannot_be_imported_is_one_line():
    run = subprocess.run([sys.executable, "-m", "kvguard", "spec", "suggest", "no_kvg.mod.Cls"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "cannot import" in run.stderr


def engines_root():
    import pathlib
    return pathlib.Path(__file__).resolve().parents[2]


def test_a_suggested_spec_guards_the_class():
    pool = SingleIdPool(4)
    g = kvguard.guard(pool, suggest(SingleIdPool)[0])
    b = pool.allocate_one()
    pool.release(b)
    with pytest.raises(kvguard.DoubleFreeError):
        pool.release(b)
    assert g.violations
