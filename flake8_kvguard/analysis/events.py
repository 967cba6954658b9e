"""What the walk hands the rules: free-like calls, free-like methods, ends of functions.

`Events` turns what the walk meets into the objects of the rule contract
(rules/contract.py) and calls the hooks registered for them: a `FreeCall` for each
call of a free-like name with ids, a `FreeMethod` for each free-like method of a
class, the end of each function with its free calls, and the expressions that
KVG105 reads (calls, comparisons, subscripts, set and dict comprehensions).
"""

from __future__ import annotations

from .. import effects, nodes

from ..cstutil import dotted_name, positional_args
from ..values import OBJECT, TENSOR
from .syntax import all_params, ids_param, is_static, mentions_int

# Keyword names under which a free-like call may receive its ids.
IDS_KEYWORDS = frozenset(
    "blocks block_ids block block_id ids indices index free_index page_ids pages slots".split()
)

# Method names too generic to resolve through the project index: the project's

# Words in the name of a receiver whose class is unknown that make it an allocator.
ALLOCATOR_WORDS = ("alloc", "pool", "cache", "block", "page", "slot", "free", "mem", "kv")

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

    __slots__ = ("call", "callee", "name", "ids", "val", "tensor_native", "scope", "unsure")

    def __init__(self, call, callee, name, ids, val, tensor_native, scope, unsure=False):
        self.call = call  # the nodes.Call
        self.callee = callee  # "self._kv_cache.free", or just "free"
        self.name = name  # "free"
        self.ids = ids  # the expression passed as ids
        self.val = val  # what is known of it
        self.tensor_native = tensor_native
        self.scope = scope
        # tensor_native only because some method of that name takes tensors while
        # others do not, and the receiver's class is unknown
        self.unsure = unsure


class FreeMethod:
    """A free-like method defined in a class (KVG201-KVG204)."""

    __slots__ = (
        "function",
        "class_info",
        "param",
        "tensor_param",
        "self_name",
        "int_ids",
        "effects",
        "decrementers",
        "detected",
    )

    def __init__(
        self,
        function,
        class_info,
        param,
        tensor_param,
        self_name,
        int_ids=True,
        effects=None,
        decrementers=frozenset(),
        detected=False,
    ):
        self.function = function
        self.class_info = class_info
        self.param = param  # name of the parameter receiving the ids
        self.tensor_param = tensor_param
        self.self_name = self_name
        # False when the annotation says the ids travel as objects (vLLM's
        # KVCacheBlock) or arrays: the rules about int ids (KVG201, KVG202) skip it.
        self.int_ids = int_ids
        self.effects = effects  # what it does to its state (effects.Effects), or None
        # methods that drop their own instance's count (`block.decr_ref()`)
        self.decrementers = decrementers
        # found by what its body does, not by a free-like name
        self.detected = detected


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
        decrementers = self.index.decrementers
        found = effects.summarize(node, self_name, param.name.value, decrementers)
        if found is None and node.name.value in self.config.detected:
            return  # another class's method of that name releases; this one does not
        method = FreeMethod(
            node,
            class_info,
            param.name.value,
            tensor_param,
            self_name,
            int_ids,
            found,
            decrementers,
            node.name.value in self.config.detected,
        )
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
        if name in self.config.detected and not self.reaches_release(call.func, name, scope):
            return
        callee = dotted_name(call.func) or name
        val = self.inference.infer(ids.value, scope)
        native = self.is_tensor_native(callee, name, call.func, scope)
        unsure = native and self._candidates_disagree(callee, name, call.func, scope)
        free = FreeCall(call, callee, name, ids.value, val, native, scope, unsure)
        scope.free_calls.append(free)
        for check in self.hooks.free_call:
            check(free, self.view)

    def receiver_class(self, func, scope):
        """The class of a method call's receiver where the code says it, else None."""
        if type(func) is not nodes.Attribute or scope is None:
            return None
        owner = func.value
        if (
            type(owner) is nodes.Name
            and owner.value == scope.self_name
            and scope.class_info is not None
        ):
            return scope.class_info.name
        receiver = self.inference.infer(owner, scope)
        return receiver.cls if receiver.kind == OBJECT and receiver.cls else None

    def reaches_release(self, func, name, scope) -> bool:
        """A call of a name that only behaviour made free-like: it counts where its
        receiver's class releases ids with that method, or, where the receiver's class
        is unknown, where the receiver is named for an allocator (`self.token_pool`,
        `allocator`): some method of that name in the project releases ids."""
        if type(func) is not nodes.Attribute:
            return False
        cls = self.receiver_class(func, scope)
        if cls is None:
            text = (dotted_name(func.value) or "").lower()
            return any(word in text for word in ALLOCATOR_WORDS)
        code = self.index.release_code(cls, name)
        return code is None or effects.releases_code(code)

    def _candidates_disagree(self, callee, name, func, scope) -> bool:
        """Tensor-native by the name alone: the receiver's class is unknown and the
        project's methods of that name that release a collection of ids differ (some
        take tensors, some are annotated to take something else)."""
        for entry in self._tensor_native:
            if callee == entry or name == entry or callee.endswith("." + entry):
                return False
        if type(func) is nodes.Attribute and self.receiver_class(func, scope) is not None:
            return False
        takes = set()
        for cls, kind in self.index.defined_by(name).items():
            code = self.index.release_code(cls, name)
            # only methods that release a collection of ids: a free(req) or a
            # free(slot: int) is no candidate for a tensor of ids
            if effects.releases_code(code) and code.split("/")[1] != effects.ONE:
                takes.add(kind)
        return "t" in takes and "n" in takes

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
