"""Instrumentation: the guard's wrappers, shadowing the allocator's methods on the instance.

The allocator object keeps working for its callers (``isinstance`` unchanged): its methods are
shadowed by instance attributes that check, forward and record under the guard's lock, so two
threads freeing the same block cannot both pass, and the allocator's calls to itself (or the
guard forwarding) pass straight through. The fast path takes the calls engines make all day
(plain ints, numpy integer arrays and scalars, block objects read by ``id_attr``, sub-pools,
references shared and dropped in refcounted pools) when every id is in the state the call needs:
one read of the ids, one loop over the ledger's columns, one site capture, all inlined with
their names bound as locals: the overhead budget goes here. Anything unusual goes to the careful
path (``careful``), which names every fault; a differential test holds the two to one verdict.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import threading

from ..fastread import ITERATORS, KINDS
from ..holderbooks import SEVERAL
from ..owners import ACTIVE_OWNER, holder_now
from ..stacks import SITES, SiteTable
from .. import compiled
from . import careful
from .arguments import MISSING, Param
from .careful import alloc_slow
from .decisions import contain
from .evidence import fold_empty
from .holders import as_holder
from .readers import fast_ledger, fast_reader, keeps_all_for

INT32_MAX = 2 ** 31 - 1
"""The largest reference count the ledger's column holds: an engine's count past it is
settled by the careful path."""

ACCEL = compiled.FASTPATH
"""The compiled wrappers in use, or None for the closures below (the reference). Tests switch
it to run the guard both ways."""


def new_lock():
    """A new guard's lock. With the compiled wrappers, their ``GuardLock``: a reentrant lock
    with ``threading.RLock``'s interface that the wrappers take and drop inline in C (an RLock
    costs them three Python-level calls per guarded call, each parsing its arguments and
    reading the clock); everything else (hooks, the closures of ``roles``, ``with
    guard.lock``) uses it as an RLock. Without them, or when ``threading`` is not CPython's
    own (``GuardLock`` knows OS threads only), ``threading.RLock``."""
    lock_type = getattr(ACCEL, "GuardLock", None)
    return lock_type() if lock_type is not None and os_threads() else threading.RLock()


def os_threads() -> bool:
    """Whether ``threading`` runs on CPython's OS threads. gevent and eventlet patch it (and
    ``_thread``) so that each greenlet is a thread of its own: there, a lock owned per OS
    thread would take another greenlet's call, made while the first is switched out inside a
    guarded call, for the allocator calling itself, and pass it through unchecked. Asked at
    every guard's creation, since the patching may come after kvguard's import."""
    import _thread
    return (type(threading.RLock()) is _thread.RLock
            and threading.get_ident is _thread.get_ident
            and type(_thread.get_ident) is type(len))


def new_history(maxlen: int):
    """A new guard's flight recorder (``maxlen`` >= 1 entries; see ``evidence``). With the
    compiled wrappers, their ``FlightRecorder``: the entries' five fields stored in a ring, so a
    wrapper records a call without making a tuple (tuples are made when it is read); it reads
    like the deque: iteration oldest first, ``len``, indexing, ``append``, ``clear``, ``maxlen``.
    Without them, ``collections.deque(maxlen=maxlen)``."""
    recorder = getattr(ACCEL, "FlightRecorder", None)
    return recorder(maxlen) if recorder is not None else collections.deque(maxlen=maxlen)


def fast_path(guard) -> bool:
    """Whether the wrappers may take their fast path. Watchers and quarantine see every call
    on the careful path; ``fast_path=False`` asks for that too (the differential tests run
    both and compare their verdicts)."""
    return guard._fast and not guard._quarantine.size and not guard._watchers


def install(guard) -> None:
    """(Re)build the wrappers for the present configuration and shadow the methods."""
    allocator = guard.allocator
    if allocator is None:
        return
    own = vars(allocator)
    spec = guard.spec
    wrappers = {spec.free: wrap_free(guard, guard._bound[spec.free])}
    if spec.alloc:
        wrappers[spec.alloc] = wrap_alloc(guard, guard._bound[spec.alloc])
    if spec.share:
        wrappers[spec.share] = wrap_share(guard, guard._bound[spec.share])
    if spec.owner_arg is not None:
        wrappers = {m: as_holder(guard, w, m) for m, w in wrappers.items()}
    wrappers.update(guard._shapes.wrappers_for(guard))  # ids in an argument: shapes
    for method, wrapper in wrappers.items():
        if method not in guard._originals:
            guard._originals[method] = own.get(method, MISSING)
        own[method] = wrapper


def wrap_free(guard, original):
    """The free wrapper: its fast path takes ids ``fast_reader`` reads, each once and live in the
    call's ledger. Refcounted pools drop one reference per id; at 0 a block is a tombstone."""
    return wrap_release(guard, original, guard.spec.free, guard._free_param, share=False)


