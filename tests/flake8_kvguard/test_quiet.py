"""analysis/quiet.py: the function bodies the walk leaves alone (and never converts).

Leaving a body alone must never change a finding. Checked three ways:
- the same findings with and without it, on the fixtures, the rules' examples, the
  linter's own source and, where downloaded, vLLM's and SGLang's KV-cache packages
  (and it does leave bodies alone there, unconverted);
- for each test quiet.py makes, a program whose finding depends on it: the finding
  is there, and disappears when that one test is switched off (so each test is
  needed, and these programs would catch a skip that loses a finding);
- the first pass reads the same imports and declared returns from unconverted
  bodies (`FunctionDef.declarations()`) as from converted ones.
"""

from __future__ import annotations

import ast
import os
import textwrap
import zipfile
from pathlib import Path

import pytest

import flake8_kvguard
from flake8_kvguard import config, engine, index, nodes
from flake8_kvguard.analysis import quiet, walk
from flake8_kvguard.rules import HOOKS, RULES

from .helpers import FIXTURES

WIDE = config.Config(
    free_names=config.DEFAULT.free_names
    | frozenset("append add pop remove discard extend put update insert".split()),
    tensor_functions=frozenset(["forward", "get_block_ids"]),
)


def _findings(text, cfg=config.DEFAULT, project_index=index.EMPTY):
    module = engine.parse(text)
    assert module is not None
    found = engine.analyze(module, cfg, project_index, text)
    return [(f.line, f.col, f.message, f.fix is not None) for f in found], module


def _without_skipping(monkeypatch, text, cfg=config.DEFAULT, project_index=index.EMPTY):
    with monkeypatch.context() as patch:
        patch.setattr(quiet, "covers", lambda hooks: False)
        return _findings(text, cfg, project_index)[0]


def _counting(monkeypatch):
    skipped = []
    real = quiet.QuietBodies.skips

    def skips(self, *args):
        skipped.append(real(self, *args))
        return skipped[-1]

    monkeypatch.setattr(quiet.QuietBodies, "skips", skips)
    return skipped


def _unconverted(module):
    """The defs whose bodies were never converted (read without converting them)."""
    count = 0
    stack = list(module.body)
    while stack:
        node = stack.pop()
        if type(node) is nodes.FunctionDef:
            if node._body is None:
                count += 1
                continue
            stack.extend(node._body.body)
            continue
        for name in node._children:
            value = getattr(node, name)
            if type(value) is list:
                stack.extend(v for v in value if isinstance(v, nodes.CSTNode))
            elif isinstance(value, nodes.CSTNode):
                stack.append(value)
    return count


def test_the_reasoning_covers_exactly_the_registered_hooks():
    """A new rule hook must be thought through in quiet.py (its docstring) before
    bodies are left alone with it: until then nothing is skipped."""
    assert quiet.covers(HOOKS)
    assert sum(len(checks) for checks in quiet.REASONED_FOR.values()) == sum(
        len(checks) for checks in HOOKS
    )
    extra = HOOKS._replace(call=HOOKS.call + (lambda call, scope, view: None,))
    assert not quiet.covers(extra)


def _sources():
    sources = {p.relative_to(FIXTURES).as_posix(): p.read_text() for p in FIXTURES.rglob("*.py")}
    package = Path(flake8_kvguard.__file__).parent
    for path in sorted(package.rglob("*.py")):
        sources[f"flake8_kvguard/{path.relative_to(package).as_posix()}"] = path.read_text()
    for rule in RULES:
        for kind in ("BAD", "GOOD"):
            for number, snippet in enumerate(getattr(rule, kind)):
                sources[f"{rule.CODE}-{kind}-{number}"] = snippet
    return sources


SOURCES = _sources()


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_same_findings_without_skipping(name, monkeypatch):
    text = SOURCES[name]
    for cfg in (config.DEFAULT, WIDE):
        assert _findings(text, cfg)[0] == _without_skipping(monkeypatch, text, cfg)


def test_bodies_are_left_alone_and_never_converted(monkeypatch):
    skipped = _counting(monkeypatch)
    unconverted = 0
    for text in SOURCES.values():
        unconverted += _unconverted(_findings(text)[1])
    assert sum(skipped) > 100 and unconverted > 100
    assert not all(skipped)


