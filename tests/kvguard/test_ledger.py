"""The ledger on its own: its columns against a plain dict model of every block.

The guard calls the ledger only with ids it has already validated, so the machine below keeps to
each method's stated precondition (``allocate``: free or unseen ids, ``release``: live ids, each
once) and checks what the ledger then believes against the model: live or free or unseen, the
reference count, the call that handed a block out or freed it, where it was allocated and freed.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvguard
from kvguard.ledger import MAX_DENSE, Ledger, LiveBlock
from kvguard.owners import ACTIVE_OWNER, OWNERS
from kvguard.stacks import SITES, UNKNOWN

N = 10
SITE = st.integers(2**31, 2**32 - 1)
"""Raw site numbers: the ledger stores them without reading them. These lie far past the end of
the process's site table (it stops at a few times 65536 sites, whatever other tests interned),
so they have no frames and no owner."""


class Block:
    """The model of one block: what a reader of the guard's reports should learn about it."""

    def __init__(self) -> None:
        self.live = False
        self.ref = 0
        self.handed_out_by = 0  # the call that made it live (0: never seen)
        self.freed_by = 0  # the call that last freed it (0: not freed since it went live)
        self.allocated_site = 0
        self.freed_site = 0


class LedgerMachine(RuleBasedStateMachine):
    refcounted = False

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0
        self.adopted = 0
        self.uncertain: set = set()

    @initialize(size=st.integers(1, N))
    def start(self, size):
        self.ledger = Ledger(size, pool="p", refcounted=self.refcounted)
        self.blocks = {b: Block() for b in range(size)}

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def ids(self, data, live: bool):
        pool = sorted(b for b, m in self.blocks.items() if m.live == live)
        return data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=4)) if pool else []

    @rule(data=st.data(), site=SITE)
    def allocate(self, data, site):
        ids, clock = self.ids(data, live=False), self.tick()
        self.ledger.allocate(ids, clock, site)
        for b in ids:
            m = self.blocks[b]
            m.live, m.ref, m.handed_out_by, m.allocated_site = True, 1, clock, site
            self.uncertain.discard(b)

    @rule(data=st.data(), site=SITE)
    def release(self, data, site):
        ids, clock = self.ids(data, live=True), self.tick()
        expected = 0
        for b in ids:
            m = self.blocks[b]
            m.ref = m.ref - 1 if self.refcounted else 0
            if m.ref == 0:
                m.live, m.freed_by, m.freed_site = False, clock, site
                expected += 1
        assert self.ledger.release(ids, clock, site) == expected

    @rule(data=st.data(), site=SITE)
    def share(self, data, site):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.blocks)), unique=True, max_size=3))
        clock = self.tick()
        self.ledger.share(ids, clock, site)
        for b in ids:
            m = self.blocks[b]
            if not m.live:
                m.live, m.handed_out_by, m.allocated_site = True, clock, site
            if self.refcounted:
                m.ref += 1
            else:
                m.ref = 1

    @rule(data=st.data())
    def adopt(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.blocks)), unique=True, max_size=3))
        clock = self.tick()
        self.ledger.adopt(ids, clock)
        for b in ids:
            m = self.blocks[b]
            if not m.live:  # the allocation site is not known: the old one stays
                m.live, m.ref, m.handed_out_by = True, 1, clock
                self.adopted += 1
                if self.refcounted:
                    self.uncertain.add(b)

    @rule(data=st.data())
    def follow(self, data):
        truth = data.draw(st.sets(st.sampled_from(sorted(self.blocks)), max_size=len(self.blocks)))
        clock = self.tick()
        self.ledger.follow(truth, clock)
        for b, m in self.blocks.items():
            if m.live and b not in truth:  # freed behind the guard's back: no free site
                m.live, m.ref, m.freed_by = False, 0, clock
            elif not m.live and b in truth:
                m.live, m.ref, m.handed_out_by = True, 1, clock
                self.adopted += 1
                if self.refcounted:
                    self.uncertain.add(b)

    @rule(size=st.integers(1, N))
    def resize(self, size):
        self.ledger.resize(size)
        self.blocks = {b: self.blocks.get(b, Block()) for b in range(size)}
        self.uncertain = {b for b in self.uncertain if b < size}

    @invariant()
    def every_block_as_the_model_says(self):
        ledger = self.ledger
        assert len(ledger) == ledger.size == len(self.blocks)
        for b, m in self.blocks.items():
            assert ledger.is_live(b) == m.live, b
            assert ledger.seen(b) == bool(m.handed_out_by), b
            assert ledger.refcount(b) == (m.ref if m.live else 0), b
            assert ledger.stamp[b] == (m.handed_out_by if m.live else -m.freed_by), b
            assert ledger.origin[b] == m.allocated_site, b
            assert ledger.freed_at[b] == m.freed_site, b
            assert ledger.block(b) == LiveBlock(b, ledger.refcount(b), None,
                                                m.handed_out_by if m.live else 0, [], "p")
        live = sorted(b for b, m in self.blocks.items() if m.live)
        assert ledger.live_ids() == live
        assert ledger.count_live() == len(live)
        assert ledger.free_delta == self.adopted - len(live)
        assert ledger.adopted == self.adopted
        assert ledger.uncertain == self.uncertain
        # The fast path writes through ``hot`` alone: it must be the ledger's own objects.
        hot = ledger.hot
        assert hot[0] is ledger.stamp and hot[1] is ledger.origin and hot[2] is ledger.freed_at
        assert hot[3] is ledger.ref and hot[4] is ledger.uncertain
        assert hot[6] is ledger.holder and hot[7] is ledger.holders and hot[8] is ledger.leased
        assert not ledger.is_live(len(self.blocks)) and ledger.refcount(-1) == 0
        assert not ledger.in_range(len(self.blocks)) and not ledger.in_range(-1)


