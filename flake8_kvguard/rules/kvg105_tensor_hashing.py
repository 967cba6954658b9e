"""KVG105: de-duplication or membership by tensor identity.

The elements of a tensor are 0-dim tensors, and a tensor hashes by identity: `set(t)`
keeps every element, two equal ids are two dict keys, and `t[i] in seen` is False
for a `seen` full of ints. Convert to Python ints first.

The fix (`.tolist()` before hashing) is made only where the set's or dict's elements never
leave it (it is only counted, asked for membership or grown, by itself or through the one name
it is bound to): elements that leave it as tensors may meet a tensor method (`k.item()`), which
an int lacks. Elsewhere the finding is reported, unfixed.
"""

from .. import nodes

from ..cstutil import dotted_name, positional_args, walk_all
from ..rewrites import method_call
from ..values import DICT, ELEMENT, SET, TENSOR, elements, is_container

CODE = "KVG105"
SUMMARY = "de-duplication or membership by tensor identity: set(tensor), dict keys, in"
MESSAGE = (
    "KVG105 {what} over torch tensor elements: 0-dim tensors hash by identity, so equal "
    "ids never match and nothing is de-duplicated; convert with .tolist() first"
)
FIXABLE = True

BAD = [
    """\
import torch

def unique_blocks(block_table: torch.Tensor) -> int:
    return len(set(block_table[0]))
""",
    """\
import torch

def owners(block_ids: torch.Tensor) -> dict:
    return dict.fromkeys(block_ids)
""",
    """\
import torch

def still_used(block_ids: torch.Tensor, freed: list) -> list:
    gone = set(freed)
    return [b for b in block_ids if b not in gone]
""",
    """\
import torch

def kept(block_table: torch.Tensor, freed: set[int]) -> list:
    return [b for b in block_table if b not in freed]
""",
]
FIXED = [
    """\
import torch

def unique_blocks(block_table: torch.Tensor) -> int:
    return len(set(block_table[0].tolist()))
""",
    None,  # its keys leave the function as tensors: a caller's k.item() would fail on ints
    None,
    None,
]
GOOD = [
    """\
import torch

def unique_blocks(block_table: torch.Tensor) -> int:
    return len(set(block_table[0].tolist()))
""",
    """\
import torch

def kept(block_table: torch.Tensor, freed: set[int]) -> list:
    return [b for b in block_table.tolist() if b not in freed]
""",
    """\
import torch

def still_used(block_ids: torch.Tensor, freed: list) -> list:
    gone = set(freed)
    return [b for b in block_ids.tolist() if b not in gone]
""",
]

HASHING_BUILTINS = {"set": "set()", "frozenset": "frozenset()"}
HASHING_CALLS = {
    "collections.Counter": "Counter()",
    "Counter": "Counter()",
    "dict.fromkeys": "dict.fromkeys()",
    "collections.OrderedDict.fromkeys": "OrderedDict.fromkeys()",
    "OrderedDict.fromkeys": "OrderedDict.fromkeys()",
}
SET_KEYED = frozenset(("add", "discard", "remove"))
DICT_KEYED = frozenset(("setdefault", "get", "pop"))


def _report(ctx, node, what, fix=None):
    ctx.report(CODE, node, MESSAGE.format(what=what), fix=fix)


def check_call(call, scope, ctx):
    """`seen.add(t[i])`, `d.get(t[i])`, `set(t)`, `Counter(t)`, `dict.fromkeys(t)`."""
    func = call.func
    args = positional_args(call)
    if type(func) is nodes.Attribute and args:
        name = func.attr.value
        if name in SET_KEYED or name in DICT_KEYED:
            container = ctx.infer(func.value, scope)
            wanted = SET if name in SET_KEYED else DICT
            if container.kind == wanted and is_container(container):
                val = ctx.infer(args[0].value, scope)
                if val.kind == ELEMENT:
                    kind = "set" if container.kind == SET else "dict"
                    _report(ctx, call, f"{name}() on a {kind}")
    dotted = dotted_name(func)
    if dotted is None:
        return
    if type(func) is nodes.Name and dotted in HASHING_BUILTINS and ctx.builtin_available(dotted):
        what = HASHING_BUILTINS[dotted]
    else:
        what = HASHING_CALLS.get(ctx.canonical(dotted))
        if what is None:
            return
    if not args:
        return
    operand = args[0].value
    val = ctx.infer(operand, scope)
    if elements(val).kind != ELEMENT:
        return
    fix = None
    replacement = _tolist_of(operand, val, scope, ctx)
    if replacement is not None and _elements_stay(call, scope):
        fix = (operand, replacement)
    _report(ctx, call, what, fix)


_ASKED = frozenset(("add", "discard", "remove", "get", "setdefault", "update", "__contains__"))


