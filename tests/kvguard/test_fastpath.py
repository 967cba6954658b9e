"""The guard's fast path against its careful path: same verdicts on random traces.

Two twins of one allocator replay the same random trace, one guarded as usual, one with
``fast_path=False`` (every call read by the careful path). After each call both must agree on
everything a user can see: the call's outcome (result or error kind), every violation (kind,
ids, message, the flight recorder it shows), ``Guard.live``, ``Guard.stats``, the ledger's
columns, and the allocator's own state. Traces mix valid use with every misuse (duplicates,
double frees, foreign, negative and bool ids, tensors, generators, numpy arrays and scalars,
lists of numpy scalars, block objects, the skipped null block) over every spec shape: plain,
refcounted with shares, ``id_attr`` block objects with and without a ``skip`` hint, sub-pools.

The allocator is a tolerant model written here (it never raises and reads ids leniently), so
that whatever a mode forwards reaches it and both twins stay comparable.
"""

import operator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvguard
from kvguard.guard import careful
from kvguard.guard.evidence import operations
from kvguard.marks import THE_ALLOCATOR

from .conftest import three_ways, use_wrappers
from .helpers import ledger_state

SIZE = 10


class Block:
    """A block object as vLLM's pool hands them out (``block_id``, its pool's ``ref_cnt``; the
    null block is skipped)."""

    def __init__(self, block_id: int, is_null: bool, counts: list) -> None:
        self.block_id = block_id
        self.is_null = is_null
        self._counts = counts

    @property
    def ref_cnt(self) -> int:
        return self._counts[self.block_id]


class SlotBlock:
    """The same block with its fields in ``__slots__``, as vLLM's ``KVCacheBlock`` (a slotted
    dataclass): the compiled reader reads those straight from the object. Pools hand out both
    kinds, mixed, so the readers meet each in turn."""

    __slots__ = ("block_id", "is_null", "_counts", "pool")
    __init__ = Block.__init__
    ref_cnt = Block.ref_cnt


class TolerantPool:
    """Two sub-pools of ``SIZE`` blocks with reference counts; block 0 of each is the null block
    when ``objects`` (never handed out). Reads any ids leniently and never raises."""

    def __init__(self, objects: bool = False, tensors: bool = False) -> None:
        self.tensors = tensors
        self.size = SIZE
        self.ref = {p: [0] * SIZE for p in (0, 1)}
        self.objects = [(SlotBlock if b % 2 else Block)(b, objects and b == 0, self.ref[0])
                        for b in range(SIZE)]
        for block in self.objects:
            block.pool = self  # as vLLM's blocks name their pool
        self.use_objects = objects
        first = 1 if objects else 0
        self.free_list = {p: list(range(SIZE - 1, first - 1, -1)) for p in (0, 1)}

    def allocate(self, n, pool=0):
        free = self.free_list[pool]
        out = [free.pop() for _ in range(min(n, len(free)))]
        for b in out:
            self.ref[pool][b] = 1
        if self.tensors:  # DeepSpeed and SGLang hand out tensors
            return torch.tensor(out, dtype=torch.int32 if n % 2 else torch.int64)
        return [self.objects[b] for b in out] if self.use_objects else out

    def _read(self, ids):
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        items = list(ids) if hasattr(ids, "__iter__") else [ids]
        out = []
        for x in items:
            x = getattr(x, "block_id", x)
            if hasattr(x, "tolist"):
                x = x.tolist()
            try:
                b = operator.index(x)
            except TypeError:
                continue
            if 0 <= b < SIZE:
                out.append(b)
        return out

    def free(self, ids, pool=0):
        for b in self._read(ids):
            self.ref[pool][b] -= 1
            if self.ref[pool][b] == 0:
                self.free_list[pool].append(b)

    def share(self, ids, pool=0):
        for b in self._read(ids):
            if self.ref[pool][b] == 0 and b in self.free_list[pool]:
                self.free_list[pool].remove(b)
            self.ref[pool][b] += 1

    def num_free(self):
        return len(self.free_list[0])

    def state(self):
        return {p: (list(self.ref[p]), list(self.free_list[p])) for p in (0, 1)}


