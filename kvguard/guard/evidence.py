"""What a violation carries: the blocks' histories from the ledger and the flight recorder.

The flight recorder is a guard's ``history`` (a deque, or with the compiled wrappers their
``FlightRecorder``, which stores an entry's fields and makes the tuple when read); every entry
has one shape, written on the hot path as a plain tuple so that recording costs one append::

    (call, ids, site, pool, op)

``call`` is the guard's call number (positive), ``ids`` the ids the allocator received, ``site``
the interned call site, ``pool`` the sub-pool key (None without sub-pools) and ``op`` one of
``OPS``. Entries are decoded into ``Operation`` values only when a report is drawn.

Calls that carry no ids (an engine's ``allocate(0)`` and ``free([])``: most of Hugging Face
continuous batching's calls) change no block, so they are counted, not recorded one by one:
consecutive ones fold into a single entry ``(call, n, None, None, "empty")``, n calls of which
the last is numbered ``call`` (``fold_empty``). The compiled wrappers fold the same way in C.
"""

from __future__ import annotations

from ..owners import current_holder, current_owner
from ..stacks import SITES, raw_stack
from ..violation import EMPTY, MAX_BLOCKS_DETAILED, Operation, Violation

OPS = ("allocate", "free", "share", "reset")
"""The steps a flight-recorder entry names, as ``kvguard replay`` reads them."""

VIOLATION_STACK_DEPTH = {"off": 1, "cheap": 24, "full": 128}
"""Frames kept for the stack of the call that broke a rule: rare, so richer than hot-path sites."""


def operation(entry) -> Operation:
    """Decode one flight-recorder entry."""
    call, ids, site, pool, op = entry
    if op == EMPTY:
        return Operation(op, (), (), None, call, count=ids)
    return Operation(op, tuple(ids), SITES.pairs(site), pool, call)


def record(history, entry, faulty) -> None:
    """Record one careful-path entry: appended, or folded when it carries no ids (a faulty
    call, whose ids were all refused, keeps an entry of its own: its report names it)."""
    if faulty or len(entry[1]):
        history.append(entry)
    else:
        fold_empty(history, entry[0])


def fold_empty(history, call) -> None:
    """Count call number ``call``, which carried no ids: the newest entry, when it folds empty
    calls already, takes it (one more, ending at ``call``); else a fold of one is appended."""
    last = history[-1] if history else None
    if last is not None and type(last[4]) is str and last[4] == EMPTY and type(last[1]) is int:
        history[-1] = (call, last[1] + 1, None, None, EMPTY)
    else:
        history.append((call, 1, None, None, EMPTY))


def operations(history) -> list:
    """A whole flight recorder, decoded, oldest first (``history`` may be None: recording off)."""
    return [operation(entry) for entry in (history or ())]


def block_histories(ledger, ids, *, with_frees: bool = True) -> list:
    """What the ledger knows of the first ``MAX_BLOCKS_DETAILED`` distinct blocks of ``ids`` it
    has seen (those a report details): state, references, owner, the call that last changed it,
    where it was handed out and (with ``with_frees``) where it was last freed."""
    return [ledger.history(b, with_frees=with_frees)
            for b in list(dict.fromkeys(ids))[:MAX_BLOCKS_DETAILED] if ledger.seen(b)]


def violation(guard, kind, block_ids, message, method, pool, ledger, detail_ids) -> Violation:
    """A violation of ``guard``'s allocator, with the stack of the call that broke the rule, the
    histories of the blocks in ``detail_ids`` and the flight recorder."""
    return Violation(
        kind=kind, block_ids=tuple(block_ids), message=message,
        allocator=guard.allocator_class, allocator_name=guard.name,
        allocator_address=guard.address, method=method, pool=pool,
        call_stack=raw_stack(1, VIOLATION_STACK_DEPTH[guard.stacks]),
        blocks=block_histories(ledger, detail_ids), owner=current_owner(),
        holder=current_holder(),
        history=operations(guard.history),
        extra={"learned": ledger.adopted} if ledger.adopted else {},
    )