def wrap_share(guard, original):
    """The share wrapper: the fast path adds a reference to ids that are live or cached
    (a tombstone, revived); never-seen ids and every fault go the careful way."""
    return wrap_release(guard, original, guard.spec.share, guard._share_param, share=True)


def wrap_release(guard, original, method, param, share):
    lock = guard.lock
    owned = lock._is_owned
    pos = param.pos if param.pos is not None else -1 - (1 << 30)
    name, default = param.name, param.default
    read = fast_reader(guard, result=False) if fast_path(guard) else None
    plain = guard.spec.id_attr is None and guard.spec.skip is None  # an int is its own id
    main, ledger_of = fast_ledger(guard, method)
    drain = guard.spec.iterator_ok
    put = param.put
    stats = guard.stats
    history = guard.history
    depth = guard._depth
    capture = guard._capture
    owner_var = ACTIVE_OWNER.get
    tick = guard._tick
    slow = careful.share_slow if share else careful.free_slow
    # [refcount_attr] The engine's own count of each block is the truth at a release: read
    # before the call, it must be positive, and the ledger takes it before dropping one.
    engine_count = operator.attrgetter(guard.spec.refcount_attr) if (
        guard.spec.refcount_attr is not None and not share and read is not None) else None
    if ACCEL is not None:
        return accelerated(
            ACCEL.SHARE if share else ACCEL.FREE, guard, original, param, read, plain, main,
            ledger_of, drain, None if type(param) is Param else put, stacks_slow(slow),
            engine_count)

    def release(*args, **kwargs):
        if owned():  # the allocator calling itself, or the guard forwarding: pass through
            return original(*args, **kwargs)
        with lock:  # no bytecode between taking the lock and the block that drops it
            try:
                value = args[pos]
            except IndexError:
                value = kwargs.get(name, default)
            if read is not None:
                if drain and type(value) in ITERATORS:  # read once, forward the list
                    value = list(value)
                    args, kwargs = put(args, kwargs, value)
                try:
                    ids = [value] if type(value) is int and plain else read(value)
                    hot = None if ids is None else main if ledger_of is None else \
                        ledger_of(args, kwargs)
                    held = None if engine_count is None or hot is None else \
                        list(map(engine_count, value))
                except Exception:  # the careful path reads it again, under _protect
                    hot = None
                if hot is not None:
                    (stamp, origin, freed_at, ref, uncertain, pool, held_by, holders, _,
                     _, shared_by, released_by) = hot
                    n = len(ids)
                    if n == 1:  # one id per call is common: no loop, no set
                        b = ids[0]
                        ok = type(b) is int and 0 <= b < len(stamp) and (
                            stamp[b] != 0 if share else stamp[b] > 0)
                    else:
                        size = len(stamp)
                        for b in ids:
                            if type(b) is not int or not 0 <= b < size or (
                                    stamp[b] == 0 if share else stamp[b] <= 0):
                                ok = False
                                break
                        else:
                            ok = len(set(ids)) == n
                    if ok and held is not None:
                        for count in held:
                            if type(count) is not int or not 0 < count <= INT32_MAX:
                                ok = False
                                break
                    h = holder_now()
                    mixed = False
                    if ok and (h or holders):
                        # [owners] A release of a block the holder does not hold is the
                        # careful path's (a stale free); blocks of SEVERAL holders, and a live
                        # one another holder holds taken by a share: ``holders`` after commit.
                        for b in ids:
                            first = held_by[b]
                            if first == SEVERAL:
                                if (counts := holders.get(b)) is None or (
                                        h and not share and h not in counts):
                                    ok = False
                                    break
                                mixed = True
                            elif h and first not in (0, h):
                                if not share:
                                    ok = False
                                    break
                                mixed = mixed or stamp[b] > 0
                    if ok and type(value) is list and len(value) != n:
                        ok = False  # changed since the read (a finalizer): read it again
                    if ok:
                        who = owner_var() if share else 0
                        try:
                            site = capture(1, depth, who) if depth or who else 0
                        except Exception as exc:
                            site = contain(guard, exc)
                        result = original(*args, **kwargs)
                        clock = tick()
                        if share:
                            for b in ids:
                                if stamp[b] <= 0:  # a cached free block comes back
                                    stamp[b] = clock
                                    origin[b] = site
                                    held_by[b] = h
                            if ref is not None:
                                for b in ids:
                                    ref[b] += 1
                            if mixed and h:
                                shared_by(ids, h)
                            stats.share_calls += 1
                            stats.blocks_shared += n
                            if history is not None:
                                history.append((clock, ids, site, pool, "share")) if ids else \
                                    fold_empty(history, clock)
                            return result
                        if ref is None:
                            if n == 1:
                                stamp[b] = -clock
                                freed_at[b] = site
                            else:
                                for b in ids:
                                    stamp[b] = -clock
                                    freed_at[b] = site
                        else:
                            if held is not None:  # references the engine took or dropped
                                for b, count in zip(ids, held):
                                    if ref[b] != count:
                                        ref[b] = count
                                        if uncertain:
                                            uncertain.discard(b)
                            dropped = 0
                            for b in ids:
                                r = ref[b] - 1
                                ref[b] = r
                                if not r:
                                    stamp[b] = -clock
                                    freed_at[b] = site
                                    dropped += 1
                            n = dropped
                        if holders:
                            released_by(ids, h)
                        stats.free_calls += 1
                        stats.blocks_freed += n
                        if history is not None:
                            history.append((clock, ids, site, pool, "free")) if ids else \
                                fold_empty(history, clock)
                        return result
            if share:
                return slow(guard, original, args, kwargs)
            return slow(guard, original, args, kwargs, value)

    release.__wrapped__ = original
    release.__kvguard__ = guard
    return release


