"""pytest face of kvguard: ``pytest -p kvguard`` guards every registered allocator."""
