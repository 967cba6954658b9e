"""Instrumentation: the guard's wrappers, shadowing the allocator's methods on the instance.

The allocator object keeps working for its callers (``isinstance`` unchanged): its methods are
shadowed by instance attributes that check, forward and record under the guard's lock, so two
threads freeing the same block cannot both pass, and the allocator's calls to itself (or the
guard forwarding) pass straight through. The fast path takes the calls engines make all day
(plain ints, numpy integer arrays and scalars, block objects read by ``id_attr``, sub-pools,
references shared and dropped in refcounted pools) when every id is in the state the call needs:
one read of the ids, one loop over the ledger's columns, one site capture, all inlined with
what they need bound as locals: this is where the overhead budget goes, so every line counts.
Anything unusual goes to the careful path (``careful``), which reads the ids exactly and names
every fault; a differential test holds the two to the same verdicts.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import sys
import threading

from ..fastread import ITERATORS, KINDS, plain_ids
from ..ids import torch_tensor_type
from ..marks import ATTR, THE_ALLOCATOR
from ..owners import ACTIVE_HOLDER, ACTIVE_OWNER, OWNERS
from ..stacks import SITES, SiteTable
from . import careful, compiled
from .arguments import MISSING, Param
from .bookkeeping import commit_allocation
from .decisions import contain, protect


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


def reduce_hook(guard):
    """The allocator's ``__reduce_ex__`` while guarded. ``copy.copy``, ``copy.deepcopy`` and
    ``pickle`` look it up on the instance: they get the allocator's own reduction with the
    guard's wrappers taken out of its state, so a copy is an unguarded, correct copy (its
    ``free`` frees on itself, not on the original) and a pickle holds the unguarded state.
    """

    def __reduce_ex__(protocol):
        allocator = guard.allocator
        guard.release_quarantine()  # the copy must see every block its caller freed
        reduction = type(allocator).__reduce_ex__(allocator, protocol)
        if not isinstance(reduction, tuple) or len(reduction) < 3:
            return reduction
        state = reduction[2]
        if isinstance(state, dict):
            state = unguarded(guard, state)
        elif (isinstance(state, tuple) and len(state) == 2
              and isinstance(state[0], dict)):  # (__dict__, __slots__ values)
            state = (unguarded(guard, state[0]), state[1])
        return reduction[:2] + (state,) + reduction[3:]
    __reduce_ex__.__kvguard_hook__ = guard  # not __kvguard__: no method to dispatch to
    return __reduce_ex__


def unguarded(guard, state: dict) -> dict:
    """An instance ``__dict__`` as it would be without the guard (a new dict)."""
    allocator = guard.allocator
    own = vars(allocator) if allocator is not None else {}
    out = dict(state)
    if out.get(ATTR) is guard:
        del out[ATTR]
    for name, original in guard._originals.items():
        if name in out and out[name] is own.get(name):
            if original is MISSING:
                del out[name]
            else:
                out[name] = original
    return out


def fast_path(guard) -> bool:
    """Whether the wrappers may take their fast path. Watchers and quarantine see every call
    on the careful path; ``fast_path=False`` asks for that too (the differential tests run
    both and compare their verdicts)."""
    return guard._fast and not guard._quarantine.size and not guard._watchers


def fast_reader(guard, result: bool):
    """The fast path's reader of ids for this spec, or None when it has none (dotted
    ``id_attr``, a ``skip`` over plain ids). ``read(value)`` returns a new list of plain
    ints, or None: then the careful path reads the value and decides."""
    spec = guard.spec
    if spec.id_attr is not None:
        if "." in spec.id_attr:
            return None
        get = operator.attrgetter(spec.id_attr)
        skip = spec.skip
        # A skipped item (vLLM's null block) is passed through unchecked: that is the careful
        # path's business. ``skip.keeps_all(allocator, items)`` answers for a whole call at
        # once (True: no item is skipped); otherwise each item is asked.
        keeps_all = getattr(skip, "keeps_all", None)
        allocator = guard.allocator

        def read_objects(value):
            tp = type(value)
            if tp is not list and tp is not tuple:
                return None
            if skip is not None:
                if keeps_all is not None:
                    if not keeps_all(allocator, value):
                        return None
                elif any(map(skip, value)):
                    return None
            return list(map(get, value))  # an object without the id: the careful path
        return read_objects
    if spec.skip is not None:
        return None
    if not (result or spec.tensor_ok):
        return plain_ids

    def read_or_tensor(value):
        ids = plain_ids(value)
        return ids if ids is not None else int_tensor_ids(value)
    return read_or_tensor


def fast_ledger(guard, method):
    """``(main, ledger_of)``: the ``Ledger.hot`` columns of a spec without sub-pools, or
    ``ledger_of(args, kwargs)`` giving those of the call's sub-pool when its key is a plain
    int (or absent) and its ledger exists, else None (careful path)."""
    param = guard._pool_params.get(method)
    if param is None:
        return guard.ledger(guard._default_pool()).hot, None
    ledgers = guard._ledgers
    get = param.get

    def ledger_of(args, kwargs):
        key = get(args, kwargs)
        if key is MISSING:
            key = None
        elif key is not None and type(key) is not int:
            return None
        ledger = ledgers.get(key)
        return None if ledger is None else ledger.hot
    return None, ledger_of


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
    for method, wrapper in wrappers.items():
        if method not in guard._originals:
            guard._originals[method] = own.get(method, MISSING)
        own[method] = wrapper


def as_holder(guard, wrapper, method):
    """[owner_arg] ``wrapper`` run as the holder its call names (``AllocatorSpec.owner_arg``):
    one context variable set around the guarded call, so the fast paths read it as they read
    a holder an engine adapter set."""
    where = guard.spec.owner_arg
    if callable(where):
        read_owner = where
    else:
        param = Param(guard._bound[method], where)
        if not param.found:
            return wrapper

        def read_owner(args, kwargs):
            value = param.get(args, kwargs)
            return None if value is MISSING else value

    intern, holder_var = OWNERS.intern, ACTIVE_HOLDER

    def holding(*args, **kwargs):
        try:
            label = read_owner(args, kwargs)
        except Exception:  # the allocator's own call decides what is wrong with it
            label = None
        if label is None:
            return wrapper(*args, **kwargs)
        token = holder_var.set(intern(label))
        try:
            return wrapper(*args, **kwargs)
        finally:
            holder_var.reset(token)

    holding.__wrapped__ = getattr(wrapper, "__wrapped__", wrapper)
    holding.__kvguard__ = guard
    return holding


def wrap_free(guard, original):
    """The free wrapper. Its fast path (ids read by ``_fast_reader``, every one live in the
    call's ledger, none repeated) is inlined with everything it needs bound as locals: this
    is where the overhead budget goes, so every line counts. Refcounted pools drop one
    reference per id; a block whose count reaches 0 becomes a tombstone."""
    return wrap_release(guard, original, guard.spec.free, guard._free_param, share=False)


def wrap_share(guard, original):
    """The share wrapper: the fast path adds a reference to ids that are live or cached
    (a tombstone, revived); never-seen ids and every fault go the careful way."""
    return wrap_release(guard, original, guard.spec.share, guard._share_param, share=True)


def wrap_release(guard, original, method, param, share):
    lock = guard.lock
    owned, acquire, unlock = lock._is_owned, lock.acquire, lock.release
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
        acquire()
        try:
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
                     holder_var) = hot
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
                            if type(count) is not int or count <= 0:
                                ok = False
                                break
                    h = holder_var.get()
                    if ok and (h or holders):
                        # [owners] A block of several holders, or one another holder holds
                        # (for a share: a live one), is the careful path's: it keeps the
                        # counts, and names a stale free.
                        for b in ids:
                            if b in holders or h and held_by[b] not in (0, h) and (
                                    not share or stamp[b] > 0):
                                ok = False
                                break
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
                            stats.share_calls += 1
                            stats.blocks_shared += n
                            if history is not None:
                                history.append((clock, ids, site, pool, "share"))
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
                        stats.free_calls += 1
                        stats.blocks_freed += n
                        if history is not None:
                            history.append((clock, ids, site, pool, "free"))
                        return result
            if share:
                return slow(guard, original, args, kwargs)
            return slow(guard, original, args, kwargs, value)
        finally:
            unlock()

    release.__wrapped__ = original
    release.__kvguard__ = guard
    return release


def wrap_alloc(guard, original):
    """The allocation wrapper: forward first, then check what came back. The fast path
    takes ids that are all free or unseen in the call's ledger, each once."""
    lock = guard.lock
    owned, acquire, unlock = lock._is_owned, lock.acquire, lock.release
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
        acquire()
        try:
            result = original(*args, **kwargs)
            if read is not None:
                try:
                    ids = [result] if type(result) is int and plain else read(result)
                    hot = None if ids is None else main if ledger_of is None else \
                        ledger_of(args, kwargs)
                except Exception:  # the slow path reads it again, under _protect
                    hot = None
                if hot is not None:
                    stamp, origin, _, ref, uncertain, pool, held_by, holders, leased, \
                        holder_var = hot
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
                            if b in holders or b in leased:
                                ok = False
                                break
                    if ok:
                        who = owner_var()
                        try:
                            site = capture(1, depth, who) if depth or who else 0
                        except Exception as exc:
                            site = contain(guard, exc)
                        clock = tick()
                        h = holder_var.get()
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
                            history.append((clock, ids, site, pool, "allocate"))
                        return result
            return alloc_slow(guard, capture, args, kwargs, result, depth, up=2)
        finally:
            unlock()

    allocate.__wrapped__ = original
    allocate.__kvguard__ = guard
    return allocate


def keeps_all_for(skip, allocator):
    """What the compiled wrapper asks before reading block objects: ``skip.keeps_all`` (called
    as the closure calls it), or, where it declares ``identities`` (``(attribute, object)``
    pairs, ``THE_ALLOCATOR`` for the allocator), those pairs, which C checks item by item
    without a Python call: every item's attribute must *be* the object. Stricter than a Python
    ``keeps_all`` that tests truth (``is_null`` being 0 is not ``False``), never looser: an
    item that fails goes to the careful path, whose verdict is the one the fast path gives."""
    keeps_all = getattr(skip, "keeps_all", None)
    try:
        pairs = tuple((sys.intern(name), allocator if want is THE_ALLOCATOR else want)
                      for name, want in getattr(keeps_all, "identities", None))
    except Exception:  # none declared, or not (str, object) pairs: call keeps_all instead
        pairs = None
    if pairs is not None:
        return pairs
    if type(keeps_all) is tuple:  # C would take a tuple for pairs: call it, as the closure
        return lambda allocator, items: keeps_all(allocator, items)
    return keeps_all


def accelerated(kind, guard, original, param, read, plain, main, ledger_of, drain, put, slow,
                engine_count):
    """The compiled twin of ``release`` / ``allocate`` (``kind``), bound to what the closure
    binds. Its careful path is ``slow``, called where the closure calls the careful path."""
    capture = guard._capture
    # front._sampled_capture (sample=N) over SITES.capture: drawn and captured in C too
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


def alloc_slow(guard, capture, args, kwargs, result, depth, up=1):
    """An allocation's careful tail: the site captured ``up`` frames above this one (1 for the
    compiled wrapper, which has no frame of its own; 2 for the closure, which calls this), the
    result read once and committed."""
    try:
        site = capture(up, depth, ACTIVE_OWNER.get())
    except Exception as exc:
        site = contain(guard, exc)
    seen, result = one_shot(result)
    protect(guard, commit_allocation, guard, args, kwargs, seen, site)
    return result


def int_tensor_ids(value):
    """A tensor's elements as a list (DeepSpeed and SGLang hand out tensors), else None. One
    ``tolist()`` (a single host sync for a CUDA tensor) and no other call into torch, whose
    attribute reads cost more than the checking: the fast path then accepts only a flat list of
    plain ints, so a bool mask (Python bools), a float or complex tensor, a 2-D one (nested
    lists) or a 0-dim one (a bare number) still goes to the careful path, which names it. An
    empty tensor has no elements to tell its dtype by: careful path too."""
    if type(value).__name__ != "Tensor" or type(value) is not torch_tensor_type():
        return None
    ids = value.tolist()
    return ids if type(ids) is list and ids else None


def one_shot(result):
    """``(what the ledger reads, what the caller gets)`` for an allocation's result. A one-shot
    iterator (a generator, ``map``, ``iter(list)``) can be read only once: the guard drains it
    into a list and the caller gets a fresh iterator over the same ids, which fails the way the
    original did, at the same point, if the allocator's iterator raised midway. Anything else
    is read in place and handed back untouched."""
    try:
        if iter(result) is not result:
            return result, result
    except Exception:
        return result, result
    items: list = []
    try:
        for item in result:
            items.append(item)
    except Exception as exc:
        return items, _then_raise(list(items), exc)
    return items, iter(list(items))


def _then_raise(items, exc):
    yield from items
    raise exc