def wrap_alloc(guard, original):
    """The allocation wrapper: forward first, then check what came back. The fast path
    takes ids that are all free or unseen in the call's ledger, each once."""
    lock = guard.lock
    owned = lock._is_owned
    read = fast_reader(guard, result=True) if fast_path(guard) else None
    plain = guard.spec.id_attr is None and guard.spec.skip is None  # an int result is its id
    main, ledger_of = fast_ledger(guard, guard.spec.alloc)
    stats = guard.stats
    history = guard.history
    depth = guard._depth
    capture = guard._capture
    owner_var = ACTIVE_OWNER.get
    tick = guard._tick
    if ACCEL is not None:
        return accelerated(ACCEL.ALLOCATE, guard, original, None, read, plain, main, ledger_of,
                           False, None, functools.partial(alloc_slow, depth=depth), None)

    def allocate(*args, **kwargs):
        if owned():
            return original(*args, **kwargs)
        with lock:  # no bytecode between taking the lock and the block that drops it
            result = original(*args, **kwargs)
            if read is not None:
                try:
                    ids = [result] if type(result) is int and plain else read(result)
                    hot = None if ids is None else main if ledger_of is None else \
                        ledger_of(args, kwargs)
                except Exception:  # the slow path reads it again, under _protect
                    hot = None
                if hot is not None:
                    stamp, origin, _, ref, uncertain, pool, held_by, holders, leased = hot[:9]
                    n = len(ids)
                    if n == 1:
                        b = ids[0]
                        ok = type(b) is int and 0 <= b < len(stamp) and stamp[b] <= 0
                    else:
                        size = len(stamp)
                        for b in ids:
                            if type(b) is not int or not 0 <= b < size or stamp[b] > 0:
                                ok = False
                                break
                        else:
                            ok = len(set(ids)) == n
                    if ok and (holders or leased):  # [owners, leases] the careful path's
                        for b in ids:
                            if held_by[b] == SEVERAL or b in leased:
                                ok = False
                                break
                    if ok:
                        who = owner_var()
                        try:
                            site = capture(1, depth, who) if depth or who else 0
                        except Exception as exc:
                            site = contain(guard, exc)
                        clock = tick()
                        h = holder_now()
                        if n == 1:
                            stamp[b] = clock
                            origin[b] = site
                            held_by[b] = h
                        else:
                            for b in ids:
                                stamp[b] = clock
                                origin[b] = site
                                held_by[b] = h
                        if ref is not None:
                            for b in ids:
                                ref[b] = 1
                            if uncertain:
                                uncertain.difference_update(ids)
                        stats.alloc_calls += 1
                        stats.blocks_allocated += n
                        if history is not None:
                            history.append((clock, ids, site, pool, "allocate")) if ids else \
                                fold_empty(history, clock)
                        return result
            return alloc_slow(guard, capture, args, kwargs, result, depth, up=2)

    allocate.__wrapped__ = original
    allocate.__kvguard__ = guard
    return allocate


