"""KVG205: a method that frees one id puts it back with no already-free check.

A free of one id (a request's table row, a state slot, a page) that appends it to a
free list, or drops its reference, without first checking that it is in use: the
same id freed twice (a row released on abort and again on finish) sits on the free
list twice, and the next two allocations hand it to two owners. A range check or an
int conversion does not catch it: only a test of the allocator's own state does (a
per-id flag, membership in the free set, a count above zero).
"""

from .. import effects, fuzzcmd

CODE = "KVG205"
SUMMARY = "a single-id free puts the id back with no already-free check"
MESSAGE = (
    "KVG205 {method}() {what} '{param}' with no check that it is in use: freeing "
    "the same id twice {consequence}; reject an id that is already free (a per-id flag, "
    "or membership in the free set) before changing state{fuzz}"
)
FIXABLE = False

BAD = [
    """\
class ReqToTokenPool:
    def free(self, req_idx: int) -> None:
        self.free_slots.append(req_idx)
""",
    """\
import operator

class RowPool:
    def release(self, row: int) -> None:
        row = operator.index(row)
        if not 0 <= row < self.size:  # a range check: a second free passes it
            raise IndexError(row)
        self.ref_count[row] -= 1
        if self.ref_count[row] == 0:
            self.free_rows.append(row)
""",
]
GOOD = [
    """\
import operator

class ReqToTokenPool:
    def free(self, req_idx: int) -> None:
        if isinstance(req_idx, bool):
            raise TypeError("a bool is not a row")
        row = operator.index(req_idx)
        if row in self.free_slots:
            raise ValueError(f"row {row} is already free")
        self.free_slots.append(row)
""",
    """\
import operator

class RowPool:
    def release(self, row: int) -> None:
        if isinstance(row, bool):
            raise TypeError("a bool is not a row")
        index = operator.index(row)
        if self.used[index] is False:
            raise ValueError(f"row {index} is already free")
        self.used[index] = False
        self.free_rows.append(index)
""",
    """\
class Scheduler:
    def add_request(self, request) -> None:
        self.waiting.append(request)  # a queue of work, not a free list
""",
]

_WHAT = {
    effects.PUSH: ("puts back", "puts it on the free list twice and hands it to two owners"),
    effects.DECREMENT: (
        "drops a reference of",
        "drops a reference it does not hold and frees the block under its other owner",
    ),
}


def check_free_method(method, ctx):
    found = method.effects
    if found is None or found.how != effects.ONE or method.self_name is None:
        return
    if effects.CHECK_FREE in found.checks or effects.CHECK_DUP in found.checks:
        return
    kind = effects.PUSH if effects.PUSH in found.kinds else effects.DECREMENT
    if kind not in found.kinds:
        return  # a bitmap cleared twice stays cleared
    what, consequence = _WHAT[kind]
    function = method.function
    message = MESSAGE.format(fuzz=fuzzcmd.for_method(method, CODE), 
        method=function.name.value, what=what, param=method.param, consequence=consequence
    )
    ctx.report(CODE, function.name, message)
