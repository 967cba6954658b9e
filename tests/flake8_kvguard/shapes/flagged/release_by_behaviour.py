"""Release methods no name marks: found by what their bodies do."""


class PagePool:
    def __init__(self, n):
        self.free_pages = list(range(n))

    def allocate(self, n):
        return [self.free_pages.pop() for _ in range(n)]

    def deallocate_pages(self, pages):  # KVG204
        for page in pages:
            self.free_pages.append(int(page))


class SlotPool:
    def __init__(self, n):
        self.available = list(range(n))

    def _free(self, indices):  # KVG204
        for index in indices:
            self.available.append(int(index))


class ResourcePool:
    def __init__(self, n):
        self.free_slot_list = list(range(n))

    def free_pages_resource(self, slot: int) -> None:  # KVG205
        self.free_slot_list.append(slot)