def _null(block) -> bool:
    return getattr(block, "is_null", False)


def _null_hinted(block) -> bool:
    return getattr(block, "is_null", False)


_null_hinted.keeps_all = lambda pool, blocks: not any(map(_null, blocks))


FOREIGN = object()
"""The pool of the "foreign" form's blocks: another pool's, which ``_null_declared`` skips as
vLLM's adapter skips blocks it hands on to their own pool."""


def _null_declared(block) -> bool:
    return getattr(block, "is_null", False) or getattr(block, "pool", None) is FOREIGN


def _all_of_this_pool(pool, blocks) -> bool:
    return all(not b.is_null and b.pool is pool for b in blocks)


# vLLM's adapter form: the compiled wrapper checks the identities, the closure calls the function
_all_of_this_pool.identities = (("is_null", False), ("pool", THE_ALLOCATOR))
_null_declared.keeps_all = _all_of_this_pool

SHAPES = {
    "plain": (False, kvguard.AllocatorSpec(size="size", free_count="num_free")),
    "tensor_ok": ("tensors", kvguard.AllocatorSpec(tensor_ok=True, size="size")),
    "refcounted": (False, kvguard.AllocatorSpec(share="share", refcounted=True, size="size")),
    "pool_arg": (False, kvguard.AllocatorSpec(share="share", refcounted=True, pool_arg="pool",
                                              size="size")),
    "plain_pool_arg": (False, kvguard.AllocatorSpec(pool_arg="pool", size="size")),
    "id_attr": (True, kvguard.AllocatorSpec(share="share", refcounted=True, id_attr="block_id",
                                            skip=_null, iterator_ok=True, size="size")),
    "id_attr_hinted": (True, kvguard.AllocatorSpec(share="share", refcounted=True,
                                                   id_attr="block_id", skip=_null_hinted,
                                                   iterator_ok=True, size="size")),
    "id_attr_identities": (True, kvguard.AllocatorSpec(share="share", refcounted=True,
                                                       id_attr="block_id", skip=_null_declared,
                                                       refcount_attr="ref_cnt",
                                                       iterator_ok=True, size="size")),
    "id_attr_plain": (True, kvguard.AllocatorSpec(id_attr="block_id", size="size")),
    "refcount_attr": (True, kvguard.AllocatorSpec(share="share", refcounted=True,
                                                  id_attr="block_id", refcount_attr="ref_cnt",
                                                  skip=_null_hinted, iterator_ok=True,
                                                  size="size")),
}

PLAIN_FORMS = ["list", "tuple", "int", "np64", "np32", "npu8", "npscalar", "nplist", "mixed",
               "gen", "bool", "npbool", "npboolscalar", "tensor", "negative", "float", "set",
               "2d", "tensor32", "tensoru8", "tensorbool", "tensorfloat", "tensor2d",
               "tensor0d", "tensornegative", "np0d", "np2dempty", "npcol", "npobject",
               "npu64big", "npfloat", "nptimedelta", "npempty", "npscalars", "npscalarneg",
               "npscalarsub", "npscalaru64big", "shifty", "flipindex", "mutindex"]
READ_TWICE = ["shifty", "flipindex", "mutindex"]
"""Arguments that give other ids when read a second time: the allocator must get what the
guard read (its own copy), on every path."""
OBJECT_FORMS = ["list", "tuple", "reversed", "gen", "ints", "null", "missing", "foreign"]


SCALAR_TYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                np.uint64, np.longlong, np.ulonglong, np.intc, np.intp]
"""Every numpy integer scalar type: the compiled reader reads each one's value in place."""


