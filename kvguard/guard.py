"""The guard: instruments one allocator in place and checks every call against its ledger.

The allocator object keeps working for its callers (``isinstance`` unchanged): its methods are
shadowed by instance attributes that check, forward and record under one lock, so two threads
freeing the same block cannot both pass. The fast path takes the calls engines make all day
(plain ints, numpy integer arrays and scalars, block objects read by ``id_attr``, sub-pools,
references shared and dropped in refcounted pools) when every id is in the state the call needs:
one read of the ids, one loop over the ledger's columns, one site capture. Anything unusual
(a fault, bools, tensors where they do not belong, generators, never-seen ids) takes the careful
path, which reads the ids exactly and names every fault; ``fast_path=False`` sends every call
there, and a differential test holds the two to the same verdicts.

``on_violation``: ``raise`` rejects a bad call before the allocator sees it; ``log`` records and
forwards the call untouched, and nothing the guard does, its own bugs included, raises into the
caller; ``repair`` records and forwards a sanitized call (plain ints, each once, only live ids).
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import logging
import operator
import os
import random
import threading
import weakref
from collections import Counter, deque

from . import kinds
from .errors import ERROR_FOR_KIND, KVGuardError, error_for
from .fastread import ITERATORS, plain_ids
from .ids import Fault, like, normalize, result_ids, torch_tensor_type
from .ledger import Ledger
from .owners import ACTIVE_OWNER as _current_owner
from .owners import OWNERS, current_owner
from .spec import DEFAULT_SPEC, AllocatorSpec, per_pool, read
from .stacks import DEPTH, SITES, raw_stack
from .violation import BlockHistory, Operation, Violation

logger = logging.getLogger("kvguard")

MODES = ("raise", "log", "repair")
_MISSING = object()
_ATTR = "__kvguard__"
_GUARDS: "weakref.WeakSet[Guard]" = weakref.WeakSet()
_subscribers: list = []
_attach_listeners: list = []
_serials: Counter = Counter()
_capture = SITES.capture

VIOLATION_STACK_DEPTH = {"off": 1, "cheap": 24, "full": 128}
"""Frames kept for the stack of the call that broke a rule: rare, so richer than hot-path sites."""


_step_aside: list = [None]
"""The predicate ``step_aside_when`` installed, or None."""


def step_aside_when(predicate):
    """While ``predicate(error_class)`` is true, a raise-mode guard steps aside for a bad call
    rather than raise ``error_class`` (the ``KVGuardError`` subclass of its first violation): it
    records the violations (marked ``extra["stepped_aside"]``) and forwards the call untouched,
    as in log mode; then the ledger follows what the allocator did (``live_ids`` when the spec has
    it) and ``check()`` compares from there. The pytest plugin sets this while a test expects
    an exception kvguard's error is not (``assertRaises(AssertionError)`` around an engine's own
    debug check), so the engine's own defence is what the test sees. Returns a function that
    removes it."""
    _step_aside[0] = predicate

    def remove() -> None:
        if _step_aside[0] is predicate:
            _step_aside[0] = None
    return remove


class _Emissions:
    """Log lines the guard could not emit: a handler or filter on the ``kvguard`` logger that
    raises (disk full, a JSON handler without ``handleError``) costs the line, never the call."""

    lost = 0


EMISSIONS = _Emissions()


def emit(level: int, message: str, *args, **kwargs) -> None:
    """Log through the ``kvguard`` logger; never raises (see ``_Emissions``)."""
    try:
        logger.log(level, message, *args, **kwargs)
    except Exception:
        EMISSIONS.lost += 1


def _after_fork_in_child() -> None:
    """A fork copies a lock held by another thread as held, and that thread does not exist in
    the child: the child's first guarded call would wait forever. Every guard's lock starts
    free in the child. (A call that was under way in the parent is not replayed: the child's
    ledger is as it was before that call.)"""
    for g in list(_GUARDS):
        reinit = getattr(g._lock, "_at_fork_reinit", None)
        if reinit is not None:
            reinit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def subscribe(callback):
    """Call ``callback(guard, violation)`` for every violation of every guard; returns an
    unsubscribe function. The pytest plugin and the staging sink listen here."""
    _subscribers.append(callback)

    def unsubscribe() -> None:
        if callback in _subscribers:
            _subscribers.remove(callback)
    return unsubscribe


def on_attach(callback):
    """Call ``callback(guard)`` for every guard attached from now on; returns an unsubscribe
    function. Staging listens here to write a guard's stats line when it is collected."""
    _attach_listeners.append(callback)

    def unsubscribe() -> None:
        if callback in _attach_listeners:
            _attach_listeners.remove(callback)
    return unsubscribe


def guards() -> list:
    """Every guard alive in this process."""
    return list(_GUARDS)


def guard_of(allocator):
    """The guard instrumenting ``allocator``, or None."""
    try:
        return vars(allocator).get(_ATTR)
    except TypeError:
        return None


def engine_method(obj, name):
    """``obj.name``, past the class-level dispatcher ``kvguard.registry`` puts on instrumented
    classes: what a guard wraps and forwards to is the engine's own function."""
    method = getattr(obj, name)
    func = getattr(getattr(method, "__func__", method), "__kvguard_function__", None)
    if func is None:
        return method
    return func.__get__(obj) if not isinstance(obj, type) else func


class Stats:
    """Counters a guard keeps; ``to_dict()`` is what summaries and JSON reports show."""

    __slots__ = ("alloc_calls", "free_calls", "share_calls", "blocks_allocated", "blocks_freed",
                 "blocks_shared", "learned", "internal_errors", "violations")

    def __init__(self) -> None:
        self.alloc_calls = self.free_calls = self.share_calls = 0
        self.blocks_allocated = self.blocks_freed = self.blocks_shared = 0
        self.learned = self.internal_errors = 0
        self.violations: Counter = Counter()

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in self.__slots__ if name != "violations"}
        d["violations"] = dict(self.violations)
        return d

    def __repr__(self) -> str:
        return f"Stats({self.to_dict()})"


LIMIT = 1 << 30
"""Largest count a guard option takes: far past any use, and small enough for every deque,
counter and random draw that holds one (``history=10**20`` would overflow at the first call)."""


