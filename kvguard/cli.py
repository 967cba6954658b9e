"""``kvguard`` / ``python -m kvguard``: one dispatcher, each command in the module that owns it.

Commands are imported only when run, so ``kvguard lint`` never imports torch and ``kvguard demo``
never imports libcst. Mistakes on the command line print one line and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import textwrap

COMMANDS = {
    "demo": ("kvguard.cli", "demo_command", "replay the DeepSpeed seed bug unguarded, then guarded"),
    "lint": ("flake8_kvguard.cli", "main", "static checks (KVG rules) over Python files"),
    "run": ("kvguard.staging", "run_command", "run a command with staging on (KVGUARD=1)"),
    "report": ("kvguard.staging.report", "report_command",
               "merge staging's JSON lines into one summary"),
    "replay": ("kvguard.staging.replay", "replay_command",
               "replay a report's last operations offline"),
    "fuzz": ("kvguard.conformance.fuzz", "fuzz_command",
             "fuzz an allocator class against the allocator contract"),
    "spec": ("kvguard.specreview", "spec_command",
             "suggest a spec for an allocator class (spec suggest pkg.mod.Class), checked"),
}

HANDOFFS = {
    "replay --emit-test": ("kvguard.conformance.replay_emit", "emit_command"),
}
"""A command's part that another face does, by the module and function that do it."""


def hand_off(name: str, *args):
    """Run another face's part of a command: ``kvguard replay --emit-test`` is staging's replay
    handed to the conformance face's regression writer. Faces meet here, in the core, and never
    import each other."""
    module, function = HANDOFFS[name]
    return getattr(importlib.import_module(module), function)(*args)


class UsageError(Exception):
    """A command-line mistake: reported as one line, exit status 2."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with paragraphs kept (a blank line in a description or an epilog starts
    a new one) and words never broken: a dotted class name stays whole on one line."""

    def _fill_text(self, text, width, indent):
        return "\n\n".join(
            textwrap.fill(" ".join(part.split()), width, initial_indent=indent,
                          subsequent_indent=indent, break_long_words=False,
                          break_on_hyphens=False)
            for part in text.split("\n\n") if part.strip())

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False,
                             break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line on stderr rather than usage text plus a line, and
    the help keeps its paragraphs (``HelpFormatter``)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{self.prog}: error: {message}")


def demo_command(argv) -> int:
    parser = Parser(prog="kvguard demo", description=COMMANDS["demo"][2])
    parser.add_argument("--short", action="store_true", help="print SUMMARY lines, not reports")
    args = parser.parse_args(argv)
    from .demo import run
    run(sys.stdout, full_reports=not args.short)
    return 0


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: kvguard COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "kvguard COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run one command; a reader that goes away (``kvguard --help | head``) ends it quietly."""
    try:
        try:
            return _dispatch(argv)
        finally:
            sys.stdout.flush()  # a closed pipe fails here, inside the handler, not at exit
    except BrokenPipeError:
        # Python's documented recipe: point stdout at devnull so that the interpreter's own
        # flush at exit does not raise a second time, and exit like a command killed by SIGPIPE
        # would be judged by a shell pipeline (the status of the last command wins).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _dispatch(argv) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__
        print(f"kvguard {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"kvguard: error: unknown command {name!r} (commands: {', '.join(COMMANDS)})",
              file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[name]
    try:
        handler = getattr(importlib.import_module(module), function)
        return int(handler(rest) or 0)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
