"""The textual scan of one file that the project index is built from.

Building the index parses nothing: a scan of the text finds each `def`, its return
annotation and the annotation of its first parameter after `self`, each `class` with
its bases and methods, and, for a method whose ids parameter has no annotation,
whether its body treats the ids as a tensor (`ids.long()`, `ids.numel()`,
`torch.cat((free, ids))`, `torch.unique(ids)`): such a method takes tensors.

A module of its own because a run in an unchanged project never scans: the index
comes from its cache, and the file being checked is found there by the digest of
its text. Its patterns are compiled only when something has to be scanned.
"""

from __future__ import annotations

import re

from . import torch_api
from .indexkinds import BOOL_TENSOR, OPTIONAL_TENSOR, OTHER, TENSOR

MAX_SIGNATURE = 4_000  # characters scanned for one signature

_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*(?:\[[^\]\n]*\])?[ \t]*\(", re.M)
_CLASS = re.compile(r"^([ \t]*)class[ \t]+(\w+)[ \t]*(?:\[[^\]\n]*\])?[ \t]*(?:\(([^)]*)\))?[ \t]*:", re.M)
_STATEMENT_START = re.compile(r"^([ \t]*)(?=[^ \t\n#])", re.M)
# What a body does with a parameter only if it is a tensor. `torch.tensor(ids)` is
# not among them: it makes a tensor out of a list.
_TENSOR_ONLY_METHODS = torch_api.TORCH_ONLY_METHODS | frozenset(("numel", "clone"))
_NOT_A_LIST = "tolist|numel|dim|ndim|size|item|shape|dtype|device"
_TENSOR_OPS = frozenset(
    "cat concat concatenate stack hstack vstack unique unique_consecutive isin "
    "index_select masked_select cumsum bincount searchsorted argsort".split()
)
_TORCH_CALL = re.compile(r"\btorch\.(\w+)\(")
_TENSOR_NAME = (
    r"(?:torch\.(?:cuda\.)?)?"
    r"(?:Tensor|LongTensor|IntTensor|ShortTensor|ByteTensor|CharTensor|BoolTensor)"
)
_TENSOR = re.compile(rf"^{_TENSOR_NAME}$")
_DTYPED = re.compile(
    rf"^(?:\w+\.)?(?P<dtype>Int\d*|UInt8|Integer|Shaped|Num|Bool|Float|Real)\[{_TENSOR_NAME},"
)
_OPTIONAL = re.compile(
    r"^(?:(?:typing\.)?Optional\[(?P<a>[^\[\]]+)\]|(?P<b>[\w.]+)\|None|None\|(?P<c>[\w.]+))$"
)
_OPEN = "([{"
_CLOSE = ")]}"


def classify_annotation(text: str) -> str:
    """The kind of a return or parameter annotation, from its source text."""
    text = re.sub(r"\s+", "", text)
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    if _TENSOR.match(text):
        return BOOL_TENSOR if text.endswith("BoolTensor") else TENSOR
    dtyped = _DTYPED.match(text)
    if dtyped:
        return BOOL_TENSOR if dtyped.group("dtype") == "Bool" else TENSOR
    optional = _OPTIONAL.match(text)
    if optional:
        inner = optional.group("a") or optional.group("b") or optional.group("c")
        if _TENSOR.match(inner):
            return OPTIONAL_TENSOR
    return OTHER


def _skip_string(source: str, i: int, end: int) -> int:
    quote = source[i]
    triple = source.startswith(quote * 3, i)
    if triple:
        close = source.find(quote * 3, i + 3, end)
        return end if close < 0 else close + 3
    i += 1
    while i < end:
        char = source[i]
        if char == "\\":
            i += 2
            continue
        if char == quote or char == "\n":
            return i + 1
        i += 1
    return end


def _signature(source: str, start: int):
    """(parameters text, return annotation text or None) of the def whose `(` is at
    source[start - 1]; None when the signature cannot be read."""
    end = min(len(source), start + MAX_SIGNATURE)
    depth = 1
    i = start
    while i < end and depth:
        char = source[i]
        if char in "'\"":
            i = _skip_string(source, i, end)
            continue
        if char == "#":
            newline = source.find("\n", i, end)
            i = end if newline < 0 else newline
            continue
        if char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            depth -= 1
        i += 1
    if depth:
        return None
    params = source[start : i - 1]
    j = i
    while j < end and source[j] in " \t\\\n":
        j += 1
    if not source.startswith("->", j):
        return params, None
    j += 2
    k = j
    depth = 0
    while k < end:
        char = source[k]
        if char in "'\"":
            k = _skip_string(source, k, end)
            continue
        if char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            depth -= 1
        elif char == ":" and depth == 0:
            return params, source[j:k]
        k += 1
    return None


def _split_top_level(text: str, separator: str):
    parts, depth, current, i = [], 0, [], 0
    while i < len(text):
        char = text[i]
        if char in "'\"":
            stop = _skip_string(text, i, len(text))
            current.append(text[i:stop])
            i = stop
            continue
        if char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            depth -= 1
        if char == separator and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
        i += 1
    parts.append("".join(current))
    return parts


def _first_id_parameter(params: str, is_method: bool):
    """(name, annotation text or None) of the first parameter that receives ids."""
    for param in _split_top_level(params, ","):
        param = param.strip()
        if not param or param in ("/", "*") or param.startswith("*"):
            continue
        name, _, annotation = param.partition(":")
        name = name.split("=")[0].strip()
        if is_method and name in ("self", "cls"):
            continue
        if not annotation:
            return name, None
        return name, _split_top_level(annotation, "=")[0]
    return None, None


def _first_id_parameter_kind(params: str, is_method: bool):
    """Kind of the annotation of the first parameter that receives ids."""
    _, annotation = _first_id_parameter(params, is_method)
    return None if annotation is None else classify_annotation(annotation)


_TENSOR_WORD = re.compile(r"\bTensor\b|\bLongTensor\b|\bIntTensor\b")


def _says_nothing(annotation: str) -> bool:
    """`Any`, `object` and the like: an annotation that leaves the kind open."""
    text = re.sub(r"\s+", "", annotation).strip("'\"")
    return text in ("Any", "typing.Any", "object", "t.Any")


def _body_end(source: str, start: int, indent: int) -> int:
    """Where the body of a def whose header ends at `start` ends: the next statement
    indented no deeper than the def (a docstring line at column 0 ends it early,
    which only loses evidence)."""
    for match in _STATEMENT_START.finditer(source, start):
        if match.start() == start:
            continue
        if len(match.group(1)) <= indent:
            return match.start()
    return len(source)


def uses_as_tensor(body: str, name: str) -> bool:
    """Whether a function body treats `name` as a torch tensor."""
    if not re.match(r"^\w+$", name):
        return False
    for method in re.finditer(rf"(?<![\w.]){name}\s*\.\s*(\w+)\s*\(", body):
        if method.group(1) in _TENSOR_ONLY_METHODS:
            return True
    if re.search(rf"(?<![\w.]){name}\s*\.\s*(?:{_NOT_A_LIST})\b", body) and \
            not re.search(rf"\bisinstance\s*\(\s*{name}\b", body):
        return True  # an array's attributes, unguarded: a list passed instead fails there
    mentions = re.compile(rf"\s*\(?[^()]*(?<![\w.]){name}\b")
    for call in _TORCH_CALL.finditer(body):
        if call.group(1) in _TENSOR_OPS and mentions.match(body, call.end()):
            return True
    return False


_RETURN = re.compile(r"^[ \t]+return\b[ \t]*(.*)$", re.M)
_CONSTRUCTION = re.compile(r"^(?:\w+\.)*([A-Z]\w*)\(")


def _constructed(body: str):
    """The class every `return` of a body constructs (`return SlotPool(n)`), or None."""
    found = None
    for match in _RETURN.finditer(body):
        construction = _CONSTRUCTION.match(match.group(1))
        if construction is None:
            return None
        if found not in (None, construction.group(1)):
            return None
        found = construction.group(1)
    return found


def _annotation_class(text: str):
    """The class an annotation names (`Pool`, `"Pool"`, `Optional[mod.Pool]`), or None."""
    text = re.sub(r"\s+", "", text).strip("'\"")
    optional = _OPTIONAL.match(text)
    if optional:
        text = optional.group("a") or optional.group("b") or optional.group("c")
    if not re.match(r"^[\w.]+$", text):
        return None
    last = text.rpartition(".")[2]
    return last if last[:1].isupper() and last != "None" else None


def scan_source(source: str) -> dict:
    """Index entries of one file: {"r": {name: kinds}, "p": [names], "c": {class:
    {"b": [bases], "m": {method: "t" or "n"}}}, "k": {function: class}}.

    "r" maps each function annotated with a return type to the kinds of its return
    annotations ("t" tensor, "b" bool tensor, "o" optional tensor, "n" other).
    "p" lists the functions whose first id parameter takes a tensor (annotated so, or
    used as one in the body). "c" gives each class its bases and, per method, "t" when
    its ids parameter takes tensors and "n" when it is annotated as something else.
    "k" maps functions annotated to return an instance of a class to that class.
    """
    returns: dict = {}
    tensor_params = set()
    classes: dict = {}
    factories: dict = {}
    candidates = []  # (class, method, its text) for effects.py
    handed_on = []  # (class, function, ids parameter, body) the body alone does not decide
    scopes = []  # (indent, class name or None for a def), innermost last
    events = [(m.start(), "c", m) for m in _CLASS.finditer(source)]
    events += [(m.start(), "d", m) for m in _DEF.finditer(source)]
    events.sort(key=lambda event: event[0])
    for position, kind, match in events:
        header = match.group(0)
        indent = len(header) - len(header.lstrip(" \t"))
        while scopes and scopes[-1][0] >= indent:
            scopes.pop()
        if kind == "c":
            name = match.group(2)
            bases = [
                base.strip().rpartition(".")[2]
                for base in (match.group(3) or "").split(",")
                if base.strip() and "=" not in base
            ]
            classes.setdefault(name, {"b": bases, "m": {}})
            scopes.append((indent, name))
            continue
        owner = scopes[-1][1] if scopes else None
        scopes.append((indent, None))
        signature = _signature(source, match.end())
        if signature is None:
            continue
        params, annotation = signature
        name = match.group(1)
        if annotation is not None:
            kind_found = classify_annotation(annotation)
            kinds = returns.get(name, "")
            if kind_found not in kinds:
                returns[name] = kinds + kind_found
            returned = _annotation_class(annotation)
            if returned is not None and kind_found == OTHER:
                factories[name] = returned if factories.get(name, returned) == returned else ""
        elif "return" in source[match.end() : match.end() + 4_000]:
            header_end = source.find(":", match.end() + len(params))
            returned = _constructed(source[header_end : _body_end(source, header_end, indent)])
            if returned is not None:  # def make_pool(): return SlotPool(16)
                factories[name] = returned if factories.get(name, returned) == returned else ""
        is_method = match.group(0)[:1] in " \t"
        param, param_annotation = _first_id_parameter(params, is_method)
        takes = None
        if param_annotation is not None and _says_nothing(param_annotation):
            param_annotation = None  # `ids: Any`: the body decides
        if param_annotation is not None:
            found = classify_annotation(param_annotation)
            takes = "t" if found in (TENSOR, BOOL_TENSOR, OPTIONAL_TENSOR) else "n"
            if takes == "n" and _TENSOR_WORD.search(param_annotation):
                takes = "t"  # Union[torch.Tensor, List[int]] takes tensors too
        if param is not None and takes != "t":  # no annotation, or one the body belies
            header_end = source.find(":", match.end() + len(params))
            body = source[header_end : _body_end(source, header_end, indent)]
            if uses_as_tensor(body, param):
                takes = "t"  # `ids: list` whose body calls ids.numel(): it takes tensors
            else:
                handed_on.append((owner, name, param, body))
        if takes == "t":
            tensor_params.add(name)
        if owner is not None and takes is not None:
            classes[owner]["m"][name] = takes
        if owner is not None and is_method:
            header_end = source.find(":", match.end() + len(params))
            end = _body_end(source, header_end, indent)
            if _may_change_state(source, header_end, end):
                line_start = source.rfind("\n", 0, match.start()) + 1
                candidates.append((owner, name, source[line_start:end]))
    _hands_on_tensors(handed_on, tensor_params, classes)
    factories = {name: cls for name, cls in factories.items() if cls}
    entry = {"r": returns, "p": sorted(tensor_params), "c": classes, "k": factories}
    if candidates:
        _add_effects(entry, candidates)
    return entry


def _hands_on_tensors(handed_on, tensor_params, classes) -> None:
    """A function that passes its ids as they are to one of this file's functions that takes
    tensors takes tensors too (`free(ids)` calling `keep(ids)`, whose body calls
    `ids.clone()`): a list passed instead would fail there. Repeated until nothing changes."""
    changed = True
    while changed and handed_on and tensor_params:
        changed = False
        callees = "|".join(re.escape(name) for name in sorted(tensor_params))
        for item in list(handed_on):
            owner, name, param, body = item
            if re.search(rf"(?<![\w.])(?:{callees})\s*\(\s*{re.escape(param)}\s*[,)]", body):
                tensor_params.add(name)
                if owner is not None:
                    classes[owner]["m"][name] = "t"
                handed_on.remove(item)
                changed = True


_EFFECT_HINT = re.compile(
    r"-=|\+=|\.(?:append|appendleft|extend|extendleft|put|put_nowait|insert|remove|discard|pop)"
    r"\s*\(|heappush|=\s*(?:True|False)\b|cat\s*\(|\bdel\b|\.\w+\(\)"
)
_STATE_HINT = re.compile(
    r"\.\w*(?:free|avail|empty|unused|idle|vacant|spare|recycl|reusable|ref|cnt|count|usage|"
    r"pin|used|alloc|busy|occupied|in_use|taken|live)",
    re.I,
)


def _may_change_state(source: str, start: int, end: int) -> bool:
    """Whether a method body might release ids or drop its own count (effects.py
    decides; this only spares parsing the bodies that cannot)."""
    return (
        _EFFECT_HINT.search(source, start, end) is not None
        and _STATE_HINT.search(source, start, end) is not None
    )


def _add_effects(entry: dict, candidates) -> None:
    """Parse each candidate method alone and record what it does (effects.py): "e"
    {method: summary code} on its class, and "d", the methods that drop their own
    instance's count (`def sub_ref(self): self.ref_cnt -= 1`)."""
    import ast
    import textwrap

    from . import effects, nodes
    from .analysis.syntax import all_params, ids_param

    functions = []
    for owner, name, text in candidates:
        text = textwrap.dedent(text)
        try:
            module = nodes.from_ast(ast.parse(text), text)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        function = module.body[0] if module.body else None
        if type(function) is not nodes.FunctionDef:
            continue
        params = all_params(function.params)
        self_name = params[0].name.value if params else None
        functions.append((owner, name, function, self_name))
    decrementers = {
        name
        for owner, name, function, self_name in functions
        if len(all_params(function.params)) == 1 and effects.decrements_itself(function, self_name)
    }
    decrementers.difference_update(effects.GENERIC)
    if decrementers:
        entry["d"] = sorted(decrementers)
    for owner, name, function, self_name in functions:
        if name in effects.GENERIC or name in decrementers:
            continue
        param = ids_param(function, True)
        if param is None:
            continue
        found = effects.summarize(function, self_name, param.name.value, decrementers)
        if found is not None:
            entry["c"][owner].setdefault("e", {})[name] = found.code

