"""The flake8 face: `flake8 --select KVG`.

flake8 picks a plugin's type from the names of its `__init__` parameters: `tree`
makes this an AST plugin: the analysis reads the `ast` tree flake8 has already
parsed (converted by nodes.py), so a file is never parsed twice, and `lines` hands
over the source flake8 already read and decoded. Importing this module is cheap: the
rules load only for a file that passes the textual pre-filter, so flake8 pays next
to nothing on files that cannot hold a finding, whatever `--select` says; libcst is
never imported.
"""

from __future__ import annotations

import logging
import os

from . import __version__, config as config_module, project
from .prefilter import effective_config, has_detected_call, prefilter_for

LOG = logging.getLogger("flake8.kvguard")

OPTIONS = (
    ("free-names", "Extra names of calls that free block ids (free, release, ... are built in)."),
    (
        "tensor-functions",
        "Functions or methods that return torch tensors (dotted names match the end of a call).",
    ),
    (
        "tensor-native",
        "Free-like callees that take 1-D integer tensors natively (no KVG101 for them).",
    ),
)


class KVGChecker:
    name = "flake8-kvguard"
    version = __version__

    # Settings from flake8's own options; merged with pyproject's [tool.kvguard].
    flake8_config = config_module.DEFAULT
    _configs: dict = {}
    _warned: set = set()

    def __init__(self, tree, lines, filename="(none)"):
        self.tree = tree
        self.lines = lines
        self.filename = filename

    @classmethod
    def add_options(cls, option_manager) -> None:
        for name, help_text in OPTIONS:
            option_manager.add_option(
                f"--{config_module.FLAKE8_PREFIX}{name}",
                default=[],
                comma_separated_list=True,
                parse_from_config=True,
                help=f"kvguard: {help_text}",
            )

    @classmethod
    def parse_options(cls, options) -> None:
        values = {}
        for name, _ in OPTIONS:
            values[name] = list(
                getattr(
                    options,
                    config_module.FLAKE8_PREFIX.replace("-", "_") + name.replace("-", "_"),
                    None,
                )
                or []
            )
        try:
            cls.flake8_config = config_module.from_mapping(values, "flake8 options")
        except config_module.ConfigError as exc:
            LOG.warning("kvguard: %s; using the built-in settings", exc)
            cls.flake8_config = config_module.DEFAULT
        cls._configs = {}

    _roots: dict = {}

    def _root(self) -> str:
        if self.filename in ("stdin", "-", "(none)", None):
            return os.getcwd()
        directory = os.path.dirname(self.filename)
        root = self._roots.get(directory)
        if root is None:
            root = (
                project.find_root(self.filename) if os.path.exists(self.filename) else os.getcwd()
            )
            self._roots[directory] = root
        return root

    def _config(self, root):
        found = self._configs.get(root)
        if found is None:
            try:
                found = self.flake8_config.merged(config_module.project_config(root))
            except config_module.ConfigError as exc:
                if root not in self._warned:
                    self._warned.add(root)
                    LOG.warning("kvguard: %s; using the flake8 options only", exc)
                found = self.flake8_config
            for message in config_module.take_warnings(root):
                LOG.warning("kvguard: %s", message)
            self._configs[root] = found
        return found

    def run(self):
        text = "".join(self.lines)
        root = self._root()
        config = self._config(root)
        prefilter = prefilter_for(config)

        def load_index():
            from . import index

            return index.for_root(root)

        if not prefilter.has_free_call(text):
            index = load_index()
            if not has_detected_call(text, effective_config(config, index)):
                if not prefilter.has_tensor_hashing(text, index):
                    return
        from . import engine

        try:
            findings = engine.lint_source(
                text, config, load_index, tree=self.tree, path=self.filename
            )
        except Exception:  # never take flake8's whole run down with us
            LOG.warning(
                "kvguard: internal error on %s; please report it", self.filename, exc_info=True
            )
            return
        for finding in findings:
            yield finding.line, finding.col, finding.message, type(self)