CACHE = Path(os.environ.get("KVGUARD_ENGINE_CACHE") or "~/.cache/kvguard-engines").expanduser()
# (the files under these prefixes, not in subdirectories when `top` is set; configs)
ENGINE_PACKAGES = {
    "vllm-0.33.0-*.whl": ("vllm/v1/core/", False, (config.DEFAULT, WIDE)),
    "sglang-0.5.23-*.whl": ("sglang/srt/mem_cache/", True, (WIDE,)),
}


@pytest.mark.parametrize("pattern", sorted(ENGINE_PACKAGES))
def test_same_findings_without_skipping_on_engine_code(pattern, monkeypatch):
    wheels = sorted(CACHE.glob(pattern)) if CACHE.is_dir() else []
    if not wheels:
        pytest.skip(f"{pattern} is not in {CACHE} (see test_real_packages.py)")
    prefix, top, configs = ENGINE_PACKAGES[pattern]
    with zipfile.ZipFile(wheels[-1]) as archive:
        texts = {
            name: archive.read(name).decode("utf-8", "replace")
            for name in archive.namelist()
            if name.endswith(".py")
            and name.startswith(prefix)
            and not (top and "/" in name[len(prefix) :])
        }
    project_index = index.ProjectIndex(index.scan_source(text) for text in texts.values())
    skipped = _counting(monkeypatch)
    compared = 0
    for name, text in sorted(texts.items()):
        for cfg in configs:
            found, module = _findings(text, cfg, project_index)
            assert found == _without_skipping(monkeypatch, text, cfg, project_index), name
            compared += len(found)
    assert len(texts) > 10 and compared > 0 and sum(skipped) > 50


# For each test quiet.py makes: a program whose finding needs it, and the switch that
# turns that one test off. Every program's finding is in a def (or depends on one)
# that the other tests alone would let the walk skip.
NEEDED = {
    "a free-like name": (
        """
        import torch
        def release(pool, ids: torch.Tensor):
            pool.free(ids)
        """,
        "KVG101",
        ("_free", None),
    ),
    "a method storing self.<attr>": (
        """
        import torch
        def make_ids() -> torch.Tensor: ...
        class Owner:
            def setup(self):
                self.ids = make_ids()
            def release(self):
                self.pool.free(self.ids)
        """,
        "KVG101",
        ("_stores_attribute", lambda statements, owner: False),
    ),
    "torch or a torch-only method in the text": (
        """
        def unique(block_ids) -> int:
            return len(set(block_ids.cuda()))
        """,
        "KVG105",
        ("_TENSOR_TEXT", "nothing"),
    ),
    "a name imported from torch": (
        """
        from torch import arange as make
        def unique() -> int:
            return len(set(make(4)))
        """,
        "KVG105",
        ("_tensor_words", None),
    ),
    "a function declared to return a tensor": (
        """
        import torch
        def ids() -> torch.Tensor: ...
        def unique() -> int:
            return len(set(ids()))
        """,
        "KVG105",
        ("_returns_words", lambda self: None),
    ),
    "a tensor bound outside the body": (
        """
        import torch
        IDS = torch.arange(4)
        def unique() -> int:
            return len(set(IDS))
        """,
        "KVG105",
        ("tensor scopes", None),
    ),
    "a tensor attribute of the instance": (
        """
        import torch
        class Table:
            def __init__(self):
                self.ids = torch.arange(4)
            def unique(self) -> int:
                return len(set(self.ids))
        """,
        "KVG105",
        ("tensor scopes", None),
    ),
    "a brace (a comprehension)": (
        """
        import torch
        def owners(block_ids: torch.Tensor):
            return {b for b in block_ids}
        """,
        "KVG105",
        ("brace", None),
    ),
    "a container name": (
        """
        import torch
        def unique(block_ids: torch.Tensor) -> int:
            return len(set(block_ids))
        """,
        "KVG105",
        ("_container_words", None),
    ),
    "a name imported as a container": (
        """
        import torch
        from collections import Counter as Tally
        def counts(block_ids: torch.Tensor):
            return Tally(block_ids)
        """,
        "KVG105",
        ("_container_words", None),
    ),
    "a container bound outside the body": (
        """
        import torch
        SEEN = set()
        def known(block_ids: torch.Tensor) -> bool:
            return block_ids[0] in SEEN
        """,
        "KVG105",
        ("container scopes", None),
    ),
    "a container attribute of the instance": (
        """
        import torch
        class Seen:
            def __init__(self):
                self.seen = set()
            def known(self, block_ids: torch.Tensor) -> bool:
                return block_ids[0] in self.seen
        """,
        "KVG105",
        ("container scopes", None),
    ),
    "an import in a body left alone": (
        """
        def setup():
            import torch as th
        def unique() -> int:
            return len(set(th.arange(4)))
        """,
        "KVG105",
        ("declarations", lambda self: []),
    ),
    "a declared return in a body left alone": (
        """
        import torch
        def setup():
            def ids() -> torch.Tensor: ...
        def unique() -> int:
            return len(set(ids()))
        """,
        "KVG105",
        ("declarations", lambda self: []),
    ),
}