class IntOverride(np.int64):
    """A subclass of ``np.int64`` (a heap type) whose ``int()`` is not its stored value: the
    compiled reader must not read its bytes, but ask ``int()`` as the Python reader does."""

    def __int__(self):
        return int(np.int64(self)) + 1


class Shifty:
    """An iterable of the caller's own: ``first`` the first time it is iterated, then ``then``."""

    def __init__(self, first, then) -> None:
        self.reads = [list(first), list(then)]

    def __iter__(self):
        return iter(self.reads.pop(0) if len(self.reads) > 1 else self.reads[0])


class Flip:
    """An id whose ``__index__`` gives ``first`` once, then ``then``."""

    def __init__(self, first, then) -> None:
        self.values = [first, then]

    def __index__(self):
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


class Rewriter:
    """An id whose first ``__index__`` rewrites the list it sits in (to ``then``)."""

    def __init__(self, value, home, then) -> None:
        self.value, self.home, self.then = value, home, then

    def __index__(self):
        if self.then is not None:
            self.home[:], self.then = self.then, None
        return self.value


def shape_ids(ids, form):
    """``ids`` (plain ints) in the form a caller might pass."""
    other = [(b + 1) % SIZE if b >= 0 else b for b in ids]  # what a second read gives
    if form == "shifty":
        return Shifty(ids, other)
    if form == "flipindex":
        return [Flip(b, o) for b, o in zip(ids, other)]
    if form == "mutindex":
        home: list = []
        home += [Rewriter(b, home, other if n == 0 else None) for n, b in enumerate(ids)]
        return home
    if form == "tuple":
        return tuple(ids)
    if form == "int":
        return ids[0] if ids else []
    if form == "np64":
        return np.array(ids, dtype=np.int64)
    if form == "np32":
        return np.array(ids, dtype=np.int32)
    if form == "npu8":
        return np.array(ids, dtype=np.uint8)
    if form == "npscalar":
        return np.int64(ids[0]) if ids else []
    if form == "npscalars":  # one id as a scalar of each numpy integer type in turn
        return SCALAR_TYPES[sum(ids) % len(SCALAR_TYPES)](ids[0]) if ids else []
    if form == "npscalarneg":
        return np.int16(-1 - ids[0]) if ids else np.int8(-128)
    if form == "npscalarsub":
        return IntOverride(ids[0]) if ids else []
    if form == "npscalaru64big":
        return np.uint64(2 ** 64 - 1 - (ids[0] if ids else 0))
    if form == "nplist":
        return [np.int64(b) for b in ids]
    if form == "mixed":
        return [np.int32(b) if n % 2 else b for n, b in enumerate(ids)]
    if form == "gen":
        return (b for b in ids)
    if form == "bool":
        return list(ids) + [True]
    if form == "npbool":
        mask = np.zeros(max([SIZE - 1, *ids]) + 1, dtype=bool)
        mask[[b for b in ids if b >= 0]] = True
        return mask
    if form == "npboolscalar":
        return np.bool_(True)
    if form == "tensor":
        return torch.tensor(ids, dtype=torch.int64)
    if form == "tensor32":
        return torch.tensor(ids, dtype=torch.int32)
    if form == "tensoru8":
        return torch.tensor([b % 256 for b in ids], dtype=torch.uint8)
    if form == "tensorbool":
        return torch.tensor([b % 2 == 1 for b in ids], dtype=torch.bool)
    if form == "tensorfloat":
        return torch.tensor(ids, dtype=torch.float32)
    if form == "tensor2d":
        return torch.tensor([ids], dtype=torch.int64)
    if form == "tensor0d":
        return torch.tensor(ids[0] if ids else 0)
    if form == "tensornegative":
        return torch.tensor(list(ids) + [-1])
    if form == "negative":
        return list(ids) + [-1]
    if form == "float":
        return list(ids) + [1.0]
    if form == "set":
        return set(ids)
    if form == "2d":
        return np.array([ids], dtype=np.int64)
    # what an array's tolist() gives is not always a 1-D array's list of ints (the compiled
    # reader tells ndim by it): a 0-D array, a 2-D one with no rows, a column, ints in an
    # object array or a generic timedelta array (tolist() gives ints; the kind is not "iu")
    if form == "np0d":
        return np.array(ids[0] if ids else 0, dtype=np.int64)
    if form == "np2dempty":
        return np.zeros((0, len(ids) + 1), dtype=np.int64)
    if form == "npcol":
        return np.array([[b] for b in ids], dtype=np.int64)
    if form == "npobject":
        return np.array(ids, dtype=object)
    if form == "npu64big":
        return np.array([b % 2**63 for b in ids] + [2**64 - 1], dtype=np.uint64)
    if form == "npfloat":
        return np.array(ids, dtype=np.float64)
    if form == "nptimedelta":
        return np.array(ids, dtype="m8")
    if form == "npempty":
        return np.array(ids[:0], dtype=np.int64)
    return list(ids)


