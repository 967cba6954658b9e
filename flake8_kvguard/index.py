"""The project index: which functions anywhere in a project return tensors.

DeepSpeed's `DSStateManager.flush_sequence` frees `seq.all_block_ids()`, a method
defined in another file and annotated `-> torch.Tensor`. flake8 checks one file at a
time, in several processes, so the index is built from the whole project once,
kept on disk keyed by each file's mtime and size, and read back by every process.

Building it does not parse anything: a textual scan finds each `def`, its return
annotation and the annotation of its first parameter after `self`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile

from . import project

LOG = logging.getLogger("flake8.kvguard")

FORMAT_VERSION = 2
CACHE_DIR_NAME = ".kvguard_cache"
CACHE_FILE = "lint-index.json"
MAX_FILES = 50_000  # a "project" bigger than this is a home directory, not a project
MAX_SIGNATURE = 4_000  # characters scanned for one signature

# Kinds of annotation, as stored in the index.
TENSOR = "t"
BOOL_TENSOR = "b"
OPTIONAL_TENSOR = "o"
OTHER = "n"

_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*(?:\[[^\]\n]*\])?[ \t]*\(", re.M)
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


def _first_id_parameter_kind(params: str, is_method: bool):
    """Kind of the annotation of the first parameter that receives ids."""
    for param in _split_top_level(params, ","):
        param = param.strip()
        if not param or param in ("/", "*") or param.startswith("*"):
            continue
        name, _, annotation = param.partition(":")
        name = name.split("=")[0].strip()
        if is_method and name in ("self", "cls"):
            continue
        if not annotation:
            return None
        annotation = _split_top_level(annotation, "=")[0]
        return classify_annotation(annotation)
    return None


def scan_source(source: str) -> dict:
    """Index entries of one file: {"r": {name: kinds}, "p": [names]}.

    "r" maps each function annotated with a return type to the kinds of its return
    annotations ("t" tensor, "b" bool tensor, "o" optional tensor, "n" other).
    "p" lists the functions whose first id parameter is annotated as a tensor.
    """
    returns: dict = {}
    tensor_params = set()
    for match in _DEF.finditer(source):
        signature = _signature(source, match.end())
        if signature is None:
            continue
        params, annotation = signature
        name = match.group(1)
        if annotation is not None:
            kind = classify_annotation(annotation)
            kinds = returns.get(name, "")
            if kind not in kinds:
                returns[name] = kinds + kind
        is_method = match.group(0)[:1] in " \t"
        if _first_id_parameter_kind(params, is_method) in (TENSOR, BOOL_TENSOR, OPTIONAL_TENSOR):
            tensor_params.add(name)
    return {"r": returns, "p": sorted(tensor_params)}


class ProjectIndex:
    """What the index says, merged over the files of one project."""

    def __init__(self, entries=()):
        kinds: dict = {}
        tensor_params = set()
        for entry in entries:
            for name, found in entry["r"].items():
                kinds[name] = kinds.get(name, "") + found
            tensor_params.update(entry["p"])
        self.returns = {}
        for name, found in kinds.items():
            found = set(found)
            # A name is known only when every annotated definition agrees.
            if found and OTHER not in found:
                if found == {BOOL_TENSOR}:
                    self.returns[name] = BOOL_TENSOR
                elif OPTIONAL_TENSOR in found:
                    self.returns[name] = OPTIONAL_TENSOR
                else:
                    self.returns[name] = TENSOR
        self.tensor_params = frozenset(tensor_params)

    def returns_tensor(self, name: str):
        """ "t", "b", "o" or None for a function or method name."""
        return self.returns.get(name)

    def takes_tensors(self, name: str) -> bool:
        """Some definition of `name` annotates its ids parameter as a tensor."""
        return name in self.tensor_params


EMPTY = ProjectIndex()


def _cache_path(root: str) -> str:
    override = os.environ.get("KVGUARD_LINT_CACHE_DIR")
    if override:
        digest = hashlib.sha1(root.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        return os.path.join(override, f"{digest}-{CACHE_FILE}")
    return os.path.join(root, CACHE_DIR_NAME, CACHE_FILE)


def _user_cache_path(root: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha1(root.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return os.path.join(base, "kvguard", f"{digest}-{CACHE_FILE}")


def _read_cache(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _write_cache(path: str, root: str, files: dict) -> bool:
    directory = os.path.dirname(path)
    try:
        fresh = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        if fresh and os.path.basename(directory) == CACHE_DIR_NAME:
            with open(os.path.join(directory, ".gitignore"), "w", encoding="utf-8") as handle:
                handle.write("# created by kvguard lint\n*\n")
        descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".index-", suffix=".tmp")
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(
                {"version": FORMAT_VERSION, "root": root, "files": files},
                handle,
                separators=(",", ":"),
            )
        os.replace(temporary, path)
        return True
    except OSError:
        return False


def _read_source(path: str):
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    return data.decode("utf-8", errors="replace")


def build(root: str) -> ProjectIndex:
    """Index a project, reusing the entries of unchanged files from the disk cache."""
    paths = [_cache_path(root)]
    if not os.environ.get("KVGUARD_LINT_CACHE_DIR"):
        paths.append(_user_cache_path(root))
    cached: dict = {}
    for path in paths:
        cached = _read_cache(path)
        if cached:
            break
    files: dict = {}
    changed = False
    prefix = len(os.path.join(root, ""))
    for count, (path, stat) in enumerate(project.iter_python_files(root, with_stat=True)):
        if count >= MAX_FILES:
            LOG.warning(
                "kvguard: %s holds more than %d Python files; indexed the first %d",
                root,
                MAX_FILES,
                MAX_FILES,
            )
            break
        relative = path[prefix:]
        stamp = [stat.st_mtime_ns, stat.st_size]
        entry = cached.get(relative)
        if (
            type(entry) is list
            and len(entry) == 3
            and entry[:2] == stamp
            and type(entry[2]) is dict
        ):
            files[relative] = entry
            continue
        source = _read_source(path)
        if source is None:
            continue
        files[relative] = stamp + [scan_source(source)]
        changed = True
    if changed or len(files) != len(cached):
        if not _write_cache(paths[0], root, files) and len(paths) > 1:
            _write_cache(paths[1], root, files)
    return ProjectIndex(entry[2] for entry in files.values())


_indexes: dict = {}


def for_root(root: str) -> ProjectIndex:
    """The index of a project, built once per process."""
    found = _indexes.get(root)
    if found is None:
        found = build(root)
        _indexes[root] = found
    return found


def forget() -> None:
    """Drop what this process remembers (tests, and `--fix` between rounds)."""
    _indexes.clear()
