"""Finding and opening staging's files as a fleet leaves them: rotated, compressed, many hosts.

logrotate renames ``kvguard-4242.jsonl`` to ``kvguard-4242.jsonl.1`` (then ``.2.gz``, ...), or
to ``kvguard-4242.jsonl-20261201`` with ``dateext``; a shipper may gzip the lot. One process's
records then span several files: its ``start`` line in the oldest, its ``stats`` lines in the
newest. ``collect_files`` orders each such set oldest first, so the readers can follow one
process from file to file, and ``rotation_set`` names the set a file belongs to.
"""

from __future__ import annotations

import errno
import gzip
import io
import os
import re
import stat
import time
from datetime import datetime

_LOG_NAME = re.compile(r"^(?P<stem>.+\.jsonl)(?:\.(?P<n>\d+)|-(?P<date>\d{8,14}))?(?P<gz>\.gz)?$")

DESCRIPTION = "*.jsonl, *.jsonl.gz, rotated *.jsonl.1, *.jsonl.2.gz, *.jsonl-20261201"
"""The names ``collect_files`` takes from a directory, for messages and help."""


def rotation_set(path: str):
    """``(the path as staging wrote it, age)`` for a log file's name, None for another name.
    Age 0 is the live file; a larger age is older (``.2`` before ``.1``, dates before both)."""
    m = _LOG_NAME.match(os.path.basename(path))
    if m is None:
        return None
    stem = os.path.join(os.path.dirname(path), m["stem"])
    if m["n"] is not None:
        return stem, int(m["n"])
    if m["date"] is not None:  # older than any numbered one, the earliest date oldest
        return stem, (1 << 62) - int(m["date"].ljust(14, "0"))
    return stem, 0


def collect_files(paths, skipped=None) -> list:
    """The log files under each directory (recursively: names as ``DESCRIPTION``) and each file
    given (any name), once each; each rotation set oldest first, sets in path order. A path that
    does not exist is a ``ValueError``. Log directories are untrusted: only regular files are
    taken, and under a directory only those inside it (a symlink out of it is not its file);
    each one left out is appended to ``skipped`` as ``(path, why)``."""
    found, seen = [], set()
    skipped = [] if skipped is None else skipped
    for path in paths:
        if os.path.isdir(path):
            candidates, top = [], os.path.realpath(path)
            for root, _dirs, files in os.walk(path):
                candidates += [os.path.join(root, f) for f in files
                               if rotation_set(f) is not None]
        elif os.path.lexists(path):
            candidates, top = [path], None
        else:
            raise ValueError(f"no such file or directory: {path}")
        for f in candidates:
            real = os.path.realpath(f)
            why = refusal(f, real, top)
            if why is not None:
                skipped.append((f, why))
            elif real not in seen:
                seen.add(real)
                found.append(f)

    def order(f):
        stem, age = rotation_set(f) or (f, 0)
        return stem, -age
    return sorted(found, key=order)


def refusal(path: str, real: str, top: str | None):
    """Why a log file is not read, or None: not a regular file (a FIFO would block the
    reader, a device never end), or a symlink out of the directory it was found under."""
    if top is not None and os.path.commonpath([real, top]) != top:
        return f"skipped: a symlink out of the directory (to {real})"
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"skipped: {exc.strerror or exc}"
    if not stat.S_ISREG(mode):
        return f"skipped: not a regular file ({file_kind(mode)})"
    return None


def file_kind(mode) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a file"


MAX_LINE_CHARS = 4 << 20
"""A longer line is skipped unread (named in the report's problems): a record is a few KiB,
and a 1.5 MB .jsonl.gz can inflate to one 1.2 GB line."""


def open_log(path: str):
    """A text stream of the file's lines, gunzipped when it is gzip data (by content, so a
    compressed file with any name is read too). Undecodable bytes become U+FFFD. Opened
    without blocking and read only if it is a regular file (``OSError`` otherwise): a FIFO
    swapped in after ``collect_files`` looked still cannot hang the reader."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"not a regular file ({file_kind(mode)})")
        raw = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    magic = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    if magic == b"\x1f\x8b":
        inflated = gzip.GzipFile(fileobj=raw, mode="rb")
        inflated.myfileobj = raw  # closed with it, as when gzip opens the file by name
        return io.TextIOWrapper(inflated, encoding="utf-8", errors="replace")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")


def bounded_lines(stream, limit: int = MAX_LINE_CHARS):
    """The stream's lines, each read ``limit`` characters at most: a longer line is read
    through in pieces and given as None (memory stays bounded whatever the file holds)."""
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith("\n"):
            while True:
                rest = stream.readline(limit)
                if not rest or rest.endswith("\n"):
                    break
            yield None
        else:
            yield line


_SPAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$", re.I)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """``--since``: seconds since the epoch from an ISO time (``2026-12-01T09:30``, local time
    unless it carries ``Z`` or an offset) or a span back from now (``90s``, ``30m``, ``2h``,
    ``7d``, ``1w``). Anything else is a ``ValueError`` saying what is accepted."""
    now = time.time() if now is None else now
    m = _SPAN.match(text)
    if m is not None:
        span = float(m[1]) * _SECONDS[m[2].lower()]
        if not span <= now:  # (an overflow to inf too)
            raise ValueError(f"--since {text!r}: that span reaches back before 1970 (the "
                             "epoch): give a shorter span, or a date")
        return now - span
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {text!r}: expected an ISO time (2026-12-01T09:30, or "
                         "...T09:30Z for UTC) or a span back from now (90s, 30m, 2h, 7d, "
                         "1w)") from None
    try:
        stamp = when.timestamp()
        time.localtime(stamp)  # the report prints it: it must be a time this system can show
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"--since {text!r}: a time this system cannot represent") from None
    return stamp
