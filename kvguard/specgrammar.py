"""The one spec language: how users write an ``AllocatorSpec`` as text, and its one parser.

Every place a user can write a spec reads it here: the pytest ini option ``kvguard_allocators``
(one entry per line or TOML list item), ``KVGUARD_REGISTER`` (entries separated by commas),
``kvguard fuzz --spec`` / ``kvguard run --register``, ``[tool.kvguard]`` in pyproject.toml,
and ``AllocatorSpec(free="deallocate(seq.block_table)")`` in Python (method patterns). One
entry names a class and, optionally, how to read it::

    pkg.mod.Class                                   the registered (or default) spec
    pkg.mod.Class(alloc=get_blocks, free=put_blocks, size=16, refcounted=true)
    pkg.mod:Class alloc=get_blocks free=put_blocks  the ini line's older spelling, same thing
    pkg.mod.Class=pkg.specs:SPEC                     an AllocatorSpec object in a module

Values: a bare word or a quoted string; whole numbers; ``true``/``false``/``none``; a list
``[clear, flush]``; ``pkg.mod:function`` for a callable (imported when first called, so
registering never imports the engine). A method keyword takes a pattern that also says where
the ids are: ``free=deallocate(seq.block_table)`` frees ``seq.block_table``,
``alloc=allocate(seq.block_table)`` hands out what it adds to ``seq.block_table``,
``free=free_one(block)`` takes one id in parameter ``block``.
"""

from __future__ import annotations

import importlib
import re

from .spec import DEFAULT_SPEC, AllocatorSpec, SpecSyntaxError, parse_pattern  # noqa: F401
# (parse_pattern: the grammar's method patterns, defined beside AllocatorSpec, which folds them)

BOOL_KEYWORDS = ("tensor_ok", "refcounted", "iterator_ok", "alloc_shares")
POSITION_KEYWORDS = ("free_arg", "pool_arg", "share_arg", "alloc_arg")
METHOD_KEYWORDS = ("alloc", "free", "share")
LIST_KEYWORDS = ("reset", "also_alloc", "also_free")
CALLABLE_ONLY = ("skip", "adapter")

_REF = re.compile(r"([A-Za-z_][\w.]*):([A-Za-z_][\w.]*)$")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


class LazyRef:
    """``pkg.mod:function`` from a spec text: imported at its first call, so that writing the
    spec (at interpreter start, in an ini file) imports nothing."""

    def __init__(self, module: str, attr: str) -> None:
        self.module, self.attr = module, attr
        self._target = None

    def resolve(self):
        if self._target is None:
            obj = importlib.import_module(self.module)
            for part in self.attr.split("."):
                obj = getattr(obj, part)
            if not callable(obj):
                raise TypeError(f"{self} is a {type(obj).__name__}, not callable")
            self._target = obj
        return self._target

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)

    def __eq__(self, other) -> bool:
        return isinstance(other, LazyRef) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash((self.module, self.attr))

    def __str__(self) -> str:
        return f"{self.module}:{self.attr}"

    __repr__ = __str__


# --- values -----------------------------------------------------------------------------------

def _split(text: str, seps: str) -> list:
    """Split at ``seps`` outside brackets and quotes; pieces stripped, empty ones dropped."""
    out, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth < 0:
                raise SpecSyntaxError(f"unbalanced {ch!r} in {text!r}")
        elif depth == 0 and ch in seps:
            out.append(text[start:i])
            start = i + 1
    if quote or depth:
        raise SpecSyntaxError(f"unclosed {'quote' if quote else 'bracket'} in {text!r}")
    out.append(text[start:])
    return [p.strip() for p in out if p.strip()]


def _unquote(raw: str) -> tuple:
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1], True
    return raw, False


def value(key: str, raw):
    """One keyword's value from its text (or a TOML value: bools, ints and lists pass)."""
    if not isinstance(raw, str):
        if key in LIST_KEYWORDS and isinstance(raw, (list, tuple)):
            return tuple(value("reset", r) if not isinstance(r, str) else r.strip() for r in raw)
        return raw
    text, quoted = _unquote(raw.strip())
    low = text.lower()
    if key in BOOL_KEYWORDS:
        if low in ("true", "yes", "on", "1"):
            return True
        if low in ("false", "no", "off", "0"):
            return False
        raise SpecSyntaxError(f"{key} takes true or false, not {raw!r}")
    if not quoted and low == "none":
        return None
    if key in LIST_KEYWORDS:
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        return tuple(_unquote(p)[0] for p in _split(text, ",; "))
    if not quoted and re.fullmatch(r"-?\d+", text):
        return int(text)
    m = _REF.match(text)
    if m is not None and key not in METHOD_KEYWORDS:
        return LazyRef(*m.groups())
    if key in CALLABLE_ONLY:
        raise SpecSyntaxError(f"{key} takes a callable: write {key}=package.module:function")
    return text


