"""What the walk knows of names while it goes: scopes, their bindings, growing lists.

A `Scope` is a function (or the module, or a class body) being walked; its `Env`
maps local names to what is known of their values (`Val`), falling back to the
enclosing scopes. Lists built up with append/extend are tracked as `Accumulation`s
so that KVG102 can tell one source of ids from several.
"""

from __future__ import annotations

from .. import nodes

from ..values import SEQUENCE, TENSOR, TENSORS, NOTHING, Val, elements, sequence_of


class Env:
    """Names of one scope; a lookup falls back to the enclosing scopes."""

    __slots__ = ("vars", "parent")

    def __init__(self, parent=None):
        self.vars = {}
        self.parent = parent

    def lookup(self, name):
        env = self
        while env is not None:
            found = env.vars.get(name)
            if found is not None:
                return found
            env = env.parent
        return None


class Accumulation:
    """A list built up with append/extend: how many sources feed it."""

    __slots__ = ("depth", "sources", "items", "reason", "guarded", "parts")

    def __init__(self, depth, sources=0, items=(), reason=None, parts=0):
        self.depth = depth
        self.sources = sources
        self.items = list(items)
        self.reason = reason
        self.guarded = False
        self.parts = parts  # how many elements it may hold: 2 means "two or more"

    def value(self) -> Val:
        dup = self.reason if self.sources >= 2 and not self.guarded else None
        return sequence_of(self.items, dup=dup).replace(dup=dup)


class ClassInfo:
    __slots__ = ("name", "attrs", "node")

    def __init__(self, node):
        self.node = node
        self.name = node.name.value
        self.attrs = {}


class Scope:
    """A function (or the module) being walked."""

    def __init__(self, node, env, *, self_name=None, class_info=None, parent=None):
        self.node = node
        self.env = env
        self.self_name = self_name
        self.class_info = class_info
        self.parent = parent
        self.loop_depth = 0
        self.guards = []  # tests of the enclosing ifs
        self.dedup_loops = set()  # loop depths whose body skips ids seen before
        self.accumulations = {}
        self.free_calls = []

    def child(self, env):
        """A comprehension or lambda: new names, same function."""
        scope = Scope(
            self.node, env, self_name=self.self_name, class_info=self.class_info, parent=self
        )
        scope.loop_depth = self.loop_depth
        scope.accumulations = self.accumulations
        scope.free_calls = self.free_calls
        scope.guards = self.guards
        scope.dedup_loops = self.dedup_loops
        return scope

    def lookup(self, name):
        accumulation = self.accumulations.get(name)
        if accumulation is not None and self.env.vars.get(name) is None:
            return accumulation.value()
        return self.env.lookup(name)

    def bind(self, name, val):
        self.accumulations.pop(name, None)
        self.env.vars[name] = val


def bind_names(target, val, env):
    """Bind a comprehension target without side effects on the enclosing function."""
    kind = type(target)
    if kind is nodes.Name:
        env.vars[target.value] = val
    elif kind in (nodes.Tuple, nodes.List):
        parts = target.elements
        item = Val(TENSOR, item=val.item) if val.kind == TENSORS else elements(val)
        for part in parts:
            bind_names(part.value, item if len(parts) else NOTHING, env)
    elif kind is nodes.StarredElement:
        bind_names(target.value, Val(SEQUENCE), env)