def _switch_off(patch, what, replacement):
    """Turn one of quiet.py's tests off (or the first pass's reading of bodies)."""
    if what == "declarations":
        patch.setattr(nodes.FunctionDef, "declarations", replacement)
    elif what == "_stores_attribute":
        patch.setattr(quiet, what, replacement)
    elif what == "_returns_words":
        patch.setattr(quiet.QuietBodies, what, replacement)
    elif what == "_TENSOR_TEXT":
        patch.setattr(quiet, what, quiet.re.compile(rb"\A\b\B"))  # matches nothing
    elif what in ("tensor scopes", "container scopes"):
        real = quiet._reaches
        off = quiet._TENSOR_KINDS if what == "tensor scopes" else (quiet.SET, quiet.DICT)
        patch.setattr(
            quiet,
            "_reaches",
            lambda env, attrs, kinds, made: False if kinds == off else real(env, attrs, kinds, made),
        )
    elif what == "brace":
        real_prepare = quiet.QuietBodies._prepare

        def prepare(self):  # a text without braces, same length and lines
            real_prepare(self)
            self._data = self._data.replace(b"{", b" ").replace(b"}", b" ")

        patch.setattr(quiet.QuietBodies, "_prepare", prepare)
    else:
        real_prepare = quiet.QuietBodies._prepare

        def prepare(self):
            real_prepare(self)
            setattr(self, what, replacement)

        patch.setattr(quiet.QuietBodies, "_prepare", prepare)


@pytest.mark.parametrize("case", sorted(NEEDED))
def test_each_test_of_quiet_is_needed(case, monkeypatch):
    source, code, (what, replacement) = NEEDED[case]
    text = textwrap.dedent(source)
    found = _findings(text)[0]
    assert found == _without_skipping(monkeypatch, text)
    assert code in {message.split()[0] for _, _, message, _ in found}
    with monkeypatch.context() as patch:
        _switch_off(patch, what, replacement)
        assert _findings(text)[0] != found, f"{case}: the finding does not depend on it"


def _first_pass(module):
    analysis = walk.Analysis(module, config.DEFAULT, index.EMPTY, HOOKS, lambda *a, **k: None)
    analysis._prepass(module.body, in_class=False)
    names = analysis.names
    return dict(names.imports), dict(names.local_returns), set(names.local_tensor_params), set(
        names.bound
    )


@pytest.mark.parametrize("name", sorted(n for n in SOURCES if n.endswith(".py")))
def test_the_first_pass_reads_the_same_from_unconverted_bodies(name):
    text = SOURCES[name]
    lazy = engine.parse(text)
    eager = engine.parse(text)
    from flake8_kvguard.cstutil import walk_all

    defs = [node for node in walk_all(eager) if type(node) is nodes.FunctionDef]
    assert all(node._body is not None for node in defs)  # the walk converted them all
    assert _first_pass(lazy) == _first_pass(eager)
    reachable = _reachable_defs(lazy)  # the first pass converted no body
    assert all(node._body is None for node in reachable)


def _reachable_defs(module):
    """The defs reachable without converting a body."""
    found = []
    stack = list(module.body)
    while stack:
        node = stack.pop()
        if type(node) is nodes.FunctionDef:
            found.append(node)
            if node._body is None:
                continue
        for name in node._children:
            value = node._body if name == "body" and type(node) is nodes.FunctionDef else getattr(node, name)
            if type(value) is list:
                stack.extend(v for v in value if isinstance(v, nodes.CSTNode))
            elif isinstance(value, nodes.CSTNode):
                stack.append(value)
    return found


def test_declarations_are_read_without_converting_the_body():
    text = textwrap.dedent(
        """
        class A:
            def f(self, ids):
                if ids:
                    import os
                    def g() -> int: ...
                return [i for i in ids]
        """
    )
    tree = ast.parse(text)
    module = nodes.from_ast(tree, text)
    method = module.body[0].body.body[0]
    assert method._body is None
    found = method.declarations()
    assert [type(node).__name__ for node in found] == ["Import", "FunctionDef"]
    body = method.body
    assert method.declarations() is None
    # The body holds the same declarations, converted again.
    inner = body.body[0].body.body
    assert repr(inner[0].body[0]) == repr(found[0]) and repr(inner[1]) == repr(found[1])
    assert inner[1].name.value == found[1].name.value == "g"