def keywords(text: str, *, separators: str = ", ") -> dict:
    """``"alloc=get, free=deallocate(seq.block_table)"`` -> the keyword dict (unchecked)."""
    out: dict = {}
    for piece in _split(text, separators):
        key, eq, raw = piece.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise SpecSyntaxError(f"cannot read {piece!r}: expected keyword=value")
        if key in out:
            raise SpecSyntaxError(f"{key} given twice")
        out[key] = value(key, raw)
    return out


def spec_from(kw: dict, where: str = ""):
    """An ``AllocatorSpec`` from keywords, every mistake as one ``SpecSyntaxError`` line."""
    known = AllocatorSpec.keywords()
    for key in kw:
        if key not in known:
            close = [k for k in known if k.split("_")[0] == key.split("_")[0]]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise SpecSyntaxError(f"{where}unknown keyword {key!r}{hint}; AllocatorSpec takes "
                                  f"{', '.join(known)}")
    try:
        return AllocatorSpec(**kw)
    except (TypeError, ValueError) as exc:
        raise SpecSyntaxError(f"{where}{exc}") from None


def parse_spec(text: str):
    """Keyword text alone (``"alloc=get, free=put"``, commas or spaces) -> ``AllocatorSpec``."""
    return spec_from(keywords(text, separators=", \n\t"))


# --- entries ----------------------------------------------------------------------------------

def _target(text: str) -> str:
    """``pkg.mod.Class`` or ``pkg.mod:Class`` -> the dotted class name."""
    module, colon, qualname = text.partition(":")
    name = f"{module}.{qualname}" if colon else text
    if not _DOTTED.match(name) or "." not in name:
        raise SpecSyntaxError(f"{text!r} is not a dotted class name: write "
                              "package.module.Class")
    return name


def _is_keyword(piece: str) -> bool:
    key = piece.split("=", 1)[0].strip()
    return "=" in piece and key.isidentifier()


def parse_entry(text: str) -> tuple:
    """One entry -> ``(dotted class name, AllocatorSpec or None)``; None: the class's
    registered spec (a built-in) or the default."""
    text = text.strip()
    m = re.match(r"([A-Za-z_][\w.]*(?::[A-Za-z_][\w.]*)?)\s*", text)
    if m is None:
        raise SpecSyntaxError(f"cannot read {text!r}: start with the class, "
                              "package.module.Class")
    name = _target(m.group(1))
    rest = text[m.end():].strip()
    if not rest:
        return name, None
    if rest.startswith("(") and rest.endswith(")"):
        return name, spec_from(keywords(rest[1:-1], separators=", \n\t"), f"{name}: ")
    if rest.startswith("="):
        ref = _REF.match(rest[1:].strip())
        if ref is None:
            raise SpecSyntaxError(f"{name}={rest[1:].strip()}: write package.module:SPEC")
        return name, import_spec(name, *ref.groups())
    return name, spec_from(keywords(rest, separators=", \t"), f"{name}: ")


def parse_entries(text: str) -> list:
    """Entries separated by commas, semicolons or new lines (``KVGUARD_REGISTER``, a list
    of ini lines): ``[(dotted class name, AllocatorSpec or None), ...]``. ``#`` starts a
    comment that runs to the end of its line."""
    lines = [line.split("#", 1)[0] for line in text.splitlines()]
    entries, current = [], ""
    for piece in _split("\n".join(lines), ",;\n"):
        if current and _is_keyword(piece) and "(" not in current:
            current += " " + piece  # the ini spelling: keywords after the class, spaced or not
            continue
        if current:
            entries.append(parse_entry(current))
        current = piece
    if current:
        entries.append(parse_entry(current))
    if not entries and "\n".join(lines).strip():
        raise SpecSyntaxError(f"cannot read {text.strip()!r}: expected package.module.Class, "
                              "package.module.Class(keyword=value, ...) or "
                              "package.module.Class=package.module:SPEC")
    return entries


