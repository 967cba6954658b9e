"""Finding and opening staging's files as a fleet leaves them: rotated, compressed, many hosts.

logrotate renames ``kvguard-4242.jsonl`` to ``kvguard-4242.jsonl.1`` (then ``.2.gz``, ...), or
to ``kvguard-4242.jsonl-20261201`` with ``dateext``; a shipper may gzip the lot. One process's
records then span several files: its ``start`` line in the oldest, its ``stats`` lines in the
newest. ``collect_files`` orders each such set oldest first, so the readers can follow one
process from file to file, and ``rotation_set`` names the set a file belongs to.
"""

from __future__ import annotations

import gzip
import os
import re
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


def collect_files(paths) -> list:
    """The log files under each directory (recursively: names as ``DESCRIPTION``) and each file
    given (any name), once each; each rotation set oldest first, sets in path order. A path that
    does not exist is a ``ValueError``."""
    found, seen = [], set()
    for path in paths:
        if os.path.isdir(path):
            candidates = []
            for root, _dirs, files in os.walk(path):
                candidates += [os.path.join(root, f) for f in files
                               if rotation_set(f) is not None]
        elif os.path.isfile(path):
            candidates = [path]
        else:
            raise ValueError(f"no such file or directory: {path}")
        for f in candidates:
            real = os.path.realpath(f)
            if real not in seen:
                seen.add(real)
                found.append(f)

    def order(f):
        stem, age = rotation_set(f) or (f, 0)
        return stem, -age
    return sorted(found, key=order)


def open_log(path: str):
    """A text stream of the file's lines, gunzipped when it is gzip data (by content, so a
    compressed file with any name is read too). Undecodable bytes become U+FFFD."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


_SPAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$", re.I)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """``--since``: seconds since the epoch from an ISO time (``2026-12-01T09:30``, local time
    unless it carries ``Z`` or an offset) or a span back from now (``90s``, ``30m``, ``2h``,
    ``7d``, ``1w``). Anything else is a ``ValueError`` saying what is accepted."""
    now = time.time() if now is None else now
    m = _SPAN.match(text)
    if m is not None:
        return now - float(m[1]) * _SECONDS[m[2].lower()]
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {text!r}: expected an ISO time (2026-12-01T09:30, or "
                         "...T09:30Z for UTC) or a span back from now (90s, 30m, 2h, 7d, "
                         "1w)") from None
    return when.timestamp()