class RefcountedLedgerMachine(LedgerMachine):
    refcounted = True


SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestLedger = LedgerMachine.TestCase
TestLedger.settings = SETTINGS
TestRefcountedLedger = RefcountedLedgerMachine.TestCase
TestRefcountedLedger.settings = SETTINGS


def test_columns_cost_20_bytes_a_block_and_24_refcounted():
    # the holder column (owners) is the fourth; the budget is 24 bytes a block
    assert Ledger(100).nbytes() == 2000
    assert Ledger(100, refcounted=True).nbytes() == 2400
    assert Ledger().nbytes() == 0


def test_an_unsized_ledger_grows_by_doubling_up_to_max_dense():
    ledger = Ledger()
    assert ledger.in_range(MAX_DENSE - 1) and not ledger.in_range(MAX_DENSE)
    assert ledger.grow(5) and len(ledger) == 1024  # at least 1024 at a time
    ledger.allocate([1000], 1, 0)
    assert ledger.grow(1025) and len(ledger) == 2048
    assert ledger.grow(5000) and len(ledger) == 5000
    assert all(len(column) == 5000 for column in ledger.columns())
    assert ledger.is_live(1000) and ledger.live_ids() == [1000]  # growing keeps what was there
    assert not ledger.grow(MAX_DENSE + 1) and len(ledger) == 5000


def test_a_sized_ledger_never_grows():
    ledger = Ledger(8)
    assert ledger.grow(8) and not ledger.grow(9)
    assert len(ledger) == 8 and ledger.in_range(7) and not ledger.in_range(8)


def test_resize_keeps_tombstones_below_the_new_size():
    ledger = Ledger(6, refcounted=True)
    ledger.allocate([1, 4], 1, 0)
    ledger.release([1, 4], 2, 0)
    ledger.adopt([0, 5], 3)
    ledger.resize(3)
    assert ledger.stamp[1] == -2  # a free through an id held across the resize: double free
    assert ledger.uncertain == {0} and ledger.live_ids() == [0]
    ledger.resize(5)
    assert not ledger.seen(4) and ledger.refcount(4) == 0 and len(ledger.ref) == 5


def test_live_ids_by_owner_follow_the_owner_active_at_allocation():
    ledger = Ledger(6)

    def allocate(ids, label, clock):
        with kvguard.owner(label):
            site = SITES.capture(0, 3, ACTIVE_OWNER.get())
        ledger.allocate(ids, clock, site)

    allocate([0, 1], "ledger-test req-a", 1)
    allocate([2], "ledger-test req-b", 2)
    ledger.allocate([3], 3, UNKNOWN)
    assert ledger.live_ids("ledger-test req-a", any_owner=False) == [0, 1]
    assert ledger.live_ids("ledger-test req-b", any_owner=False) == [2]
    assert ledger.live_ids(None, any_owner=False) == [3]
    assert ledger.live_ids("ledger-test never used", any_owner=False) == []
    assert ledger.live_ids("ledger-test req-a") == [0, 1, 2, 3]  # any_owner wins
    ledger.release([1], 4, 0)
    assert ledger.live_ids("ledger-test req-a", any_owner=False) == [0]
    block = ledger.block(0)
    assert block.owner == "ledger-test req-a" and block.allocated_by_call == 1
    assert block.allocated_at[0].function.endswith("allocate")
    assert OWNERS.labels[SITES.owner(ledger.origin[2])] == "ledger-test req-b"
