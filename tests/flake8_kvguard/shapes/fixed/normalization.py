class ReqPool:
    def __init__(self, n):
        self.free_slots = list(range(n))

    def free(self, free_index):
        ids = [free_index] if isinstance(free_index, int) else free_index
        for idx in ids:
            idx = int(idx)
            if idx in self.free_slots:
                raise ValueError(f"slot {idx} is already free")
            self.free_slots.append(idx)
