"""What one module's names stand for: its imports, its own defs, their declared returns.

`canonical("th.cat")` is `torch.cat` after `import torch as th`. The walk fills the
tables in a first pass over the module (imports and return annotations anywhere in
it) and gives a function its own copy of the imports while it walks that function.
"""

from __future__ import annotations

from .. import nodes

from ..cstutil import dotted_name


class ModuleNames:
    """Imports, module-level defs and classes, and the return annotations of this file's
    functions."""

    __slots__ = ("imports", "shadowed", "local_returns", "local_tensor_params", "bound")

    def __init__(self):
        self.imports = {}  # local name -> dotted name it stands for
        self.shadowed = set()  # module-level defs and classes: not the builtins
        self.local_returns = {}  # function name -> Val of its return annotation
        self.local_tensor_params = set()  # free-like defs whose ids are annotated tensors
        # (local name, dotted name) for every name any import in the file binds, even
        # where a later import rebinds it: it only grows (analysis/quiet.py reads it).
        self.bound = set()

    def record_import(self, node):
        if type(node) is nodes.Import:
            for alias in node.names:
                full = dotted_name(alias.name)
                if full is None:
                    continue
                if alias.asname is not None and type(alias.asname.name) is nodes.Name:
                    self.imports[alias.asname.name.value] = full
                    self.bound.add((alias.asname.name.value, full))
                else:
                    first = full.split(".")[0]
                    self.imports[first] = first
                    self.bound.add((first, first))
        else:
            if node.relative or node.module is None:
                module = None
            else:
                module = dotted_name(node.module)
            if isinstance(node.names, nodes.ImportStar):
                return
            for alias in node.names:
                name = dotted_name(alias.name)
                if name is None:
                    continue
                local = name
                if alias.asname is not None and type(alias.asname.name) is nodes.Name:
                    local = alias.asname.name.value
                self.imports[local] = f"{module}.{name}" if module else f".{name}"
                self.bound.add((local, self.imports[local]))

    def canonical(self, dotted):
        """`torch.cat` for `th.cat` after `import torch as th`, and so on."""
        if dotted is None:
            return None
        first, _, rest = dotted.partition(".")
        target = self.imports.get(first)
        if target is None:
            return dotted
        return f"{target}.{rest}" if rest else target

    def builtin_available(self, name, scope=None):
        """Whether `name` still means the builtin: not imported, not defined at module
        level and, given a scope, not bound in it."""
        return (
            name not in self.imports
            and name not in self.shadowed
            and (scope is None or scope.lookup(name) is None)
        )