STRAY = object()
"""An item without ``block_id`` (one object, so both twins' reports name the same one)."""


def shape_objects(allocator, ids, form):
    blocks = [allocator.objects[b] for b in ids]
    if form == "tuple":
        return tuple(blocks)
    if form == "reversed":
        return reversed(blocks)
    if form == "gen":
        return (b for b in blocks)
    if form == "ints":
        return list(ids)
    if form == "null":
        return blocks + [allocator.objects[0]]
    if form == "missing":
        return blocks + [STRAY]
    if form == "foreign":  # the same ids, live here too, but blocks of another pool
        foreign = [Block(b.block_id, False, allocator.ref[0]) for b in blocks]
        for b in foreign:
            b.pool = FOREIGN
        return foreign
    return blocks


STEP = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 4), st.integers(0, 1)),
    st.tuples(st.just("bump"), st.integers(0, SIZE - 1), st.integers(-1, 1)),
    st.tuples(st.sampled_from(["free", "share"]),
              st.lists(st.integers(-1, 40), min_size=0, max_size=4),
              st.integers(0, len(PLAIN_FORMS) - 1), st.integers(0, 1)),
)


def handed_ids(got) -> list:
    if isinstance(got, torch.Tensor):
        return got.tolist()
    return [getattr(b, "block_id", b) for b in got]


def twin(kind):
    """A fresh allocator of a shape's kind: block objects (True), tensors, or plain ints."""
    return TolerantPool(objects=kind is True, tensors=kind == "tensors")


def run(allocator, guard, step, handed, objects, pooled):
    """One step on one twin; returns what the caller saw."""
    kind = step[0]
    if kind == "bump":  # the engine changes a count behind the guard (vLLM's copy-on-write)
        block = handed[step[1] % len(handed)] if handed else step[1]
        allocator.ref[0][block] += step[2]
        return ("ok",)
    pool_kw = {"pool": step[2 if kind == "alloc" else 3]} if pooled else {}
    try:
        if kind == "alloc":
            got = allocator.allocate(step[1], **pool_kw)
            return ("ok", handed_ids(got))
        if kind == "share" and guard.spec.share is None:
            return ("skipped",)
        picks = step[1]
        # Pick among ids handed out so far (live or freed: double frees come from here), or
        # past them (foreign or out of range).
        ids = [handed[p % len(handed)] if handed and p >= 0 and p < 30 else p % 12 for p in picks]
        if objects:
            form = OBJECT_FORMS[step[2] % len(OBJECT_FORMS)]
            ids = [b for b in ids if 0 <= b < SIZE]
            value = shape_objects(allocator, ids, form)
        else:
            value = shape_ids(ids, PLAIN_FORMS[step[2]])
        getattr(allocator, kind)(value, **pool_kw)
        return ("ok",)
    except kvguard.KVGuardError as exc:
        return ("error", exc.kind)


