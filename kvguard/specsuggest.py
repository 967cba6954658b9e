"""``kvguard spec suggest pkg.mod.Class``: a spec read from a class, then checked against it.

The class's methods are read by name and by body (``ast``): which one hands blocks out and
where they land (its result, or an argument's list it extends), which takes them back and where
it finds them (its argument, or a list inside it), which shares, which resets; reference counts
on block objects or in a table; the pool's size and free count. The spec is printed in the one
spec language. Then a short self-check: an instance is built (``--factory``), guarded with the
spec, and driven a few rounds (allocate, share, free), the allocator's own free count compared
with the ledger's; what could not be confirmed is said. For a class with a built-in spec, where
the suggestion differs from it, and why.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from .spec import AllocatorSpec

ALLOC_NAMES = ("allocate", "alloc", "get_new_blocks", "get_free_blocks", "allocate_blocks",
               "alloc_blocks", "alloc_rows", "alloc_pages", "get_blocks", "allocate_one",
               "new_blocks")
FREE_NAMES = ("free", "free_blocks", "deallocate", "release", "free_rows", "release_blocks",
              "free_block", "free_pages", "put_blocks", "free_request", "_release_page_ids")
SHARE_NAMES = ("touch", "share", "fork", "incref", "inc_ref", "add_ref", "retain",
               "add_ref_count")
RESET_NAMES = ("clear", "reset", "flush")
SIZE_NAMES = ("num_blocks", "num_gpu_blocks", "_num_blocks", "num_pages", "size", "capacity",
              "total_blocks", "n")
FREE_COUNT_NAMES = ("get_num_free_blocks", "num_free_blocks", "free_blocks", "available_size",
                    "num_free", "available", "free_count", "get_num_free")
REFCOUNT_ATTRS = ("ref_cnt", "ref_count", "refcount", "refs", "ref_counts", "page_refs")
ID_ATTRS = ("block_id", "page_id", "block_idx")
IDS_WORDS = ("id", "block", "page", "slot", "indices", "index_list")
POOL_PARAMS = ("index", "pool", "group", "cache_group", "layer", "pool_idx")
COUNT_PARAMS = ("n", "k", "num", "num_blocks", "count", "need_size", "size", "num_pages")


def functions(cls) -> dict:
    """Name -> plain function, over the class and its bases (the nearest wins)."""
    out: dict = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ == "builtins":
            continue
        for name, value in vars(klass).items():
            if inspect.isfunction(value):
                out[name] = value
            else:
                out.pop(name, None) if name in out and not callable(value) else None
    return out


def properties(cls) -> set:
    return {n for k in cls.__mro__ for n, v in vars(k).items() if isinstance(v, property)}


def body(func):
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def params(fn) -> list:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args][1:] if fn is not None else []


def attributes_read(fn) -> set:
    return {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)} if fn else set()


def carried_path(fn, param, *, into: bool):
    """``param.path`` the method iterates (a free) or extends (an allocation), or None."""
    if fn is None:
        return None
    for node in ast.walk(fn):
        target = None
        if not into and isinstance(node, (ast.For, ast.comprehension)):
            target = node.iter
            if isinstance(target, ast.Call) and target.args:  # reversed(seq.block_table)
                target = target.args[0]
        elif not into and isinstance(node, ast.Call) and node.args:  # extend(req.pages)
            target = node.args[0]
        elif into and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("append", "extend"):
            target = node.func.value
        path = _path_of(target, param)
        if path:
            return path
    return None


def _path_of(node, param):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    if parts and isinstance(node, ast.Name) and node.id == param:
        return ".".join(parts)
    return None


def first(names, present):
    return next((n for n in names if n in present), None)


def suggest(cls) -> tuple:
    """``(AllocatorSpec, notes)``: the spec read from ``cls``, and what the reading assumed."""
    funcs = functions(cls)
    props = properties(cls)
    public = {n for n in funcs if not n.startswith("__")}
    notes = []
    kw: dict = {}
    alloc = first(ALLOC_NAMES, public)
    free = first(FREE_NAMES, public - props)
    share = first(SHARE_NAMES, public)
    if free is None:
        notes.append("no method reads as a free (free, free_blocks, deallocate, release...): "
                     "name it with free=")
        free = "free"
    free_fn = body(funcs.get(free))
    alloc_fn = body(funcs.get(alloc)) if alloc else None
    kw["alloc"] = alloc
    kw["free"] = free
    free_params = params(free_fn)
    ids_param = next((p for p in free_params if any(w in p for w in IDS_WORDS)),
                     free_params[0] if free_params else None)
    if ids_param is not None:
        path = carried_path(free_fn, ids_param, into=False)
        if path:
            kw["free"] = f"{free}({ids_param}.{path})"
        elif ids_param != free_params[0]:
            kw["free"] = f"{free}({ids_param})"
    pools = [p for p in free_params if p in POOL_PARAMS and p in params(alloc_fn)]
    if pools:
        kw["pool_arg"] = pools[0]
    if alloc_fn is not None:
        for p in params(alloc_fn):
            path = carried_path(alloc_fn, p, into=True)
            if path:
                kw["alloc"] = f"{alloc}({p}.{path})"
                break
    if share:
        share_fn = body(funcs.get(share))
        kw["share"] = share
        for p in params(share_fn):
            path = carried_path(share_fn, p, into=False)
            if path:
                kw["share"] = f"{share}({p}.{path})"
                break
    read = set().union(*(attributes_read(body(f)) for f in funcs.values()))
    refcount_attr = first(REFCOUNT_ATTRS, read)
    id_attr = first(ID_ATTRS, read) or (id_path(free_fn, ids_param) if ids_param else None)
    if id_attr:
        kw["id_attr"] = id_attr
    if ids_param and "Iterable[" in annotation(free_fn, ids_param) and \
            _reads(free_fn, ids_param) == 1:
        kw["iterator_ok"] = True  # free(blocks: Iterable[...]), iterated once: an iterator
    tables = _subscripted_tables(funcs)
    refcounts = first(REFCOUNT_ATTRS, tables)
    if refcounts:
        kw["refcounts"] = refcount_attr = refcounts
    elif refcount_attr and not any(_increments(body(f), decrements=True)
                                   for f in funcs.values() if body(f) is not None):
        refcount_attr = None  # a count set on hand-out, kept by others: not the pool's
    if share or refcount_attr:
        kw["refcounted"] = True
        if alloc_fn is not None and _increments(alloc_fn) and any(
                p not in COUNT_PARAMS for p in params(alloc_fn)):
            kw["alloc_shares"] = True
            notes.append(f"{alloc}() adds to a reference count: it may hand out live blocks "
                         "again (a prefix-cache hit), so alloc_shares=true")
        if refcount_attr and id_attr and refcount_attr in attributes_read(free_fn):
            kw["refcount_attr"] = refcount_attr
    reset = [n for n in RESET_NAMES if n in public and n not in (alloc, free, share)]
    if reset:
        kw["reset"] = tuple(reset)
    init_attrs = _assigned_in_init(funcs.get("__init__"))
    size = first(SIZE_NAMES, init_attrs | props)
    if size:
        kw["size"] = size
    free_count = first(FREE_COUNT_NAMES, (public | props) - {free, alloc})
    if free_count:
        kw["free_count"] = free_count
    if free_fn is not None and "torch" in ast.unparse(free_fn):
        kw["tensor_ok"] = True
    spec = AllocatorSpec(**{k: v for k, v in kw.items() if v is not None} | (
        {"alloc": None} if alloc is None else {}))
    if alloc is None:
        notes.append("no method reads as an allocation: alloc=none (name it with alloc=)")
    return spec, notes


def _subscripted_tables(funcs) -> set:
    """Attributes of ``self`` indexed by something in some method (``self.ref_counts[b]``)."""
    out = set()
    for f in funcs.values():
        fn = body(f)
        if fn is None or not params(fn) and not fn.args.args:
            continue
        me = fn.args.args[0].arg if fn.args.args else None
        for n in ast.walk(fn):
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and \
                    isinstance(n.value.value, ast.Name) and n.value.value.id == me:
                out.add(n.value.attr)
    return out


ID_ENDS = ID_ATTRS + ("address", "page_idx", "idx", "index")


def id_path(fn, param):
    """``param.a.b`` read in ``fn`` whose last name is an id's (LMCache's ``obj.meta.address``),
    or None."""
    for node in ast.walk(fn) if fn is not None else ():
        if isinstance(node, ast.Attribute) and node.attr in ID_ENDS:
            path = _path_of(node, param)
            if path:
                return path
    return None


def _reads(fn, param) -> int:
    """How many times ``fn``'s body reads ``param`` (a loop over it, a call taking it): one
    read only takes a one-shot iterator (DeepSpeed's free validates, then frees: two)."""
    return sum(isinstance(n, ast.Name) and n.id == param and isinstance(n.ctx, ast.Load)
               for n in ast.walk(fn))


def annotation(fn, param) -> str:
    """The annotation of ``param`` in ``fn``'s signature, as written ('' when none)."""
    for a in (fn.args.args + fn.args.kwonlyargs) if fn is not None else ():
        if a.arg == param and a.annotation is not None:
            return ast.unparse(a.annotation)
    return ""


def _increments(fn, decrements: bool = False) -> bool:
    """A ``+= 1`` on a reference count (``self.refs[b] += 1``, ``block.ref_cnt += 1``); with
    ``decrements``, a ``-= 1`` too."""
    ops = (ast.Add, ast.Sub) if decrements else (ast.Add,)
    for n in ast.walk(fn):
        if isinstance(n, ast.AugAssign) and isinstance(n.op, ops):
            text = ast.unparse(n.target)
            if any(a in text for a in REFCOUNT_ATTRS):
                return True
    return False


def _assigned_in_init(init) -> set:
    fn = body(init) if init else None
    if fn is None:
        return set()
    return {t.attr for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute)}
