"""A release that range-checks each id, then decrements and pushes."""


class RefPool:
    def __init__(self, n):
        self.num_blocks = n
        self.ref_counts = [0] * n
        self.free_list = list(range(n))

    def release(self, block_ids):  # KVG201
        for b in block_ids:
            b = int(b)
            if b < 0 or b >= self.num_blocks:
                raise ValueError(f"block {b} out of range")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_list.append(b)
