"""How to read an allocator: which methods hand out and take back ids, and where the ids are."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
import re
from typing import Any, Callable, Union

AttrOrCallable = Union[str, Callable[[Any], Any], None]

_PATTERN = re.compile(r"\s*([A-Za-z_]\w*)\s*(?:\(\s*([A-Za-z_]\w*|\d+)((?:\.[A-Za-z_]\w*)*)"
                      r"\s*\))?\s*$")


class SpecSyntaxError(ValueError):
    """A spec text that cannot be read; the message names the piece and what was expected."""


def parse_pattern(text: str):
    """``"deallocate(seq.block_table)"`` -> ``("deallocate", "seq", "block_table")``;
    ``"free_one(b)"`` -> ``("free_one", "b", None)``; ``"free"`` -> ``("free", None, None)``.
    A position may stand for the parameter name: ``"free(0.pages)"``."""
    m = _PATTERN.match(text)
    if m is None:
        raise SpecSyntaxError(f"{text!r} is not a method pattern: write name, name(arg) or "
                              "name(arg.attribute.path)")
    method, arg, path = m.groups()
    if arg is not None and arg.isdigit():
        arg = int(arg)
    return method, arg, (path[1:] if path else None)


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
    Method keywords (``alloc``, ``free``, ``share``) also take a pattern that says where the
    ids are (``kvguard.specgrammar``): ``free="deallocate(seq.block_table)"`` is
    ``free="deallocate", free_arg="seq", free_ids="block_table"``. See docs/reference.md for
    ``free_ids``/``share_ids``/``alloc_arg``/``alloc_ids`` (ids carried in an argument),
    ``alloc_shares`` (an allocation that also takes references), ``refcounts``, ``reset``,
    ``also_alloc`` and ``also_free``.
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
    free_ids: AttrOrCallable = None
    share_arg: int | str = 0
    share_ids: AttrOrCallable = None
    alloc_arg: int | str | None = None
    alloc_ids: AttrOrCallable = None
    alloc_shares: bool = False
    refcounts: AttrOrCallable = None
    reset: tuple = ()
    also_alloc: tuple = ()
    also_free: tuple = ()

    def __post_init__(self) -> None:
        fold_patterns(self)
        for name in ("free_arg", "pool_arg", "share_arg", "alloc_arg"):
            value = getattr(self, name)
            if value is None and name != "free_arg":
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
        check_shapes(self)

    def methods(self) -> tuple[str, ...]:
        return tuple(m for m in (self.alloc, self.free, self.share) if m)

    def extra_methods(self) -> tuple[str, ...]:
        """Methods guarded besides ``methods()``: resets and the ``also_*`` ones."""
        return tuple(self.reset) + tuple(parse_pattern(p)[0]
                                         for p in self.also_alloc + self.also_free)

    def pattern(self, method: str) -> str | None:
        """``alloc``/``free``/``share`` as one pattern: ``"deallocate(seq.block_table)"``."""
        name = getattr(self, method)
        if name is None:
            return None
        arg, ids = {"free": (self.free_arg, self.free_ids), "share": (self.share_arg,
                    self.share_ids), "alloc": (self.alloc_arg, self.alloc_ids)}[method]
        if isinstance(ids, str):
            return f"{name}({arg}.{ids})"
        if method != "alloc" and arg != 0 and ids is None:
            return f"{name}({arg})"
        return name

    def replace(self, **changes) -> "AllocatorSpec":
        return replace(self, **changes)

    @classmethod
    def keywords(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def fold_patterns(spec) -> None:
    """Method patterns (``free="deallocate(seq.block_table)"``) into their keywords, and the
    list keywords (a comma-separated string, or a list) into tuples."""
    keyed = {"free": ("free_arg", "free_ids", 0), "share": ("share_arg", "share_ids", 0),
             "alloc": ("alloc_arg", "alloc_ids", None)}
    for method, (arg_key, ids_key, default) in keyed.items():
        text = getattr(spec, method)
        if not isinstance(text, str) or "(" not in text:
            continue
        name, arg, path = parse_pattern(text)
        for key, new in ((arg_key, arg), (ids_key, path)):
            old = getattr(spec, key)
            if new is None or old == new:
                continue
            if old not in (None, default):
                raise ValueError(f"AllocatorSpec: {method}={text!r} says {key}={new!r}, but "
                                 f"{key}={old!r} was given too")
            object.__setattr__(spec, key, new)
        object.__setattr__(spec, method, name)
    for key in ("reset", "also_alloc", "also_free"):
        v = getattr(spec, key)
        if v is None:
            v = ()
        elif isinstance(v, str):
            v = tuple(p.strip() for p in v.replace(";", ",").split(",") if p.strip())
        elif isinstance(v, list):
            v = tuple(v)
        if not isinstance(v, tuple) or not all(isinstance(p, str) for p in v):
            raise TypeError(f"AllocatorSpec.{key} takes method names (a string or a tuple of "
                            f"them), not {v!r}")
        object.__setattr__(spec, key, v)


def check_shapes(spec) -> None:
    """The keywords of issue-27 shapes, checked together (a clear error, nothing made)."""
    for key in ("free_ids", "share_ids", "alloc_ids", "refcounts"):
        v = getattr(spec, key)
        if v is None or callable(v):
            continue
        if not isinstance(v, str) or not all(p.isidentifier() for p in v.split(".")):
            raise TypeError(f"AllocatorSpec.{key} takes an attribute path ('block_table', "
                            f"'req.pages') or a callable, not {v!r}")
    if spec.alloc_ids is not None and spec.alloc_arg is None:
        raise ValueError("AllocatorSpec.alloc_ids says where in an argument an allocation puts "
                         "its ids: it needs alloc_arg, or write alloc='allocate(seq.block_table)'")
    if spec.alloc_ids is not None and spec.alloc is None:
        raise ValueError("AllocatorSpec.alloc_ids needs alloc, the method that allocates")
    if spec.alloc_shares and not spec.refcounted:
        raise ValueError("AllocatorSpec.alloc_shares: an allocation that also takes references "
                         "to live blocks needs refcounted=True")
    for text in spec.also_alloc + spec.also_free:
        parse_pattern(text)
    for name in spec.reset + spec.extra_methods():
        if not name.isidentifier():
            raise TypeError(f"AllocatorSpec: {name!r} is not a method name")
    overlap = set(spec.methods()) & set(spec.extra_methods())
    if overlap:
        raise ValueError(f"AllocatorSpec: {', '.join(sorted(overlap))} is named twice "
                         "(alloc/free/share and reset/also_*)")


DEFAULT_SPEC = AllocatorSpec()


def read(allocator, how: AttrOrCallable):
    """Evaluate a ``size``/``free_count``/``live_ids`` setting against an allocator."""
    if how is None:
        return None
    if isinstance(how, int) and not isinstance(how, bool):
        return how
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


class SpecMisfitError(TypeError):
    """A spec that names a method its class lacks: a configuration error, said in one line
    where the spec is given (``register()``, the pytest plugin, ``kvguard fuzz``)."""


def misfit(target, spec: AllocatorSpec, name: str | None = None) -> str | None:
    """What keeps ``spec`` from fitting ``target`` (a class, or an instance: then each method
    must be callable), in one line; None when every method it names is there."""
    is_class = isinstance(target, type)
    cls = target if is_class else type(target)
    name = name or f"{cls.__module__}.{cls.__qualname__}"
    keyed = {spec.alloc: "alloc", spec.free: "free", spec.share: "share"}
    for method in spec.methods() + spec.extra_methods():
        if is_class and _has(cls, method) or not is_class and callable(
                getattr(target, method, None)):
            continue
        key = keyed.get(method, "reset/also_*")
        default = getattr(DEFAULT_SPEC, key, None) == method
        public = sorted(n for n in dir(cls) if not n.startswith("_") and callable(
            getattr(cls, n, None)))
        has = f"its public methods: {', '.join(public[:8])}" if public else "no public methods"
        return (f"{name} has no method {method!r} (AllocatorSpec {key}={method!r}"
                f"{', the default' if default else ''}); name its methods in the spec "
                f"({has}; `kvguard spec suggest {name}` writes one)")
    return None


def _has(cls, method) -> bool:
    """A class has ``method`` when its attribute of that name is there (a function, a
    property, any descriptor), or when it computes attributes (``__getattr__``)."""
    try:
        getattr(cls, method)
        return True
    except AttributeError:
        return hasattr(cls, "__getattr__")
    except Exception:
        return True
