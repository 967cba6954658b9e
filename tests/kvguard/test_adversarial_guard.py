"""Adversarial use of the guard: each test is a class of attack on one of its promises.

The promises (docs/reliability.md): in ``log`` and ``repair`` the serving path never breaks and
nothing is lost; in ``raise`` a rejected call never reaches the allocator; a guard never changes
what the allocator hands out or takes back except as its mode says.
"""

import copy
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvguard
from kvguard import kinds
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.guard import MODES
from kvguard.guard.telemetry import internal_error

pytestmark = pytest.mark.usefixtures("quiet_kvguard_log")


class SetPool:
    """An exact allocator: a set of free ids; it refuses what it did not hand out."""

    def __init__(self, n=8, reserved=()):
        self.n = n
        self.free_ids = set(range(n)) - set(reserved)

    def allocate(self, k):
        ids = sorted(self.free_ids)[:k]
        self.free_ids.difference_update(ids)
        return ids

    def free(self, ids):
        ids = [ids] if isinstance(ids, int) else list(ids)
        for b in ids:
            if b in self.free_ids or not 0 <= b < self.n:
                raise ValueError(f"block {b} is not handed out")
        self.free_ids.update(ids)

    def num_free(self):
        return len(self.free_ids)


SET_SPEC = kvguard.AllocatorSpec(size="n", free_count="num_free")


# --- 1. allocate() returning a one-shot iterator -------------------------------------------

