"""The project index: which functions anywhere in a project return tensors.

DeepSpeed's `DSStateManager.flush_sequence` frees `seq.all_block_ids()`, a method
defined in another file and annotated `-> torch.Tensor`. flake8 checks one file at a
time, in several processes, so the index is built from the whole project once,
kept on disk keyed by each file's mtime and size, and read back by every process.

Building it does not parse anything: a textual scan of each file (indexscan.py)
finds its functions' return annotations, the classes with their bases and what
their methods take. A run in a project where nothing changed reads the merged cache
and only the parts of it that the files it checks ask for (CachedIndex).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

from . import project
from .collector import gc_paused
from .indexkinds import BOOL_TENSOR, OPTIONAL_TENSOR, OTHER, TENSOR

try:  # `hashlib` loads OpenSSL's bindings first, a few ms of every flake8 run
    from _blake2 import blake2b
except ImportError:  # a Python built without it
    from hashlib import blake2b

LOG = logging.getLogger("flake8.kvguard")

FORMAT_VERSION = 6  # 6: ids a body uses as tensors take tensors, whatever the annotation; 5: effects of methods ("e", "d"); 4: each file's entry holds the digest of the text it was scanned from
CACHE_DIR_NAME = ".kvguard_cache"
CACHE_FILE = "lint-index.json"
# Beside it: the merged index with the stamps of the files it was merged from, so that
# a run in an unchanged project reads neither every file's entry nor merges them.
MERGED_FILE = "lint-index-merged.json"
MERGED_VERSION = 6  # 6: releases and decrementers in the first line; 5: lines (CachedIndex), methods by name, scans by digest
MAX_FILES = 50_000  # a "project" bigger than this is a home directory, not a project


def digest(source: str) -> str:
    """What identifies a file's text: equal digests, equal scans."""
    return blake2b(source.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def scan_source(source: str) -> dict:
    """Index entries of one file (indexscan.py, imported the first time a file has to
    be scanned)."""
    from . import indexscan

    return indexscan.scan_source(source)


class ProjectIndex:
    """What the index says, merged over the files of one project. `scans` maps the
    digest of each file's text to its entry, so that the file being checked need not
    be scanned again when it is as the index saw it.

    Classes are kept as two tables: each class's bases, and for each method name the
    classes that define it with what they take. Only free-like method names are ever
    looked up, so the merged cache can keep the second table unparsed (CachedIndex)."""

    def __init__(self, entries=(), scans=None):
        self._scans = scans or {}  # digest -> entry
        kinds: dict = {}
        tensor_params = set()
        bases: dict = {}
        methods: dict = {}
        factories: dict = {}
        releases: dict = {}
        decrementers = set()
        for entry in entries:
            decrementers.update(entry.get("d", ()))
            for name, found in entry["r"].items():
                kinds[name] = kinds.get(name, "") + found
            tensor_params.update(entry["p"])
            for name, info in entry.get("c", {}).items():
                # Two classes of one name: keep what they agree on.
                known = bases.get(name)
                bases[name] = (
                    list(info["b"]) if known is None else [b for b in known if b in info["b"]]
                )
                for method, takes in info["m"].items():
                    classes = methods.setdefault(method, {})
                    if classes.get(name, takes) != takes:
                        takes = "?"
                    classes[name] = takes
                for method, code in info.get("e", {}).items():
                    releases.setdefault(method, {})[name] = code
            for name, cls in entry.get("k", {}).items():
                factories[name] = cls if factories.get(name, cls) == cls else ""
        self.bases = bases
        self._methods = methods
        self.releases = releases
        self.decrementers = frozenset(decrementers)
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
        """Everything the index holds, JSON-ready (what the merged cache is written
        from)."""
        return {
            "r": self.returns,
            "p": sorted(self.tensor_params),
            "b": self.bases,
            "m": {method: self.defined_by(method) for method in self.method_names()},
            "k": self.factories,
            "x": self.releases,
            "d": sorted(self.decrementers),
            "s": {digest: self.scan_of(digest) for digest in self.scan_digests()},
        }

    def method_names(self):
        return list(self._methods)

    def scan_digests(self):
        return list(self._scans)

    def defined_by(self, method: str) -> dict:
        """{class: what its `method` takes} for the classes that define it."""
        return self._methods.get(method, {})

    def scan_of(self, digest: str):
        """The entry of the project's file whose text has this digest, or None."""
        return self._scans.get(digest)

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
        return name in self.bases

    def factory_class(self, name: str):
        """The class a function is annotated to return an instance of, or None."""
        return self.factories.get(name)

    def release_code(self, cls: str, method: str):
        """The effects.py summary of `cls.method` (through the bases the index knows)
        where it releases ids; "" where no class on the way does (all of them the
        project's); None when a base outside the project may."""
        code, complete = self._first_defined(cls, self.releases.get(method, {}))
        if code is not None:
            return code
        return "" if complete else None  # "": every class on the way is the project's

    def release_names(self):
        """Method names some class of the project releases ids with (effects.py)."""
        return self.releases.keys()

    def method_takes(self, cls: str, method: str):
        """ "t" when `cls.method` takes ids as a tensor, "n" when it is annotated to take
        something else, None when unknown (no such class or method, or an ambiguous one);
        methods are looked up through the bases the index knows."""
        takes, _ = self._first_defined(cls, self.defined_by(method))
        return takes if takes != "?" else None

    def _first_defined(self, cls: str, defined: dict):
        """`defined`'s value for the first of `cls` and its bases (breadth first) that has
        one, and whether the walk stayed inside the project: (value, True) when found,
        (None, False) at a base the index does not know, (None, True) when no class on
        the way has one."""
        seen = set()
        queue = [cls]
        while queue:
            current = queue.pop(0)
            if current in seen or len(seen) > 20:
                continue
            seen.add(current)
            bases = self.bases.get(current)
            if bases is None:
                return None, False  # a base outside the project may define it
            value = defined.get(current)
            if value is not None:
                return value, True
            queue.extend(bases)
        return None, True


class CachedIndex(ProjectIndex):
    """The index as the merged cache holds it (`write_merged`): a first line with the
    tables every checked file consults (returned kinds, tensor-taking names,
    factories, the bases of each class), then one line per method name with the
    classes that define it, and one line per file with its scan, keyed by the digest
    of its text. Those lines are read only when asked for, by searching the bytes for
    their key: a run reads the few free-like method names and the scans of the files
    it checks, not the whole project's (on SGLang's 4,700 files, 0.05 s of JSON)."""

    def __init__(self, tables: dict, data: bytes):
        super().__init__()
        self.returns = tables["r"]
        self.tensor_params = frozenset(tables["p"])
        self.bases = tables["b"]
        self.factories = tables["k"]
        self.releases = tables["x"]
        self.decrementers = frozenset(tables["d"])
        self._data = data

    def _line(self, kind: bytes, key: str):
        """The JSON value on the line `kind key value`, or None."""
        prefix = b"\n" + kind + b" " + key.encode("utf-8", "surrogatepass") + b" "
        start = self._data.find(prefix)
        if start < 0:
            return None
        start += len(prefix)
        end = self._data.find(b"\n", start)
        try:
            value = json.loads(self._data[start : end if end >= 0 else len(self._data)])
        except ValueError:
            return None
        return value if type(value) is dict else None

    def defined_by(self, method: str) -> dict:
        found = self._methods.get(method)
        if found is None:
            found = self._line(b"m", method) or {}
            self._methods[method] = found
        return found

    def scan_of(self, digest: str):
        return self._line(b"s", digest)

    def _keys(self, kind: bytes):
        prefix = b"\n" + kind + b" "
        return [
            line[2 : line.index(b" ", 2)].decode("utf-8", "surrogatepass")
            for line in self._data.split(b"\n")
            if line.startswith(prefix[1:])
        ]

    def method_names(self):
        return self._keys(b"m")

    def scan_digests(self):
        return self._keys(b"s")


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

    def defined_by(self, method):
        found = dict(self.project.defined_by(method))
        found.update(self.local.defined_by(method))
        return found

    def release_code(self, cls, method):
        if self.local.is_class(cls):
            found = self.local.release_code(cls, method)
            if found:
                return found
        return self.project.release_code(cls, method)

    def release_names(self):
        return self.local.release_names() | self.project.release_names()

    @property
    def decrementers(self):
        return self.local.decrementers | self.project.decrementers

    def method_takes(self, cls, method):
        if self.local.is_class(cls):
            found = self.local.method_takes(cls, method)
            if found is not None:
                return found
        return self.project.method_takes(cls, method)


EMPTY = ProjectIndex()


def _root_name(root: str) -> str:
    """The prefix of a project's cache files in a shared directory."""
    import hashlib  # not at module level: it loads OpenSSL's bindings, and most runs keep
    # their cache in the project

    return hashlib.sha1(root.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _cache_path(root: str) -> str:
    override = os.environ.get("KVGUARD_LINT_CACHE_DIR")
    if override:
        return os.path.join(override, f"{_root_name(root)}-{CACHE_FILE}")
    return os.path.join(root, CACHE_DIR_NAME, CACHE_FILE)


def _user_cache_path(root: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvguard", f"{_root_name(root)}-{CACHE_FILE}")


def _cache_paths(root: str):
    """Where the project's cache may be, in order (the second only when the first is
    not writable); computed as they are tried."""
    yield _cache_path(root)
    if not os.environ.get("KVGUARD_LINT_CACHE_DIR"):
        yield _user_cache_path(root)


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
    beside `path` (CachedIndex), or None."""
    try:
        with open(_merged_path(path), "rb") as handle:
            data = handle.read()
        header = json.loads(data[: data.find(b"\n")] if b"\n" in data else data)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(header, dict)
        or header.get("version") != MERGED_VERSION
        or header.get("stamps") != stamps
    ):
        return None
    tables = header.get("tables")
    if (
        not isinstance(tables, dict)
        or set(tables) != {"r", "p", "b", "k", "x", "d"}
        or not all(
            isinstance(tables[key], dict) for key in ("r", "b", "k", "x")
        )
        or not isinstance(tables["p"], list)
        or not isinstance(tables["d"], list)
    ):
        return None
    return CachedIndex(tables, data)


def _merged_lines(root: str, stamps: dict, index: ProjectIndex):
    """The merged cache's text, line by line (CachedIndex reads it)."""
    tables = index.tables()
    header = {key: tables[key] for key in ("r", "p", "b", "k", "x", "d")}
    dump = json.dumps
    yield dump(
        {"version": MERGED_VERSION, "root": root, "stamps": stamps, "tables": header},
        separators=(",", ":"),
    )
    for kind in ("m", "s"):
        for key, value in tables[kind].items():
            yield f"{kind} {key} {dump(value, separators=(',', ':'))}"


def _scans(files: dict) -> dict:
    """{digest: entry} of the entries in a cache's files."""
    return {
        entry[3]: entry[2]
        for entry in files.values()
        if type(entry) is list and len(entry) == 4 and type(entry[2]) is dict
    }


def _write_cache(path: str, root: str, files: dict, merged: list = None) -> bool:
    """Write the per-file cache at `path` (or, with `merged`, the merged one beside
    it, `merged` holding its lines)."""
    directory = os.path.dirname(path)
    if merged is not None:
        path = _merged_path(path)
    else:
        payload = {"version": FORMAT_VERSION, "root": root, "files": files}
    try:
        fresh = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        if fresh and os.path.basename(directory) == CACHE_DIR_NAME:
            with open(os.path.join(directory, ".gitignore"), "w", encoding="utf-8") as handle:
                handle.write("# created by kvguard lint\n*\n")
        descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".index-", suffix=".tmp")
        with os.fdopen(descriptor, "w", encoding="utf-8", errors="surrogatepass") as handle:
            if merged is not None:
                handle.write("\n".join(merged))
            else:
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
        if stat.st_size > project.MAX_SOURCE_BYTES:
            continue
        relative = path[prefix:]
        stamps[relative] = [stat.st_mtime_ns, stat.st_size]
        listed.append((path, relative))
    paths = []
    for path in _cache_paths(root):
        found = _read_merged(path, stamps)
        if found is not None:
            return found
        paths.append(path)
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
        stamps = {relative: entry[:2] for relative, entry in files.items()}
        _write_cache(written, root, files, list(_merged_lines(root, stamps, index)))
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