def _check_range(name: str, value, least: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= LIMIT:
        raise ValueError(f"{name} must be an int >= {least} and <= {LIMIT} ({meaning}), "
                         f"not {value!r}")


def _parameters(method) -> tuple:
    """A method's parameters after ``self``, cached per function: ``inspect.signature`` is most
    of what building a guard costs, and a test suite builds thousands of guards of one class."""
    func = getattr(method, "__func__", None)
    try:
        if func is not None and getattr(method, "__self__", None) is not None:
            return _signature(func)[1:]
        return _signature(method)
    except TypeError:  # unhashable callable: no cache
        try:
            return tuple(inspect.signature(method).parameters.values())
        except (TypeError, ValueError):
            return ()


@functools.lru_cache(maxsize=4096)
def _signature(func) -> tuple:
    try:
        return tuple(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return ()


class _Param:
    """Where one argument of a method is: by position (after self) and/or by name."""

    __slots__ = ("pos", "name", "default", "found")

    def __init__(self, method, where) -> None:
        self.pos = self.name = None
        self.default = _MISSING
        every = _parameters(method)
        params = [p for p in every
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        # Without a readable signature, or with *args/**kwargs, trust the spec.
        self.found = not every or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in every)
        if isinstance(where, int):
            self.pos = where
            self.found = self.found or where < len(params)
            if where < len(params):  # keyword-only too: free(self, *, ids) takes ids=...
                self.name = params[where].name
                self.default = params[where].default
                if self.default is inspect.Parameter.empty:
                    self.default = _MISSING
            return
        self.name = where
        for n, p in enumerate(params):
            if p.name == where:
                self.found = True
                if p.kind != p.KEYWORD_ONLY:
                    self.pos = n
                if p.default is not inspect.Parameter.empty:
                    self.default = p.default
                break

    def get(self, args, kwargs):
        pos = self.pos
        if pos is not None and len(args) > pos:
            return args[pos]
        if self.name is not None:
            return kwargs.get(self.name, self.default)
        return self.default

    def put(self, args, kwargs, value):
        pos = self.pos
        if pos is not None and len(args) > pos:
            args = args[:pos] + (value,) + args[pos + 1:]
        else:
            kwargs = dict(kwargs)
            kwargs[self.name] = value
        return args, kwargs


class Guard:
    """One guarded allocator. Created by ``kvguard.guard()``; see the module docstring."""

    def __init__(self, allocator, spec: AllocatorSpec, *, on_violation: str = "raise",
                 stacks: str = "cheap", name: str | None = None, history: int = 32,
                 max_violations: int = 10_000, learn: bool | None = None,
                 log_every: int = 100, sample: int = 1, fast_path: bool = True) -> None:
        if on_violation not in MODES:
            raise ValueError(f"on_violation must be one of {', '.join(MODES)}, "
                             f"not {on_violation!r}")
        if stacks not in DEPTH:
            raise ValueError(f"stacks must be one of {', '.join(DEPTH)}, not {stacks!r}")
        if not isinstance(spec, AllocatorSpec):
            raise TypeError(f"spec must be a kvguard.AllocatorSpec, not {type(spec).__name__}")
        _check_range("sample", sample, 1, "stacks of one call in N")
        _check_range("history", history, 0, "operations in the flight recorder")
        _check_range("max_violations", max_violations, 1, "violations kept")
        _check_range("log_every", log_every, 1, "log one repeat in N")
        self.spec = spec
        self.mode = on_violation
        self.stacks = stacks
        self._depth = DEPTH[stacks]
        self.sample = sample
        self._capture = _capture if sample == 1 else _sampled_capture(sample)
        cls = type(allocator)
        self.allocator_class = f"{cls.__module__}.{cls.__qualname__}"
        _serials[cls] += 1
        self.name = name or f"{cls.__qualname__}#{_serials[cls]}"
        self.address = hex(id(allocator))
        try:
            self._allocator = weakref.ref(allocator)
        except TypeError:
            self._allocator = lambda allocator=allocator: allocator
        self._lock = threading.RLock()
        self._tick = itertools.count(2).__next__
        """The guard's call counter: the ledger stamps each block with the call that last
        changed it. Call #1 stands for "before the guard attached"."""
        self.stats = Stats()
        self._violations: deque = deque(maxlen=max_violations)
        self.history: deque = deque(maxlen=history) if history else None
        self._log_every = max(1, log_every)
        self._logged: Counter = Counter()
        self._watchers: list = []
        self._bound: dict = {}
        self._tensor_like = None
        self._quarantine: dict = {}
        self.quarantine_size = 0
        self._ledgers: dict = {}
        self._originals: dict = {}
        self._params: dict = {}
        self._baseline = None
        self._learn = learn
        self._fast = bool(fast_path)
        self._learn_budget = None
        self._attach(allocator)

    # --- attaching ---------------------------------------------------------------------------

    @property
    def allocator(self):
        return self._allocator()

    def _attach(self, allocator) -> None:
        spec = self.spec
        for method in spec.methods():
            if not callable(getattr(allocator, method, None)):
                raise TypeError(f"cannot guard {self.allocator_class}: it has no method "
                                f"{method!r} (AllocatorSpec says {method!r})")
        try:
            own = vars(allocator)
        except TypeError:
            raise TypeError(f"cannot guard {self.allocator_class}: its instances have no "
                            "__dict__ (__slots__), so methods cannot be shadowed") from None
        free = getattr(allocator, spec.free)
        self._free_param = _Param(free, spec.free_arg)
        if not self._free_param.found:
            raise TypeError(f"cannot guard {self.allocator_class}: {spec.free}() has no "
                            f"parameter {spec.free_arg!r}")
        self._share_param = _Param(getattr(allocator, spec.share), 0) if spec.share else None
        self._pool_params = {
            m: _Param(getattr(allocator, m), spec.pool_arg) for m in spec.methods()
        } if spec.pool_arg is not None else {}
        self._seed(allocator)
        self.ledger(self._default_pool())
        self._bound = {m: engine_method(allocator, m) for m in spec.methods()}
        self._install()
        self._originals.setdefault("__reduce_ex__", own.get("__reduce_ex__", _MISSING))
        own["__reduce_ex__"] = self._reduce_hook()
        own[_ATTR] = self
        _GUARDS.add(self)
        if spec.adapter is not None:  # an engine adapter's extra wrappers (kvguard.adapters)
            try:
                spec.adapter(self)
            except BaseException:
                self.unguard()
                raise
        for callback in list(_attach_listeners):
            try:
                callback(self)
            except Exception as exc:  # a listener's bug must not stop the guarding
                self._internal_error(exc)

    def _seed(self, allocator) -> None:
        """Start from the allocator's present state: its free count, and live ids if known."""
        spec = self.spec
        self._baseline = self._free_count(allocator)
        live = read(allocator, spec.live_ids) if spec.live_ids is not None else None
        if live is not None:
            pools = live.items() if isinstance(live, dict) else [(self._default_pool(), live)]
            for pool, ids in pools:
                self.ledger(pool).adopt(result_ids(ids, spec.id_attr, spec.skip).ids, 1)
            self._learn = False if self._learn is None else self._learn
            # Blocks freed before the guard came may sit in a prefix cache, revivable by a
            # share: no spec can list those, so a refcounted pool learns them on their share.
            self._learn_shares = spec.refcounted
            return
        out = self._blocks_out(allocator)
        if self._learn is None:
            self._learn = bool(out) and any(out.values())
        self._learn_shares = spec.refcounted and bool(self._learn)
        # At most as many ids are learned as were out at attach (per pool): past that, an id
        # the guard never saw handed out is foreign-id again. Unknown counts: no bound.
        self._learn_budget = out if self._learn and out is not None else None
        for pool, ledger in self._ledgers.items():
            ledger.learn = self._learn
            ledger.learn_budget = self._budget(pool)
        n = sum(out.values()) if self._learn and out else 0
        if n:
            emit(logging.INFO, "kvguard: %s attached while %d block(s) were out: up to %d "
                 "id(s) it never saw handed out are learned as live on their first free; past "
                 "that, an unknown id is foreign-id", self.name, n, n)

    def _blocks_out(self, allocator):
        """How many blocks the allocator had handed out before the guard came, per pool
        (``{pool: count}``; ``None`` when its spec gives no size and free count to tell)."""
        if self._baseline is None or self.spec.size is None:
            return None
        try:
            size = read(allocator, self.spec.size)
        except Exception:
            return None
        keyed = self.spec.pool_arg is not None
        if isinstance(self._baseline, dict):
            out = {}
            for p, c in self._baseline.items():
                total = per_pool(size, p)
                if not isinstance(total, int):
                    return None
                key = p if keyed else None
                out[key] = out.get(key, 0) + max(total - c, 0)
            return out
        if not isinstance(size, int):
            return None
        return {None: max(size - self._baseline, 0)}

    def _budget(self, pool):
        budget = self._learn_budget
        if budget is None:
            return None
        return budget.get(pool, 0)

    def _default_pool(self):
        if self.spec.pool_arg is None:
            return None
        param = self._pool_params[self.spec.free]
        return None if param.default is _MISSING else param.default

    def ledger(self, pool=None) -> Ledger:
        """The ledger of one sub-pool (``pool_arg``), created on first use."""
        try:
            return self._ledgers[pool]
        except KeyError:
            pass
        size = None
        if self.spec.size is not None:
            allocator = self.allocator
            try:
                size = per_pool(read(allocator, self.spec.size), pool)
                size = int(size) if size is not None else None
            except Exception:
                size = None
        ledger = self._ledgers[pool] = Ledger(size, pool, refcounted=self.spec.refcounted,
                                              learn=bool(self._learn))
        ledger.learn_budget = self._budget(pool)
        return ledger

    def unguard(self) -> None:
        """Restore the original methods; blocks held in quarantine go back to the allocator."""
        with self._lock:
            allocator = self.allocator
            if allocator is None:
                return
            self.release_quarantine()
            own = vars(allocator)
            for method, original in self._originals.items():
                present = own.get(method)
                if getattr(present, "__kvguard__", None) is not self and \
                        getattr(present, "__kvguard_hook__", None) is not self:
                    continue  # replaced since by someone else: theirs stays
                if original is _MISSING:
                    own.pop(method, None)
                else:
                    own[method] = original
            self._originals.clear()
            if own.get(_ATTR) is self:
                del own[_ATTR]
            for watcher in self._watchers:
                getattr(watcher, "detach", lambda: None)()
            self._watchers.clear()
            _GUARDS.discard(self)

    def _reduce_hook(self):
        """The allocator's ``__reduce_ex__`` while guarded. ``copy.copy``, ``copy.deepcopy`` and
        ``pickle`` look it up on the instance: they get the allocator's own reduction with the
        guard's wrappers taken out of its state, so a copy is an unguarded, correct copy (its
        ``free`` frees on itself, not on the original) and a pickle holds the unguarded state.
        """
        guard = self

        def __reduce_ex__(protocol):
            allocator = guard.allocator
            guard.release_quarantine()  # the copy must see every block its caller freed
            reduction = type(allocator).__reduce_ex__(allocator, protocol)
            if not isinstance(reduction, tuple) or len(reduction) < 3:
                return reduction
            state = reduction[2]
            if isinstance(state, dict):
                state = guard._unguarded(state)
            elif (isinstance(state, tuple) and len(state) == 2
                  and isinstance(state[0], dict)):  # (__dict__, __slots__ values)
                state = (guard._unguarded(state[0]), state[1])
            return reduction[:2] + (state,) + reduction[3:]
        __reduce_ex__.__kvguard_hook__ = self  # not __kvguard__: no method to dispatch to
        return __reduce_ex__

    def _unguarded(self, state: dict) -> dict:
        """An instance ``__dict__`` as it would be without the guard (a new dict)."""
        allocator = self.allocator
        own = vars(allocator) if allocator is not None else {}
        out = dict(state)
        if out.get(_ATTR) is self:
            del out[_ATTR]
        for name, original in self._originals.items():
            if name in out and out[name] is own.get(name):
                if original is _MISSING:
                    del out[name]
                else:
                    out[name] = original
        return out

    def _original(self, allocator, method):
        """The method as it was before the guard shadowed it."""
        own = self._originals.get(method, _MISSING)
        if own is not _MISSING:
            return own
        return engine_method(type(allocator), method).__get__(allocator)

    @property
    def guarded(self) -> bool:
        return bool(self._originals)

    # --- the wrappers ------------------------------------------------------------------------

    def _fast_path(self) -> bool:
        """Whether the wrappers may take their fast path. Watchers and quarantine see every call
        on the careful path; ``fast_path=False`` asks for that too (the differential tests run
        both and compare their verdicts)."""
        return self._fast and not self.quarantine_size and not self._watchers

    def _fast_reader(self, result: bool):
        """The fast path's reader of ids for this spec, or None when it has none (dotted
        ``id_attr``, a ``skip`` over plain ids). ``read(value)`` returns a new list of plain
        ints, or None: then the careful path reads the value and decides."""
        spec = self.spec
        if spec.id_attr is not None:
            if "." in spec.id_attr:
                return None
            get = operator.attrgetter(spec.id_attr)
            skip = spec.skip
            # A skipped item (vLLM's null block) is passed through unchecked: that is the careful
            # path's business. ``skip.keeps_all(allocator, items)`` answers for a whole call at
            # once (True: no item is skipped); otherwise each item is asked.
            keeps_all = getattr(skip, "keeps_all", None)
            allocator = self.allocator

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
            return ids if ids is not None else _int_tensor_ids(value)
        return read_or_tensor

    def _fast_ledger(self, method):
        """``(main, ledger_of)``: the ``Ledger.hot`` columns of a spec without sub-pools, or
        ``ledger_of(args, kwargs)`` giving those of the call's sub-pool when its key is a plain
        int (or absent) and its ledger exists, else None (careful path)."""
        param = self._pool_params.get(method)
        if param is None:
            return self.ledger(self._default_pool()).hot, None
        ledgers = self._ledgers
        get = param.get

        def ledger_of(args, kwargs):
            key = get(args, kwargs)
            if key is _MISSING:
                key = None
            elif key is not None and type(key) is not int:
                return None
            ledger = ledgers.get(key)
            return None if ledger is None else ledger.hot
        return None, ledger_of

    def _install(self) -> None:
        """(Re)build the wrappers for the present configuration and shadow the methods."""
        allocator = self.allocator
        if allocator is None:
            return
        own = vars(allocator)
        spec = self.spec
        wrappers = {spec.free: self._wrap_free(self._bound[spec.free])}
        if spec.alloc:
            wrappers[spec.alloc] = self._wrap_alloc(self._bound[spec.alloc])
        if spec.share:
            wrappers[spec.share] = self._wrap_share(self._bound[spec.share])
        for method, wrapper in wrappers.items():
            if method not in self._originals:
                self._originals[method] = own.get(method, _MISSING)
            own[method] = wrapper

    def _wrap_free(self, original):
        """The free wrapper. Its fast path (ids read by ``_fast_reader``, every one live in the
        call's ledger, none repeated) is inlined with everything it needs bound as locals: this
        is where the overhead budget goes, so every line counts. Refcounted pools drop one
        reference per id; a block whose count reaches 0 becomes a tombstone."""
        return self._wrap_release(original, self.spec.free, self._free_param, share=False)

    def _wrap_share(self, original):
        """The share wrapper: the fast path adds a reference to ids that are live or cached
        (a tombstone, revived); never-seen ids and every fault go the careful way."""
        return self._wrap_release(original, self.spec.share, self._share_param, share=True)

    def _wrap_release(self, original, method, param, share):
        guard = self
        lock = self._lock
        owned, acquire, unlock = lock._is_owned, lock.acquire, lock.release
        pos = param.pos if param.pos is not None else -1 - (1 << 30)
        name, default = param.name, param.default
        read = self._fast_reader(result=False) if self._fast_path() else None
        plain = self.spec.id_attr is None and self.spec.skip is None  # an int is its own id
        main, ledger_of = self._fast_ledger(method)
        drain = self.spec.iterator_ok
        put = param.put
        pooled = self.spec.pool_arg is not None
        stats = self.stats
        history = self.history
        depth = self._depth
        capture = self._capture
        owner_var = _current_owner.get
        tick = self._tick
        slow = self._share_slow if share else self._free_slow
        # [refcount_attr] The engine's own count of each block is the truth at a release: read
        # before the call, it must be positive, and the ledger takes it before dropping one.
        engine_count = operator.attrgetter(self.spec.refcount_attr) if (
            self.spec.refcount_attr is not None and not share and read is not None) else None

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
                        stamp, origin, freed_at, ref, uncertain, pool = hot
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
                        if ok:
                            who = owner_var() if share else 0
                            try:
                                site = capture(1, depth, who) if depth or who else 0
                            except Exception as exc:
                                site = guard._site_failed(exc)
                            result = original(*args, **kwargs)
                            clock = tick()
                            if share:
                                for b in ids:
                                    if stamp[b] <= 0:  # a cached free block comes back
                                        stamp[b] = clock
                                        origin[b] = site
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
                                history.append((-clock, ids, site, pool) if pooled
                                               else (-clock, ids, site))
                            return result
                if share:
                    return slow(original, args, kwargs)
                return slow(original, args, kwargs, value)
            finally:
                unlock()

        release.__wrapped__ = original
        release.__kvguard__ = self
        return release

    def _wrap_alloc(self, original):
        """The allocation wrapper: forward first, then check what came back. The fast path
        takes ids that are all free or unseen in the call's ledger, each once."""
        guard = self
        lock = self._lock
        owned, acquire, unlock = lock._is_owned, lock.acquire, lock.release
        read = self._fast_reader(result=True) if self._fast_path() else None
        plain = self.spec.id_attr is None and self.spec.skip is None  # an int result is its id
        main, ledger_of = self._fast_ledger(self.spec.alloc)
        pooled = self.spec.pool_arg is not None
        stats = self.stats
        history = self.history
        depth = self._depth
        capture = self._capture
        owner_var = _current_owner.get
        tick = self._tick

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
                        stamp, origin, _, ref, uncertain, pool = hot
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
                        if ok:
                            who = owner_var()
                            try:
                                site = capture(1, depth, who) if depth or who else 0
                            except Exception as exc:
                                site = guard._site_failed(exc)
                            clock = tick()
                            if n == 1:
                                stamp[b] = clock
                                origin[b] = site
                            else:
                                for b in ids:
                                    stamp[b] = clock
                                    origin[b] = site
                            if ref is not None:
                                for b in ids:
                                    ref[b] = 1
                                if uncertain:
                                    uncertain.difference_update(ids)
                            stats.alloc_calls += 1
                            stats.blocks_allocated += n
                            if history is not None:
                                history.append((clock, ids, site, pool) if pooled
                                               else (clock, ids, site))
                            return result
                try:
                    site = capture(1, depth, owner_var())
                except Exception as exc:
                    site = guard._site_failed(exc)
                seen, result = _one_shot(result)
                guard._protect(guard._after_alloc, args, kwargs, seen, site)
                return result
            finally:
                unlock()

        allocate.__wrapped__ = original
        allocate.__kvguard__ = self
        return allocate

    # --- slow paths --------------------------------------------------------------------------

    def _protect(self, step, *args):
        """Run a guard step; in log/repair mode a bug in the guard never reaches the caller."""
        if self.mode == "raise":
            return step(*args)
        try:
            return step(*args)
        except KVGuardError:
            raise
        except Exception as exc:
            self._internal_error(exc)
            return None

    def _site_failed(self, exc: BaseException) -> int:
        """A call site could not be captured: raise mode shows the guard's bug; log and repair
        go on with an unknown site, so the call (already forwarded, for an allocation) and its
        bookkeeping complete."""
        if self.mode == "raise":
            raise exc
        self._internal_error(exc)
        return 0

    def _internal_error(self, exc: BaseException) -> None:
        self.stats.internal_errors += 1
        if self.stats.internal_errors == 1:
            emit(logging.ERROR, "kvguard: internal error in the guard of %s, call forwarded "
                 "unchecked (logged once per guard): %r", self.name, exc, exc_info=exc)

    def _pool(self, method: str, args, kwargs):
        param = self._pool_params.get(method)
        if param is None:
            return None
        value = param.get(args, kwargs)
        return None if value is _MISSING else _pool_key(value)

    def _free_slow(self, original, args, kwargs, value):
        if value is _MISSING:  # no ids at all: the allocator's own TypeError says it best
            return original(*args, **kwargs)
        try:
            site = self._capture(2, self._depth)
            plan = self._plan_release(self.spec.free, args, kwargs, value, f"{self.spec.free}()",
                                      site)
        except Exception as exc:
            if self.mode == "raise":
                raise
            self._internal_error(exc)
            return original(*args, **kwargs)
        if plan.aside:
            return self._forward_aside(original, args, kwargs, plan)
        args, kwargs, forward = self._protect(self._route_free, plan, args, kwargs) or (
            args, kwargs, True)
        result = original(*args, **kwargs) if forward else None
        self._protect(self._commit_release, plan)
        return result

    def _plan_release(self, method, args, kwargs, value, what, site):
        """Read and check the ids of a free()/share() call; record violations; raise in raise
        mode. Returns the plan the call is forwarded and committed by."""
        spec = self.spec
        pool = self._pool(method, args, kwargs)
        ledger = self.ledger(pool)
        norm = normalize(value, tensor_ok=spec.tensor_ok, id_attr=spec.id_attr, skip=spec.skip,
                         iterator_ok=spec.iterator_ok, consume=self.mode == "repair", what=what)
        faults = norm.faults
        ids = norm.ids
        stamp = ledger.stamp
        n = len(stamp)
        is_share = method == spec.share
        # [refcount_attr] The engine's own count of each block, read before the call: the
        # truth for a release (None without the keyword, and for a share).
        held = _engine_refcounts(spec.refcount_attr, norm) if (
            spec.refcount_attr is not None and not is_share) else None
        if not faults and len(set(ids)) == len(ids):
            # The common case, checked in one pass: every id live (or, for a share, handed out
            # at least once) and inside the ledger. Anything else is sorted out below.
            for b in ids:
                if not b < n or stamp[b] <= 0 and (not is_share or stamp[b] == 0):
                    break
            else:  # (b < len(stamp) means in range: a sized ledger is exactly its size long)
                if held is None or min(held, default=1) > 0:
                    return _Plan(method, pool, ledger, norm, ids, [], site, held)
        faults = list(faults)
        unique = list(dict.fromkeys(ids))
        if len(unique) != len(ids):
            counts = Counter(ids)
            dups = tuple(b for b in unique if counts[b] > 1)
            shown = ", ".join(f"{b} x{counts[b]}" for b in dups[:8])
            faults.append(Fault(kinds.DUPLICATE_ID, (
                f"{what} got the same block id more than once in one call ({shown}): each copy "
                "would go back on the free list and the block would be handed to two owners; "
                "de-duplicate the ids (were two sources concatenated?)"), dups))
        good, learned, foreign, double, out_of_range = [], [], [], [], []
        unknown = 0  # ids never seen, learned by this call (bounded by the ledger's budget)
        for b in unique:
            if not ledger.in_range(b):
                out_of_range.append(b)
            elif b >= len(stamp) or stamp[b] == 0:
                if is_share:
                    (learned if self._learn_shares else foreign).append(b)
                elif ledger.learn and (ledger.learn_budget is None
                                       or unknown < ledger.learn_budget):
                    learned.append(b)
                    unknown += 1
                else:
                    foreign.append(b)
            elif stamp[b] < 0 and not is_share:
                (learned if b in ledger.uncertain else double).append(b)
            else:
                good.append(b)
        drained = []
        if held is not None:  # [refcount_attr] live in the ledger, but the engine holds none
            count = dict(zip(ids, held))
            drained = [b for b in good if count[b] is not None and count[b] <= 0]
            if drained:
                good = [b for b in good if b not in set(drained)]
        if out_of_range:
            faults.append(Fault(kinds.INVALID_ID, (
                f"{what} got block id {out_of_range[0]}, outside the pool [0, {ledger.size})"
                + _more(out_of_range)), tuple(out_of_range)))
        if foreign:
            faults.append(Fault(kinds.FOREIGN_ID, (
                f"{what} got block id {foreign[0]}, which this allocator never handed out"
                + _more(foreign) + "; was it allocated from another pool or allocator?"),
                tuple(foreign)))
        if double:
            faults.append(Fault(kinds.DOUBLE_FREE, (
                f"{what} got block id {double[0]}, which is already free" + _more(double)
                + ": a second free puts it on the free list twice, and two requests will share "
                "it; free each block once, and forget ids after freeing them"), tuple(double)))
        if drained:
            faults.append(Fault(kinds.DOUBLE_FREE, (
                f"{what} got block id {drained[0]}" + _more(drained) + ", whose own "
                f"{spec.refcount_attr} is already {count[drained[0]]}: every reference to it "
                "was released, so this release takes the count below zero and the block goes "
                "back on the free list while it may still be in use; free each reference once"),
                tuple(drained)))
        plan = _Plan(method, pool, ledger, norm, good, learned, site, held)
        if faults:
            faults.sort(key=lambda f: kinds.PRECEDENCE[f.kind])
            plan.aside = self._stepping_aside(faults[0].kind)
            detail = [b for f in faults for b in f.block_ids]
            violations = [self._violation(f.kind, f.block_ids, f.message, method, pool, ledger,
                                          detail)
                          for f in faults]
            for v in violations[1:]:
                violations[0].extra.setdefault("also", []).append(v.headline())
            for v in violations:
                if plan.aside:
                    v.extra["stepped_aside"] = True
                self._record(v)
            plan.faulty = True
            if self.mode == "raise" and not plan.aside:
                raise error_for(violations[0])
        return plan

    # --- stepping aside (step_aside_when) ----------------------------------------------------

    def _stepping_aside(self, kind) -> bool:
        """Whether to forward a call whose first violation is ``kind`` rather than raise."""
        predicate = _step_aside[0]
        if predicate is None or self.mode != "raise":
            return False
        try:
            return bool(predicate(ERROR_FOR_KIND[kind]))
        except Exception as exc:  # the predicate's bug: raise as usual
            self._internal_error(exc)
            return False

    def _forward_aside(self, original, args, kwargs, plan):
        """A bad call the guard stepped aside for reaches the allocator untouched. Whatever the
        allocator did with it, or refused to do by raising, the ledger then follows."""
        try:
            result = original(*args, **kwargs)
            self._commit_release(plan)
        finally:
            self._follow_allocator()
        return result

    def _follow_allocator(self) -> None:
        """Take the allocator's word after a call the guard let through with bad input: the
        live ids it reports (the spec's ``live_ids``) become the ledger's, and ``check()``
        compares its free count from here on. Never raises: the allocator's own exception, if
        any, is what the caller must see."""
        allocator = self.allocator
        if allocator is None:
            return
        spec = self.spec
        try:
            if spec.live_ids is not None:
                live = read(allocator, spec.live_ids)
                if live is not None:
                    pools = live.items() if isinstance(live, dict) else [
                        (self._default_pool(), live)]
                    clock = self._tick()
                    for pool, ids in pools:
                        self.ledger(pool).follow(result_ids(ids, spec.id_attr, spec.skip).ids,
                                                 clock)
            self._rebase(allocator)
        except Exception as exc:
            self._internal_error(exc)

    def _rebase(self, allocator) -> None:
        """``check()`` compares the allocator's free count from here on: its present count
        stands for the ledger's present state (after a call the guard let through, a resize)."""
        now = self._free_count(allocator)
        if isinstance(now, dict):
            keyed = self.spec.pool_arg is not None
            self._baseline = {pool: count - self._expected_delta(pool if keyed else None)
                              for pool, count in now.items()}
        elif now is not None:
            self._baseline = now - sum(self._expected_delta(p) for p in self._ledgers)

    def _route_free(self, plan, args, kwargs):
        """Decide what the allocator receives: the call itself, a repaired one, or the ids
        leaving quarantine. Returns ``(args, kwargs, forward)``."""
        ids = plan.good + plan.learned
        repair = plan.faulty and self.mode == "repair"
        if self.quarantine_size and not self.spec.refcounted:
            released = self._enter_quarantine(plan.pool, ids, plan)
            if not released and not plan.norm.passthrough:
                return args, kwargs, False
            return (*self._free_param.put(args, kwargs, self._forward_value(plan, released)),
                    True)
        if repair:
            if not ids and not plan.norm.passthrough:
                return args, kwargs, False
            return (*self._free_param.put(args, kwargs, self._forward_value(plan, ids)), True)
        if plan.norm.consumed:
            return (*self._free_param.put(args, kwargs, plan.norm.materialized), True)
        return args, kwargs, True

    def _forward_value(self, plan, ids):
        """Ids as the allocator takes them: its objects, a tensor like the caller's, or ints."""
        norm = plan.norm
        if norm.objects is not None:
            first = {}
            for b, obj in zip(norm.ids, norm.objects):
                first.setdefault(b, obj)
            held = plan.held_objects
            objects = [first[b] if b in first else held[b] for b in ids] + norm.passthrough
            return tuple(objects) if type(norm.given) is tuple else objects
        if norm.tensor is not None and self.spec.tensor_ok:
            torch = __import__("torch")
            return torch.tensor(ids, dtype=norm.tensor.dtype, device=norm.tensor.device)
        return like(norm.given, ids)

    def _commit_release(self, plan) -> None:
        ledger = plan.ledger
        clock = self._tick()
        if plan.learned:
            if ledger.learn_budget is not None and plan.method != self.spec.share:
                ledger.learn_budget -= sum(1 for b in plan.learned if not ledger.seen(b))
                if ledger.learn_budget <= 0:
                    ledger.learn = False
            ledger.adopt(plan.learned, clock)
            self.stats.learned += len(plan.learned)
        ids = plan.good + plan.learned
        site = plan.site
        stats = self.stats
        if plan.held is not None:
            _follow_engine_refcounts(ledger, plan)
        revived = ()
        if plan.method == self.spec.share:
            if self._watchers:  # free blocks a share takes back (a prefix-cache hit)
                stamp = ledger.stamp
                revived = [b for b in ids if stamp[b] < 0]
            ledger.share(ids, clock, site)
            stats.share_calls += 1
            stats.blocks_shared += len(ids)
            op = "share"
        else:
            if ledger.ref is not None:
                dropping = [b for b in ids if ledger.ref[b] == 1]
            else:
                dropping = ids
            stats.blocks_freed += ledger.release(ids, clock, site)
            stats.free_calls += 1
            op = "free"
            for watcher in self._watchers:
                watcher.on_free(self, plan.pool, dropping)
        if self.history is not None:
            # The flight recorder keeps what the allocator received (log mode forwards a faulty
            # call untouched), so `kvguard replay` can find where the allocator went wrong.
            received = plan.norm.ids if plan.faulty and (self.mode == "log" or plan.aside) \
                else ids
            self.history.append((clock if op == "share" else -clock, received, site, plan.pool,
                                 op))
        if revived:
            self._raise_found(self._watched("on_share", plan.method, plan.pool, ledger, revived))

    def _share_slow(self, original, args, kwargs):
        value = self._share_param.get(args, kwargs)
        try:
            site = self._capture(2, self._depth, _current_owner.get())  # a share hands one out
            plan = self._plan_release(self.spec.share, args, kwargs, value, f"{self.spec.share}()",
                                      site)
        except Exception as exc:
            if self.mode == "raise":
                raise
            self._internal_error(exc)
            return original(*args, **kwargs)
        if plan.norm.consumed:
            args, kwargs = self._share_param.put(args, kwargs, plan.norm.materialized)
        if plan.aside:
            return self._forward_aside(original, args, kwargs, plan)
        result = original(*args, **kwargs)
        self._protect(self._commit_release, plan)
        return result

    def _after_alloc(self, args, kwargs, result, site, method=None) -> None:
        spec = self.spec
        method = method or spec.alloc
        pool = self._pool(method, args, kwargs)
        ledger = self.ledger(pool)
        norm = result_ids(result, spec.id_attr, spec.skip)
        faults = list(norm.faults)
        ids = norm.ids
        stamp = ledger.stamp
        n = len(stamp)
        fresh, shared, bad = [], [], []
        if not faults and len(set(ids)) == len(ids):
            for b in ids:  # the common case in one pass: each id free or new, inside the ledger
                if not b < n or stamp[b] > 0:
                    break
            else:
                fresh = ids
        seen = set() if fresh is not ids else ()
        for b in ids if fresh is not ids else ():
            if b in seen:
                shared.append(b)
                continue
            seen.add(b)
            if not ledger.in_range(b) or not ledger.grow(b + 1):
                bad.append(b)
            elif ledger.stamp[b] > 0 and b not in ledger.uncertain:
                shared.append(b)
            else:
                fresh.append(b)
        if bad:
            faults.append(Fault(kinds.INVALID_ID, (
                f"{method}() handed out block id {bad[0]}, outside the pool [0, {ledger.size})"
                + _more(bad) + ": the allocator's free list is corrupt"), tuple(bad)))
        if shared:
            faults.append(Fault(kinds.SHARED_BLOCK, (
                f"{method}() handed out block {shared[0]}" + _more(shared)
                + " while it is still live: two owners now share one KV block and overwrite "
                "each other's attention state; the allocator's free list is corrupt (a "
                "duplicate or double free earlier?)"), tuple(shared)))
        violations = []
        for fault in sorted(faults, key=lambda f: kinds.PRECEDENCE[f.kind]):
            violations.append(self._violation(fault.kind, fault.block_ids, fault.message, method,
                                              pool, ledger, fault.block_ids))
        clock = self._tick()
        ledger.allocate(fresh, clock, site)
        self.stats.alloc_calls += 1
        self.stats.blocks_allocated += len(fresh)
        if self.history is not None:
            self.history.append((clock, ids, site, pool))
        violations += self._watched("on_alloc", method, pool, ledger, fresh)
        self._raise_found(violations)

    def _watched(self, hook, method, pool, ledger, ids) -> list:
        """What the watchers' ``hook`` (``on_alloc``, ``on_share``) finds in blocks handed out
        by ``method``. ``on_share`` is optional in the watcher protocol."""
        found = []
        for watcher in self._watchers:
            check = getattr(watcher, hook, None)
            for kind, block_ids, message, extra in (check(self, pool, ids) or ()) if check else ():
                v = self._violation(kind, block_ids, message, method, pool, ledger, block_ids)
                v.extra.update(extra)
                found.append(v)
        return found

    def _raise_found(self, violations) -> None:
        """Record violations found on the way out of a call; raise mode raises the first
        (unless the guard steps aside: ``step_aside_when``)."""
        aside = bool(violations) and self._stepping_aside(violations[0].kind)
        for v in violations:
            if aside:
                v.extra["stepped_aside"] = True
            self._record(v)
        if violations and self.mode == "raise" and not aside:
            raise error_for(violations[0])

    # --- quarantine --------------------------------------------------------------------------

    def set_quarantine(self, blocks: int) -> None:
        """Hold freed blocks back from the allocator until ``blocks`` more have been freed.

        A stale reference then keeps pointing at poisoned, unused memory for longer, which is
        the window in which a write-after-free is caught (AddressSanitizer's quarantine).
        """
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            raise ValueError(f"quarantine must be a block count >= 0, not {blocks!r}")
        if blocks and self.spec.refcounted:
            raise ValueError("quarantine needs a non-refcounted pool: a refcounted allocator "
                             "must see every reference drop")
        with self._lock:
            self.quarantine_size = blocks
            self._update_paths()
            if not blocks:
                self.release_quarantine()

    def _update_paths(self) -> None:
        """Watchers and quarantine need the slow path: rebuild the wrappers without the fast one."""
        self._install()

    def add_watcher(self, watcher) -> None:
        """Attach a watcher (``on_free(guard, pool, ids)``, ``on_alloc(guard, pool, ids)`` ->
        iterable of ``(kind, ids, message, extra)``, and optionally ``on_share(guard, pool,
        ids)``, the same for free blocks a share revives): kvguard.cache poisons and verifies
        blocks through this."""
        with self._lock:
            self._watchers.append(watcher)
            self._update_paths()

    def remove_watcher(self, watcher) -> None:
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)
            self._update_paths()

    def _enter_quarantine(self, pool, ids, plan) -> list:
        fifo = self._quarantine.setdefault(pool, collections.OrderedDict())
        norm = plan.norm
        objects = dict(zip(norm.ids, norm.objects)) if norm.objects is not None else {}
        if norm.tensor is not None:
            self._tensor_like = norm.tensor
        for b in ids:
            fifo[b] = objects.get(b)
        released = []
        while len(fifo) > self.quarantine_size:
            b, obj = fifo.popitem(last=False)
            released.append(b)
            plan.held_objects[b] = obj
        return released

    def held(self, pool=None) -> list:
        """Ids freed by the caller but still held in quarantine."""
        return list(self._quarantine.get(pool, ()))

    def release_quarantine(self) -> None:
        """Give every quarantined block back to the allocator now."""
        with self._lock:
            allocator = self.allocator
            for pool, fifo in list(self._quarantine.items()):
                if not fifo or allocator is None:
                    continue
                ids = list(fifo)
                objects = list(fifo.values())
                fifo.clear()
                value = objects if self.spec.id_attr else ids
                like = self._tensor_like
                if like is not None and self.spec.tensor_ok:
                    torch = __import__("torch")
                    value = torch.tensor(ids, dtype=like.dtype, device=like.device)
                args, kwargs = self._free_param.put((), {}, value)
                pool_param = self._pool_params.get(self.spec.free)
                if pool_param is not None and pool is not None:
                    args, kwargs = pool_param.put(args, kwargs, pool)
                self._original(allocator, self.spec.free)(*args, **kwargs)

    # --- violations --------------------------------------------------------------------------

    def _violation(self, kind, block_ids, message, method, pool, ledger, detail_ids) -> Violation:
        blocks = []
        for b in list(dict.fromkeys(detail_ids))[:4]:
            if ledger.seen(b):
                stamp = ledger.stamp[b]
                site = ledger.origin[b]
                blocks.append(BlockHistory(
                    b, "live" if stamp > 0 else "free", ledger.refcount(b),
                    OWNERS.labels[SITES.owner(site)], abs(stamp), SITES.pairs(site),
                    SITES.pairs(ledger.freed_at[b])))
        history = [self._operation(*entry) for entry in (self.history or ())]
        return Violation(
            kind=kind, block_ids=tuple(block_ids), message=message,
            allocator=self.allocator_class, allocator_name=self.name,
            allocator_address=self.address, method=method, pool=pool,
            call_stack=raw_stack(1, VIOLATION_STACK_DEPTH[self.stacks]), blocks=blocks,
            owner=current_owner(), history=history,
            extra={"learned": ledger.adopted} if ledger.adopted else {},
        )

    def _operation(self, signed_clock, ids, site, pool=None, op=None) -> Operation:
        """Decode a flight-recorder entry. The hot path stores 3-tuples: the sign of the call
        number tells a hand-out (+) from a free (-)."""
        if op is None:
            op = "free" if signed_clock < 0 else "allocate"  # kinds of step, as replay reads them
        return Operation(op, tuple(ids), SITES.pairs(site), pool, abs(signed_clock))

    def _record(self, violation: Violation) -> None:
        self._violations.append(violation)
        self.stats.violations[violation.kind] += 1
        if self.mode != "raise":
            self._log(violation)
        for callback in list(_subscribers):
            try:
                callback(self, violation)
            except Exception as exc:  # a listener's bug must not break the guarded call
                self._internal_error(exc)

    def _log(self, violation: Violation) -> None:
        key = (violation.kind, violation.summary())
        self._logged[key] += 1
        n = self._logged[key]
        if n == 1 or n % self._log_every == 0:
            again = f" (occurrence {n})" if n > 1 else ""
            emit(logging.WARNING, "%s%s", violation.render(), again)

    def report(self, violation: Violation) -> None:
        """Record a violation found by a helper outside the call paths (cache checks)."""
        with self._lock:
            self._record(violation)
            if self.mode == "raise":
                raise error_for(violation)

    @property
    def violations(self) -> list:
        return list(self._violations)

    # --- assertions you call -----------------------------------------------------------------

    def _free_count(self, allocator):
        how = self.spec.free_count
        if how is None or allocator is None:
            return None
        value = read(allocator, how)
        if isinstance(value, int):
            return value
        if isinstance(value, dict):
            return {_pool_key(k): int(v) for k, v in value.items()}
        if hasattr(value, "tolist"):
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            return {n: int(v) for n, v in enumerate(value)}
        return int(value)

    def check(self) -> dict:
        """Compare the allocator's own free count with the ledger's; raises ``inconsistent``
        (in every mode: it is an assertion) when they disagree. Returns the figures."""
        with self._lock:
            if self.spec.free_count is None:
                raise ValueError(f"cannot check {self.name}: its AllocatorSpec has no "
                                 "free_count to compare with; guard it with AllocatorSpec("
                                 "free_count=...), the attribute, method or callable giving "
                                 "the allocator's own count of free blocks")
            now = self._free_count(self.allocator)
            figures = {}
            if isinstance(now, dict):
                base = self._baseline if isinstance(self._baseline, dict) else {}
                for pool, count in now.items():
                    key = pool if self.spec.pool_arg is not None else None
                    figures[pool] = self._compare(key, count - base.get(pool, count))
            else:
                total = sum(self._expected_delta(p) for p in self._ledgers)
                figures[None] = (now - self._baseline, total)
            bad = {p: f for p, f in figures.items() if f[0] != f[1]}
            if bad:
                pool, (theirs, ours) = next(iter(bad.items()))
                ledger = self.ledger(pool if self.spec.pool_arg is not None else None)
                v = self._violation(kinds.INCONSISTENT, (), (
                    f"the allocator's free count changed by {theirs:+d} since the guard "
                    f"attached, but the ledger saw {ours:+d}: the allocator is corrupt, or was "
                    "called behind the guard's back"), "check", pool, ledger, ())
                v.extra["allocator_free_delta"] = theirs
                v.extra["ledger_free_delta"] = ours
                self._record(v)
                raise error_for(v)
            return figures

    def _compare(self, pool, their_delta):
        return their_delta, self._expected_delta(pool)

    def _expected_delta(self, pool) -> int:
        ledger = self._ledgers.get(pool)
        if ledger is None:
            return 0
        return ledger.free_delta - len(self._quarantine.get(pool, ()))

    @property
    def live(self) -> dict:
        """Block id (or ``(pool, id)`` with sub-pools) -> record of each live block."""
        with self._lock:
            out = {}
            for pool, ledger in self._ledgers.items():
                for b in ledger.live_ids():
                    out[b if self.spec.pool_arg is None else (pool, b)] = ledger.block(b)
            return out

    def assert_no_leaks(self, owner=_MISSING) -> None:
        """Raise ``leak`` if blocks are still live (of ``owner`` only, when given)."""
        with self._lock:
            for pool, ledger in self._ledgers.items():
                if owner is _MISSING:
                    ids = ledger.live_ids()
                else:
                    ids = ledger.live_ids(owner, any_owner=False)
                if ids:
                    whose = "" if owner is _MISSING else f" owned by {owner!r}"
                    v = self._violation(kinds.LEAK, ids, (
                        f"{len(ids)} block(s){whose} are still live: free them when their "
                        "sequence finishes, or they are lost to the pool"),
                        "assert_no_leaks", pool, ledger, ids)
                    self._record(v)
                    raise error_for(v)

    def check_tables(self, tables, pool=None, *, refs=None) -> list:
        """Check block tables against the ledger: ids that are not live are ``stale-table``; a
        live block in more owners' tables than it has references is ``shared-block``.

        ``tables``: a mapping owner -> ids, or a 2-D integer tensor with one row per sequence
        and negative entries as padding (checked on its own device; see kvguard.tables).
        ``refs``: block id -> references held, for an engine that shares blocks above its
        allocator (Hugging Face's ``BlockLedger.shared_ref_counts``).
        """
        from .tables import check_tables
        with self._lock:
            found = check_tables(self, tables, pool, refs)
            for v in found:
                self._record(v)
            if found and self.mode == "raise":
                raise error_for(found[0])
            return found

    def snapshot(self) -> dict:
        """The counters (``stats.to_dict()``) plus ``blocks_live`` and ``seeded`` (ids made live
        at attach from the spec's ``live_ids``), for readers on other threads such as a metrics
        scrape. The guard's lock is held for the counters' copy alone: the ledgers are counted
        after it from copies of their columns, so the allocator never waits for a scan."""
        with self._lock:
            figures = self.stats.to_dict()
        ledgers = list(self._ledgers.values())
        adopted = sum(ledger.adopted for ledger in ledgers)
        figures["blocks_live"] = sum(ledger.count_live() for ledger in ledgers)
        figures["seeded"] = max(adopted - figures["learned"], 0)
        return figures

    def __repr__(self) -> str:
        return (f"<kvguard.Guard {self.name} of {self.allocator_class} mode={self.mode} "
                f"stacks={self.stacks} violations={sum(self.stats.violations.values())}>")


class _Plan:
    """What a checked free()/share() call will do, between its check and its commit."""

    __slots__ = ("method", "pool", "ledger", "norm", "good", "learned", "site", "faulty",
                 "held_objects", "held", "aside")

    def __init__(self, method, pool, ledger, norm, good, learned, site, held=None) -> None:
        self.site = site
        self.held = held
        """[refcount_attr] The engine's count of each of ``norm.ids`` before the call."""
        self.method = method
        self.pool = pool
        self.ledger = ledger
        self.norm = norm
        self.good = good
        self.learned = learned
        self.faulty = False
        self.aside = False
        """The guard steps aside for this faulty call (``step_aside_when``)."""
        self.held_objects: dict = {}


def _engine_refcounts(attr, norm):
    """[refcount_attr] Each block object's own reference count, in the order of ``norm.ids``
    (None for an object without one, or an unreadable one: the ledger decides those)."""
    objects = norm.objects
    if objects is None:
        return None
    try:
        return list(map(operator.attrgetter(attr), objects))
    except Exception:
        return [_count_or_none(obj, attr) for obj in objects]


def _count_or_none(obj, attr):
    try:
        value = getattr(obj, attr)
    except Exception:
        return None
    return value if type(value) is int else None


def _follow_engine_refcounts(ledger, plan) -> None:
    """[refcount_attr] Before a release is committed, each live block's count in the ledger
    becomes the engine's: references the engine took or dropped behind the guard (vLLM's
    copy-on-write ``ref_cnt += 1``) are no longer missing. The release then drops one, as the
    engine is about to. Learned blocks keep their learned count of 1."""
    ref = ledger.ref
    if ref is None:
        return
    good = set(plan.good)
    uncertain = ledger.uncertain
    for b, count in zip(plan.norm.ids, plan.held):
        if b in good and type(count) is int and count > 0 and ref[b] != count:
            ref[b] = count
            if uncertain:
                uncertain.discard(b)


def _int_tensor_ids(value):
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


def _one_shot(result):
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


def _more(ids) -> str:
    return f" (and {len(ids) - 1} more: {list(ids[1:9])})" if len(ids) > 1 else ""


def _pool_key(value):
    """Sub-pool keys come as ints, 0-dim tensors or numpy ints: make them plain and hashable."""
    if type(value) is int:
        return value
    Tensor = torch_tensor_type()
    if Tensor is not None and isinstance(value, Tensor) and value.dim() == 0:
        return value.item()
    if hasattr(value, "__index__") and not isinstance(value, bool):
        return int(value.__index__())
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _sampled_capture(every: int):
    """A site capture that keeps the stack of one call in ``every`` and only the owner for the
    rest (``sample=``; staging's ``KVGUARD_SAMPLE``). Calls are drawn at random from a private
    generator, so a periodic workload cannot hide a call site and the program's own ``random``
    sequence is left alone; the ledger and the counters still see every call."""
    draw = random.Random(every).random
    chance = 1.0 / every
    capture = _capture

    def sampled(depth, limit, owner=0):
        if draw() < chance:
            return capture(depth + 1, limit, owner)
        return capture(depth + 1, 0, owner) if owner else 0
    return sampled


def guard(allocator, spec: AllocatorSpec | None = None, *, on_violation: str | None = None,
          stacks: str | None = None, name: str | None = None, **options) -> Guard:
    """Instrument ``allocator`` in place and return its ``Guard``.

    ``on_violation`` defaults to ``"raise"`` and ``stacks`` to ``"cheap"``. ``spec=None`` looks
    the allocator's class up among registered specs, then falls back to methods named
    ``allocate``/``free``. Guarding an already guarded allocator returns its guard unchanged;
    asking it for another spec, mode or stacks is an error (``unguard()`` it first), never a
    silent no-op.
    """
    existing = guard_of(allocator)
    if existing is not None:
        asked = {"spec": (spec, existing.spec), "on_violation": (on_violation, existing.mode),
                 "stacks": (stacks, existing.stacks)}
        for what, (wanted, present) in asked.items():
            if wanted is not None and wanted != present:
                shown = "another spec" if what == "spec" else f"{what}={present!r}"
                raise ValueError(f"{existing.name} is already guarded with {shown}; "
                                 "unguard() it first")
        return existing
    if spec is None:
        from .registry import spec_for
        spec = spec_for(type(allocator)) or DEFAULT_SPEC
    return Guard(allocator, spec, on_violation=on_violation or "raise", stacks=stacks or "cheap",
                 name=name, **options)
