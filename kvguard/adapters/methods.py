"""Engine methods that an ``AllocatorSpec``'s three names cannot cover, guarded by their role.

Real allocators hand out ids from more than one method (SGLang's ``alloc``/``alloc_extend``/
``alloc_decode``, LMCache's ``allocate``/``batched_allocate``), take them back through more than
one (vLLM's ``free_blocks`` and ``unpin_blocks``), return everything at once (Hugging Face's
``CachePool.reset``), or free later what a caller already gave up (SGLang's free groups). Each
function here names a method and its role; ``adapter(*installers)`` bundles them into the
callable an ``AllocatorSpec(adapter=...)`` runs once its guard is attached, which asks the guard
for each (``Guard.wrap_method``): same lock, same ledger, same checks and reports, and
``unguard()`` restores them.
"""

from __future__ import annotations


def adapter(*installers):
    """The ``AllocatorSpec.adapter`` that runs each installer on a newly attached guard."""
    def install(guard) -> None:
        for installer in installers:
            installer(guard)
    install.installers = installers
    return install


def _role(role, name, **options):
    def install(guard) -> None:
        guard.wrap_method(name, role, **options)
    install.role, install.method = role, name
    return install


def allocating(name, convert=None):
    """``name`` hands out ids, like the spec's ``alloc``. ``convert(allocator, result)`` turns
    its result into the ids the ledger tracks (SGLang's paged allocator returns token slots and
    is tracked by page)."""
    return _role("allocating", name, convert=convert)


def freeing(name):
    """``name`` takes ids back as its first argument, checked like the spec's ``free``."""
    return _role("freeing", name)


def checking(name):
    """``name`` takes ids whose form is checked (bools, floats, 2-D tensors, negative ids) but
    leaves the bookkeeping to the spec's ``free``, which it calls itself (SGLang's paged
    ``free()`` takes token slots and releases pages through ``_release_page_ids``; a bool mask
    must be named as such before ``// page_size`` turns it into page 0)."""
    return _role("checking", name)


def resetting(name):
    """``name`` returns every block of every sub-pool to the allocator (Hugging Face's
    ``CachePool.reset()``, SGLang's ``clear()``): the ledgers follow, so blocks handed out
    again afterwards are not mistaken for blocks handed out twice."""
    return _role("resetting", name)


def resizing(name, pool=None):
    """``name`` gives the allocator another size and returns every block (SGLang's
    ``resize(config)``): the ledgers forget every live block, take the new size and ``check()``
    counts from the rebuilt pool. With ``pool(args, kwargs)``, only that sub-pool starts afresh,
    with another id space (Hugging Face's ``set_blocks_per_sector(index, n)``)."""
    return _role("resizing", name, pool=pool)


def settled(name, when):
    """While ``when(allocator)`` holds, the frees ``name`` makes were already checked and
    counted when the caller asked for them: the guard's lock is held across it so the
    allocator's inner calls pass through. Otherwise those inner calls are checked like any
    other (SGLang's ``free_group_end()`` releases the frees deferred since
    ``free_group_begin()``; called again without an open group, before sglang#36739 it freed
    the same ids a second time)."""
    return _role("settled", name, when=when)
