"""A per-item decrement method, found by behaviour: Page.sub_ref drops its own count."""


class Page:
    def __init__(self, idx):
        self.idx = idx
        self.ref_count = 0

    def sub_ref(self):
        self.ref_count -= 1


class PageAllocator:
    def __init__(self, n):
        self.pages = [Page(i) for i in range(n)]
        self.free_queue = []

    def release(self, pages):  # KVG204
        for page in pages:
            page.sub_ref()
            if page.ref_count == 0:
                self.free_queue.append(page)