ONE_SHOT = {
    "generator": lambda ids: (b for b in ids),
    "map": lambda ids: map(int, ids),
    "iter(list)": lambda ids: iter(ids),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make", ONE_SHOT.values(), ids=ONE_SHOT)
def test_a_one_shot_allocation_reaches_the_caller_intact(mode, make):
    class OneShot(SetPool):
        def allocate(self, k):
            return make(super().allocate(k))

    a = OneShot(8)
    g = kvguard.guard(a, SET_SPEC, on_violation=mode)
    got = a.allocate(3)
    assert next(got) == 0, "still an iterator"
    assert list(got) == [1, 2], "and it yields every id the allocator handed out"
    assert sorted(g.live) == [0, 1, 2], "the ledger holds what the caller got"
    a.free([0, 1, 2])
    assert g.violations == [] and a.num_free() == 8
    assert g.check() == {None: (0, 0)}


def test_a_one_shot_allocation_that_fails_midway_fails_the_caller_the_same_way():
    class Flaky(SetPool):
        def allocate(self, k):
            ids = super().allocate(k)

            def gen():
                yield ids[0]
                raise RuntimeError("device lost")
            return gen()

    a = Flaky(8)
    g = kvguard.guard(a, SET_SPEC, on_violation="log")
    got = a.allocate(2)
    assert next(got) == 0
    with pytest.raises(RuntimeError, match="device lost"):
        next(got)
    assert sorted(g.live) == [0]


# --- 2. repair forwards the caller's container type ----------------------------------------

class TypedPool(SetPool):
    """free() takes exactly one container type, as real pools do (numpy refcounts indexed by
    an array, a tensor kernel, a tuple key)."""

    def __init__(self, n, check):
        super().__init__(n)
        self.check = check

    def free(self, ids):
        self.check(ids)
        if isinstance(ids, torch.Tensor) or isinstance(ids, np.ndarray):
            ids = ids.tolist()
        elif isinstance(ids, np.integer):
            ids = int(ids)
        super().free(ids)


def _is(tp, dtype=None):
    def check(ids):
        if type(ids) is not tp:
            raise TypeError(f"free() takes a {tp.__name__}, got {type(ids).__name__}")
        if dtype is not None and ids.dtype != dtype:
            raise TypeError(f"free() takes {dtype}, got {ids.dtype}")
    return check


CONTAINERS = {
    "list": (list, _is(list), False),
    "tuple": (tuple, _is(tuple), False),
    "int": (lambda ids: ids[0], _is(int), False),
    "np.int32 scalar": (lambda ids: np.int32(ids[0]), _is(np.int32), False),
    "ndarray int32": (lambda ids: np.array(ids, dtype=np.int32), _is(np.ndarray, np.int32),
                      False),
    "ndarray uint64": (lambda ids: np.array(ids, dtype=np.uint64),
                       _is(np.ndarray, np.uint64), False),
    "tensor int32": (lambda ids: torch.tensor(ids, dtype=torch.int32),
                     _is(torch.Tensor, torch.int32), True),
    "tensor int64": (lambda ids: torch.tensor(ids, dtype=torch.int64),
                     _is(torch.Tensor, torch.int64), True),
}

FAULTS = {
    "double-free": lambda live, freed: live[:1] + freed[:1],
    "foreign-id": lambda live, freed: live[:1] + [7],
    "out-of-range": lambda live, freed: live[:1] + [99],
    "duplicate-id": lambda live, freed: live[:1] + live[:1],
    "only-bad": lambda live, freed: freed[:1],
    "clean": lambda live, freed: live[:1],
}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(container=st.sampled_from(sorted(CONTAINERS)), fault=st.sampled_from(sorted(FAULTS)),
       rounds=st.integers(1, 3))
def test_repair_forwards_the_callers_container_and_never_raises(container, fault, rounds):
    make, check, tensor_ok = CONTAINERS[container]
    a = TypedPool(8, check)
    g = kvguard.guard(a, SET_SPEC.replace(tensor_ok=tensor_ok), on_violation="repair")
    freed = []
    for _ in range(rounds):
        live = a.allocate(2)
        a.free(make([live[1]]))
        freed.append(live[1])
        ids = FAULTS[fault](live, freed)
        if container in ("int", "np.int32 scalar"):
            ids = ids[-1:] if fault != "clean" else ids
        a.free(make(ids))
        theirs, ours = g.check()[None]  # raises `inconsistent` when they disagree
        assert theirs == ours
        assert sorted(set(range(8)) - a.free_ids) == sorted(g.live)
    single = container in ("int", "np.int32 scalar")
    if fault != "clean" and not (single and fault == "duplicate-id"):
        assert g.violations, "each fault was still reported"


def test_repair_keeps_a_tensor_on_its_device_and_dtype():
    seen = []

    class TensorPool(SetPool):
        def free(self, ids):
            seen.append((ids.dtype, ids.device))
            super().free(ids.tolist())

    a = TensorPool(8)
    kvguard.guard(a, SET_SPEC.replace(tensor_ok=True), on_violation="repair")
    ids = a.allocate(2)
    a.free(torch.tensor(ids + ids, dtype=torch.int16))
    assert seen == [(torch.int16, torch.device("cpu"))]


# --- 3. copies and pickles of a guarded allocator ------------------------------------------

def test_a_shallow_copy_is_an_unguarded_correct_copy():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    ids = a.allocate(2)
    b = copy.copy(a)
    assert kvguard.guard_of(b) is None and "free" not in vars(b)
    b._blocks = list(b._blocks)  # a shallow copy shares its list; give it its own
    b.free(ids)
    assert a.free_blocks == 6 and b.free_blocks == 8, "the copy freed on itself"
    assert sorted(g.live) == ids, "the original's ledger is untouched"
    a.free(ids)
    assert g.check() == {None: (0, 0)}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_deep_copy_or_a_pickle_holds_the_unguarded_state(how):
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    ids = a.allocate(3)
    b = copy.deepcopy(a) if how == "deepcopy" else pickle.loads(pickle.dumps(a))
    assert type(b) is LinkedFreeList and kvguard.guard_of(b) is None
    assert set(vars(b)) == set(vars(LinkedFreeList(8)))
    b.free(ids)
    assert b.free_blocks == 8 and a.free_blocks == 5
    assert sorted(g.live) == ids and g.guarded
    a.free(ids)
    assert g.violations == []


class Reducing(SetPool):
    def __reduce__(self):
        return (Reducing, (self.n,), dict(vars(self)))  # its whole __dict__, wrappers included


def test_a_copy_of_a_class_with_its_own_reduce_is_still_unguarded():
    a = Reducing(8)
    kvguard.guard(a, SET_SPEC)
    a.allocate(2)
    b = pickle.loads(pickle.dumps(a))
    assert kvguard.guard_of(b) is None and b.free_ids == a.free_ids
    assert set(vars(b)) == {"n", "free_ids"}


def test_unguard_after_copying_restores_the_original():
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    copy.copy(a)
    g.unguard()
    assert set(vars(a)) == set(vars(LinkedFreeList(4)))


# --- 4. learning on late attach is bounded -------------------------------------------------

class ReservingPool(SetPool):
    """Reserves block 0 at construction (padding, the null block): never handed out."""

    def __init__(self, n=8):
        super().__init__(n, reserved=(0,))


def test_a_guard_attached_at_construction_treats_reserved_blocks_as_reserved():
    kvguard.register(ReservingPool, SET_SPEC)
    kvguard.instrument(on_violation="raise")
    try:
        a = ReservingPool(8)
    finally:
        kvguard.uninstrument()
        kvguard.unregister(ReservingPool)
    g = kvguard.guard_of(a)
    assert g is not None and g.live == {}
    with pytest.raises(kvguard.KVGuardError) as info:
        a.free(0)
    assert info.value.violation.kind == kinds.FOREIGN_ID
    with pytest.raises(kvguard.KVGuardError):
        a.free(5)  # never handed out either
    assert a.num_free() == 7


def test_late_attach_learns_at_most_the_blocks_out_and_says_so(caplog):
    a = SetPool(8)
    early = a.allocate(3)
    logging.getLogger("kvguard").disabled = False
    with caplog.at_level(logging.INFO, logger="kvguard"):
        g = kvguard.guard(a, SET_SPEC)
    assert "3 block(s) were out" in caplog.text and "foreign-id" in caplog.text
    a.free(early[:2])
    with pytest.raises(kvguard.KVGuardError) as info:
        a.free([early[2], 6])  # 6 was free at attach: 3 were out, this is an unknown past them
    assert info.value.violation.kind == kinds.FOREIGN_ID and info.value.violation.block_ids == (6,)
    a.free([early[2]])
    assert g.stats.learned == 3 and a.num_free() == 8
    with pytest.raises(kvguard.KVGuardError) as info:
        a.free([7])  # the budget is spent: every unknown id is foreign now
    assert info.value.violation.kind == kinds.FOREIGN_ID


# --- 5. emissions are contained ------------------------------------------------------------

class Raising(logging.Handler):
    def emit(self, record):
        raise OSError("disk full")

    def handleError(self, record):
        raise OSError("disk full")


def _raising_filter(record):
    raise RuntimeError("bad filter")


@pytest.mark.parametrize("mode", ["log", "repair"])
@pytest.mark.parametrize("how", ["handler", "filter"])
def test_a_raising_log_handler_never_reaches_the_caller(mode, how):
    logger = logging.getLogger("kvguard")
    logger.disabled = False
    hook = Raising() if how == "handler" else _raising_filter
    (logger.addHandler if how == "handler" else logger.addFilter)(hook)
    try:
        class Corrupt(SetPool):
            def allocate(self, k):  # hands block 0 out every time: shared-block
                self.free_ids.discard(0)
                return [0]

            def free(self, ids):  # trusts its caller
                self.free_ids.update(ids)

        a = Corrupt(8)
        g = kvguard.guard(a, SET_SPEC, on_violation=mode)
        a.allocate(1)
        assert a.allocate(1) == [0], "the allocation reached its caller"
        a.free([5])  # foreign-id: logged into the raising handler
        a.free([0])
        assert [v.kind for v in g.violations] == [kinds.SHARED_BLOCK, kinds.FOREIGN_ID]
        assert sorted(a.free_ids) == list(range(8))
        g.stats.internal_errors = 0
        internal_error(g, ValueError("boom"))  # the guard's own error line is contained too
    finally:
        (logger.removeHandler if how == "handler" else logger.removeFilter)(hook)


# --- 6. fork while another thread holds the guard's lock -----------------------------------

FORK = textwrap.dedent('''
    import os, sys, threading, time
    import kvguard
    from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList

    class Slow(LinkedFreeList):
        def free(self, blocks):
            time.sleep(1.5)
            return super().free(blocks)

    a = Slow(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    ids = a.allocate(2)
    t = threading.Thread(target=a.free, args=(ids[:1],))
    t.start()
    time.sleep(0.3)  # the thread is inside free(), holding the guard's lock
    pid = os.fork()
    if pid == 0:
        more = a.allocate(1)
        os._exit(0 if more and g.violations == [] else 3)
    t.join()
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
''')


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_while_a_thread_holds_the_guards_lock_does_not_hang_the_child(tmp_path):
    script = tmp_path / "fork.py"
    script.write_text(FORK)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the parent and the hung child with it
        proc.communicate()
        pytest.fail("the forked child hung on the guard's lock")
    assert proc.returncode == 0, err


# --- 7. staging registration of classes it cannot patch ------------------------------------

class NewOnly:
    """Builds itself in __new__, with no __init__ of its own."""

    def __new__(cls, n):
        self = super().__new__(cls)
        self.n = n
        self.free_ids = set(range(n))
        return self

    allocate = SetPool.allocate
    free = SetPool.free
    num_free = SetPool.num_free


STAGING = textwrap.dedent('''
    import decimal, sys
    import kvguard
    from tests.kvguard.test_adversarial_guard import NewOnly
    print(decimal.Decimal("1.5") + 1)
    a = NewOnly(4)
    ids = a.allocate(2)
    print(kvguard.guard_of(a) is not None, ids)
''')


def test_staging_registers_a_c_type_and_a_new_only_class_without_breaking(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    env.update(PYTHONPATH=root, KVGUARD="1", KVGUARD_MODE="raise",
               KVGUARD_REGISTER="decimal.Decimal,tests.kvguard.test_adversarial_guard.NewOnly")
    out = subprocess.run([sys.executable, "-c",
                          "import kvguard.staging as s; s.start()\n" + STAGING],
                         capture_output=True, text=True, timeout=60, env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["2.5", "True [0, 1]"]
    errors = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "decimal.Decimal" in errors[0], out.stderr


# --- 8. out-of-range settings ---------------------------------------------------------------

@pytest.mark.parametrize("name, value", [
    ("KVGUARD_HISTORY", "100000000000000000000"), ("KVGUARD_SAMPLE", str(1 << 70)),
    ("KVGUARD_LOG_EVERY", str(1 << 70)), ("KVGUARD_LOG_MAX_MB", str(1 << 70)),
])
def test_out_of_range_settings_are_refused_with_their_range(name, value):
    from kvguard.staging import config_from_env
    with pytest.raises(ValueError) as info:
        config_from_env({"KVGUARD": "1", name: value})
    assert name in str(info.value) and "<=" in str(info.value)


@pytest.mark.parametrize("keyword, value", [
    ("history", 10 ** 20), ("history", -1), ("max_violations", 0), ("log_every", 1.5),
    ("max_violations", 10 ** 20), ("sample", 10 ** 20),
])
def test_out_of_range_guard_options_are_a_clear_error(keyword, value):
    a = LinkedFreeList(4)
    with pytest.raises(ValueError, match=keyword):
        kvguard.guard(a, LINKED_FREE_LIST_SPEC, **{keyword: value})
    assert kvguard.guard_of(a) is None and "free" not in vars(a)


# --- 9. re-guarding with other settings -----------------------------------------------------

@pytest.mark.parametrize("change", [{"on_violation": "log"}, {"stacks": "full"}])
def test_guarding_again_with_another_mode_or_stacks_is_an_error(change):
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    with pytest.raises(ValueError, match="already guarded"):
        kvguard.guard(a, **change)
    assert kvguard.guard(a) is g and kvguard.guard(a, on_violation="raise") is g
    assert g.mode == "raise" and g.stacks == "cheap"


# --- 10. unreadable ids in raise mode --------------------------------------------------------

class BadIndex:
    def __index__(self):
        raise RuntimeError("no index today")


@pytest.mark.parametrize("value", [
    torch.empty(2, dtype=torch.int64, device="meta"),
    [torch.empty((), dtype=torch.int64, device="meta")],
    BadIndex(), [BadIndex()], [0, BadIndex()],
], ids=["meta tensor", "meta element", "__index__ raises", "[bad]", "[0, bad]"])
@pytest.mark.parametrize("tensor_ok", [False, True])
def test_unreadable_ids_are_invalid_id_in_raise_mode(value, tensor_ok):
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC.replace(tensor_ok=tensor_ok))
    a.allocate(2)
    before = (list(a._blocks), a.free_blocks)
    with pytest.raises(kvguard.KVGuardError) as info:
        a.free(value)
    assert isinstance(info.value, ValueError)
    assert info.value.violation.kind in (kinds.INVALID_ID, kinds.TENSOR_ID)
    assert (list(a._blocks), a.free_blocks) == before, "the rejected call changed nothing"
    assert sorted(g.live) == [0, 1]
