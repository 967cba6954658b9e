"""Settings of the checker, read the same way by both faces.

Three lists, each extending the built-in one:

- free-names: names of the calls that take block ids back (`free`, `release`, ...);
- tensor-functions: functions or methods whose result is a torch tensor, beyond
  what annotations tell (a dotted name matches the end of a call: `pool.ids`);
- tensor-native: free-like callees that take 1-D integer tensors natively, so
  KVG101 stays quiet for them (`token_to_kv_pool_allocator.free`).

flake8 reads them as `kvguard-free-names` etc. from its own configuration; both faces
also read `[tool.kvguard]` in pyproject.toml and the `[flake8]` section of
setup.cfg / tox.ini / .flake8 at the project root, so `flake8 --select KVG` and
`kvguard lint` agree on one project.
"""

from __future__ import annotations

import configparser
import os
import re

DEFAULT_FREE_NAMES = frozenset(
    ("free", "free_blocks", "free_block", "release", "release_blocks", "deallocate")
)

# name in pyproject / flake8 config -> Config field
SETTINGS = {
    "free-names": "free_names",
    "tensor-functions": "tensor_functions",
    "tensor-native": "tensor_native",
}
FLAKE8_PREFIX = "kvguard-"
FLAKE8_SECTIONS = (("setup.cfg", "flake8"), ("tox.ini", "flake8"), (".flake8", "flake8"))

_NAME = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"  # compiled when a name is read


class ConfigError(Exception):
    """A setting that cannot be used; the message is one line for the user."""


class Config:
    """One project's settings: immutable, equal and hashable by value. A plain class
    rather than a dataclass: flake8 imports this module on every run, and a dataclass
    compiles its generated methods at import."""

    __slots__ = ("free_names", "tensor_functions", "tensor_native", "detected")

    def __init__(
        self,
        free_names: frozenset = DEFAULT_FREE_NAMES,
        tensor_functions: frozenset = frozenset(),
        tensor_native: frozenset = frozenset(),
        detected: frozenset = frozenset(),
    ):
        set_field = object.__setattr__
        set_field(self, "free_names", free_names)
        set_field(self, "tensor_functions", tensor_functions)
        set_field(self, "tensor_native", tensor_native)
        # Names of methods that release ids by what their bodies do (effects.py), not
        # configured: part of free_names, but a call or def of one counts only where
        # it reaches such a method.
        set_field(self, "detected", detected)

    def __setattr__(self, name, value):
        raise AttributeError(f"Config is immutable: cannot set {name!r}")

    def __delattr__(self, name):
        raise AttributeError(f"Config is immutable: cannot delete {name!r}")

    def _fields(self) -> tuple:
        return (self.free_names, self.tensor_functions, self.tensor_native, self.detected)

    def __eq__(self, other):
        if type(other) is not Config:
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self):
        return hash(self._fields())

    def __repr__(self):
        return (
            f"Config(free_names={self.free_names!r}, tensor_functions="
            f"{self.tensor_functions!r}, tensor_native={self.tensor_native!r}, "
            f"detected={self.detected!r})"
        )

    def merged(self, other: "Config") -> "Config":
        return Config(
            free_names=self.free_names | other.free_names,
            tensor_functions=self.tensor_functions | other.tensor_functions,
            tensor_native=self.tensor_native | other.tensor_native,
            detected=(self.detected | other.detected)
            - (self.free_names - self.detected)
            - (other.free_names - other.detected),
        )

    def with_detected(self, names) -> "Config":
        """These settings, with the project's release methods found by behaviour added
        to the free-like names (configured names stay configured)."""
        extra = frozenset(names) - self.free_names
        if not extra:
            return self
        return Config(
            self.free_names | extra,
            self.tensor_functions,
            self.tensor_native,
            self.detected | extra,
        )

    def key(self) -> tuple:
        return (
            tuple(sorted(self.free_names)),
            tuple(sorted(self.tensor_functions)),
            tuple(sorted(self.tensor_native)),
            tuple(sorted(self.detected)),
        )


DEFAULT = Config()


def split_names(value, where: str) -> frozenset:
    """A list of names from a TOML list or a comma/space separated string."""
    if isinstance(value, str):
        names = [part for part in re.split(r"[\s,]+", value) if part]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        names = [v.strip() for v in value if v.strip()]
    else:
        raise ConfigError(f"{where}: expected a list of names, got {value!r}")
    for name in names:
        if not re.match(_NAME, name):
            raise ConfigError(f"{where}: {name!r} is not a (dotted) Python name")
    return frozenset(names)


def unknown_setting(key: str, normalized: str, where: str) -> str:
    """The warning for a key that looks like ours but is no setting (a typo, most likely)."""
    import difflib  # only for this warning: flake8 imports this module on every run

    close = difflib.get_close_matches(normalized, SETTINGS, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"{where}: unknown setting {key!r} is ignored ({hint}known: "
            f"{', '.join(SETTINGS)})")


def from_mapping(values: dict, where: str, *, prefix: str = "", unknown: list | None = None
                 ) -> Config:
    """Config from the entries of one table/section that belong to us; keys that belong to us
    but name no setting are described in ``unknown`` when a list is given."""
    fields = {}
    for key, value in values.items():
        normalized = key.replace("_", "-")
        if prefix:
            if not normalized.startswith(prefix):
                continue
            normalized = normalized[len(prefix) :]
        field = SETTINGS.get(normalized)
        if field is not None:
            fields[field] = split_names(value, f"{where}: {key}")
        elif unknown is not None:
            unknown.append(unknown_setting(key, normalized, where))
    config = Config(**fields)
    # Settings extend the defaults, they never replace them.
    return DEFAULT.merged(config)


def _read_pyproject(path: str, unknown: list) -> Config:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            return DEFAULT
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    table = data.get("tool", {}).get("kvguard", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.kvguard] must be a table")
    return from_mapping(table, f"{path} [tool.kvguard]", unknown=unknown)


def _read_flake8_section(path: str, section: str, unknown: list) -> Config:
    parser = configparser.RawConfigParser()
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"{path}: cannot parse: {str(exc).splitlines()[0]}") from None
    if not parser.has_section(section):
        return DEFAULT
    return from_mapping(dict(parser.items(section)), f"{path} [{section}]", prefix=FLAKE8_PREFIX,
                        unknown=unknown)


_project_configs: dict = {}
_unknown: dict = {}  # root -> warnings about unknown settings, until someone tells the user


def project_config(root: str) -> Config:
    """The settings found in the configuration files at a project root (cached)."""
    config = _project_configs.get(root)
    if config is None:
        config = DEFAULT
        unknown: list = []
        pyproject = os.path.join(root, "pyproject.toml")
        if os.path.isfile(pyproject):
            config = config.merged(_read_pyproject(pyproject, unknown))
        for filename, section in FLAKE8_SECTIONS:
            path = os.path.join(root, filename)
            if os.path.isfile(path):
                config = config.merged(_read_flake8_section(path, section, unknown))
        _project_configs[root] = config
        _unknown[root] = unknown
    return config


def take_warnings(root: str) -> list:
    """The warnings about the project's configuration not yet shown (each once per process):
    unknown keys in ``[tool.kvguard]`` or ``kvguard-*`` keys of a flake8 section."""
    return _unknown.pop(root, [])
