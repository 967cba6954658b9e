"""Violations and their AddressSanitizer-style reports.

A ``Violation`` is cheap to create: stacks stay raw ``(code, line)`` pairs until ``render()`` or
``to_dict()`` resolves them. The rendered text leads with what went wrong on which allocator, then
the stacks that matter (this call, where the block was last freed, where it was allocated), then a
``SUMMARY:`` line a script can grep. ``to_dict()`` carries the same data as JSON.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from . import kinds
from .stacks import Frame, is_internal, resolve

EMPTY = "empty"
"""The op of a flight-recorder entry folding calls with no ids (``allocate(0)``, ``free([])``)."""

MAX_BLOCKS_DETAILED = 4
"""Blocks whose free and allocation stacks a report prints (all ids are listed in the header)."""


def _frames(stack) -> list[Frame]:
    """Resolve raw ``(code, line)`` pairs; already-resolved frames (from JSON) pass through."""
    if not stack:
        return []
    if isinstance(stack[0], Frame):
        return list(stack)
    return resolve(stack)


def user_frames(stack) -> list[Frame]:
    """The stack without kvguard's own frames, which say nothing about the bug."""
    if stack and not isinstance(stack[0], Frame):
        stack = [pair for pair in stack if not is_internal(pair[0])]
    return _frames(stack)


def _frame_from_dict(d: dict) -> Frame:
    return Frame(d["file"], int(d["line"]), d["function"])


def _ids_text(ids, limit: int = 16) -> str:
    ids = list(ids)
    if len(ids) == 1:
        return f"block {ids[0]}"
    shown = ", ".join(map(str, ids[:limit]))
    more = f", ... ({len(ids)} in all)" if len(ids) > limit else ""
    return f"blocks [{shown}{more}]"


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