def seen(guard):
    """Everything a user can read off the guard."""
    violations = [(v.kind, v.block_ids, v.message, v.pool,
                   [(op.op, tuple(op.ids), op.pool, op.call) for op in v.history])
                  for v in guard.violations]
    live = {b: (r.refcount, r.allocated_by_call) for b, r in guard.live.items()}
    history = [(op.op, tuple(op.ids), op.pool, op.call, op.count)
               for op in operations(guard.history)]
    return violations, live, guard.stats.to_dict(), ledger_state(guard), history


def twins_of(kind, spec, mode, stacks):
    """The twins a trace is replayed on: the fast path in C (when built), the fast path in
    Python (the closures, the reference), and the careful path."""
    out = []
    for accel, fast in three_ways():
        allocator = twin(kind)
        # "sampled": staging's sample= (the capture the compiled wrappers call in Python)
        options = {"stacks": "cheap", "sample": 2} if stacks == "sampled" else {"stacks": stacks}
        with use_wrappers(accel):
            guard = kvguard.guard(allocator, spec, on_violation=mode, fast_path=fast, **options)
        out.append((allocator, guard))
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=1, max_size=25), mode=st.sampled_from(["raise", "log",
                                                                           "repair"]),
       stacks=st.sampled_from(["off", "cheap", "sampled"]))
@example(steps=[("free", [], PLAIN_FORMS.index("tensorbool"), 0)], mode="raise",
         stacks="off")  # empty mask
@example(steps=[("free", [], PLAIN_FORMS.index("tensorfloat"), 0)], mode="log", stacks="off")
@example(steps=[("alloc", 3, 0), ("free", [0, 1, 2], OBJECT_FORMS.index("foreign"), 0)],
         mode="log", stacks="off")  # live ids, every block another pool's: all skipped
def test_the_fast_path_gives_the_careful_paths_verdicts(shape, steps, mode, stacks):
    """Compiled wrappers, Python closures and the careful path: same outcome of every call,
    same violations, live blocks, counters, ledger columns (the interned sites of every
    allocation and free among them, with ``stacks="cheap"`` and with one call in two sampled)
    and allocator state. (Every call below reaches the allocator through ``f(*args, **kw)``,
    whose instruction has no inline cache: the site keys are the same on both implementations
    here, not only the frames they resolve to.)"""
    kind, spec = SHAPES[shape]
    objects = kind is True
    pooled = spec.pool_arg is not None
    twins = twins_of(kind, spec, mode, stacks)
    handed = []
    for step in steps:
        outcomes = [run(a, g, step, handed, objects, pooled) for a, g in twins]
        assert all(o == outcomes[-1] for o in outcomes), step
        if outcomes[0][0] == "ok" and step[0] == "alloc":
            handed += outcomes[0][1]
        careful_alloc, careful_guard = twins[-1]
        for fast_alloc, fast_guard in twins[:-1]:
            assert seen(fast_guard) == seen(careful_guard), step
            assert fast_alloc.state() == careful_alloc.state(), step


def test_an_engine_count_raised_behind_the_guard_is_followed_on_both_paths():
    """refcount_attr: a reference the engine took itself (vLLM's copy-on-write ``ref_cnt += 1``)
    keeps the block live in the ledger after one release, on either path."""
    seen_by = []
    for fast in (True, False):
        allocator = TolerantPool(objects=True)
        guard = kvguard.guard(allocator, SHAPES["refcount_attr"][1], stacks="off",
                              fast_path=fast)
        a, b = allocator.allocate(2)
        allocator.ref[0][a.block_id] += 1
        allocator.free([a, b])
        seen_by.append(seen(guard))
        assert {k: r.refcount for k, r in guard.live.items()} == {a.block_id: 1}
    assert seen_by[0] == seen_by[1]


