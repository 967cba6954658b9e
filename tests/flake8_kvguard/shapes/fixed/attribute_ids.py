class BlockManager:
    def __init__(self, n):
        self.free_block_ids = list(range(n))

    def deallocate(self, seq):
        blocks = [int(block) for block in seq.block_table]
        if len(set(blocks)) != len(blocks):
            raise ValueError("a block is listed twice")
        for block in blocks:
            self.free_block_ids.append(block)
        seq.block_table = []
