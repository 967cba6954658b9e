"""What is known of the value of an expression: tensors, their elements, bools, ids.

`Inference.infer(node, scope)` reads an expression against what the scopes, the
module's names, the configuration and the project index say; `annotation_val`
reads an annotation. Neither reports anything: the walk and the rules ask.
"""

from __future__ import annotations

from .. import nodes

from .. import torch_api
from ..cstutil import dotted_name, keyword_arg, positional_args
from ..values import (
    AN_INT,
    A_BOOL,
    BOOL,
    DICT,
    ELEMENT,
    INT,
    NOTHING,
    OBJECT,
    SEQUENCE,
    SET,
    TENSOR,
    TENSORS,
    UNKNOWN,
    Val,
    elements,
    is_bool,
    is_container,
    join,
    sequence_of,
)
from .scopes import Env, bind_names
from .syntax import is_int_literal, is_none

# Method names too generic to resolve through the project index: the project's
# `def get(self) -> Tensor` says nothing about `some_dict.get(key)`.
GENERIC_METHODS = frozenset(
    "get pop popleft popitem copy keys values items setdefault index count next result "
    "item tolist numpy read readline readlines write send recv run call apply forward".split()
) | frozenset(
    # What str, bytes, list, dict, set and numbers also have: `text.split(",")` says
    # nothing about a project's `def split(self) -> Tensor`.
    name
    for kind in (str, bytes, list, dict, set, tuple, int, float, object)
    for name in dir(kind)
)


CONTAINER_CALLS = {
    "set": SET,
    "frozenset": SET,
    "dict": DICT,
    "collections.Counter": DICT,
    "Counter": DICT,
    "collections.defaultdict": DICT,
    "defaultdict": DICT,
    "collections.OrderedDict": DICT,
    "OrderedDict": DICT,
    "dict.fromkeys": DICT,
    "collections.OrderedDict.fromkeys": DICT,
    "OrderedDict.fromkeys": DICT,
}
SET_ANNOTATIONS = frozenset("Set set FrozenSet frozenset AbstractSet MutableSet".split())
DICT_ANNOTATIONS = frozenset(
    "Dict dict DefaultDict defaultdict OrderedDict Mapping MutableMapping Counter".split()
)
SEQUENCE_ANNOTATIONS = frozenset(
    "List list Sequence MutableSequence Iterable Iterator Collection Tuple tuple".split()
)
BOOL_NOTE_LITERAL = "a bool literal"
BOOL_NOTE_COMPARISON = "a comparison"
BOOL_NOTE_MASK = "a bool mask"
MAX_DEPTH = 120

EQUALITY_OPERATORS = (
    nodes.Equal,
    nodes.NotEqual,
    nodes.LessThan,
    nodes.LessThanEqual,
    nodes.GreaterThan,
    nodes.GreaterThanEqual,
)
# Tensor methods whose result has the receiver's shape.
SHAPE_KEEPING = frozenset(
    "long int short to type cuda cpu clone contiguous detach pin_memory abs neg".split()
)


def _is_minus_one(node):
    return (
        type(node) is nodes.UnaryOperation
        and type(node.operator) is nodes.Minus
        and type(node.expression) is nodes.Integer
        and node.expression.value == "1"
    )


