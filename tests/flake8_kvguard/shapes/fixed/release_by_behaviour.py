class PagePool:
    def __init__(self, n):
        self.free_pages = list(range(n))

    def allocate(self, n):
        return [self.free_pages.pop() for _ in range(n)]

    def deallocate_pages(self, pages):
        pages = [int(page) for page in pages]
        if len(set(pages)) != len(pages) or any(p in self.free_pages for p in pages):
            raise ValueError("repeated or already-free page")
        for page in pages:
            self.free_pages.append(page)


class SlotPool:
    def __init__(self, n):
        self.available = list(range(n))

    def _free(self, indices):
        for index in indices:
            index = int(index)
            if index in self.available:
                raise ValueError(f"slot {index} is already free")
            self.available.append(index)


class ResourcePool:
    def __init__(self, n):
        self.free_slot_list = list(range(n))

    def free_pages_resource(self, slot: int) -> None:
        if slot in self.free_slot_list:
            raise ValueError(f"slot {slot} is already free")
        self.free_slot_list.append(slot)