def _elements_stay(call, scope) -> bool:
    """Whether what `call` builds is only counted, asked for membership or grown (by itself,
    or through the one name it is bound to): then ints in place of the tensor's elements
    change nothing but the hashing. Elements that may leave it (iterated, returned, passed
    on, popped) may meet a tensor method there (`k.item()`), which an int lacks: a fix could
    break a working program, so the finding is left unfixed."""
    parents = {}
    for node in walk_all(scope.node):
        for child in nodes.children(node):
            parents[id(child)] = node
    use = _use(call, parents)
    if type(use) is not nodes.Name:
        return use == "kept"
    for node in walk_all(scope.node):
        if type(node) is nodes.Name and node.value == use.value and node is not use and \
                type(parents.get(id(node))) is not nodes.AssignTarget and \
                _use(node, parents) != "kept":
            return False
    return True


def _use(node, parents):
    """"kept" where `node`'s value is only counted or asked (`len(x)`, `b in x`, `x.add(b)`,
    `x[b]`), the name it is bound to (`x = node`), else None."""
    parent = parents.get(id(node))
    kind = type(parent)
    if kind is nodes.Arg:
        outer = parents.get(id(parent))
        if type(outer) is nodes.Call and type(outer.func) is nodes.Name and \
                outer.func.value in ("len", "bool"):
            return "kept"
    elif kind is nodes.ComparisonTarget:
        if type(parent.operator) in (nodes.In, nodes.NotIn):
            return "kept"
    elif kind is nodes.Attribute:
        if parent.attr.value in _ASKED and type(parents.get(id(parent))) is nodes.Call:
            return "kept"
    elif kind is nodes.Subscript:
        return "kept"
    elif kind is nodes.Assign and len(parent.targets) == 1:
        target = parent.targets[0].target
        if type(target) is nodes.Name:
            return target
    return None


def check_comparison(node, scope, ctx):
    """`t[i] in seen` for a set or dict the code made."""
    left = node.left
    for target in node.comparisons:
        if type(target.operator) in (nodes.In, nodes.NotIn):
            container = ctx.infer(target.comparator, scope)
            if is_container(container) or (
                container.kind == SET and container.note == "annotation"
            ):  # a filter over a parameter annotated as a set hashes elements too
                val = ctx.infer(left, scope)
                if val.kind == ELEMENT:
                    _report(ctx, node, f"membership test in a {container.kind}")
        left = target.comparator


def check_subscript(node, scope, ctx):
    """`d[t[i]]`, read or stored, for a dict the code made."""
    if len(node.slice) != 1 or type(node.slice[0].slice) is not nodes.Index:
        return
    container = ctx.infer(node.value, scope)
    if container.kind == DICT and is_container(container):
        key = node.slice[0].slice.value
        val = ctx.infer(key, scope)
        if val.kind == ELEMENT:
            _report(ctx, node, "a dict key")


def check_comprehension(node, scope, ctx):
    """`{b for b in t}` and `{b: ... for b in t}`; `scope` has the targets bound."""
    key = node.key if type(node) is nodes.DictComp else node.elt
    val = ctx.infer(key, scope)
    if val.kind == ELEMENT:
        what = "a set comprehension" if type(node) is nodes.SetComp else "dict comprehension keys"
        _report(ctx, node, what, _comprehension_fix(node, key, scope, ctx))


def _tolist_of(operand, val, scope, ctx):
    """`t.tolist()` for an operand that is a definite tensor, or `list(t)` of one."""
    if val.kind in (TENSOR, ELEMENT) and not val.optional:
        return method_call(operand, "tolist")
    if (
        type(operand) is nodes.Call
        and type(operand.func) is nodes.Name
        and operand.func.value in ("list", "tuple")
        and ctx.builtin_available(operand.func.value)
        and len(operand.args) == 1
        and operand.args[0].keyword is None
        and not operand.args[0].star
    ):
        inner = operand.args[0].value
        inner_val = ctx.infer(inner, scope)
        if inner_val.kind == TENSOR and not inner_val.optional:
            return method_call(inner, "tolist")
    return None


def _comprehension_fix(node, key, scope, ctx):
    for_in = node.for_in
    if for_in.inner_for_in is not None or for_in.ifs or type(key) is not nodes.Name:
        return None
    target = for_in.target
    if type(target) is not nodes.Name or target.value != key.value:
        return None
    uses = sum(1 for n in walk_all(node) if type(n) is nodes.Name and n.value == key.value)
    if uses != 2:  # the target and the key: the element is used for nothing else
        return None
    iter_val = ctx.infer(for_in.iter, scope.parent or scope)
    if iter_val.kind != TENSOR or iter_val.optional:
        return None
    return (for_in.iter, method_call(for_in.iter, "tolist"))
