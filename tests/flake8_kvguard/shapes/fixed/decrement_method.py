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

    def release(self, pages):
        pages = list(pages)
        if len({id(page) for page in pages}) != len(pages):
            raise ValueError("a page is listed twice")
        for page in pages:
            if page.ref_count <= 0:
                raise ValueError("page already free")
            page.sub_ref()
            if page.ref_count == 0:
                self.free_queue.append(page)
