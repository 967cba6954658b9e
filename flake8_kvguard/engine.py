"""The one analysis behind both faces: source in, findings out.

flake8 and `kvguard lint` both call `lint_source`; they differ only in how they read
files, filter by code and `# noqa`, and print.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
import warnings

from . import analysis, depth, fuzzcmd, nodes, positions, slicing
from .collector import gc_paused
from .prefilter import effective_config, has_detected_call, prefilter_for
from .rules import HOOKS

MAX_SOURCE = 20_000_000  # characters; bigger files are generated data, not code

# Not a rule: the one line that says a file was not analyzed (see depth.py).
SKIPPED = "KVG000"
SKIPPED_MESSAGE = (
    "KVG000 file not checked: {reason} on line {line}, deeper than kvguard's parser "
    "handles safely; no KVG rule ran on this file"
)


class Finding:
    """One finding: 1-based line, 0-based column (flake8's convention)."""

    __slots__ = ("code", "line", "col", "message", "fix")

    def __init__(self, code, line, col, message, fix=None):
        self.code = code
        self.line = line
        self.col = col
        self.message = message  # starts with the code, as flake8 prints it
        self.fix = fix  # (old node, rewrites.Rewrite) or None

    def key(self):
        return (self.line, self.col, self.code, self.message)

    def __repr__(self):
        return f"Finding({self.line}:{self.col} {self.message!r})"


class _Raw:
    __slots__ = ("code", "node", "message", "fix", "related")

    def __init__(self, code, node, message, fix, related):
        self.code = code
        self.node = node
        self.message = message
        self.fix = fix
        self.related = related


def parse(source, *, scanned=False, tree=None, body=None):
    """The module (nodes.py: `ast`, in the shape the rules read), or None for anything
    that is not valid Python, or that is nested too deep to analyze safely (depth.py;
    `scanned` when the caller has checked that already). `tree` is the source's `ast`
    when the caller has it (flake8 does); `body`, a subset of its top-level statements
    to analyze instead of all of them (slicing.py)."""
    if len(source) > (MAX_SOURCE * 4 if isinstance(source, bytes) else MAX_SOURCE):
        return None
    if not scanned:
        text = source.decode("latin-1") if isinstance(source, bytes) else source
        if depth.too_deep(text) is not None:
            return None
    text = decode(source)
    if text is None:
        return None
    with deep_recursion(), gc_paused():
        if tree is None:
            try:
                tree = _parse_quietly(text)
            except SyntaxError:
                if body is not None:
                    return None
                from . import newsyntax  # syntax newer than this Python's (imports libcst)

                return newsyntax.parse(text)
            except (ValueError, RecursionError, MemoryError, UnicodeError):
                return None
        try:
            return nodes.from_ast(tree, text, body)
        except (RecursionError, MemoryError):
            return None


def decode(source):
    """The text of a file's bytes, by its PEP 263 declaration (or BOM); None where
    it cannot be decoded."""
    if isinstance(source, str):
        return source
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
        return source.decode(encoding)
    except (SyntaxError, UnicodeError, LookupError):
        return None


class deep_recursion:
    """Converting a tree (nodes.py), generating code and transforming it with libcst
    (`--fix`) recurse a few frames per nesting level: raise the recursion limit while
    working on one module (Python 3.11 recursion between Python functions does not
    grow the C stack)."""

    LIMIT = 20_000

    def __enter__(self):
        self.previous = sys.getrecursionlimit()
        if self.previous < self.LIMIT:
            sys.setrecursionlimit(self.LIMIT)
        return self

    def __exit__(self, *exc):
        sys.setrecursionlimit(self.previous)
        return False


def analyze(module, config, index, source=None, path=None):
    """Findings (with positions) for a parsed module; `source` is the text the file's
    own index is read from, when the caller has it (else the module's); `path`, the
    file's, names its module in the `kvguard fuzz` command of a KVG2xx finding."""
    from .index import LocalIndex

    if source is None or isinstance(source, bytes):
        source = module.code
    with deep_recursion(), gc_paused():
        local = LocalIndex(index, source)
        return _analyze(
            module, config.with_detected(local.release_names()), local, fuzzcmd.module_of(path)
        )


def _analyze(module, config, index, fuzz_module=None):
    raw = []

    def report(code, node, message, fix=None, related=None):
        raw.append(_Raw(code, node, message, fix, related))

    analysis.Analysis(module, config, index, HOOKS, report, skip_quiet=True).run()
    if not raw:
        return []
    nodes = [r.node for r in raw] + [r.related for r in raw if r.related is not None]
    found = positions.positions(module, nodes)
    findings = {}
    for r in raw:
        line, col = found.get(id(r.node), (1, 0))
        message = r.message
        if r.related is not None:
            message = message.replace("{related_line}", str(found.get(id(r.related), (1, 0))[0]))
        message = fuzzcmd.resolve(message, fuzz_module)
        finding = Finding(r.code, line, col, message, r.fix)
        findings.setdefault((line, col, r.code), finding)
    return sorted(findings.values(), key=Finding.key)


def lint_source(source, config, index, *, use_prefilter=True, tree=None, path=None):
    """Findings for one file's source (str, or bytes with its PEP 263 encoding).

    `index` is the project index or a function returning it, called only for files
    that pass the pre-filter; `tree` is the stdlib ast of the source when the caller
    has one (flake8 does). Anything Python cannot parse yields no finding (flake8
    reports it as E999); valid Python nested too deep to parse safely yields the one
    KVG000 line that says so."""
    text = source if isinstance(source, str) else source.decode("latin-1")
    kvg105_only = False  # no free-like call: only KVG105 can be found
    if use_prefilter:
        prefilter = prefilter_for(config)
        if not prefilter.has_free_call(text):
            if callable(index):
                index = index()
            config = effective_config(config, index)
            if not has_detected_call(text, config):
                if not prefilter.has_tensor_hashing(text, index):
                    return []
                kvg105_only = True
    if tree is None and isinstance(source, str):
        tree = _ast_of(source)
    body = None
    if kvg105_only and tree is not None and isinstance(source, str):
        reduced = slicing.reduce_tree(source, tree)
        if reduced is not None:
            source, body = reduced
    deep = depth.too_deep(text, tree=tree)
    if deep is not None:
        return _skipped(text, deep, tree)
    module = parse(source if body is None else text, scanned=True, tree=tree, body=body)
    if module is None:
        return []
    if callable(index):
        index = index()
    try:
        return analyze(module, config, index, source, path)
    except RecursionError:
        return []


def _ast_of(source):
    """Python's tree of `source`, or None where Python cannot build it (then the
    depth scan and parse() say why)."""
    try:
        return _parse_quietly(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _parse_quietly(text):
    """ast.parse without the warnings Python's compiler gives about the code (an invalid
    escape sequence): they are the file's business, not the checker's output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(text)


def _skipped(text, deep, tree):
    """The KVG000 finding for a file too deep to parse, unless it is not Python at all
    (flake8 reports that as E999, and so the file gets one line either way)."""
    line, reason = deep
    if tree is None:
        try:
            ast.parse(text)
        except SyntaxError:
            return []
        except (RecursionError, MemoryError):
            pass  # Python itself gives up on it: still code, too deep to check
    message = SKIPPED_MESSAGE.format(reason=reason, line=line)
    return [Finding(SKIPPED, line, 0, message)]


def selected(code: str, select) -> bool:
    return select is None or any(code.startswith(prefix) for prefix in select)


_NOQA = re.compile(r"# noqa(?::[\s]?(?P<codes>([A-Z]+[0-9]+(?:[,\s]+)?)+))?", re.IGNORECASE)
_NOQA_FILE = re.compile(r"\s*# flake8[:=]\s*noqa", re.I)


def file_is_noqa(lines) -> bool:
    """`# flake8: noqa` at the start of a line skips a file, as in flake8."""
    return any(_NOQA_FILE.match(line) for line in lines)


def noqa_lines(source: str) -> dict:
    """{line number: text searched for `# noqa`}, as flake8 maps it: a noqa comment
    covers every line of a multi-line string it ends."""
    import io
    import tokenize

    lines = source.splitlines(True)
    mapping = {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return {number: line for number, line in enumerate(lines, 1)}
    start = end = None
    for token in tokens:
        if token.type in (tokenize.ENDMARKER, tokenize.DEDENT):
            continue
        start = token.start[0] if start is None else min(start, token.start[0])
        end = token.end[0] if end is None else max(end, token.end[0])
        if token.type in (tokenize.NL, tokenize.NEWLINE):
            joined = "".join(lines[start - 1 : end])
            for number in range(start, end + 1):
                mapping[number] = joined
            start = end = None
    return mapping


def suppressed(finding, mapping) -> bool:
    line = mapping.get(finding.line)
    if line is None:
        return False
    match = _NOQA.search(line)
    if match is None:
        return False
    codes = match.group("codes")
    if not codes:
        return True
    wanted = tuple(code for code in re.split(r"[,\s]+", codes) if code)
    return finding.code.startswith(wanted)
