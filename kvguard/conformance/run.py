"""A judge that runs one call sequence against the allocator contract.

``Run`` drives an *unguarded* allocator with a sequence of operations and judges every answer
with kvguard's own ``Ledger`` (what a correct allocator must have live and free), so what it
finds are the allocator's bugs, never the caller's. An operation is abstract (``("free", (3,
0))`` frees the live blocks at positions 3 and 0 of the ledger's sorted live ids), so any
sequence is meaningful in any state: ``kvguard.testing`` lets hypothesis generate and shrink
such sequences, and ``kvguard replay --emit-test`` builds one from a staging log. Everything here
is plain Python; torch and numpy are touched only when a probe needs one of their values (and
skipped when they are not installed).
"""

from __future__ import annotations

from ..ids import result_ids
from ..ledger import Ledger
from ..spec import AllocatorSpec, read
from .clauses import CLAUSES, Broken, Driver, Step, requirement
from .probes import PROBES


def _plain(value) -> str:
    try:
        return repr(value.tolist()) if hasattr(value, "tolist") else repr(value)
    except Exception:  # an allocator's own object with a broken repr
        return f"<{type(value).__name__}>"


def _outcome(result) -> str:
    if result is None:
        return "returned None"
    text = _plain(result)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"returned {text}"


class Run:
    """One allocator driven through one sequence of abstract operations and judged as it goes.

    ``checks`` limits which clauses may be reported (a search for one clause ignores the
    others, so one bug cannot hide another); a step the judge cannot make valid (no live block
    to free) is skipped, not recorded.
    """

    def __init__(self, allocator, spec: AllocatorSpec, driver: Driver | None = None,
                 checks=None, dry: bool = False) -> None:
        self.allocator = allocator
        self.spec = spec
        self.driver = driver or Driver()
        self.checks = set(checks) if checks is not None else set(CLAUSES)
        self.dry = dry
        """Probes prepare (allocate, free) but make no bad call: the same sequence without them."""
        self.steps: list[Step] = []
        self.ops: list = []
        """The operations this run was given (``judge`` keeps them, for shrinking)."""
        size = self.driver.size(allocator) if self.driver.size else read(allocator, spec.size)
        self.size = size if isinstance(size, int) else None
        self.ledger = Ledger(self.size, refcounted=spec.refcounted)
        self.objects: dict = {}
        self.alias: dict = {}
        """Replayed calls: a recorded id -> the id this allocator handed out in its place."""
        self.clock = 0
        self.made = 0
        """Probes made and allocations that succeeded: a search that made none ran nothing."""
        self.allocated = 0
        self.initial_free = self.read_free()
        if self.initial_free is None and self.size is None:
            raise TypeError("the fuzzer needs the pool's size or its free count: give the spec "
                            "size= or free_count=")
        self.capacity = (self.initial_free if self.initial_free is not None
                         else self.size - len(self.driver.reserved))

    # --- what the allocator says about itself ---

    def read_free(self):
        how = self.driver.free_count
        try:
            value = how(self.allocator) if how else read(self.allocator, self.spec.free_count)
        except Exception:  # a corrupt allocator may fail to count: that is a wrong count too
            return -1
        return value if value is None else int(value)

    def expected_free(self) -> int:
        return self.capacity - len(self.ledger.live_ids())

    def live(self) -> list:
        return self.ledger.live_ids()

    def tombstones(self) -> list:
        stamp = self.ledger.stamp
        return [b for b in range(len(stamp)) if stamp[b] < 0]

    # --- calls ---

    def _alloc_call(self, n):
        if self.driver.allocate:
            return self.driver.allocate(self.allocator, n)
        return getattr(self.allocator, self.spec.alloc)(n)

    def _free_call(self, value):
        if self.driver.free:
            return self.driver.free(self.allocator, value)
        return getattr(self.allocator, self.spec.free)(value)

    def _share_call(self, value):
        if self.driver.share:
            return self.driver.share(self.allocator, value)
        return getattr(self.allocator, self.spec.share)(value)

    def _check(self, clause: str, did: str, required: str | None = None) -> None:
        if clause in self.checks:
            raise Broken(clause, did, required or requirement(clause, self.spec))

    def pick(self, pool: list, picks) -> list:
        out = []
        for p in picks:
            b = pool[p % len(pool)]
            if b not in out:
                out.append(b)
        return out

    def as_passed(self, ids: list):
        """The ids as this allocator's callers pass them: objects, a tensor, or a list."""
        if self.spec.id_attr is not None:
            return [self.objects[b] if b in self.objects else self.block(b) for b in ids], \
                "objects"
        if self.spec.tensor_ok:
            import torch
            return torch.tensor(ids, dtype=torch.int64), "tensor"
        return list(ids), "list"

    def block(self, b: int):
        """The object for id ``b`` that no allocation returned (a probe's never-allocated id)."""
        if self.spec.id_attr is None:
            return b
        return self.driver.block(self.allocator, b) if self.driver.block else None

    def _count_free(self, step: Step, clause: str, before) -> None:
        """After a step that must leave the ledger's free blocks free in the allocator too."""
        after = step.free_after = self.read_free()
        if after is None or self.initial_free is None:
            return
        want = step.expect_free = self.initial_free - len(self.ledger.live_ids())
        if after == want:
            return
        if step.op in PROBES and step.rejected:
            did = (f"rejected it ({step.outcome}), but not atomically: free count {before} -> "
                   f"{after}, must stay {want}")
        elif step.op in PROBES:
            did = (f"accepted it ({step.outcome}), but free count {before} -> {after}: freeing "
                   f"{step.effect} once makes it {want}")
        else:
            did = f"free count {before} -> {after} after {step.op}(), the ledger says {want}"
        self._check(clause, did)

    def _record(self, step: Step) -> Step:
        self.steps.append(step)
        return step

    # --- the operations ---

    def apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "allocate":
            self.allocate(op[1])
        elif kind == "free":
            self.free(op[1])
        elif kind == "share":
            self.share(op[1])
        elif kind == "exact":
            self.exact(op[1], op[2])
        else:
            PROBES[kind](self, *op[1:])

    def exact(self, op: str, recorded: tuple) -> None:
        """Replay one recorded call: ``allocate`` as many blocks as it handed out (its ids then
        name the ones this allocator hands out, in order), ``free``/``share`` those ids. A free
        the ledger finds wrong is made as that clause's bad call; ids never handed out in the
        replay keep their recorded value."""
        alias = self.alias
        if op == "allocate":
            before = len(self.steps)
            self.allocate(len(recorded))
            got = self.steps[-1].ids if len(self.steps) > before else []
            alias.update(zip(recorded, got))
            return
        ids = [alias.get(r, r) for r in recorded]
        if op == "share":
            if all(self.ledger.is_live(b) for b in ids) and len(set(ids)) == len(ids):
                value, form = self.as_passed(ids)
                self._valid_release("share", ids, value, form)
            return
        clause = self._wrong_free(ids)
        value, form = self.as_passed([b for b in ids])
        if clause is None:
            self._valid_release("free", ids, value, form)
        else:
            self.probe(clause, ids, value, form)

    def _wrong_free(self, ids: list):
        """The clause a free of these plain ids would test, or None when it is valid."""
        if len(set(ids)) != len(ids):
            return "duplicate-id"
        for b in ids:
            if not self.ledger.in_range(b) or b in self.driver.reserved or \
                    not self.ledger.seen(b):
                return "foreign-id"
            if not self.ledger.is_live(b):
                return "release-past-zero" if self.spec.refcounted else "double-free"
        return None

    def allocate(self, n: int, *, force: bool = False) -> None:
        """Allocate ``n`` blocks (no more than the ledger says are free, unless ``force``: the
        allocator's own count claims more, and the harm shown is what it hands out then)."""
        free = self.expected_free()
        n = n if force else min(n, free)
        if n <= 0:
            return
        self.clock += 1
        step = self._record(Step("allocate", [], n=n, expect_live=self.live()))
        before = self.read_free()
        step.free_before = before
        try:
            result = self._alloc_call(n)
        except Exception as exc:
            step.outcome = f"raised {exc!r}"
            step.rejected = True
            step.error = exc
            if not force:
                self._check("valid-trace", f"allocate({n}) raised {exc!r} with {free} blocks "
                            "free")
            return
        self.allocated += 1
        step.outcome = _outcome(result)
        if result is None:
            self._check("valid-trace", f"allocate({n}) returned None with {free} blocks free")
            return
        got = result_ids(result, self.spec.id_attr)
        ids = got.ids
        step.ids = list(ids)
        if got.objects is not None:
            self.objects.update(zip(ids, got.objects))
            step.outcome = f"returned the blocks {ids}"
        if got.faults:
            self._check("no-live-handout", f"allocate({n}) {step.outcome}: "
                        f"{got.faults[0].message}")
        if len(ids) != n:
            self._check("valid-trace", f"allocate({n}) handed out {len(ids)} ids {ids}")
        bad = [b for b in ids if not self.ledger.in_range(b) or b in self.driver.reserved]
        if bad:
            self._check("no-live-handout", f"allocate({n}) {step.outcome}: id(s) {bad} are "
                        "not blocks of the pool")
        twice = sorted({b for b in ids if ids.count(b) > 1})
        if twice:
            self._check("no-live-handout", f"allocate({n}) {step.outcome}: block(s) {twice} "
                        "twice in one call")
        live = [b for b in ids if self.ledger.is_live(b)]
        if live:
            self._check("no-live-handout", f"allocate({n}) {step.outcome}: block(s) {live} "
                        "are live (handed out and not freed)")
        fresh = [b for b in dict.fromkeys(ids) if b not in bad]
        self.ledger.grow(max(fresh, default=-1) + 1)
        self.ledger.allocate([b for b in fresh if not self.ledger.is_live(b)], self.clock, 0)
        self._count_free(step, "free-count", before)

    def free(self, picks) -> None:
        live = self.live()
        if not live:
            return
        ids = self.pick(live, picks)
        value, form = self.as_passed(ids)
        self._valid_release("free", ids, value, form)

    def share(self, picks) -> None:
        live = self.live()
        if not live or not self.spec.share:
            return
        ids = self.pick(live, picks)
        value, form = self.as_passed(ids)
        self._valid_release("share", ids, value, form)

    def share_ids(self, ids: list) -> None:
        """Add a reference to these live blocks (a probe's preparation)."""
        value, form = self.as_passed(ids)
        self._valid_release("share", ids, value, form)

    def _valid_release(self, op, ids, value, form) -> None:
        self.clock += 1
        step = self._record(Step(op, ids, value, form))
        before = step.free_before = self.read_free()
        try:
            result = (self._free_call if op == "free" else self._share_call)(value)
        except Exception as exc:
            step.outcome = f"raised {exc!r}"
            step.rejected = True
            step.error = exc
            self._check("valid-trace", f"{op}({ids}) of live blocks raised {exc!r}")
            return
        step.outcome = _outcome(result)
        if op == "free":
            self.ledger.release(ids, self.clock, 0)
        else:
            self.ledger.share(ids, self.clock, 0)
        self._count_free(step, "free-count", before)

    def refcounts(self, ids) -> dict:
        """Block -> its reference count as the pool keeps it (``Driver.refcount``), for the
        in-range plain ids among ``ids``; empty without a reader."""
        read = self.driver.refcount
        if read is None:
            return {}
        out = {}
        for b in ids:
            if type(b) is int and self.ledger.in_range(b) and b not in self.driver.reserved:
                try:
                    out[b] = int(read(self.allocator, b))
                except Exception:
                    continue
        return out

    def intended(self, ids: list) -> list:
        """The releases a caller meant by a bad call that was accepted anyway: each live block
        it names, once on a plain pool, as often as named but never past zero on a refcounted
        one. The ledger follows that, so what comes after shows what the call corrupted."""
        out = []
        for b in ids:
            if type(b) is not int or not self.ledger.is_live(b):
                continue
            if self.spec.refcounted:
                if out.count(b) < self.ledger.refcount(b):
                    out.append(b)
            elif b not in out:
                out.append(b)
        return out

    def probe(self, clause: str, ids: list, value, form: str, *, effect=None,
              mutate_to=None, intent=None, via_release=False) -> None:
        """Make one bad call. ``effect``: the ids it frees if the allocator accepts it and
        handles it correctly (None: it must be rejected). ``intent``: what the caller meant
        to free, had a must-reject call been accepted (default: ``intended(ids)``)."""
        if self.dry:
            return
        self.clock += 1
        self.made += 1
        step = self._record(Step(clause, list(ids), value, form, effect=effect,
                                 must_reject=effect is None, mutate_to=mutate_to,
                                 via_release=via_release))
        before = step.free_before = self.read_free()
        counts = self.refcounts(ids)
        try:
            result = self.driver.release(self.allocator, value) if via_release \
                else self._free_call(value)
        except Exception as exc:
            step.outcome = f"raised {exc!r}"
            step.rejected = True
            step.error = exc
        else:
            step.outcome = _outcome(result)
        if step.rejected:
            after = self.refcounts(counts)
            moved = [(b, n, after[b]) for b, n in counts.items() if b in after and after[b] != n]
            if moved:
                b, n, m = moved[0]
                self._check(clause, f"rejected it ({step.outcome}), but not atomically: block "
                            f"{b}'s reference count {n} -> {m}")
        if mutate_to is not None:
            value.fill_(mutate_to)  # the caller reuses its buffer, as callers do
        if not step.rejected:
            if effect is None:
                self.ledger.release(self.intended(ids) if intent is None else intent,
                                    self.clock, 0)
                self._check(clause, f"accepted it ({step.outcome})")
            else:
                self.ledger.release(effect, self.clock, 0)
        self._count_free(step, clause, before)

    def run(self, ops) -> Broken | None:
        """Apply ``ops``; the first broken clause (among ``checks``), or None."""
        try:
            for op in ops:
                self.apply(op)
        except Broken as broken:
            self.steps[-1].broken = broken
            return broken
        return None
