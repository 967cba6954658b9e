"""The `kvguard fuzz` command that shows an allocator-side finding happen.

A KVG2xx finding says a free method would corrupt its allocator if a bad call came;
`kvguard fuzz package.module.Class` drives the class with such calls and reports the
clause it breaks, with a shrunk call sequence. The command's syntax lives here only:
a rule asks for `suffix(...)`, which leaves the module open (a rule sees a tree, not a
path), and the engine fills it in with `resolve(...)` once it knows the file.
"""

from __future__ import annotations

import os

MODULE = "{fuzz_module}"
UNKNOWN_MODULE = "<module>"

# The fuzzer's clause that shows each rule's hazard (`kvguard fuzz --clause NAME`).
CLAUSES = {
    "KVG201": "duplicate-id",
    "KVG202": "bool-id",
    "KVG203": "duplicate-id",
    "KVG204": "duplicate-id",
    "KVG205": "double-free",
}

# Hazards that need input outside a typed API's declared one (a bool where `int` is
# annotated): the fuzzer feeds those only with --robustness.
OUTSIDE_THE_TYPE = frozenset(("KVG202",))


def command(module: str, cls: str, code: str, method: str = "free") -> str:
    """`kvguard fuzz pkg.mod.Class --clause duplicate-id`; a free method not named
    `free` needs a spec that names it."""
    text = f"kvguard fuzz {module}.{cls} --clause {CLAUSES[code]}"
    if code in OUTSIDE_THE_TYPE:
        text += " --robustness"
    if method != "free":
        text += f" --spec MODULE.SPEC (a kvguard.AllocatorSpec with free={method!r})"
    return text


def suffix(cls: str, code: str, method: str) -> str:
    """The end of a KVG2xx message, with the module left for `resolve`."""
    return "; to see it happen: " + command(MODULE, cls, code, method)


def for_method(method, code: str) -> str:
    """`suffix` for a FreeMethod (rules/contract.py) reported under `code`."""
    return suffix(method.class_info.name, code, method.function.name.value)


def resolve(message: str, module: str | None) -> str:
    return message.replace(MODULE, module or UNKNOWN_MODULE)


def module_of(path: str | None) -> str | None:
    """`pkg.sub.mod` for `.../pkg/sub/mod.py`: the file's name under the outermost
    directory above it that is a package (holds `__init__.py`)."""
    if not path or path in ("-", "stdin", "(none)"):
        return None
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    stem, extension = os.path.splitext(name)
    if extension not in (".py", ".pyi") or not stem.isidentifier():
        return None
    parts = [] if stem == "__init__" else [stem]
    while os.path.isfile(os.path.join(directory, "__init__.py")):
        directory, package = os.path.split(directory)
        if not package.isidentifier():
            break
        parts.append(package)
    return ".".join(reversed(parts)) or None
