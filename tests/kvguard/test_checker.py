"""The checker on its own: a ledger and normalized ids in, faults and a plan out, no guard, no
allocator, no lock. Checked against a model of three block states (live, freed, never seen)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard import kinds
from kvguard.guard.checker import check_handout, check_release
from kvguard.ids import normalize, result_ids
from kvguard.ledger import Ledger

SIZE = 12
STATES = st.lists(st.sampled_from(["live", "freed", "unseen"]), min_size=SIZE, max_size=SIZE)
IDS = st.lists(st.integers(0, SIZE + 3), max_size=8)


def ledger_in(states, *, learn=False) -> Ledger:
    ledger = Ledger(SIZE, learn=learn)
    ledger.allocate([b for b, s in enumerate(states) if s in ("live", "freed")], 2, 0)
    ledger.release([b for b, s in enumerate(states) if s == "freed"], 3, 0)
    return ledger


def columns(ledger) -> tuple:
    return tuple(bytes(c) for c in ledger.columns() if c is not None)


def expected_release(states, ids, share):
    """The model: what each distinct id is, and the fault kinds the call must get."""
    good, found = [], set()
    if len(set(ids)) != len(ids):
        found.add(kinds.DUPLICATE_ID)
    for b in dict.fromkeys(ids):
        state = states[b] if b < SIZE else "outside"
        if state == "outside":
            found.add(kinds.INVALID_ID)
        elif state == "unseen":
            found.add(kinds.FOREIGN_ID)
        elif state == "freed" and not share:
            found.add(kinds.DOUBLE_FREE)
        else:
            good.append(b)
    return good, found


@settings(max_examples=300, deadline=None)
@given(STATES, IDS, st.booleans())
def test_a_release_is_judged_as_the_model_says_and_changes_nothing(states, ids, share):
    ledger = ledger_in(states)
    before = columns(ledger)
    norm = normalize(list(ids), what="free()")
    plan = check_release(ledger, norm, method="free", pool=None, site=0, what="free()",
                         share=share)
    good, found = expected_release(states, ids, share)
    assert plan.good == good
    assert {f.kind for f in plan.faults} == found
    ranks = [kinds.PRECEDENCE[f.kind] for f in plan.faults]
    assert ranks == sorted(ranks), "most severe first"
    assert plan.faulty == bool(found)
    assert columns(ledger) == before, "checking never writes the ledger"


@settings(max_examples=200, deadline=None)
@given(STATES, st.lists(st.integers(0, SIZE - 1), max_size=6))
def test_never_seen_ids_are_learned_only_within_the_budget(states, ids):
    ledger = ledger_in(states, learn=True)
    ledger.learn_budget = 2
    norm = normalize(list(dict.fromkeys(ids)))
    plan = check_release(ledger, norm, method="free", pool=None, site=0, what="free()")
    unseen = [b for b in dict.fromkeys(ids) if states[b] == "unseen"]
    assert plan.learned == unseen[:2]
    assert (kinds.FOREIGN_ID in {f.kind for f in plan.faults}) == (len(unseen) > 2)


@settings(max_examples=300, deadline=None)
@given(STATES, IDS)
def test_a_handout_takes_free_and_unseen_ids_and_names_the_rest(states, ids):
    ledger = ledger_in(states)
    fresh, faults = check_handout(ledger, result_ids(list(ids)), "allocate")
    seen, want_fresh, shared, outside = set(), [], False, False
    for b in ids:
        if b in seen:  # a repeat in one hand-out is a block given to two owners
            shared = True
        elif b >= SIZE:
            outside = True
        elif states[b] == "live":
            shared = True
        else:
            want_fresh.append(b)
        seen.add(b)
    assert fresh == want_fresh
    assert {f.kind for f in faults} == ({kinds.INVALID_ID} if outside else set()) | (
        {kinds.SHARED_BLOCK} if shared else set())


def test_a_block_objects_own_count_must_be_positive_to_release():
    class Block:
        def __init__(self, block_id, ref_cnt):
            self.block_id, self.ref_cnt = block_id, ref_cnt

    ledger = Ledger(4, refcounted=True)
    ledger.allocate([0, 1], 2, 0)
    norm = normalize([Block(0, 1), Block(1, 0)], id_attr="block_id")
    plan = check_release(ledger, norm, method="free", pool=None, site=0, what="free()",
                         refcount_attr="ref_cnt")
    assert plan.good == [0] and plan.held == [1, 0]
    assert [f.kind for f in plan.faults] == [kinds.DOUBLE_FREE]
    assert "ref_cnt is already 0" in plan.faults[0].message
