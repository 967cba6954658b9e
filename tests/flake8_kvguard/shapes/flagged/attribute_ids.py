"""Ids read from an attribute of the argument."""


class BlockManager:
    def __init__(self, n):
        self.free_block_ids = list(range(n))

    def deallocate(self, seq):  # KVG204
        for block in seq.block_table:
            self.free_block_ids.append(int(block))
        seq.block_table = []
