"""How to read an allocator: which methods hand out and take back ids, and where the ids are."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Union

AttrOrCallable = Union[str, Callable[[Any], Any], None]


@dataclass(frozen=True)
class AllocatorSpec:
    """How to read an allocator; every keyword with an example is in docs/reference.md.

    ``iterator_ok``: ``free()`` iterates its argument once (it copies it first), so a generator is
    legal there; the guard drains it into a list and forwards that list.
    ``live_ids``: attribute or callable giving the ids live right now, so a guard attached to an
    allocator that already has blocks out starts with a true ledger instead of learning them.
    ``adapter``: callable(guard) run once the guard is attached, for what the keywords cannot
    say (more than one allocating or freeing method, deferred frees, a reset): the engine
    adapters in ``kvguard.adapters`` install their extra wrappers through it.
    ``id_attr`` may be a dotted path (``"meta.address"``) when the id sits on a nested object.
    ``refcount_attr``: the block objects of a refcounted pool carry the engine's own reference
    count in this attribute (vLLM's ``ref_cnt``), which the engine may change without calling
    the spec's ``share`` (copy-on-write takes a reference by ``block.ref_cnt += 1``). The guard
    then takes that count as the truth at each release: a block whose count is still positive
    is released, however many shares the guard saw; one whose count is already 0 or below, or
    that the ledger holds free, is a double free. Needs ``id_attr`` and ``refcounted=True``.
    ``owner_arg``: the argument of ``alloc``, ``free`` and ``share`` that names the request the
    call is for (a position after self, a parameter name, or ``callable(args, kwargs) ->
    label``): the call runs as that request's holder, so a release of a block another request
    holds is a ``stale-free`` (docs/lifecycle.md). A method without that argument runs as the
    holder active around it, if any.
    """

    alloc: str | None = "allocate"
    free: str = "free"
    free_arg: int | str = 0
    pool_arg: int | str | None = None
    share: str | None = None
    id_attr: str | None = None
    size: AttrOrCallable = None
    free_count: AttrOrCallable = None
    tensor_ok: bool = False
    refcounted: bool = False
    skip: Callable[[Any], bool] | None = None
    iterator_ok: bool = False
    live_ids: AttrOrCallable = None
    refcount_attr: str | None = None
    adapter: Callable[[Any], Any] | None = None
    owner_arg: int | str | Callable[[tuple, dict], Any] | None = None

    def __post_init__(self) -> None:
        for name in ("free_arg", "pool_arg"):
            value = getattr(self, name)
            if value is None and name == "pool_arg":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise TypeError(f"AllocatorSpec.{name} must be a position or a parameter name, "
                                f"not {value!r}")
            if isinstance(value, int) and value < 0:
                raise ValueError(f"AllocatorSpec.{name} must be >= 0, not {value}")
        for name in ("alloc", "free", "share", "id_attr", "refcount_attr"):
            value = getattr(self, name)
            parts = value.split(".") if name == "id_attr" and isinstance(value, str) else [value]
            if value is not None and not all(isinstance(p, str) and p.isidentifier()
                                             for p in parts):
                raise TypeError(f"AllocatorSpec.{name} must be a method/attribute name, "
                                f"not {value!r}")
        if not self.free:
            raise ValueError("AllocatorSpec.free must name the method that takes ids back")
        if self.refcount_attr is not None and (self.id_attr is None or not self.refcounted):
            raise ValueError("AllocatorSpec.refcount_attr names an attribute of the block "
                             "objects of a refcounted pool: it needs id_attr and refcounted=True")
        if self.skip is not None and not callable(self.skip):
            raise TypeError("AllocatorSpec.skip must be callable(id or object) -> bool")
        if self.adapter is not None and not callable(self.adapter):
            raise TypeError("AllocatorSpec.adapter must be callable(guard)")
        owner = self.owner_arg
        if owner is not None and not callable(owner) and (
                isinstance(owner, bool) or not isinstance(owner, (int, str))
                or isinstance(owner, int) and owner < 0):
            raise TypeError("AllocatorSpec.owner_arg must be a position, a parameter name or "
                            f"callable(args, kwargs) -> label, not {owner!r}")

    def methods(self) -> tuple[str, ...]:
        return tuple(m for m in (self.alloc, self.free, self.share) if m)

    def replace(self, **changes) -> "AllocatorSpec":
        return replace(self, **changes)

    @classmethod
    def keywords(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


DEFAULT_SPEC = AllocatorSpec()


def read(allocator, how: AttrOrCallable):
    """Evaluate a ``size``/``free_count``/``live_ids`` setting against an allocator."""
    if how is None:
        return None
    if callable(how):
        return how(allocator)
    value = getattr(allocator, how)
    return value() if callable(value) else value


def per_pool(value, pool):
    """A setting may give one number for all sub-pools or one per pool (a list or a dict)."""
    if value is None or pool is None or isinstance(value, int):
        return value
    try:
        return value[pool]
    except (TypeError, KeyError, IndexError):
        return value
