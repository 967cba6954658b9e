"""`kvguard lint PATH... [--fix] [--select CODES] [--format text|json|sarif]`.

The same rules as `flake8 --select KVG`, on the same files, with the same `# noqa`
handling: the two print identical findings. Exit status: 0 clean, 1 findings,
2 a usage or input error (one line on stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import io
import os
import stat
import sys
import tokenize

from . import config as config_module
from . import project

PROG = "kvguard lint"

# flake8's default --exclude, so that both faces check the same files.
FLAKE8_EXCLUDES = (
    ".svn",
    "CVS",
    ".bzr",
    ".hg",
    ".git",
    "__pycache__",
    ".tox",
    ".nox",
    ".eggs",
    ".kvguard_cache",
)


class UsageError(Exception):
    """A mistake on the command line; the message is one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)

    def exit(self, status=0, message=None):
        if message:
            sys.stderr.write(message)
        raise SystemExit(status)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Check Python files for block-id bugs of paged KV-cache allocators "
        "(the KVG rules of flake8-kvguard).",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or directories to check")
    parser.add_argument(
        "--fix", action="store_true", help="apply the behaviour-preserving fixes in place"
    )
    parser.add_argument(
        "--select", metavar="CODES", help="comma-separated codes or prefixes (default: all KVG)"
    )
    parser.add_argument(
        "--format", choices=("text", "json", "sarif"), default="text", help="output format"
    )
    return parser


def _select(value, codes):
    if value is None:
        return None
    wanted = tuple(part.strip().upper() for part in value.split(",") if part.strip())
    if not wanted:
        raise UsageError("--select: no codes given")
    for prefix in wanted:
        if not any(code.startswith(prefix) for code in codes):
            raise UsageError(f"--select: unknown code {prefix!r} (known: {', '.join(codes)})")
    return wanted


def _excluded(name: str) -> bool:
    return name in FLAKE8_EXCLUDES or name.endswith(".egg")


def _files(paths):
    """Every file to check, in a stable order: ``(path, tree)``, where ``tree`` is the directory
    it was found under (None for a file named on the command line)."""
    found = []
    for path in paths:
        if os.path.isdir(path):
            for current, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not _excluded(d))
                for filename in sorted(filenames):
                    if filename.endswith(".py") and not _excluded(filename):
                        found.append((os.path.join(current, filename), path))
        elif os.path.exists(path):
            found.append((path, None))
        else:
            raise UsageError(f"{path}: no such file or directory")
    return found


def _read_source(path, tree):
    """``(bytes, None)``, or ``(None, why it is skipped)``. A source tree is untrusted: only a
    regular file is read (a FIFO would block, a device never end), found under a tree only if
    it lies inside it (a symlink out of the tree is not the tree's), and only up to
    ``project.MAX_SOURCE_BYTES``. Opened without blocking: a FIFO with no writer cannot hang."""
    limit = project.MAX_SOURCE_BYTES
    if tree is not None:
        real, top = os.path.realpath(path), os.path.realpath(tree)
        if os.path.commonpath([real, top]) != top:
            return None, f"skipped: a symlink out of {tree} (to {real})"
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, f"skipped: not a regular file ({_file_kind(info.st_mode)})"
        if info.st_size > limit:
            return None, (f"skipped: {info.st_size:,} bytes, over the {limit:,}-byte limit "
                          "for a source file")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while read
        return None, f"skipped: over the {limit:,}-byte limit for a source file"
    return data, None


def _file_kind(mode) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a file"


def _decode(data: bytes):
    """The text of a file as flake8 reads it (PEP 263, BOM stripped), or None."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        text = data.decode(encoding)
    except (SyntaxError, LookupError, UnicodeDecodeError):
        return None
    if text.startswith("\ufeff"):
        text = text[1:]
    # flake8 reads with universal newlines
    return text.replace("\r\n", "\n").replace("\r", "\n")


class _Run:
    def __init__(self, options, select, out, err):
        from . import engine, index, report
        from .rules import RULES

        fixer = None
        if options.fix:  # the only part that needs libcst (0.2-0.3 s to import)
            from . import fixer
        self.engine, self.fixer, self.index, self.report = engine, fixer, index, report
        self.rules = RULES
        self.options = options
        self.select = select
        self.out, self.err = out, err
        self.failed = False
        self.fixed = 0
        self.findings = []

    def warn(self, message):
        self.err.write(f"{PROG}: {message}\n")

    def check(self, path, tree=None):
        root = project.find_root(path)
        try:
            config = config_module.project_config(root)
        except config_module.ConfigError as exc:
            raise UsageError(str(exc)) from None
        for message in config_module.take_warnings(root):
            self.warn(f"warning: {message}")
        try:
            data, skipped = _read_source(path, tree)
        except OSError as exc:
            self.warn(f"{path}: cannot read: {exc.strerror or exc}")
            self.failed = True
            return
        if skipped is not None:
            self.warn(f"{path}: {skipped}")
            return
        text = _decode(data)
        if text is None:
            self.warn(f"{path}: skipped: cannot decode it as Python source")
            return
        if self.engine.file_is_noqa(text.splitlines()):
            return
        index = lambda: self.index.for_root(root)  # noqa: E731 - loaded only when needed
        findings = self._lint(text, config, index, path)
        if self.options.fix and any(f.fix is not None for f in findings):
            new_data, count = self.fixer.fix_source(data, config, index(), self.select)
            if count and new_data != data:
                try:
                    with open(path, "wb") as handle:
                        handle.write(new_data)
                except OSError as exc:
                    self.warn(f"{path}: cannot write: {exc.strerror or exc}")
                    self.failed = True
                else:
                    self.fixed += count
                    findings = self._lint(_decode(new_data) or "", config, index, path)
        for finding in findings:
            self.findings.append(self.report.Located(path, finding))

    def _lint(self, text, config, index, path=None):
        """Selected, unsuppressed findings. A file that is not valid Python has none
        (flake8 reports it as E999)."""
        engine = self.engine
        found = engine.lint_source(text, config, index, path=path)
        mapping = engine.noqa_lines(text) if found else {}
        return [
            f
            for f in found
            if engine.selected(f.code, self.select) and not engine.suppressed(f, mapping)
        ]

    def finish(self):
        fmt = self.options.format
        if fmt == "text":
            self.out.write(self.report.text(self.findings))
        elif fmt == "json":
            self.out.write(self.report.as_json(self.findings))
        else:
            self.out.write(self.report.sarif(self.findings, self.rules))
        if self.options.fix and self.fixed:
            noun = "fix" if self.fixed == 1 else "fixes"
            self.warn(f"applied {self.fixed} {noun}")
        if self.failed:
            return 2
        return 1 if self.findings else 0


def main(argv=None, *, out=None, err=None) -> int:
    """Run `kvguard lint` with the arguments after `lint`; returns the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        options = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        from .engine import SKIPPED
        from .rules import CODES

        select = _select(options.select, CODES + (SKIPPED,))
        files = _files(options.paths)
        run = _Run(options, select, out, err)
        for path, tree in files:
            run.check(path, tree)
        return run.finish()
    except UsageError as exc:
        err.write(f"{PROG}: error: {exc}\n")
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except KeyboardInterrupt:
        err.write(f"{PROG}: interrupted\n")
        return 130
    except Exception as exc:  # never a traceback: one line, and a way to report it
        err.write(f"{PROG}: internal error: {type(exc).__name__}: {exc} (please report it)\n")
        return 2
