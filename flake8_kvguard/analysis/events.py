"""What the walk hands the rules: free-like calls, free-like methods, ends of functions.

`Events` turns what the walk meets into the objects of the rule contract
(rules/contract.py) and calls the hooks registered for them: a `FreeCall` for each
call of a free-like name with ids, a `FreeMethod` for each free-like method of a
class, the end of each function with its free calls, and the expressions that
KVG105 reads (calls, comparisons, subscripts, set and dict comprehensions).
"""

from __future__ import annotations

from .. import nodes

from ..cstutil import dotted_name, positional_args
from ..values import OBJECT, TENSOR
from .syntax import all_params, ids_param, is_static, mentions_int

# Keyword names under which a free-like call may receive its ids.
IDS_KEYWORDS = frozenset(
    "blocks block_ids block block_id ids indices index free_index page_ids pages slots".split()
)

# Method names too generic to resolve through the project index: the project's

# Literals that cannot be block ids: `cache.release("session-a")` releases something else.
NOT_IDS = frozenset(
    (
        nodes.SimpleString,
        nodes.ConcatenatedString,
        nodes.FormattedString,
        nodes.Float,
        nodes.Imaginary,
        nodes.Dict,
        nodes.Lambda,
    )
)


class FreeCall:
    """A call to a free-like function or method, as the rules see it."""

    __slots__ = ("call", "callee", "name", "ids", "val", "tensor_native", "scope")

    def __init__(self, call, callee, name, ids, val, tensor_native, scope):
        self.call = call  # the nodes.Call
        self.callee = callee  # "self._kv_cache.free", or just "free"
        self.name = name  # "free"
        self.ids = ids  # the expression passed as ids
        self.val = val  # what is known of it
        self.tensor_native = tensor_native
        self.scope = scope


class FreeMethod:
    """A free-like method defined in a class (KVG201-KVG204)."""

    __slots__ = ("function", "class_info", "param", "tensor_param", "self_name", "int_ids")

    def __init__(self, function, class_info, param, tensor_param, self_name, int_ids=True):
        self.function = function
        self.class_info = class_info
        self.param = param  # name of the parameter receiving the ids
        self.tensor_param = tensor_param
        self.self_name = self_name
        # False when the annotation says the ids travel as objects (vLLM's
        # KVCacheBlock) or arrays: the rules about int ids (KVG201, KVG202) skip it.
        self.int_ids = int_ids


class Events:
    """Builds the events of one module and calls the registered hooks with the rule
    view."""

    def __init__(self, hooks, view, inference, names, config, index):
        self.hooks = hooks
        self.view = view
        self.inference = inference
        self.names = names
        self.config = config
        self.index = index
        self._tensor_native = sorted(config.tensor_native)

    def function_end(self, scope):
        for check in self.hooks.function_end:
            check(scope.node, scope.free_calls, self.view)
        # Done with them: a FreeCall refers to its scope, which lists it, and that cycle
        # would keep the module's whole tree alive until the cyclic collector runs
        # (in flake8's process, on flake8's time).
        scope.free_calls.clear()

    def expression(self, checks, node, scope):
        """A call, comparison, subscript or comprehension, for the rules that read
        expressions (KVG105)."""
        for check in checks:
            check(node, scope, self.view)

    def free_method(self, node, class_info, in_class):
        param = ids_param(node, in_class)
        if param is None:
            return
        tensor_param = False
        int_ids = True
        if param.annotation is not None:
            annotation = param.annotation.annotation
            val = self.inference.annotation_val(annotation)
            if val.kind == TENSOR:
                tensor_param = True
            elif not mentions_int(annotation):
                int_ids = False  # ids that travel as objects (KVCacheBlock), or arrays
        params = all_params(node.params)
        self_name = params[0].name.value if params and not is_static(node) else None
        method = FreeMethod(node, class_info, param.name.value, tensor_param, self_name, int_ids)
        for check in self.hooks.free_method:
            check(method, self.view)

    def free_call(self, call, name, scope):
        args = positional_args(call)
        ids = args[0] if args else None
        if ids is None:
            ids = next(
                (a for a in call.args if a.keyword is not None and a.keyword.value in IDS_KEYWORDS),
                None,
            )
        if (
            ids is None
            or type(ids.value) in NOT_IDS
            or (type(ids.value) is nodes.Name and ids.value.value == "None")
        ):
            return
        callee = dotted_name(call.func) or name
        val = self.inference.infer(ids.value, scope)
        native = self.is_tensor_native(callee, name, call.func, scope)
        free = FreeCall(call, callee, name, ids.value, val, native, scope)
        scope.free_calls.append(free)
        for check in self.hooks.free_call:
            check(free, self.view)

    def is_tensor_native(self, callee, name, func=None, scope=None):
        """Whether the free-like callee takes its ids as a tensor.

        Configured names first. Then the receiver: where the code says what class it is
        (an annotation, `self.x = Cls(...)`, a constructor parameter stored on self, a
        factory's return annotation), that class's method decides, found in this file
        or the project index and through its bases. An unresolved receiver, or a
        resolved one whose method says nothing, counts as taking tensors when any
        definition of that name in the project does: quiet rather than wrong (see
        docs/lint.md)."""
        for entry in self._tensor_native:
            if callee == entry or name == entry or callee.endswith("." + entry):
                return True
        if type(func) is nodes.Attribute and scope is not None:
            receiver = self.inference.infer(func.value, scope)
            if receiver.kind == OBJECT and receiver.cls:
                takes = self.index.method_takes(receiver.cls, name)
                if takes is not None:
                    return takes == "t"
        return name in self.names.local_tensor_params or self.index.takes_tensors(name)