def test_the_fast_path_is_taken(monkeypatch, implementation):
    """The twins above would agree trivially if both went the careful way: the fast one must
    not reach the careful reader on clean calls of any shape."""
    calls = []
    monkeypatch.setattr(careful, "plan_release", lambda *a: calls.append(a))
    monkeypatch.setattr(careful, "commit_allocation", lambda *a: calls.append(a))
    for shape, (kind, spec) in SHAPES.items():
        objects = kind is True
        allocator = twin(kind)
        guard = kvguard.guard(allocator, spec, stacks="off")
        got = allocator.allocate(3)
        ids = handed_ids(got)
        if spec.share:
            allocator.share(got[:1] if objects else np.array(ids[:1]))
        if objects:
            allocator.free(reversed(got) if spec.iterator_ok else got)
        else:
            allocator.free(torch.tensor(ids) if kind == "tensors" else np.array(ids))
        if spec.share:
            allocator.free(got[:1] if objects else [np.int64(ids[0])])
        assert calls == [], shape
        assert guard.live == {}, shape


class Recording(TolerantPool):
    """Records the ids each ``free``/``share`` call read (the allocator's view)."""

    def __init__(self) -> None:
        super().__init__()
        self.views: list = []

    def free(self, ids, pool=0):
        self.views.append(sorted(self._read(ids)))
        super().free(list(self.views[-1]), pool)

    def share(self, ids, pool=0):
        self.views.append(sorted(self._read(ids)))
        super().share(list(self.views[-1]), pool)


@pytest.mark.parametrize("form", READ_TWICE)
@pytest.mark.parametrize("mode", ["raise", "log", "repair"])
@pytest.mark.parametrize("method", ["free", "share"])
def test_an_argument_read_twice_reaches_the_allocator_as_the_guard_read_it(form, mode, method):
    """The guard forwards its own copy of what it checked: the allocator reads the same ids,
    on the compiled wrappers, the closures and the careful path, in every mode."""
    spec = kvguard.AllocatorSpec(share="share", refcounted=True, size="size")
    for accel, fast in three_ways():
        allocator = Recording()
        with use_wrappers(accel):
            g = kvguard.guard(allocator, spec, on_violation=mode, fast_path=fast)
        ids = allocator.allocate(3)
        getattr(allocator, method)(shape_ids(ids, form))
        assert allocator.views == [sorted(ids)], (accel, fast)
        assert g.history[-1][1] == ids and g.violations == [], (accel, fast)
        expected = [2 if method == "share" else 0] * 3
        assert [allocator.ref[0][b] for b in ids] == expected, (accel, fast)


def test_calls_with_no_ids_are_counted_not_recorded_alike_on_all_three():
    """An engine's ``allocate(0)`` and ``free([])`` (most of Hugging Face continuous batching's
    calls) fold into one ``empty`` entry between real ones, counting them and ending at the
    last one's call number, on the compiled wrappers, the closures and the careful path; a
    faulty call whose ids were all refused keeps an entry of its own."""
    histories, reports = [], []
    for accel, fast in three_ways():
        allocator = twin(False)
        with use_wrappers(accel):
            guard = kvguard.guard(allocator, SHAPES["plain"][1], on_violation="log",
                                  stacks="off", fast_path=fast, history=5)
        held = handed_ids(allocator.allocate(2))
        for _ in range(57):
            allocator.allocate(0)
            allocator.free([])
        allocator.free(held[:1])
        allocator.free([])
        allocator.free([-1])  # refused: a report, and an entry of its own
        allocator.free([])
        allocator.free(held[:1])  # a double free: its report shows the recorder
        histories.append([(op.op, op.ids, op.call, op.count)
                          for op in operations(guard.history)])
        reports.append(guard.violations[-1].render().split("oldest first:")[1])
    assert histories[0] == [("free", (0,), 117, 1), ("empty", (), 118, 1),
                            ("free", (), 119, 1), ("empty", (), 120, 1), ("free", (0,), 121, 1)]
    assert all(h == histories[0] for h in histories)
    assert "    ... 114 empty calls (#3..#116) ...\n    #117 free [0]\n" in reports[0]
    assert all(r == reports[0] for r in reports)