def accelerated(kind, guard, original, param, read, plain, main, ledger_of, drain, put, slow,
                engine_count):
    """The compiled twin of ``release`` / ``allocate`` (``kind``), bound to what the closure
    binds. Its careful path is ``slow``, called where the closure calls the careful path."""
    capture = guard._capture
    # stacks.sampled_capture (sample=N) over SITES.capture: drawn and captured in C too
    draw, chance, inner = getattr(capture, "__kvguard_sample__", (None, None, capture))
    native = getattr(inner, "__self__", None) is SITES and \
        getattr(inner, "__func__", None) is SiteTable.capture
    if not native:
        draw = chance = None
    # The readers it runs itself, exactly as ``fast_reader``'s: plain ints, lists of them and
    # numpy types ``fastread`` has learned when ``plain``; block objects by a plain ``id_attr``.
    spec = guard.spec
    counter = getattr(guard._tick, "__self__", None)  # the guard's itertools.count
    objects = read is not None and spec.id_attr is not None and "." not in spec.id_attr
    skip = spec.skip if objects else None
    count_attr = spec.refcount_attr or ""  # a plain name is read in C, not through attrgetter
    wrapper = ACCEL.Wrapper(
        kind, guard, original, guard.lock,
        param.pos if param is not None and param.pos is not None else -1,
        param.name if param is not None else None,
        param.default if param is not None else MISSING,
        read, plain, main, ledger_of, drain, put, ITERATORS, guard.stats, guard.history,
        guard._depth, capture, SITES._index if native else None,
        SITES if native else None, ACTIVE_OWNER, guard._tick, slow,
        count_attr if engine_count is not None and "." not in count_attr else engine_count,
        contain, KINDS if plain else None, spec.id_attr if objects else None, skip,
        keeps_all_for(skip, guard.allocator), guard.allocator if objects else None,
        counter if type(counter) is itertools.count else None, draw, chance)
    wrapper.__wrapped__ = original
    wrapper.__kvguard__ = guard
    wrapper.__name__ = wrapper.__qualname__ = "allocate" if kind == ACCEL.ALLOCATE else "release"
    wrapper.__module__ = __name__  # as the closure's (the type's docstring stays its __doc__)
    return wrapper


def stacks_slow(slow):
    """``slow`` called through one Python frame: the careful path captures its site two frames
    up (itself, then the closure that called it), and a compiled wrapper has no frame."""

    def careful_path(*args):
        return slow(*args)
    return careful_path