@dataclass
class BlockHistory:
    """What the ledger knew about one block when the violation happened."""

    block_id: int
    state: str = "unknown"
    """``live``, ``free`` (a tombstone: handed out and freed before) or ``unknown``."""
    refcount: int = 0
    owner: object = None
    last_call: int = 0
    """The guard's call number that last handed the block out (live) or freed it (free)."""
    allocated_at: tuple | list = ()
    freed_at: tuple | list = ()
    holder: object = None
    """The request holding it (live), or that held it last (free); None if not known."""

    def to_dict(self) -> dict:
        return {
            "id": self.block_id,
            "state": self.state,
            "refcount": self.refcount,
            "owner": _jsonable(self.owner),
            "holder": _jsonable(self.holder),
            "last_call": self.last_call,
            "allocated_at": [f.to_dict() for f in user_frames(self.allocated_at)],
            "freed_at": [f.to_dict() for f in user_frames(self.freed_at)],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "BlockHistory":
        return cls(
            d["id"], d.get("state", "unknown"), d.get("refcount", 0), d.get("owner"),
            d.get("last_call", 0),
            [_frame_from_dict(f) for f in d.get("allocated_at", ())],
            [_frame_from_dict(f) for f in d.get("freed_at", ())],
            d.get("holder"),
        )


@dataclass
class Operation:
    """One entry of a guard's flight recorder: a call and the ids it carried."""

    op: str
    ids: tuple
    site: tuple | list = ()
    pool: object = None
    call: int = 0
    count: int = 1
    """The calls it stands for: ``count`` calls with no ids fold into one ``empty`` entry,
    numbered ``call - count + 1`` to ``call``."""

    def to_dict(self) -> dict:
        frames = user_frames(self.site)
        d = {
            "op": self.op,
            "ids": list(self.ids),
            "pool": _jsonable(self.pool),
            "call": self.call,
            "site": frames[0].to_dict() if frames else None,
        }
        if self.op == EMPTY:
            d["count"] = self.count
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Operation":
        site = [_frame_from_dict(d["site"])] if d.get("site") else []
        return cls(d["op"], tuple(d.get("ids", ())), site, d.get("pool"), d.get("call", 0),
                   d.get("count", 1))

    def line(self) -> str:
        """The operation as a report's history shows it."""
        if self.op == EMPTY:
            first = self.call - self.count + 1
            calls = f"#{first}..#{self.call}" if self.count > 1 else f"#{self.call}"
            return f"... {self.count} empty call{'s' if self.count > 1 else ''} ({calls}) ..."
        frames = user_frames(self.site)
        at = f"  at {frames[0]}" if frames else ""
        return f"#{self.call} {self.op} {list(self.ids)}{at}"


@dataclass
class Violation:
    """One misuse, with everything its report needs."""

    kind: str
    block_ids: tuple
    message: str
    allocator: str = ""
    allocator_name: str = ""
    allocator_address: str = ""
    method: str = ""
    pool: object = None
    call_stack: tuple | list = ()
    blocks: list = field(default_factory=list)
    owner: object = None
    holder: object = None
    """The request the violating call was made for (``kvguard.owner``, an adapter), if any."""
    history: list = field(default_factory=list)
    thread: str = field(default_factory=lambda: threading.current_thread().name)
    pid: int = field(default_factory=os.getpid)
    time: float = field(default_factory=time.time)
    expected: bool = False
    extra: dict = field(default_factory=dict)

    def headline(self) -> str:
        where = f" in pool {self.pool!r}" if self.pool is not None else ""
        ids = f" of {_ids_text(self.block_ids)}" if self.block_ids else ""
        return (
            f"{self.kind}{ids} on {self.allocator_name}{where}"
            f" ({self.allocator} at {self.allocator_address})"
        )

    def summary(self) -> str:
        frames = user_frames(self.call_stack)
        where = f" {frames[0]}" if frames else ""
        return f"SUMMARY: kvguard: {self.kind}{where}"

    def render(self) -> str:
        lines = [f"=={self.pid}==ERROR: kvguard: {self.headline()}", self.message]
        if self.extra.get("learned"):
            lines.append(f"note: the guard attached while blocks were out; {self.extra['learned']} "
                         "id(s) were taken as live without a hand-out it saw (seeded or learned "
                         "lazily on their first free), so their allocation stacks are unknown")
        call = f"{self.method}()" if self.method else "this call"
        lines.append(f"{call} was called here (thread {self.thread!r}):")
        lines += _stack_lines(self.call_stack)
        for block in self.blocks[:MAX_BLOCKS_DETAILED]:
            owned = f", owner {block.owner!r}" if block.owner is not None else ""
            if block.holder is not None and block.holder != block.owner:
                owned += f", {'held' if block.state == 'live' else 'last held'} by " \
                         f"{block.holder!r}"
            free = block.state == "free"
            if block.freed_at:
                # A live block's last free is still the one to see: a stale owner wrote after
                # it (write-after-free), or kept the id and freed it again (shared-block).
                when = f"by call #{block.last_call}" if free else "before it was handed out again"
                lines.append(f"\nblock {block.block_id} was {'' if free else 'last '}freed here "
                             f"{when}:")
                lines += _stack_lines(block.freed_at)
            if block.allocated_at:
                when = "" if free else f" by call #{block.last_call}"
                lines.append(f"\nblock {block.block_id} was {'last ' if free else ''}allocated "
                             f"here{when} ({block.state}{owned}):")
                lines += _stack_lines(block.allocated_at)
        if self.history:
            lines.append("\nlast operations on this allocator, oldest first:")
            lines += [f"    {op.line()}" for op in self.history]
        lines.append("")
        lines.append(self.summary())
        return "\n".join(lines)

    __str__ = render

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "block_ids": list(self.block_ids),
            "message": self.message,
            "allocator": {
                "class": self.allocator,
                "name": self.allocator_name,
                "address": self.allocator_address,
            },
            "method": self.method,
            "pool": _jsonable(self.pool),
            "call_stack": [f.to_dict() for f in user_frames(self.call_stack)],
            "blocks": [b.to_dict() for b in self.blocks],
            "owner": _jsonable(self.owner),
            "holder": _jsonable(self.holder),
            "history": [op.to_dict() for op in self.history],
            "thread": self.thread,
            "pid": self.pid,
            "time": self.time,
            "expected": self.expected,
            "extra": {k: _jsonable(v) for k, v in self.extra.items()},
            "summary": self.summary(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Violation":
        """Rebuild a violation from its JSON form (``kvguard report`` merges these)."""
        if d.get("kind") not in kinds.MEANING:
            raise ValueError(f"not a kvguard violation: kind {d.get('kind')!r}")
        alloc = d.get("allocator") or {}
        return cls(
            kind=d["kind"],
            block_ids=tuple(d.get("block_ids", ())),
            message=d.get("message", ""),
            allocator=alloc.get("class", ""),
            allocator_name=alloc.get("name", ""),
            allocator_address=alloc.get("address", ""),
            method=d.get("method", ""),
            pool=d.get("pool"),
            call_stack=[_frame_from_dict(f) for f in d.get("call_stack", ())],
            blocks=[BlockHistory.from_dict(b) for b in d.get("blocks", ())],
            owner=d.get("owner"),
            holder=d.get("holder"),
            history=[Operation.from_dict(o) for o in d.get("history", ())],
            thread=d.get("thread", ""),
            pid=d.get("pid", 0),
            time=d.get("time", 0.0),
            expected=d.get("expected", False),
            extra=dict(d.get("extra") or {}),
        )


def _stack_lines(stack) -> list[str]:
    frames = user_frames(stack)
    if not frames:
        return ["    <no stack recorded: stacks='off'>"]
    out = []
    for n, frame in enumerate(frames):
        out.append(f"    #{n} {frame.function} {frame.filename}:{frame.lineno}")
        source = frame.source
        if source and n == 0:
            out.append(f"        {source}")
    return out