def test_a_comment_full_of_hashes_after_a_dot_is_read_in_linear_time():
    """The torch-only-method test lets comments stand between `.` and the name; a
    pattern that could split a comment at each `#` took exponential time on a line
    of them (an aphrodite-engine file hung the checker). Run in a subprocess so that
    a regression fails here rather than hanging the suite."""
    import subprocess
    import sys

    source = "def f(x):\n    return (x.  #" + "#" * 200 + "\n        items())\n"
    script = (
        "import sys\n"
        "from flake8_kvguard import config, engine, index\n"
        "text = sys.stdin.read()\n"
        "print(len(engine.analyze(engine.parse(text), config.DEFAULT, index.EMPTY, text)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], input=source, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr


# Programs from an adversarial review, each a premise of quiet.py the text alone did not
# hold: their finding was lost while bodies were skipped, and must be found both ways.
REVIEWED = {
    "two outside sets join into a made one": ("""\
        import torch
        S = {0}
        D = {}
        KEYS = D.keys()

        def seen_before(t: torch.Tensor) -> bool:
            return t[0] in (S or KEYS)
        """, "KVG105", config.DEFAULT),
    "one outside keys view joins itself": ("""\
        import torch
        LIMITS = {"a": 1}
        NAMES = LIMITS.keys()

        def known(t: torch.Tensor) -> bool:
            return t[0] in (NAMES or NAMES | NAMES)
        """, "KVG105", config.DEFAULT),
    "an annotated set and a display meet in a conditional": ("""\
        import torch
        from typing import Set
        A: Set[int] = set
        B = {1}

        def f(t: torch.Tensor):
            return t[0] in (A if t else B)
        """, "KVG105", config.DEFAULT),
    "a configured tensor function imported under another name": ("""\
        from mypkg import get_ids as g

        def unique_blocks(seq) -> int:
            return len(set(g(seq)))
        """, "KVG105", config.Config(tensor_functions=frozenset(["mypkg.get_ids"]))),
    "a name Python reads NFKC-normalized": ("""\
        def abort(allocator, ids):
            allocator.\uff46ree(ids)
            allocator.\uff46ree(ids)
        """, "KVG104", config.DEFAULT),
    "a tensor-returning function named with a non-ASCII letter": ("""\
        import torch

        def \u00f1ids() -> torch.Tensor:
            return torch.arange(4)

        def unique_blocks() -> int:
            return len(set(\u00f1ids()))
        """, "KVG105", config.DEFAULT),
    "an escaped string annotation": ("""\
        def unique_blocks(t) -> int:
            ids: "\\x54ensor" = t
            return len(set(ids))
        """, "KVG105", config.DEFAULT),
    "a concatenated string annotation of a nested def": ("""\
        def outer():
            def inner(x: "Ten" "sor"):
                return set(x)
            return inner
        """, "KVG105", config.DEFAULT),
    "a comment between a dot and a torch-only method, CR line ends": (
        "def unique_blocks(t):\r    return len(set((t.  # move it\r        cuda())))\r",
        "KVG105", config.DEFAULT),
}


@pytest.mark.parametrize("case", sorted(REVIEWED))
def test_reviewed_programs_keep_their_finding(case, monkeypatch):
    source, code, cfg = REVIEWED[case]
    text = textwrap.dedent(source)
    found = _findings(text, cfg)[0]
    assert code in {message.split()[0] for _, _, message, _ in found}, found
    assert found == _without_skipping(monkeypatch, text, cfg)


@pytest.mark.parametrize("line_end", ["\n", "\r\n", "\r"])
def test_comment_lines_after_a_dot_are_read_in_linear_time(line_end):
    """Each line end may be read one way only: a CRLF read either as one end or as a CR
    end and a blank took exponential time on a block of comment lines after a `.`."""
    import subprocess
    import sys

    source = line_end.join(["def f(x):", "    return (x."] + ["    #"] * 200 + ["    items())", ""])
    script = (
        "import sys\n"
        "from flake8_kvguard import config, engine, index\n"
        "text = sys.stdin.buffer.read().decode()\n"
        "print(len(engine.analyze(engine.parse(text), config.DEFAULT, index.EMPTY, text)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], input=source.encode(),
                          capture_output=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == b"0", done.stderr
