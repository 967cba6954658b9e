"""The KV-cache face: guarding the cache tensors and the calls that write into them.

- ``guard_cache``: freed blocks are poisoned on the tensor's own device and checked when handed
  out again (``write-after-free``); ``poison``: the per-pool state behind it.
- ``writes``: ``guard_writes`` checks an engine's cache-write call before it writes.
- ``tables``: ``Guard.check_tables`` checks block tables against the ledger, on their device.

Users reach them as ``kvguard.guard_cache``, ``kvguard.guard_writes`` and ``Guard.check_tables``.
This package imports nothing itself: the core (``Guard.check_tables``) imports ``tables`` without
loading the tensor code of the other two.
"""