def import_spec(name: str, module: str, attr: str):
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise SpecSyntaxError(f"{name}={module}:{attr}: {exc}") from None
    if not isinstance(obj, AllocatorSpec):
        raise SpecSyntaxError(f"{name}={module}:{attr} is a {type(obj).__name__}, not a "
                              "kvguard.AllocatorSpec")
    return obj


def from_table(name: str, table: dict):
    """``[tool.kvguard.allocators."pkg.mod.Class"]`` -> the entry (TOML values read as text
    values are)."""
    return _target(name), spec_from({k: value(k, v) for k, v in table.items()}, f"{name}: ")


# --- writing ----------------------------------------------------------------------------------

def format_value(v) -> str | None:
    """A value as spec text, or None when it has no text form (a lambda, a local function)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, LazyRef):
        return str(v)
    if isinstance(v, str):
        return v if re.fullmatch(r"[\w.()]+", v) else repr(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(v) + "]"
    module, qualname = getattr(v, "__module__", None), getattr(v, "__qualname__", "")
    if module and qualname and "<" not in qualname:
        return f"{module}:{qualname}"
    return None


def format_entry(name: str, spec) -> tuple:
    """``(text, unwritable)``: the entry in the canonical spelling, keywords that differ from
    the defaults only, method patterns folded in; ``unwritable`` lists keywords whose value has
    no text form (a lambda): use a ``pkg.mod:function`` there."""
    parts, unwritable = [], []
    folded = set()
    for method in METHOD_KEYWORDS:
        text = spec.pattern(method)
        if text is not None and text != getattr(DEFAULT_SPEC, method):
            parts.append(f"{method}={text}")
        folded.update({f"{method}_arg", f"{method}_ids"} if "(" in (text or "") else ())
        if method == "alloc" and spec.alloc is None:
            parts.append("alloc=none")
    for key in spec.keywords():
        if key in METHOD_KEYWORDS or key in folded:
            continue
        v = getattr(spec, key)
        if v == getattr(DEFAULT_SPEC, key):
            continue
        text = format_value(v)
        if text is None:
            unwritable.append(key)
        else:
            parts.append(f"{key}={text}")
    return f"{name}({', '.join(parts)})", unwritable


# --- callables with arguments (kvguard fuzz --factory, --lifecycle, --driver) ------------------

_CALL = re.compile(r"\s*([A-Za-z_][\w.]*):([A-Za-z_][\w.]*)\s*(?:\((.*)\))?\s*$", re.S)


def parse_call(text: str):
    """``pkg.mod:function`` or ``pkg.mod:function(k=v, ...)`` -> ``(LazyRef, keywords)``, the
    values read as the spec language reads them (whole numbers, true/false/none, quoted
    strings, lists, ``pkg.mod:function``); None when ``text`` is not of that form. Imports
    nothing."""
    m = _CALL.match(text)
    if m is None:
        return None
    module, attr, args = m.groups()
    kw = {}
    for piece in _split(args or "", ","):
        key, eq, raw = piece.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier() or not raw.strip():
            raise SpecSyntaxError(f"cannot read {piece!r} in {text.strip()!r}: expected "
                                  "keyword=value")
        if key in kw:
            raise SpecSyntaxError(f"{key} given twice in {text.strip()!r}")
        kw[key] = literal(raw)
    return LazyRef(module, attr), kw


def literal(raw: str):
    """One argument's value in the spec language, whatever its keyword."""
    text, quoted = _unquote(raw.strip())
    if quoted:
        return text
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if text.startswith("[") and text.endswith("]"):
        return [literal(p) for p in _split(text[1:-1], ",")]
    m = _REF.match(text)
    return LazyRef(*m.groups()) if m is not None else text


def call_source(ref, kw, *first: str) -> str:
    """Python source that makes the call ``parse_call`` read, importing its module inline
    (an emitted regression test stays standalone)."""
    module, _, head = str(ref).partition(":")
    args = list(first) + [f"{k}={v!r}" if not isinstance(v, LazyRef) else
                          f"{k}=__import__({v.module!r}, fromlist=['_']).{v.attr}"
                          for k, v in kw.items()]
    return f"__import__({module!r}, fromlist=['_']).{head}({', '.join(args)})"
