"""``--write-docs``: a benchmark's printed figures become its section of docs/cost.md.

docs/cost.md is the one place the project states what kvguard costs. Each benchmark owns one
section there, between ``<!-- bench: NAME -->`` and ``<!-- /bench: NAME -->``, holding the exact
command, the machine, the date and everything the run printed. A benchmark run with
``--write-docs`` replaces its own section and leaves the rest of the page alone, so a figure is
never retyped by hand and never disagrees with its run:

    python benchmarks/bench_guard.py --write-docs

Every benchmark's entry point is ``sys.exit(results.main(main))``: ``main`` parses its own
arguments (``--write-docs`` removed) and prints as before.
"""

from __future__ import annotations

import datetime
import io
import os
import platform
import re
import shlex
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "cost.md"
FLAG = "--write-docs"


class _Tee(io.TextIOBase):
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def machine() -> str:
    """CPU model and count, OS, Python, torch and CUDA device when loaded: enough to compare."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    parts = [f"{cpu}, {os.cpu_count()} cores", f"{platform.system()} {platform.release()}",
             f"Python {platform.python_version()}"]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
        try:
            if torch.cuda.is_available():
                parts.append(torch.cuda.get_device_name(0))
        except Exception:
            pass
    return "; ".join(parts)


def section(name: str, command: str, output: str, when: str, where: str) -> str:
    return (f"<!-- bench: {name} -->\n"
            f"`{command}`, {when}, on {where}:\n\n"
            f"```text\n{output.rstrip()}\n```\n"
            f"<!-- /bench: {name} -->")


def write(name: str, command: str, output: str, page: Path = PAGE) -> None:
    """Replace ``name``'s section of ``page`` (or append one at its end)."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    new = section(name, command, output, when, machine())
    text = page.read_text(encoding="utf-8")
    pattern = re.compile(rf"<!-- bench: {re.escape(name)} -->.*?<!-- /bench: {re.escape(name)} -->",
                         re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: new, text)
    else:
        text = text.rstrip("\n") + f"\n\n## `{name}`\n\n{new}\n"
    page.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")


def main(run, argv: list | None = None, modes: tuple = ()) -> int:
    """Run a benchmark's ``main``; with ``--write-docs``, also write what it printed. A flag in
    ``modes`` (``--instructions``) measures something else: its run gets a section of its own,
    named ``NAME-instructions``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    record = FLAG in argv
    argv = [a for a in argv if a != FLAG]
    script = Path(sys.argv[0]).name
    name = script.removesuffix(".py") + "".join(
        "-" + mode.lstrip("-") for mode in modes if mode in argv)
    if not record:
        sys.argv[1:] = argv
        return int(run() or 0)
    captured = io.StringIO()
    stdout, sys.stdout = sys.stdout, _Tee(sys.stdout, captured)
    sys.argv[1:] = argv
    try:
        status = int(run() or 0)
    finally:
        sys.stdout = stdout
    if status == 0:
        command = shlex.join(["python", f"benchmarks/{script}", *argv])
        write(name, command, captured.getvalue(), Path(os.environ.get("KVGUARD_COST_PAGE", PAGE)))
        print(f"wrote the {name} section of {os.environ.get('KVGUARD_COST_PAGE', PAGE)}",
              file=sys.stderr)
    return status
