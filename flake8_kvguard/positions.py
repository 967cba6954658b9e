"""Line and column of a few nodes, computed only when a finding is reported.

libcst's PositionProvider computes a range for every node of the module, which
costs about two more parses. Findings are rare, so this module generates the code
of the module only up to the last node asked for, recording where the asked-for
nodes start, and stops there.

Lines are 1-based, columns 0-based characters: what flake8 expects from a plugin
(it adds 1 to the column when it prints).
"""

from __future__ import annotations

import contextlib
import re

import libcst as cst

try:  # The codegen state is not public API; fall back to PositionProvider without it.
    from libcst._nodes.internal import CodegenState as _CodegenState
except ImportError:  # pragma: no cover - depends on libcst internals
    _CodegenState = None

_NEWLINE = re.compile(r"\r\n?|\n")
_NULL = contextlib.nullcontext()


class _Found(Exception):
    pass


if _CodegenState is not None:

    class _TargetedState(_CodegenState):
        """A CodegenState that notes where the target nodes start."""

        def __init__(self, module: cst.Module, targets: dict):
            super().__init__(
                default_indent=module.default_indent, default_newline=module.default_newline
            )
            self.targets = targets  # id(node) -> node
            self.found: dict = {}
            self._counted = 0  # tokens already folded into line/column
            self._line = 1
            self._column = 0

        def _advance(self):
            tokens = self.tokens
            line, column = self._line, self._column
            for index in range(self._counted, len(tokens)):
                token = tokens[index]
                newlines = _NEWLINE.findall(token)
                if newlines:
                    line += len(newlines)
                    column = len(token) - max(token.rfind("\n"), token.rfind("\r")) - 1
                else:
                    column += len(token)
            self._counted = len(tokens)
            self._line, self._column = line, column
            return line, column

        def record_syntactic_position(self, node, *, start_node=None, end_node=None):
            key = id(node)
            if key in self.targets and key not in self.found:
                self.found[key] = self._advance()
                if len(self.found) == len(self.targets):
                    raise _Found
            return _NULL


def positions(module: cst.Module, nodes) -> dict:
    """{id(node): (line, column)} for the given nodes of `module`."""
    targets = {id(node): node for node in nodes}
    if not targets:
        return {}
    if _CodegenState is not None:
        try:
            state = _TargetedState(module, targets)
            try:
                module._codegen(state)
            except _Found:
                pass
            if len(state.found) == len(targets):
                return state.found
        except (TypeError, AttributeError):  # pragma: no cover - libcst internals changed
            pass
    return _with_provider(module, targets)


def _with_provider(module: cst.Module, targets: dict) -> dict:
    wrapper = cst.MetadataWrapper(module, unsafe_skip_copy=True)
    ranges = wrapper.resolve(cst.metadata.PositionProvider)
    found = {}
    for key, node in targets.items():
        code_range = ranges.get(node)
        if code_range is not None:
            found[key] = (code_range.start.line, code_range.start.column)
        else:
            found[key] = (1, 0)
    return found
