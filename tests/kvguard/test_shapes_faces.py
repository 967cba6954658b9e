"""The shapes of issue 27 through the faces that guard without a code change: staging
(``KVGUARD_REGISTER`` in the spec language, log and repair mode) here, the pytest plugin in
tests/pytest_kvguard/test_spec_language.py. A correct workload gives no violation; a planted
double free is caught."""

from __future__ import annotations

import logging

import pytest

import kvguard
from kvguard import kinds, staging

from .shape_classes import Seq, SeqBlockManager

ENTRY = ("tests.kvguard.shape_classes.SeqBlockManager(alloc=allocate(seq.block_table), "
         "free=deallocate(seq.block_table), share=fork(parent.block_table), refcounted=true, "
         "alloc_shares=true, refcounts=ref_counts, size=num_blocks, free_count=num_free)")


@pytest.mark.parametrize("mode", ["log", "repair"])
def test_a_shape_under_staging(mode, caplog):
    assert staging.start({"KVGUARD": "1", "KVGUARD_MODE": mode, "KVGUARD_REGISTER": ENTRY})
    try:
        m = SeqBlockManager(8)
        g = kvguard.guard_of(m)
        assert g is not None and g.mode == mode and g.spec.free_ids == "block_table"
        a = Seq(3)
        m.allocate(a)
        b = Seq(4, prefix=a, shared=2)            # a prefix-cache hit: two shared, two new
        m.allocate(b)
        c = Seq(0)
        m.fork(c, b)
        for seq in (a, b, c):
            m.deallocate(seq)
        assert g.violations == [] and g.live == {}
        d = Seq(2)
        m.allocate(d)
        table = list(d.block_table)
        m.deallocate(d)
        d.block_table = table                     # freed again: a double free
        with caplog.at_level(logging.CRITICAL, logger="kvguard"):
            m.deallocate(d)                       # staging never raises into the host
        assert [v.kind for v in g.violations] == [kinds.DOUBLE_FREE]
        if mode == "repair":
            assert m.ref_counts[table[0]] == 0, "the sanitized call freed nothing twice"
    finally:
        staging.stop()
        kvguard.unregister(ENTRY.partition("(")[0])
