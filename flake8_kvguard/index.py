"""The project index: which functions anywhere in a project return tensors.

DeepSpeed's `DSStateManager.flush_sequence` frees `seq.all_block_ids()`, a method
defined in another file and annotated `-> torch.Tensor`. flake8 checks one file at a
time, in several processes, so the index is built from the whole project once,
kept on disk keyed by each file's mtime and size, and read back by every process.

Building it does not parse anything: a textual scan finds each `def`, its return
annotation and the annotation of its first parameter after `self`, each `class` with
its bases and methods, and, for a method whose ids parameter has no annotation,
whether its body treats the ids as a tensor (`ids.long()`, `ids.numel()`,
`torch.cat((free, ids))`, `torch.unique(ids)`): such a method takes tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile

from . import project, torch_api
from .collector import gc_paused

LOG = logging.getLogger("flake8.kvguard")

FORMAT_VERSION = 4  # 4: each file's entry holds the digest of the text it was scanned from
CACHE_DIR_NAME = ".kvguard_cache"
CACHE_FILE = "lint-index.json"
# Beside it: the merged index with the stamps of the files it was merged from, so that
# a run in an unchanged project reads neither every file's entry nor merges them.
MERGED_FILE = "lint-index-merged.json"
MAX_FILES = 50_000  # a "project" bigger than this is a home directory, not a project
MAX_SIGNATURE = 4_000  # characters scanned for one signature

# Kinds of annotation, as stored in the index.
TENSOR = "t"
BOOL_TENSOR = "b"
OPTIONAL_TENSOR = "o"
OTHER = "n"

_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*(?:\[[^\]\n]*\])?[ \t]*\(", re.M)
_CLASS = re.compile(r"^([ \t]*)class[ \t]+(\w+)[ \t]*(?:\[[^\]\n]*\])?[ \t]*(?:\(([^)]*)\))?[ \t]*:", re.M)
_STATEMENT_START = re.compile(r"^([ \t]*)(?=[^ \t\n#])", re.M)
# What a body does with a parameter only if it is a tensor. `torch.tensor(ids)` is
# not among them: it makes a tensor out of a list.
_TENSOR_ONLY_METHODS = torch_api.TORCH_ONLY_METHODS | frozenset(("numel", "clone"))
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
    mentions = re.compile(rf"\s*\(?[^()]*(?<![\w.]){name}\b")
    for call in _TORCH_CALL.finditer(body):
        if call.group(1) in _TENSOR_OPS and mentions.match(body, call.end()):
            return True
    return False


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
        if param_annotation is None and param is not None:
            header_end = source.find(":", match.end() + len(params))
            body = source[header_end : _body_end(source, header_end, indent)]
            if uses_as_tensor(body, param):
                takes = "t"
        if takes == "t":
            tensor_params.add(name)
        if owner is not None and takes is not None:
            classes[owner]["m"][name] = takes
    factories = {name: cls for name, cls in factories.items() if cls}
    return {"r": returns, "p": sorted(tensor_params), "c": classes, "k": factories}


def digest(source: str) -> str:
    """What identifies a file's text: equal digests, equal scans."""
    return hashlib.blake2b(source.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


class ProjectIndex:
    """What the index says, merged over the files of one project. `scans` maps the
    digest of each file's text to its entry, so that the file being checked need not
    be scanned again when it is as the index saw it."""

    def __init__(self, entries=(), scans=None):
        self._scans = scans or {}  # digest -> entry, or its JSON text (from_tables)
        kinds: dict = {}
        tensor_params = set()
        classes: dict = {}
        factories: dict = {}
        for entry in entries:
            for name, found in entry["r"].items():
                kinds[name] = kinds.get(name, "") + found
            tensor_params.update(entry["p"])
            for name, info in entry.get("c", {}).items():
                # Two classes of one name: keep what they agree on.
                known = classes.get(name)
                if known is None:
                    classes[name] = {"b": list(info["b"]), "m": dict(info["m"])}
                else:
                    known["b"] = [base for base in known["b"] if base in info["b"]]
                    for method, takes in info["m"].items():
                        if known["m"].get(method, takes) != takes:
                            takes = "?"
                        known["m"][method] = takes
            for name, cls in entry.get("k", {}).items():
                factories[name] = cls if factories.get(name, cls) == cls else ""
        self.classes = classes
        self.factories = {name: cls for name, cls in factories.items() if cls}
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

    def tables(self) -> dict:
        """What `from_tables` rebuilds the index from (JSON-ready): each file's entry
        is kept as JSON text, parsed only for a file being checked (text is not
        something the cyclic collector has to walk through)."""
        return {
            "r": self.returns,
            "p": sorted(self.tensor_params),
            "c": self.classes,
            "k": self.factories,
            "s": {
                digest: entry if type(entry) is str else json.dumps(entry, separators=(",", ":"))
                for digest, entry in self._scans.items()
            },
        }

    @classmethod
    def from_tables(cls, tables):
        """The index `tables()` describes."""
        index = cls()
        index.returns = tables["r"]
        index.tensor_params = frozenset(tables["p"])
        index.classes = tables["c"]
        index.factories = tables["k"]
        index._scans = tables["s"]
        return index

    def scan_of(self, digest: str):
        """The entry of the project's file whose text has this digest, or None."""
        entry = self._scans.get(digest)
        if type(entry) is str:
            try:
                entry = json.loads(entry)
            except ValueError:
                return None
            if type(entry) is not dict:
                return None
        return entry

    def returns_tensor(self, name: str):
        """ "t", "b", "o" or None for a function or method name."""
        return self.returns.get(name)

    def tensor_returning(self):
        """The names `returns_tensor` knows (a set-like view)."""
        return self.returns.keys()

    def takes_tensors(self, name: str) -> bool:
        """Some definition of `name` takes its ids as a tensor (by annotation, or by
        what its body does with them)."""
        return name in self.tensor_params

    def is_class(self, name: str) -> bool:
        return name in self.classes

    def factory_class(self, name: str):
        """The class a function is annotated to return an instance of, or None."""
        return self.factories.get(name)

    def method_takes(self, cls: str, method: str):
        """ "t" when `cls.method` takes ids as a tensor, "n" when it is annotated to take
        something else, None when unknown (no such class or method, or an ambiguous one);
        methods are looked up through the bases the index knows."""
        seen = set()
        queue = [cls]
        while queue:
            current = queue.pop(0)
            if current in seen or len(seen) > 20:
                continue
            seen.add(current)
            info = self.classes.get(current)
            if info is None:
                return None  # a base outside the project may define it
            takes = info["m"].get(method)
            if takes is not None:
                return takes if takes != "?" else None
            queue.extend(info["b"])
        return None


class LocalIndex:
    """The project index, with what the file being checked says of itself first:
    its own classes and functions as it is now (the project's cache may be older, and
    a file outside any project has only itself)."""

    def __init__(self, project_index, source: str):
        self.project = project_index
        entry = project_index.scan_of(digest(source))
        self.local = ProjectIndex([entry if entry is not None else scan_source(source)])

    def returns_tensor(self, name):
        return self.project.returns_tensor(name)

    def tensor_returning(self):
        return self.project.tensor_returning()

    def takes_tensors(self, name):
        return self.local.takes_tensors(name) or self.project.takes_tensors(name)

    def is_class(self, name):
        return self.local.is_class(name) or self.project.is_class(name)

    def factory_class(self, name):
        return self.local.factory_class(name) or self.project.factory_class(name)

    def method_takes(self, cls, method):
        if self.local.is_class(cls):
            found = self.local.method_takes(cls, method)
            if found is not None:
                return found
        return self.project.method_takes(cls, method)


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


def _read_json(path: str):
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        return None
    return data


def _read_cache(path: str) -> dict:
    data = _read_json(path)
    files = data.get("files") if data is not None else None
    return files if isinstance(files, dict) else {}


def _merged_path(path: str) -> str:
    return path[: -len(CACHE_FILE)] + MERGED_FILE


def _read_merged(path: str, stamps: dict):
    """The index merged from exactly the files `stamps` lists, from the merged cache
    beside `path`, or None."""
    data = _read_json(_merged_path(path))
    if data is None or data.get("stamps") != stamps:
        return None
    tables = data.get("tables")
    if (
        not isinstance(tables, dict)
        or set(tables) != {"r", "p", "c", "k", "s"}
        or not isinstance(tables["s"], dict)
    ):
        return None
    try:
        return ProjectIndex.from_tables(tables)
    except (TypeError, ValueError):
        return None


def _scans(files: dict) -> dict:
    """{digest: entry} of the entries in a cache's files."""
    return {
        entry[3]: entry[2]
        for entry in files.values()
        if type(entry) is list and len(entry) == 4 and type(entry[2]) is dict
    }


def _write_cache(path: str, root: str, files: dict, merged: dict = None) -> bool:
    """Write the per-file cache at `path` (or, with `merged`, the merged one beside
    it, `merged` holding its stamps and tables)."""
    directory = os.path.dirname(path)
    if merged is not None:
        path = _merged_path(path)
        payload = {"version": FORMAT_VERSION, "root": root, **merged}
    else:
        payload = {"version": FORMAT_VERSION, "root": root, "files": files}
    try:
        fresh = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        if fresh and os.path.basename(directory) == CACHE_DIR_NAME:
            with open(os.path.join(directory, ".gitignore"), "w", encoding="utf-8") as handle:
                handle.write("# created by kvguard lint\n*\n")
        descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".index-", suffix=".tmp")
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, separators=(",", ":"))
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
    """Index a project: the merged cache when no file changed since it was written,
    else the per-file cache for the unchanged files, rescanning the rest."""
    paths = [_cache_path(root)]
    if not os.environ.get("KVGUARD_LINT_CACHE_DIR"):
        paths.append(_user_cache_path(root))
    listed = []
    stamps = {}
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
        stamps[relative] = [stat.st_mtime_ns, stat.st_size]
        listed.append((path, relative))
    for path in paths:
        found = _read_merged(path, stamps)
        if found is not None:
            return found
    cached: dict = {}
    written = paths[0]
    for path in paths:
        cached = _read_cache(path)
        if cached:
            written = path
            break
    files: dict = {}
    changed = False
    for path, relative in listed:
        stamp = stamps[relative]
        entry = cached.get(relative)
        if (
            type(entry) is list
            and len(entry) == 4
            and entry[:2] == stamp
            and type(entry[2]) is dict
            and type(entry[3]) is str
        ):
            files[relative] = entry
            continue
        source = _read_source(path)
        if source is None:
            continue
        files[relative] = stamp + [scan_source(source), digest(source)]
        changed = True
    if changed or len(files) != len(cached):
        written = None
        for path in paths:
            if _write_cache(path, root, files):
                written = path
                break
    index = ProjectIndex((entry[2] for entry in files.values()), _scans(files))
    if written is not None:
        merged = {
            "stamps": {relative: entry[:2] for relative, entry in files.items()},
            "tables": index.tables(),
        }
        _write_cache(written, root, files, merged)
    return index


_indexes: dict = {}


def for_root(root: str) -> ProjectIndex:
    """The index of a project, built once per process."""
    found = _indexes.get(root)
    if found is None:
        with gc_paused():
            found = build(root)
        _indexes[root] = found
    return found


def forget() -> None:
    """Drop what this process remembers (tests, and `--fix` between rounds)."""
    _indexes.clear()
