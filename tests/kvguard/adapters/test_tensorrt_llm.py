"""TensorRT-LLM#14937 (a duplicate release queues a block twice), on a faithful small model.

TensorRT-LLM cannot run here (a multi-GB CUDA build whose block manager is C++), and its Python
``KVCacheManager`` frees per request, not per block. The model is the C++ ``LRUEvictionPolicy``
of ``cpp/tensorrt_llm/batch_manager/evictionPolicy.cpp`` as its public source has it (the older
``releaseBlock`` and the newer ``addToFreeBlockQueue`` agree): free blocks sit in a queue,
``mFreeBlockIterators[id]`` remembers each block's node, ``getFreeBlock()`` reads the front,
``claimBlock()`` erases the remembered node (if any), and ``releaseBlock(block, toFront)``
inserts a node, overwrites the remembered one and bumps the free count, without asking whether
the block is already queued. ``allocate_block`` is the block manager's get-then-claim.
"""

import pytest

import kvguard


class Node:
    """A list node of the free queue (identity matters, as for a C++ list iterator)."""

    __slots__ = ("block_id",)

    def __init__(self, block_id):
        self.block_id = block_id


class LRUEvictionPolicy:
    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.free_queue = []           # mFreeQueues[level][priority]
        self.free_block_iterators = {}  # mFreeBlockIterators
        self.num_free_blocks = 0       # mNumFreeBlocksPerLevel[level]
        for block_id in range(num_blocks):
            self.release_block(block_id)

    def get_free_block(self):
        return self.free_queue[0].block_id

    def claim_block(self, block_id):
        node = self.free_block_iterators.pop(block_id, None)  # std::optional, reset on claim
        if node is not None:
            self.free_queue.remove(node)
            self.num_free_blocks -= 1

    def release_block(self, block_id, to_front=False):
        node = Node(block_id)
        self.free_queue.insert(0 if to_front else len(self.free_queue), node)
        self.free_block_iterators[block_id] = node
        self.num_free_blocks += 1

    def allocate_block(self):
        block_id = self.get_free_block()
        self.claim_block(block_id)
        return [block_id]


SPEC = kvguard.AllocatorSpec(alloc="allocate_block", free="release_block", size="num_blocks",
                             free_count="num_free_blocks")


def test_unguarded_a_duplicate_release_hands_the_block_to_two_sequences():
    """The control: the first node of a twice-released block outlives its claim."""
    policy = LRUEvictionPolicy(4)
    held = [policy.allocate_block()[0] for _ in range(4)]
    policy.release_block(held[0])
    policy.release_block(held[0])  # duplicate release: queued twice, counted twice
    assert policy.num_free_blocks == 2
    first = policy.allocate_block()
    second = policy.allocate_block()
    assert first == second == [held[0]]


def test_regression_tensorrt_llm_14937_duplicate_release():
    policy = LRUEvictionPolicy(4)
    g = kvguard.guard(policy, SPEC)
    held = [policy.allocate_block()[0] for _ in range(4)]
    policy.release_block(held[0], to_front=True)
    with pytest.raises(kvguard.DoubleFreeError) as info:
        policy.release_block(held[0])
    assert info.value.block_ids == (held[0],)
    assert policy.num_free_blocks == 1 and len(policy.free_queue) == 1
    assert policy.allocate_block() == [held[0]] and g.check() == {None: (-4, -4)}
