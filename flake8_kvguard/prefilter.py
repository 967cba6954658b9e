"""A textual test that skips files which cannot hold a finding, before parsing.

Most files never call a free-like function and never hash tensor elements. flake8
runs every installed plugin on every file whatever `--select` says, so the checker
reads each file's text with a few regular expressions and parses only the rest.

The test is exact with respect to the rules, not a guess: every finding needs
- a free-like call with an argument, or a free-like `def` with a parameter
  (KVG101-104, KVG106, KVG201, KVG202), or
- a hash-based container or de-duplication made by a call or a comprehension
  (set(), dict(), Counter(), defaultdict(), dict.fromkeys(), {... for ...}) and
  some source of tensors (torch,
  a Tensor annotation, a torch-only method such as .cuda(), a configured name, or a
  function the project index knows returns a tensor) (KVG105).
"""

from __future__ import annotations

import re

from . import torch_api

_CALL = re.compile(r"\s*\(")
_EMPTY_CALL = re.compile(r"\s*\)")
_NO_ARGUMENT_DEF = re.compile(r"\s*(?:(?:self|cls)\s*,?\s*)?\)")
_DEF_BEFORE = re.compile(r"def\s+$")
_WORD_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")

# Regular expressions that start with a literal are scanned fast by `re`; a leading
# \b or look-behind makes it try every position (about 5x slower on real code). So
# the patterns find candidates and `_starts_word` checks what precedes them.
# These two are compiled where used (re caches them): a run whose files have no
# container call never needs them, and flake8 imports this module on every run.
_COMPREHENSION = r"\{(?:[^{}]|\{[^{}]*\})*?\bfor\b"
_TENSOR_WORDS = r"torch|Tensor|\.(?:%s)\s*\(" % "|".join(sorted(torch_api.TORCH_ONLY_METHODS))
_WORD = re.compile(r"[A-Za-z_]\w*")
# A parameter or variable annotated as a set: membership in it hashes (KVG105).
_SET_ANNOTATION = r":\s*(?:typing\.|t\.)?(?:[Ss]et|FrozenSet|frozenset|AbstractSet|MutableSet)\b"


def spellings(text: str) -> tuple:
    """The text, and where it has non-ASCII characters its NFKC form too: Python reads
    identifiers NFKC-normalized (`allocator.\uff46ree(ids)` calls `free`, `\uff53et(t)`
    is `set(t)`), the patterns read what is written. ASCII text (`isascii()` is a flag
    read) is its own form."""
    if text.isascii():
        return (text,)
    if _last[0] is text:  # the filter and the slicing ask about one file in turn
        return _last[1]
    import unicodedata  # for non-ASCII text only

    normal = unicodedata.normalize("NFKC", text)
    forms = (text,) if normal == text else (text, normal)
    _last[:] = [text, forms]
    return forms


_last: list = [None, ()]


def _after(text: str, start: int, dot_ok: bool) -> bool:
    """Whether text[start:] begins a name: not the tail of another name, and not an
    attribute unless `dot_ok` (`collections.Counter(` is, `x.set(` is not)."""
    if start == 0:
        return True
    before = text[start - 1]
    return before not in _WORD_CHARS and (dot_ok or before != ".")


def has_container(text: str) -> bool:
    return any(_has_container(form) for form in spellings(text))


def _has_container(text: str) -> bool:
    # str.find for each word, as in Prefilter._has_free_call (one alternation: 5x slower)
    find = text.find
    for word, prefix in (("set", "frozen"), ("dict", "default")):
        start = find(word)
        while start >= 0:
            if _CALL.match(text, start + len(word)) is not None:
                if _after(text, start, dot_ok=False):
                    return True
                if text.startswith(prefix, start - len(prefix)) and _after(
                    text, start - len(prefix), dot_ok=True
                ):
                    return True
            start = find(word, start + 1)
    for word in ("fromkeys", "Counter", "OrderedDict"):
        start = find(word)
        while start >= 0:
            if _after(text, start, dot_ok=True):
                return True
            start = find(word, start + 1)
    if re.search(_COMPREHENSION, text) is not None:
        return True
    return re.search(_SET_ANNOTATION, text) is not None


class Prefilter:
    def __init__(self, config):
        self._names = tuple(sorted(config.free_names))
        self._configured = frozenset(name.rpartition(".")[2] for name in config.tensor_functions)
        self._last = (None, False)  # the last text has_free_call answered, and its answer

    def has_free_call(self, text: str) -> bool:
        """A call to a free-like name with an argument, or a def of one taking some."""
        last, answer = self._last
        if last is not text:  # the plugin asks, then the engine asks again of the same text
            answer = any(self._has_free_call(form) for form in spellings(text))
            self._last = (text, answer)
        return answer

    def _has_free_call(self, text: str) -> bool:
        # str.find for each name runs at memory speed; one pattern alternating the names
        # ran ten times slower, on every file flake8 checks.
        find = text.find
        for name in self._names:
            start = find(name)
            while start >= 0:
                if self._is_free_call(text, start, start + len(name)):
                    return True
                start = find(name, start + 1)
        return False

    @staticmethod
    def _is_free_call(text: str, start: int, end: int) -> bool:
        """Whether the name at text[start:end] is called with an argument, or is a def
        taking one."""
        if start and text[start - 1] in _WORD_CHARS:
            return False  # `my_free(`: another name
        call = _CALL.match(text, end)
        if call is None:
            return False  # `free_blocks` for `free`, or no call
        end = call.end()
        if _EMPTY_CALL.match(text, end):
            return False
        line_start = text.rfind("\n", 0, start) + 1
        return not (
            _DEF_BEFORE.search(text, line_start, start) and _NO_ARGUMENT_DEF.match(text, end)
        )

    def has_tensor_hashing(self, text: str, index) -> bool:
        forms = spellings(text)
        return any(self._has_tensor_hashing(form, index) for form in forms)

    def _has_tensor_hashing(self, text: str, index) -> bool:
        if not _has_container(text):
            return False
        if re.search(_TENSOR_WORDS, text):
            return True
        words = set(_WORD.findall(text))
        if words & self._configured:
            return True
        index = index() if callable(index) else index
        return any(word in index.returns for word in words)

    def may_hold_findings(self, text: str, index) -> bool:
        """`index` is the project index, or a function that loads it (only called
        when the answer depends on it)."""
        return self.has_free_call(text) or self.has_tensor_hashing(text, index)


_prefilters: dict = {}
_effective: dict = {}


def effective_config(config, index):
    """`config` with the project's release methods found by behaviour (the index's
    effects.py summaries) added as detected free-like names; once per index."""
    key = (config, id(index))
    found = _effective.get(key)
    if found is None or found[0] is not index:
        names = index.release_names()
        found = (index, config.with_detected(names) if names else config)
        _effective[key] = found
    return found[1]


def has_detected_call(text: str, config) -> bool:
    """A call or def (with an argument) of a detected release method's name."""
    if not config.detected:
        return False
    from .config import Config

    return prefilter_for(Config(free_names=config.detected)).has_free_call(text)


def prefilter_for(config) -> Prefilter:
    """The pre-filter for a configuration (compiled once per process)."""
    key = config.key()
    found = _prefilters.get(key)
    if found is None:
        found = Prefilter(config)
        _prefilters[key] = found
    return found