class Inference:
    """Infers values for one module; shared by the walk and, through the rule view, the
    rules."""

    def __init__(self, names, config, index):
        self.names = names
        self.index = index
        self._depth = 0
        self._tensor_functions = sorted(config.tensor_functions)

    def loop_bindings(self, target, iter_node, scope):
        """(target node, Val) pairs bound by `for target in iter_node`."""
        if (
            type(iter_node) is nodes.Call
            and type(iter_node.func) is nodes.Name
            and iter_node.func.value not in self.names.shadowed
        ):
            builtin = iter_node.func.value
            args = positional_args(iter_node)
            if builtin == "range":
                return [(target, AN_INT)]
            if (
                builtin == "enumerate"
                and args
                and type(target) in (nodes.Tuple, nodes.List)
                and len(target.elements) == 2
            ):
                item = elements(self.infer(args[0].value, scope))
                return [(target.elements[0].value, AN_INT), (target.elements[1].value, item)]
            if (
                builtin == "zip"
                and args
                and type(target) in (nodes.Tuple, nodes.List)
                and len(target.elements) == len(args)
            ):
                return [
                    (element.value, elements(self.infer(arg.value, scope)))
                    for element, arg in zip(target.elements, args)
                ]
        return [(target, elements(self.infer(iter_node, scope)))]

    def comprehension_scope(self, node, scope, visit=None):
        """A scope with the comprehension's targets bound. `visit(expression, scope)`,
        when given, sees the iterables and conditions on the way (the walk scans them
        for events, once)."""
        env = Env(scope.env)
        child = scope.child(env)
        for_in = node.for_in
        first = True
        while for_in is not None:
            outer = scope if first else child
            if visit is not None:
                visit(for_in.iter, outer)
            for target, val in self.loop_bindings(for_in.target, for_in.iter, outer):
                bind_names(target, val, env)
            if visit is not None:
                for condition in for_in.ifs:
                    visit(condition.test, child)
            first = False
            for_in = for_in.inner_for_in
        return child

    def class_val(self, name):
        """An instance of `name`, when it is a class this file or the project defines."""
        if name and self.index.is_class(name):
            return Val(OBJECT, cls=name)
        return None

    def infer(self, node, scope) -> Val:
        """What is known of the value of an expression."""
        if self._depth > MAX_DEPTH:
            return NOTHING
        self._depth += 1
        try:
            return self._infer(node, scope)
        finally:
            self._depth -= 1

    def _infer(self, node, scope) -> Val:
        kind = type(node)
        if kind is nodes.Name:
            value = node.value
            if value == "True" or value == "False":
                return Val(BOOL, note=BOOL_NOTE_LITERAL)
            found = scope.lookup(value)
            return found if found is not None else NOTHING
        if kind is nodes.Integer:
            return AN_INT
        if kind is nodes.Call:
            return self._infer_call(node, scope)
        if kind is nodes.Attribute:
            return self._infer_attribute(node, scope)
        if kind is nodes.Subscript:
            return self._infer_subscript(node, scope)
        if kind is nodes.List or kind is nodes.Tuple:
            return self._infer_display(node, scope)
        if kind is nodes.Comparison:
            return self._infer_comparison(node, scope)
        if kind is nodes.BinaryOperation:
            return self._infer_binary(node, scope)
        if kind is nodes.UnaryOperation:
            operator = type(node.operator)
            if operator is nodes.Not:
                return Val(BOOL, note="a negation")
            inner = self.infer(node.expression, scope)
            if operator is nodes.BitInvert and inner.kind in (TENSOR, ELEMENT):
                return inner.replace(dup=None)
            if operator in (nodes.Minus, nodes.Plus) and inner.kind in (INT, TENSOR, ELEMENT):
                return inner.replace(dup=None) if inner.kind != INT else AN_INT
            return NOTHING
        if kind is nodes.BooleanOperation:
            return join([self.infer(node.left, scope), self.infer(node.right, scope)])
        if kind is nodes.IfExp:
            return join([self.infer(node.body, scope), self.infer(node.orelse, scope)])
        if kind is nodes.NamedExpr:
            return self.infer(node.value, scope)
        if kind in (nodes.ListComp, nodes.GeneratorExp, nodes.SetComp):
            return self._infer_comprehension(node, scope)
        if kind is nodes.DictComp:
            return Val(DICT, note="comprehension")
        if kind is nodes.Set:
            return Val(SET, item=join(self._display_items(node, scope)), note="display")
        if kind is nodes.Dict:
            return Val(DICT, note="display")
        return NOTHING

    def _display_items(self, node, scope):
        items = []
        for element in node.elements:
            if type(element) is nodes.StarredElement:
                items.append(elements(self.infer(element.value, scope)))
            else:
                items.append(self.infer(element.value, scope))
        return items

    def _infer_display(self, node, scope):
        items = []
        starred = plain = 0
        inner_dup = None
        for element in node.elements:
            if type(element) is nodes.StarredElement:
                starred += 1
                inner = self.infer(element.value, scope)
                inner_dup = inner_dup or inner.dup
                items.append(elements(inner))
            else:
                plain += 1
                items.append(self.infer(element.value, scope))
        dup = None
        if starred >= 2 or (starred and plain):
            dup = "unpacking of several sources"
        elif starred:
            dup = inner_dup
        return sequence_of(items, dup=dup)

    def _infer_comprehension(self, node, scope):
        child = self.comprehension_scope(node, scope)
        elt = self.infer(node.elt, child)
        nested = node.for_in.inner_for_in is not None
        dup = None
        if nested:
            dup = "a comprehension flattening several sources"
        elif (
            type(node.elt) is nodes.Name
            and type(node.for_in.target) is nodes.Name
            and node.elt.value == node.for_in.target.value
        ):
            dup = self.infer(node.for_in.iter, scope).dup
        if type(node) is nodes.SetComp:
            return Val(SET, item=elt, note="comprehension")
        return Val(SEQUENCE, item=elt, dup=dup)

    def _infer_comparison(self, node, scope):
        operators = [type(target.operator) for target in node.comparisons]
        if all(op in EQUALITY_OPERATORS for op in operators):
            vals = [self.infer(node.left, scope)] + [
                self.infer(t.comparator, scope) for t in node.comparisons
            ]
            kinds = {val.kind for val in vals}
            if TENSOR in kinds:
                return Val(TENSOR, item=A_BOOL, note=BOOL_NOTE_MASK)
            if ELEMENT in kinds:
                return Val(ELEMENT, item=A_BOOL, note=BOOL_NOTE_MASK)
        return Val(BOOL, note=BOOL_NOTE_COMPARISON)

    def _infer_binary(self, node, scope):
        operator = type(node.operator)
        left = self.infer(node.left, scope)
        right = self.infer(node.right, scope)
        kinds = {left.kind, right.kind}
        if operator is nodes.Add:
            if SEQUENCE in kinds and TENSOR not in kinds and ELEMENT not in kinds:
                return sequence_of([elements(left), elements(right)], dup="concatenation")
        elif operator is nodes.Multiply:
            if SEQUENCE in kinds and TENSOR not in kinds:
                seq = left if left.kind == SEQUENCE else right
                return seq.replace(dup="repetition")
        elif operator in (nodes.BitAnd, nodes.BitOr, nodes.BitXor):
            if TENSOR in kinds or ELEMENT in kinds:
                kind = TENSOR if TENSOR in kinds else ELEMENT
                if is_bool(left) and is_bool(right):
                    return Val(kind, item=A_BOOL, note=BOOL_NOTE_MASK)
                return Val(kind)
            if kinds == {SET}:
                made = is_container(left) and is_container(right)
                item = join([left.item or NOTHING, right.item or NOTHING])
                return Val(SET, item=item, note="operator" if made else "display")
            if kinds == {BOOL}:
                return Val(BOOL, note=left.note or right.note)
        if TENSOR in kinds:
            item = (
                AN_INT
                if {left.kind, right.kind} <= {TENSOR, INT}
                and all(
                    v.kind == INT or (v.item is not None and v.item.kind == INT)
                    for v in (left, right)
                )
                else None
            )
            return Val(TENSOR, item=item)
        if ELEMENT in kinds:
            return Val(ELEMENT)
        if kinds == {INT} and operator not in (nodes.Divide, nodes.Power):
            return AN_INT
        return NOTHING

    def _infer_attribute(self, node, scope):
        owner = node.value
        attr = node.attr.value
        if (
            type(owner) is nodes.Name
            and owner.value == scope.self_name
            and scope.class_info is not None
        ):
            found = scope.class_info.attrs.get(attr)
            return found if found is not None else NOTHING
        inner = self.infer(owner, scope)
        if inner.kind in (TENSOR, ELEMENT) and attr in torch_api.TENSOR_ATTRIBUTES:
            return inner if attr == "data" else inner.replace(dup=None)
        if inner.kind == TENSORS and attr in torch_api.TUPLE_TENSOR_FIELDS:
            return Val(TENSOR, item=AN_INT if attr == "indices" else inner.item)
        return NOTHING

    def _infer_subscript(self, node, scope):
        base = self.infer(node.value, scope)
        kind = base.kind
        if kind in (TENSOR, ELEMENT):
            indices = []
            slices = 0
            for element in node.slice:
                index = element.slice
                if type(index) is nodes.Slice:
                    slices += 1
                    continue
                if type(index) is not nodes.Index or index.star is not None:
                    return Val(TENSOR, item=base.item, dup=base.dup)
                if type(index.value) is nodes.Name and index.value.value in ("None", "Ellipsis"):
                    return Val(TENSOR, item=base.item, dup=base.dup)
                if type(index.value) is nodes.Ellipsis:
                    return Val(TENSOR, item=base.item, dup=base.dup)
                indices.append(self.infer(index.value, scope))
            ints = all(index.kind == INT for index in indices)
            left = None  # dimensions left, where the base's rank is known
            if ints and base.ndim is not None and base.ndim >= len(indices):
                left = base.ndim - len(indices)
            if slices:  # a slice keeps the ids
                return Val(TENSOR, item=base.item, dup=base.dup, ndim=left if ints else None)
            if ints:
                if left is not None and left > 0:
                    return Val(TENSOR, item=base.item, ndim=left)  # a row of a table
                return Val(ELEMENT, item=base.item, ndim=left)
            if len(indices) == 1 and indices[0].kind in (TENSOR, ELEMENT) and is_bool(indices[0]):
                return Val(TENSOR, item=base.item, dup=base.dup)  # a mask keeps each id once
            return Val(TENSOR, item=base.item)
        if kind == TENSORS:
            if len(node.slice) == 1 and type(node.slice[0].slice) is nodes.Index:
                return Val(TENSOR, item=base.item)
            return base
        if kind == SEQUENCE:
            if len(node.slice) == 1 and type(node.slice[0].slice) is nodes.Slice:
                return base
            return base.item if base.item is not None else NOTHING
        return NOTHING

    def _infer_call(self, node, scope):
        func = node.func
        kind = type(func)
        if kind is nodes.Attribute:
            method = func.attr.value
            dotted = dotted_name(func)
            canonical = self.names.canonical(dotted)
            if canonical is not None:
                module, _, function = canonical.rpartition(".")
                if module == "torch":
                    return self._torch_function(function, node, scope)
                if canonical == "itertools.chain.from_iterable":
                    return Val(SEQUENCE, dup="itertools.chain.from_iterable()")
                if canonical == "itertools.chain":
                    return self._chain(node, scope)
                if canonical in CONTAINER_CALLS:
                    return Val(CONTAINER_CALLS[canonical])
            receiver = self.infer(func.value, scope)
            if receiver.kind in (TENSOR, ELEMENT):
                return self._tensor_method(receiver, method, node, scope)
            if receiver.kind == SEQUENCE:
                if method == "copy":
                    return receiver
                if method == "pop":
                    return receiver.item if receiver.item is not None else NOTHING
            if receiver.kind in (SET, DICT):
                if method == "copy":
                    return receiver
                if method == "keys":
                    return Val(SET, note="keys")
            if method in torch_api.TORCH_ONLY_METHODS and receiver.kind in (UNKNOWN,):
                return self._tensor_method(Val(TENSOR), method, node, scope)
            if method == "tolist" and receiver.kind == UNKNOWN:
                return Val(SEQUENCE)
            if receiver.kind == UNKNOWN and type(func.value) in (nodes.Name, nodes.Attribute):
                instance = self.class_val(method)  # module.Pool(...)
                if instance is not None:
                    return instance
            return self._declared_tensor(dotted or method, method, is_method=True)
        if kind is nodes.Name:
            name = func.value
            canonical = self.names.canonical(name)
            module, _, function = canonical.rpartition(".")
            if module == "torch":
                return self._torch_function(function, node, scope)
            if name not in self.names.imports and scope.lookup(name) is None:
                builtin = self._builtin(name, node, scope)
                if builtin is not None:
                    return builtin
            if canonical == "itertools.chain":
                return self._chain(node, scope)
            if (
                canonical in CONTAINER_CALLS
                and canonical != "set"
                and canonical != "frozenset"
                and canonical != "dict"
            ):
                return Val(CONTAINER_CALLS[canonical])
            bound = scope.lookup(name)
            if bound is None or bound.kind == UNKNOWN:  # a class statement binds nothing known
                instance = self.class_val(name)
                if instance is not None:
                    return instance
            return self._declared_tensor(canonical, name, is_method=False)
        return NOTHING

    def _chain(self, node, scope):
        parts = [elements(self.infer(arg.value, scope)) for arg in node.args]
        dup = "itertools.chain()" if len(node.args) >= 2 or any(a.star for a in node.args) else None
        return sequence_of(parts, dup=dup)

    def _builtin(self, name, node, scope):
        args = positional_args(node)
        first = self.infer(args[0].value, scope) if args else None
        if name in ("list", "tuple", "sorted", "reversed"):
            if first is None:
                return Val(SEQUENCE)
            if first.kind == TENSOR:
                return Val(SEQUENCE, item=Val(ELEMENT, item=first.item), dup=first.dup)
            if first.kind == SEQUENCE:
                return first
            if first.kind == SET:
                return Val(SEQUENCE, item=first.item)
            if first.kind == TENSORS:
                return Val(SEQUENCE, item=Val(TENSOR, item=first.item))
            return Val(SEQUENCE)
        if name in ("set", "frozenset"):
            return Val(SET, item=elements(first) if first is not None else None)
        if name == "dict":
            return Val(DICT)
        if name in ("int", "len", "ord", "hash"):
            return AN_INT
        if name == "bool":
            return Val(BOOL, note="bool()")
        if name in ("isinstance", "issubclass", "callable", "hasattr", "any", "all"):
            return Val(BOOL, note=f"{name}()")
        if name == "range":
            return Val(SEQUENCE, item=AN_INT)
        if name == "map" and len(args) >= 2:
            source = self.infer(args[1].value, scope)
            if type(args[0].value) is nodes.Name and args[0].value.value == "int":
                return Val(SEQUENCE, item=AN_INT, dup=source.dup)
            return Val(SEQUENCE, dup=source.dup)
        return None

    def _torch_function(self, function, node, scope):
        args = positional_args(node)
        if function == "where" and len(node.args) == 1:
            return Val(TENSORS, item=AN_INT)
        if function in torch_api.TUPLE_KEYWORDS:
            for keyword in torch_api.TUPLE_KEYWORDS[function]:
                arg = keyword_arg(node, keyword)
                if arg is not None and not (
                    type(arg.value) is nodes.Name and arg.value.value == "False"
                ):
                    return Val(TENSORS, item=AN_INT if function == "nonzero" else None)
        if function in torch_api.TENSOR_TUPLE_FUNCTIONS:
            first = self.infer(args[0].value, scope) if args else NOTHING
            return Val(TENSORS, item=first.item if first.kind in (TENSOR, ELEMENT) else None)
        if function not in torch_api.TENSOR_FUNCTIONS:
            return NOTHING
        first_node = args[0].value if args else None
        first = self.infer(first_node, scope) if first_node is not None else NOTHING
        item = None
        dtype = keyword_arg(node, "dtype")
        if function in torch_api.BOOL_FUNCTIONS:
            item = A_BOOL
        elif dtype is not None:
            item = self._dtype_item(dtype.value)
        elif function in (
            "arange",
            "randint",
            "randperm",
            "nonzero",
            "argsort",
            "tril_indices",
            "triu_indices",
            "searchsorted",
            "bucketize",
            "bincount",
        ):
            item = AN_INT
        elif (
            function in ("tensor", "as_tensor", "asarray")
            or function in torch_api.ID_PRESERVING
            or function in torch_api.CONCATENATIONS
        ):
            source = elements(first) if function in torch_api.CONCATENATIONS else first
            if source.kind in (TENSOR, ELEMENT, SEQUENCE):
                item = source.item
                if source.kind == SEQUENCE and item is not None and item.kind in (TENSOR, ELEMENT):
                    item = item.item
            elif source.kind in (INT, BOOL):
                item = source
        elif function == "where" and len(args) == 3:
            item = None
        dup = None
        if function in torch_api.CONCATENATIONS:
            dup = self._concatenation_dup(function, first_node, scope)
        elif function in torch_api.ID_PRESERVING:
            dup = first.dup
        note = BOOL_NOTE_MASK if item is not None and item.kind == BOOL else None
        return Val(
            TENSOR, item=item, dup=dup, note=note, ndim=self._torch_ndim(function, node, scope)
        )

    def _torch_ndim(self, function, node, scope):
        """The rank of torch.<function>(...)'s result where the call proves it."""
        args = positional_args(node)
        if function in ("arange", "randperm", "linspace", "logspace"):
            return 1
        if function in ("zeros", "ones", "empty", "rand", "randn", "full"):
            if not args:
                return None
            first = args[0].value
            if type(first) in (nodes.Tuple, nodes.List):
                if any(type(e) is nodes.StarredElement for e in first.elements):
                    return None
                return len(first.elements)
            shape = args[:1] if function == "full" else args
            # zeros(n) is 1-D only if n is an int: zeros(shape) takes a whole shape.
            if any(a.star or self.infer(a.value, scope).kind != INT for a in shape):
                return None
            return len(shape)
        if function in ("tensor", "as_tensor") and args:
            data = args[0].value
            if type(data) in (nodes.List, nodes.Tuple) and data.elements:
                parts = [e.value for e in data.elements if type(e) is nodes.Element]
                if len(parts) == len(data.elements):
                    if all(is_int_literal(p) for p in parts):
                        return 1
                    if all(type(p) in (nodes.List, nodes.Tuple) for p in parts):
                        return 2
            return None
        if function in ("flatten", "masked_select"):
            return 1
        if function == "unique" and keyword_arg(node, "dim") is None:
            return 1
        return None

    def _concatenation_dup(self, function, parts, scope):
        """Why torch.cat(parts) may repeat an id: it joins two or more tensors the
        code visibly gathers (a literal list, or a list it fills itself). A list of
        unknown origin is not taken to hold several parts."""
        if parts is None:
            return None
        if type(parts) is nodes.Name:
            accumulation = scope.accumulations.get(parts.value)
            if accumulation is not None and scope.env.vars.get(parts.value) is None:
                if accumulation.parts >= 2 and not accumulation.guarded:
                    return f"torch.{function}() of several tensors"
            return None
        if type(parts) in (nodes.List, nodes.Tuple):
            count = 0
            for element in parts.elements:
                count += 2 if type(element) is nodes.StarredElement else 1
            if count >= 2:
                return f"torch.{function}() of several tensors"
            if count == 1 and type(parts.elements[0]) is not nodes.StarredElement:
                return self.infer(parts.elements[0].value, scope).dup
            return None
        return None

    def _dtype_item(self, node):
        dotted = self.names.canonical(dotted_name(node))
        if dotted in torch_api.BOOL_DTYPES:
            return A_BOOL
        if dotted is not None and (
            dotted.startswith("torch.int")
            or dotted.startswith("torch.uint")
            or dotted in ("torch.long", "torch.short", "int")
        ):
            return AN_INT
        return None

    def _tensor_method(self, receiver, method, node, scope):
        bool_receiver = is_bool(receiver)
        if method == "tolist":
            scalar = A_BOOL if bool_receiver else AN_INT
            if receiver.kind == ELEMENT:
                return scalar
            return Val(SEQUENCE, item=scalar, dup=receiver.dup)
        if method == "item":
            return A_BOOL if bool_receiver else AN_INT
        if method in torch_api.INT_METHODS:
            return AN_INT
        if method in torch_api.TUPLE_KEYWORDS:
            for keyword in torch_api.TUPLE_KEYWORDS[method]:
                arg = keyword_arg(node, keyword)
                if arg is not None and not (
                    type(arg.value) is nodes.Name and arg.value.value == "False"
                ):
                    return Val(TENSORS)
        if method in torch_api.TENSOR_TUPLE_METHODS:
            return Val(TENSORS, item=receiver.item)
        if method not in torch_api.TENSOR_METHODS:
            return NOTHING
        kind = receiver.kind
        if kind == ELEMENT and method in torch_api.RESHAPING_METHODS:
            kind = TENSOR
        if method == "nonzero":
            return Val(TENSOR, item=AN_INT)
        item = None
        if method in torch_api.BOOL_METHODS:
            item = A_BOOL
        elif method in ("long", "int", "short"):
            item = AN_INT
        elif method in ("to", "type"):
            item = receiver.item
            for arg in node.args:
                if arg.keyword is None or arg.keyword.value == "dtype":
                    dtype_item = self._dtype_item(arg.value)
                    if dtype_item is not None:
                        item = dtype_item
        elif method in torch_api.SAME_IDS_METHODS:
            item = receiver.item
        dup = receiver.dup if method in torch_api.SAME_IDS_METHODS else None
        note = BOOL_NOTE_MASK if item is not None and item.kind == BOOL else None
        ndim = None
        if method in ("flatten", "ravel", "masked_select") or (
            method in ("view", "reshape")
            and len(node.args) == 1
            and _is_minus_one(node.args[0].value)
        ):
            ndim = 1
        elif method in SHAPE_KEEPING:
            ndim = receiver.ndim
        if ndim == 1 and kind == ELEMENT:
            kind = TENSOR
        return Val(kind, item=item, dup=dup, optional=False, note=note, ndim=ndim)

    def _declared_tensor(self, dotted, name, is_method):
        """A call whose result configuration, this file or the project index declares
        to be a tensor."""
        for entry in self._tensor_functions:
            if dotted == entry or name == entry or dotted.endswith("." + entry):
                return Val(TENSOR)
        local = self.names.local_returns.get(name)
        if local is not None:
            return local if local.kind in (TENSOR, OBJECT) else NOTHING
        if is_method and name in GENERIC_METHODS:
            return NOTHING
        kind = self.index.returns_tensor(name)
        if kind is None:
            instance = self.class_val(self.index.factory_class(name))
            return instance if instance is not None else NOTHING
        if kind == "b":
            return Val(TENSOR, item=A_BOOL, note=BOOL_NOTE_MASK)
        return Val(TENSOR, optional=kind == "o")

    # -------------------------------------------------------------- annotations

    def annotation_val(self, node) -> Val:
        """What an annotation says of a value."""
        if self._depth > MAX_DEPTH:
            return NOTHING
        self._depth += 1
        try:
            return self._annotation_val(node)
        finally:
            self._depth -= 1

    def _annotation_val(self, node) -> Val:
        kind = type(node)
        if kind is nodes.SimpleString:
            text = node.evaluated_value if isinstance(node.evaluated_value, str) else None
            if not text or len(text) > 200:
                return NOTHING
            try:
                return self.annotation_val(nodes.parse_expression(text))
            except (SyntaxError, RecursionError, ValueError, MemoryError):
                return NOTHING
        if kind in (nodes.Name, nodes.Attribute):
            dotted = dotted_name(node)
            canonical = self.names.canonical(dotted)
            if canonical is None:
                return NOTHING
            last = canonical.rpartition(".")[2]
            if last in torch_api.TENSOR_TYPES and self._is_torch(dotted, canonical):
                if last in torch_api.BOOL_TENSOR_TYPES:
                    return Val(TENSOR, item=A_BOOL, note=BOOL_NOTE_MASK)
                return Val(TENSOR, item=None if last == "Tensor" else AN_INT)
            if canonical in ("int", "builtins.int"):
                return AN_INT
            if canonical in ("bool", "builtins.bool"):
                return Val(BOOL, note="a bool")
            if last in SET_ANNOTATIONS:
                return Val(SET, note="annotation")
            if last in DICT_ANNOTATIONS:
                return Val(DICT, note="annotation")
            return self.class_val(last) or NOTHING
        if kind is nodes.Subscript:
            base = self.names.canonical(dotted_name(node.value))
            if base is None:
                return NOTHING
            last = base.rpartition(".")[2]
            parts = [e.slice.value for e in node.slice if type(e.slice) is nodes.Index]
            if not parts:
                return NOTHING
            if last == "Optional":
                inner = self.annotation_val(parts[0])
                return inner.replace(optional=True) if inner.kind in (TENSOR, OBJECT) else NOTHING
            if last == "Union":
                return self._union(
                    [self.annotation_val(p) if not is_none(p) else None for p in parts]
                )
            if last in SEQUENCE_ANNOTATIONS:
                item = self.annotation_val(parts[0])
                return Val(SEQUENCE, item=item if item.kind != UNKNOWN else None)
            if last in SET_ANNOTATIONS:
                return Val(SET, note="annotation")
            if last in DICT_ANNOTATIONS:
                return Val(DICT, note="annotation")
            if last in torch_api.DTYPE_ANNOTATIONS:
                inner = self.annotation_val(parts[0])
                if inner.kind == TENSOR:
                    if last in torch_api.BOOL_DTYPE_ANNOTATIONS:
                        return Val(TENSOR, item=A_BOOL, note=BOOL_NOTE_MASK)
                    return Val(TENSOR, item=AN_INT if last.startswith(("Int", "UInt")) else None)
            if last == "Annotated":
                return self.annotation_val(parts[0])
            return NOTHING
        if kind is nodes.BinaryOperation and type(node.operator) is nodes.BitOr:
            options = []
            for side in (node.left, node.right):
                options.append(None if is_none(side) else self.annotation_val(side))
            return self._union(options)
        return NOTHING

    def _union(self, options):
        known = [o for o in options if o is not None]
        if known and all(o.kind == TENSOR for o in known):
            merged = join(known)
            if merged.kind != TENSOR:
                merged = Val(TENSOR)
            return merged.replace(optional=len(known) != len(options) or merged.optional)
        return NOTHING

    def _is_torch(self, dotted, canonical):
        if canonical.startswith("torch."):
            return True
        # A bare `Tensor` that nothing imported from elsewhere is taken to be torch's.
        return "." not in dotted and dotted not in self.names.imports
