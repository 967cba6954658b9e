"""Id normalization: what each kind of argument becomes, and what is reported instead."""

import numpy as np
import pytest
import torch

from kvguard import kinds
from kvguard.ids import fast_ids, normalize, result_ids


def kinds_of(norm):
    return [f.kind for f in norm.faults]


@pytest.mark.parametrize("value, ids", [
    (3, [3]),
    ([4, 2, 9], [4, 2, 9]),
    ((1, 2), [1, 2]),
    (range(2, 5), [2, 3, 4]),
    ({7}, [7]),
    (frozenset([5]), [5]),
    ([], []),
    (np.int64(6), [6]),
    ([np.int32(1), np.uint16(2)], [1, 2]),
    (np.array([3, 1], dtype=np.int32), [3, 1]),
    ({5: "x"}.keys(), [5]),
])
def test_plain_ids_are_read_as_ints(value, ids):
    norm = normalize(value)
    assert norm.faults == []
    assert norm.ids == ids
    assert all(type(b) is int for b in norm.ids)


def test_fast_path_copies_lists_so_the_caller_can_mutate_them():
    ids = [1, 2]
    fast = fast_ids(ids)
    ids.append(3)
    assert fast == [1, 2]
    assert fast_ids([1, True]) is None
    assert fast_ids((1, 2)) == [1, 2]
    assert fast_ids(7) == [7]
    assert fast_ids(True) is None


@pytest.mark.parametrize("value", [True, [0, False], np.bool_(True), [np.bool_(False)],
                                   np.array([True, False]), torch.tensor([True, False]),
                                   torch.tensor(True), [torch.tensor(True)]])
def test_bools_are_rejected_never_coerced(value):
    assert kinds.BOOL_ID in kinds_of(normalize(value))


def test_bool_tensor_reports_the_positions_it_would_select():
    norm = normalize(torch.tensor([False, True, True]))
    assert kinds_of(norm) == [kinds.BOOL_ID]
    assert norm.faults[0].block_ids == (1, 2)
    assert "mask" in norm.faults[0].message


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.uint8])
def test_integer_tensor_is_a_tensor_id_unless_the_allocator_takes_tensors(dtype):
    t = torch.tensor([3, 0, 3], dtype=dtype)
    norm = normalize(t)  # the repeated 3 is found too, though a set() of it would not be
    assert kinds_of(norm) == [kinds.TENSOR_ID, kinds.DUPLICATE_ID]
    assert norm.faults[0].block_ids == (3, 0, 3)
    assert "tolist()" in norm.faults[0].message
    ok = normalize(t, tensor_ok=True, distinct=False)
    assert ok.faults == [] and ok.ids == [3, 0, 3] and ok.tensor is t


def test_tensor_elements_inside_a_list_are_tensor_ids():
    t = torch.tensor([5, 6])
    norm = normalize(list(t))  # iterating a tensor yields 0-dim tensors
    assert kinds_of(norm) == [kinds.TENSOR_ID]
    assert norm.faults[0].block_ids == (5, 6)
    assert normalize(list(t), tensor_ok=True).ids == [5, 6]


@pytest.mark.parametrize("value", [1.0, [1, 2.5], "3", b"\x01", None, [None], [object()],
                                   torch.tensor([1.0]), np.array([1.5]), [[1, 2]],
                                   torch.zeros(2, 2, dtype=torch.long), np.zeros((2, 2), int),
                                   [-1], np.array([-2]), torch.tensor([-3]), {1: 2}, object()])
def test_non_ids_are_invalid(value):
    assert kinds.INVALID_ID in kinds_of(normalize(value))


def test_negative_id_is_named():
    norm = normalize([4, -1])
    assert norm.ids == [4]
    assert norm.faults[0].block_ids == (-1,) and "negative" in norm.faults[0].message


def test_one_shot_iterators_are_not_consumed_unless_asked():
    gen = (b for b in [1, 2])
    norm = normalize(gen)
    assert kinds_of(norm) == [kinds.CONSUMED_ITERABLE]
    assert next(gen) == 1, "the guard must not drain the caller's generator"
    accepted = normalize(iter([4, 5]), iterator_ok=True)
    assert accepted.faults == [] and accepted.ids == [4, 5] and accepted.consumed
    assert accepted.materialized == [4, 5]
    repaired = normalize(iter([4, 5]), consume=True)  # repair mode: drained, still reported
    assert kinds_of(repaired) == [kinds.CONSUMED_ITERABLE] and repaired.materialized == [4, 5]
    assert kinds_of(normalize(map(int, [1]))) == [kinds.CONSUMED_ITERABLE]


class Block:
    def __init__(self, block_id):
        self.block_id = block_id


def test_objects_carrying_ids_and_skipped_items():
    null = Block(0)
    blocks = [Block(3), null, Block(4)]
    norm = normalize(blocks, id_attr="block_id", skip=lambda b: b is null)
    assert norm.ids == [3, 4]
    assert norm.objects == [blocks[0], blocks[2]]
    assert norm.passthrough == [null]
    nested = normalize(([blocks[0]], [blocks[2]]), id_attr="block_id")
    assert nested.ids == [3, 4]
    missing = normalize([object()], id_attr="block_id")
    assert kinds_of(missing) == [kinds.INVALID_ID]
    assert "block_id" in missing.faults[0].message
    assert kinds_of(normalize([Block(True)], id_attr="block_id")) == [kinds.BOOL_ID]


def test_results_accept_tensors_and_none():
    assert result_ids(torch.tensor([2, 1], dtype=torch.int32)).ids == [2, 1]
    assert result_ids(None).ids == []
    assert result_ids([Block(9)], id_attr="block_id").ids == [9]
    assert kinds_of(result_ids([True])) == [kinds.BOOL_ID]


def test_a_broken_iterable_is_reported_not_raised():
    class Broken:
        def __iter__(self):
            raise RuntimeError("boom")
    norm = normalize(Broken())
    assert kinds_of(norm) == [kinds.INVALID_ID]
