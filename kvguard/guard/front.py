"""The public ``Guard``: attaching, options, the user's assertions, and the hook protocol.

A ``Guard`` holds one allocator's state (ledgers, counters, flight recorder, quarantine,
watchers) and answers the user (``check``, ``assert_no_leaks``, ``check_tables``, ``live``,
``snapshot``). Adapters and the cache, table and write checks reach it through its hooks:
``lock``, ``wrap_method`` (an extra method by its role), ``capture_site``, ``commit_release`` /
``commit_allocation``, ``violation`` / ``settle`` / ``flag``. The work is done by the modules
beside this one; none of them is reached from outside the package.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections import Counter

from .. import registry
from ..ledger import Ledger
from ..marks import ATTR, guard_of
from ..owners import ACTIVE_OWNER
from ..spec import DEFAULT_SPEC, AllocatorSpec, per_pool, read
from ..stacks import DEPTH, SITES, sampled_capture
from . import (baseline, bookkeeping, careful, copies, decisions, descriptors, evidence,
               observers, roles, selfcheck, shadowing, shapes)
from .arguments import MISSING, Param, pool_key
from .assertions import Assertions
from .decisions import MODES
from .instances import GUARDS, engine_method
from .quarantine import Quarantine
from .telemetry import Journal, announce, new_stats

LIMIT = 1 << 30
"""Largest count a guard option takes: far past any use, and small enough for every deque,
counter and random draw that holds one (``history=10**20`` would overflow at the first call)."""

_serials: Counter = Counter()
_capture = SITES.capture


def _check_range(name: str, value, least: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= LIMIT:
        raise ValueError(f"{name} must be an int >= {least} and <= {LIMIT} ({meaning}), "
                         f"not {value!r}")


class Guard(Assertions, selfcheck.SelfChecked):
    """One guarded allocator. Created by ``kvguard.guard()``; see the package docstring."""

    _shapes = shapes  # shadowing's wrappers defer to shapes.wrapper_for; selfcheck re-installs
    _install = staticmethod(shadowing.install)

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
        self._capture = _capture if sample == 1 else sampled_capture(sample)
        cls = type(allocator)
        self.allocator_class = f"{cls.__module__}.{cls.__qualname__}"
        _serials[cls] += 1
        self.name = name or f"{cls.__qualname__}#{_serials[cls]}"
        self.address = hex(id(allocator))
        try:
            self._allocator = weakref.ref(allocator)
        except TypeError:
            self._allocator = lambda allocator=allocator: allocator
        self.lock = shadowing.new_lock()
        """Held across every guarded call: hooks that touch the ledgers take it too."""
        self._tick = itertools.count(2).__next__
        """The guard's call counter: the ledger stamps each block with the call that last
        changed it. Call #1 stands for "before the guard attached"."""
        self.stats = new_stats(shadowing.ACCEL is not None)
        self.journal = Journal(max_violations, log_every)
        self.history = shadowing.new_history(history) if history else None
        """The flight recorder (see ``kvguard.guard.evidence`` for its entries): a deque, or
        with the compiled wrappers their ``FlightRecorder``, which reads the same."""
        self._watchers: list = []
        self._bound: dict = {}
        self._quarantine = Quarantine()
        self._ledgers: dict = {}
        self._originals: dict = {}
        self._baseline = None
        self._learn = learn
        self._learn_shares = False
        self._fast = bool(fast_path)
        self._learn_budget = None
        self._leases: dict = {}
        """Open in-flight leases: step -> [(ledger, blocks)] (see ``leases``)."""
        self._attach(allocator)

    # --- attaching ---------------------------------------------------------------------------

    @property
    def allocator(self):
        return self._allocator()

    def _attach(self, allocator) -> None:
        spec = self.spec
        descriptors.prepare(self, allocator)  # fits, has a __dict__; descriptors routed
        own = vars(allocator)
        free = getattr(allocator, spec.free)
        self._free_param = shapes.param_for(free, spec.free_arg, spec.free_ids)
        if not self._free_param.found:
            raise TypeError(f"cannot guard {self.allocator_class}: {spec.free}() has no "
                            f"parameter {spec.free_arg!r}")
        self._share_param = shapes.share_param(allocator, spec)
        self._pool_params = {
            m: Param(getattr(allocator, m), spec.pool_arg) for m in spec.methods()
        } if spec.pool_arg is not None else {}
        baseline.seed(self, allocator)
        self.ledger(self._default_pool())
        self._bound = {m: engine_method(allocator, m) for m in spec.methods()}
        shadowing.install(self)
        self._originals.setdefault("__reduce_ex__", own.get("__reduce_ex__", MISSING))
        own["__reduce_ex__"] = copies.reduce_hook(self)
        own[ATTR] = self
        GUARDS.add(self)
        shapes.install_extras(self)
        if spec.adapter is not None:  # an engine adapter's extra wrappers (kvguard.adapters)
            try:
                spec.adapter(self)
            except BaseException:
                self.unguard()
                raise
        observers.observe(self)  # and remembers the wrappers on the instance (selfcheck)
        announce(self)

    def _default_pool(self):
        if self.spec.pool_arg is None:
            return None
        param = self._pool_params[self.spec.free]
        return None if param.default is MISSING else param.default

    def _pool_of(self, method: str, args, kwargs):
        param = self._pool_params.get(method)
        if param is None:
            return None
        value = param.get(args, kwargs)
        return None if value is MISSING else pool_key(value)

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
        ledger.learn_budget = baseline.budget(self, pool)
        return ledger

    @property
    def ledgers(self):
        """Sub-pool -> ledger, a read-only live view (sub-pools added later show up)."""
        return types.MappingProxyType(self._ledgers)

    @property
    def learning(self) -> bool:
        """Whether never-seen ids are learned as live on their first free (see ``learn=``)."""
        return bool(self._learn)

    @property
    def watchers(self) -> tuple:
        return tuple(self._watchers)

    def unguard(self) -> None:
        """Restore the original methods; blocks held in quarantine go back to the allocator."""
        with self.lock:
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
                if original is MISSING:
                    own.pop(method, None)
                else:
                    own[method] = original
            self._originals.clear()
            if own.get(ATTR) is self:
                del own[ATTR]
            for watcher in self._watchers:
                getattr(watcher, "detach", lambda: None)()
            self._watchers.clear()
            GUARDS.discard(self)
            selfcheck.let_go(self)

    @property
    def guarded(self) -> bool:
        return bool(self._originals)

    def inside(self) -> bool:
        """Whether this thread is inside a call of this guard right now."""
        return self.lock._is_owned()

    # --- the hook protocol (adapters, cache, tables, writes) ---------------------------------

    def wrap_method(self, name: str, role: str, *, convert=None, when=None, pool=None) -> None:
        """Guard the extra method ``name`` by its role (see ``kvguard.guard.roles``):
        ``allocating`` (``convert(allocator, result)`` gives its ids), ``freeing``,
        ``checking``, ``resetting``, ``resizing`` (``pool(args, kwargs)``: one sub-pool
        only) or ``settled`` (while ``when(allocator)``). ``unguard()`` restores it."""
        roles.wrap_method(self, name, role, convert=convert, when=when, pool=pool)

    def _shadow(self, name: str, wrapper, original) -> None:
        """Put ``wrapper`` of the engine's ``original`` method on the instance."""
        own = vars(self.allocator)
        self._originals.setdefault(name, own.get(name, MISSING))
        wrapper.__wrapped__ = original
        wrapper.__kvguard__ = self
        own[name] = wrapper

    def capture_site(self, owner: bool = False) -> int:
        """The interned call site of the caller's caller (with the owner active now, when
        ``owner``); 0 when it cannot be had outside raise mode."""
        try:
            return SITES.capture(2, self._depth, ACTIVE_OWNER.get() if owner else 0)
        except Exception as exc:
            return decisions.contain(self, exc)

    def plan_release(self, method: str, ids, site: int = 0, args=(), kwargs=None):
        """Check ids given back through ``method`` (a method of your own that frees; ``args``
        and ``kwargs`` of the call give its sub-pool) and settle what is wrong per mode: raise
        mode raises. Returns the plan: ``plan.good + plan.learned`` are the ids to forward,
        ``plan.faulty`` says whether anything was wrong; ``commit_release(plan)`` once the
        allocator took them."""
        with self.lock:
            return careful.plan_release(self, method, args, kwargs or {}, ids, f"{method}()",
                                        site)

    def commit_release(self, plan) -> None:
        """Record a planned release in the ledger, counters and flight recorder."""
        with self.lock:
            bookkeeping.commit_release(self, plan)

    def commit_allocation(self, method: str, result, site: int = 0, args=(), kwargs=None):
        """Check and apply ids ``method`` handed out (``result``, any form ids come in)."""
        with self.lock:
            bookkeeping.commit_allocation(self, args, kwargs or {}, result, site, method)

    def violation(self, kind, block_ids, message, method, pool=None, *, detail=None):
        """A violation of this guard's allocator, built but not recorded (see ``settle``)."""
        ledger = self.ledger(pool)
        return evidence.violation(self, kind, block_ids, message, method, pool, ledger,
                                  block_ids if detail is None else detail)

    def settle(self, violations, *, aside_ok: bool = False):
        """Record ``violations`` (most severe first) and raise the first in raise mode. Returns
        None when there were none, else what the caller does with its call: ``"repair"`` in
        repair mode, ``"log"`` (forward it), ``"aside"`` (stepping aside, ``aside_ok``)."""
        with self.lock:
            return decisions.settle(self, violations, aside_ok=aside_ok)

    def flag(self, kind, block_ids, message, method, pool=None, *, detail=None, extra=None,
             aside_ok: bool = False):
        """Build, record and act on one violation (``settle`` of one)."""
        with self.lock:
            return decisions.flag(self, kind, block_ids, message, method, pool, detail=detail,
                                  extra=extra, aside_ok=aside_ok)

    def report(self, violation) -> None:
        """Record a violation found by a helper outside the call paths; raise in raise mode."""
        self.settle([violation])

    @property
    def violations(self) -> list:
        selfcheck.verify(self)
        return list(self.journal.kept)

    # --- quarantine and watchers -------------------------------------------------------------

    @property
    def quarantine_size(self) -> int:
        return self._quarantine.size

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
        shapes.refuse_quarantine(self, blocks)
        with self.lock:
            self._quarantine.size = blocks
            shadowing.install(self)  # quarantine needs the careful path
            if not blocks:
                self.release_quarantine()

    def held(self, pool=None) -> list:
        """Ids freed by the caller but still held in quarantine."""
        return self._quarantine.held(pool)

    def release_quarantine(self) -> None:
        """Give every quarantined block back to the allocator now."""
        with self.lock:
            allocator = self.allocator
            if allocator is None or not self._quarantine.holding():
                return
            self._quarantine.release_all(self.spec, self._free_param,
                                         self._pool_params.get(self.spec.free),
                                         self._original(allocator, self.spec.free))

    def _original(self, allocator, method):
        """The method as it was before the guard shadowed it."""
        own = self._originals.get(method, MISSING)
        if own is not MISSING:
            return own
        return engine_method(type(allocator), method).__get__(allocator)

    def _forget_pool(self, pool) -> None:
        """One sub-pool starts afresh: its ledger is rebuilt on its next call."""
        self._ledgers.pop(pool, None)
        self._quarantine.forget(pool)

    def add_watcher(self, watcher) -> None:
        """Attach a watcher (``on_free(guard, pool, ids)``, ``on_alloc(guard, pool, ids)`` ->
        iterable of ``(kind, ids, message, extra)``, and optionally ``on_share(guard, pool,
        ids)``, the same for free blocks a share revives): kvguard.cache poisons and verifies
        blocks through this. Watchers see every call on the careful path."""
        with self.lock:
            self._watchers.append(watcher)
            shadowing.install(self)

    def remove_watcher(self, watcher) -> None:
        with self.lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)
            shadowing.install(self)

    def __repr__(self) -> str:
        return (f"<kvguard.Guard {self.name} of {self.allocator_class} mode={self.mode} "
                f"stacks={self.stacks} violations={sum(self.stats.violations.values())}>")


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
        spec = registry.spec_for(type(allocator)) or DEFAULT_SPEC
    return Guard(allocator, spec, on_violation=on_violation or "raise", stacks=stacks or "cheap",
                 name=name, **options)


registry.use_factory(guard)
