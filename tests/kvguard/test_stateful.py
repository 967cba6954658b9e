"""Hypothesis state machines: the guarded allocators against a simple model.

Valid operation sequences must give zero violations and a ledger equal to the model; invalid
calls must give the right kind and (raise mode) leave allocator and ledger exactly as they were;
in repair mode the allocator stays consistent whatever it is fed.
"""

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvguard
from kvguard.examples import (
    LINKED_FREE_LIST_SPEC, REFCOUNTED_POOL_SPEC, LinkedFreeList, RefcountedPool,
)

from .helpers import snapshot

N = 12
CONTAINERS = st.sampled_from(["list", "tuple", "set", "numpy", "single"])


def wrap(ids, container):
    if container == "tuple":
        return tuple(ids)
    if container == "set":
        return set(ids)
    if container == "numpy":
        return np.array(ids, dtype=np.int64)
    if container == "single" and len(ids) == 1:
        return ids[0]
    return list(ids)


BAD_KINDS = ["duplicate-id", "double-free", "foreign-id", "invalid-id", "bool-id",
             "tensor-id", "consumed-iterable"]


class FreeListMachine(RuleBasedStateMachine):
    """LinkedFreeList (DeepSpeed's logic) guarded in raise mode."""

    mode = "raise"

    def __init__(self):
        super().__init__()
        self.alloc = LinkedFreeList(N)
        self.guard = kvguard.guard(self.alloc, LINKED_FREE_LIST_SPEC, on_violation=self.mode)
        self.live: list = []
        self.ever: set = set()

    @property
    def free_count(self):
        return N - len(self.live)

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        if n > self.free_count:
            return
        # int(): a numpy id freed earlier becomes the list head and is handed out as np.int64,
        # which the allocator's own `isinstance(blocks, int)` would then refuse.
        got = [int(b) for b in self.alloc.allocate(n)]
        assert not set(got) & set(self.live), "handed out a live block"
        self.live += got
        self.ever |= set(got)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), container=CONTAINERS)
    def free_some(self, data, container):
        chosen = data.draw(st.lists(st.sampled_from(self.live), min_size=1, unique=True))
        chosen = data.draw(st.permutations(chosen))
        self.alloc.free(wrap(chosen, container))
        for b in chosen:
            self.live.remove(b)

    def bad_ids(self, data, kind):
        free_seen = sorted(self.ever - set(self.live))
        never = sorted(set(range(N)) - self.ever)
        if kind == "duplicate-id" and self.live:
            b = data.draw(st.sampled_from(self.live))
            return [b, b], (b,)
        if kind == "double-free" and free_seen:
            b = data.draw(st.sampled_from(free_seen))
            return [b], (b,)
        if kind == "foreign-id" and never:
            b = data.draw(st.sampled_from(never))
            return [b], (b,)
        if kind == "invalid-id":
            b = data.draw(st.sampled_from([-1, N, N + 5, 10**9]))
            return [b], (b,)
        if kind == "bool-id":
            return data.draw(st.sampled_from([True, False, [True]])), None
        if kind == "tensor-id" and self.live:
            return torch.tensor(self.live[:1]), (self.live[0],)
        if kind == "consumed-iterable" and self.live:
            return (b for b in self.live[:1]), ()
        return None

    @rule(data=st.data(), kind=st.sampled_from(BAD_KINDS))
    def free_bad(self, data, kind):
        bad = self.bad_ids(data, kind)
        if bad is None:
            return
        value, block_ids = bad
        before = snapshot(self.alloc, self.guard)
        n_before = len(self.guard.violations)
        try:
            self.alloc.free(value)
        except kvguard.KVGuardError as exc:
            assert self.mode == "raise"
            assert exc.kind == kind
            assert block_ids is None or exc.block_ids == block_ids
            assert snapshot(self.alloc, self.guard) == before
        else:
            assert self.mode != "raise", f"{kind} was not caught"
            self.after_bad_call(kind, block_ids)
        assert self.guard.violations[n_before].kind == kind

    def after_bad_call(self, kind, block_ids):
        raise AssertionError("raise mode never gets here")

    @invariant()
    def ledger_matches_model(self):
        assert sorted(self.guard.live) == sorted(self.live)
        assert self.alloc.free_blocks == self.free_count
        self.guard.check()

    @invariant()
    def valid_calls_raise_nothing(self):
        assert all(v.kind in BAD_KINDS for v in self.guard.violations)


class RepairMachine(FreeListMachine):
    """The same misuses in repair mode: recorded, sanitized, never corrupting the allocator."""

    mode = "repair"

    def after_bad_call(self, kind, block_ids):
        if kind in ("tensor-id", "consumed-iterable"):
            # Their ids were live and valid: the sanitized call freed them as plain ints.
            freed = block_ids if block_ids else ()
            if kind == "consumed-iterable":
                freed = [self.live[0]]
            for b in freed:
                self.live.remove(b)
        elif kind == "duplicate-id":
            self.live.remove(block_ids[0])


class RefcountMachine(RuleBasedStateMachine):
    """RefcountedPool (vLLM-style) guarded in raise mode, against a refcount model."""

    def __init__(self):
        super().__init__()
        self.pool = RefcountedPool(N)
        self.guard = kvguard.guard(self.pool, REFCOUNTED_POOL_SPEC)
        self.refs = {}
        self.ever = set()

    @rule(n=st.integers(1, 3))
    def allocate(self, n):
        if n > N - len(self.refs):
            return
        for b in self.pool.allocate(n):
            assert b not in self.refs
            self.refs[b] = 1
            self.ever.add(b)

    @precondition(lambda self: self.ever)
    @rule(data=st.data())
    def share(self, data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.ever)), min_size=1, unique=True))
        self.pool.share(chosen)
        for b in chosen:
            self.refs[b] = self.refs.get(b, 0) + 1

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free(self, data):
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.refs)), min_size=1, unique=True))
        self.pool.free(chosen)
        for b in chosen:
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]

    @rule(data=st.data())
    def free_bad(self, data):
        dead = sorted(self.ever - set(self.refs))
        options = [("invalid-id", [N])]
        if dead:
            options.append(("double-free", [data.draw(st.sampled_from(dead))]))
        if self.refs:
            b = data.draw(st.sampled_from(sorted(self.refs)))
            options.append(("duplicate-id", [b, b]))
        kind, ids = data.draw(st.sampled_from(options))
        before = snapshot(self.pool, self.guard)
        try:
            self.pool.free(ids)
        except kvguard.KVGuardError as exc:
            assert exc.kind == kind
        else:
            raise AssertionError(f"{kind} not caught")
        assert snapshot(self.pool, self.guard) == before

    @invariant()
    def ledger_matches_model(self):
        live = self.guard.live
        assert {b: r.refcount for b, r in live.items()} == self.refs
        assert self.pool.num_free() == N - len(self.refs)
        self.guard.check()


SETTINGS = settings(max_examples=80, stateful_step_count=25, deadline=None)
TestFreeList = FreeListMachine.TestCase
TestFreeList.settings = SETTINGS
TestRepair = RepairMachine.TestCase
TestRepair.settings = SETTINGS
TestRefcount = RefcountMachine.TestCase
TestRefcount.settings = SETTINGS
