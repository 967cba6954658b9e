"""A normalization line ahead of the unchecked push."""


class ReqPool:
    def __init__(self, n):
        self.free_slots = list(range(n))

    def free(self, free_index):  # KVG204
        ids = [free_index] if isinstance(free_index, int) else free_index
        for idx in ids:
            self.free_slots.append(int(idx))
