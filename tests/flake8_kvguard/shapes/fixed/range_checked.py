class RefPool:
    def __init__(self, n):
        self.num_blocks = n
        self.ref_counts = [0] * n
        self.free_list = list(range(n))

    def release(self, block_ids):
        for b in block_ids:
            b = int(b)
            if b < 0 or b >= self.num_blocks:
                raise ValueError(f"block {b} out of range")
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is already free")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_list.append(b)
