"""The allocator contract as named clauses: what a correct allocator promises, and the values a
run of it is made of (the operations' driver, a step, a broken clause).

The guard stops a caller's misuse at the call. The conformance face asks the other question:
does the allocator itself keep the contract? ``kvguard.conformance.run`` drives an *unguarded*
allocator and judges every answer against these clauses with kvguard's own ``Ledger``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..spec import AllocatorSpec


@dataclass(frozen=True)
class Clause:
    """One promise a correct allocator keeps."""

    name: str
    summary: str
    requires: str
    """What the contract requires, as the report states it."""
    probe: bool = True
    """Exercised by feeding the allocator a bad call (otherwise by valid calls alone)."""
    refcounted: bool | None = None
    """Applies only to refcounted pools (True), only to plain ones (False), or to both."""
    typed_input: bool = False
    """Feeds a value outside a typed API's declared input (a bool, tensor, mask or generator
    where block objects or arrays belong): on such an API it is the robustness tier, reported
    apart from broken promises and off unless asked for."""
    requires_refcounted: str = ""
    """What the contract requires of a refcounted pool, where it differs."""


CLAUSES = {c.name: c for c in (
    Clause("valid-trace", "a valid call sequence never fails",
           "allocate(n) with n blocks free returns n ids; freeing (or sharing) live blocks "
           "succeeds", probe=False),
    Clause("no-live-handout", "allocate never hands out a live block",
           "every id allocate() returns is in range, distinct, and not live", probe=False),
    Clause("free-count", "the allocator's own free count matches",
           "the allocator's free count moves exactly as blocks are handed out and freed",
           probe=False),
    Clause("duplicate-id", "a repeated id in one free is rejected, atomically",
           "free() of a list naming one id twice raises and frees nothing",
           requires_refcounted="a block named k times in one free is k releases: with at least "
           "k references it releases exactly those (or the call is rejected and frees "
           "nothing); with fewer it is rejected and frees nothing"),
    Clause("double-free", "a double free is rejected, atomically",
           "free() of an id that is already free raises and frees nothing", refcounted=False),
    Clause("foreign-id", "a block never handed out is rejected",
           "free() of an in-range id that was never handed out (a block still free, the "
           "padding slot) raises and frees nothing"),
    Clause("invalid-id", "an id that is not a block of the pool is rejected",
           "free() of a negative id (which Python and numpy indexing wrap to the last block), "
           "an id past the pool, or a float, string or None raises and frees nothing"),
    Clause("bool-id", "a bool is rejected",
           "free(True), free([True]) or a bool among the ids raises and frees nothing (a bool "
           "is id 1 to operator.index but a mask to tensor indexing)", typed_input=True),
    Clause("bool-mask", "a bool mask is rejected or read as a mask",
           "free() of a bool array/tensor raises and frees nothing, or frees exactly the "
           "blocks it selects", typed_input=True),
    Clause("tensor-id", "a tensor is rejected or handled correctly (allocators that do not "
           "take tensors)",
           "free() of a torch tensor (or its 0-dim elements) raises and frees nothing, or "
           "frees exactly those ids and keeps no view of the caller's tensor", typed_input=True),
    Clause("generator", "a generator is rejected or handled correctly",
           "free() of a one-shot generator raises and frees nothing, or frees exactly the ids "
           "it yields", typed_input=True),
    Clause("release-past-zero", "refcounted: a release past zero is rejected",
           "free() of a block whose reference count is already 0 raises and frees nothing",
           refcounted=True),
)}


def requirement(clause: str, spec: AllocatorSpec) -> str:
    """What ``clause`` requires of an allocator read with ``spec`` (refcounted pools differ)."""
    c = CLAUSES[clause]
    return c.requires_refcounted if spec.refcounted and c.requires_refcounted else c.requires


VALID_CLAUSES = tuple(name for name, c in CLAUSES.items() if not c.probe)
PROBE_CLAUSES = tuple(name for name, c in CLAUSES.items() if c.probe)


@dataclass(frozen=True)
class Driver:
    """How to call one allocator, for what an ``AllocatorSpec``'s method names cannot say.

    Each callable receives the allocator; each ``None`` falls back to the spec (``alloc(n)``,
    ``free(ids)``, ``share(ids)``, ``size``, ``free_count``). ``block(allocator, id)`` gives the
    object a caller would pass for an id the allocator never handed out (pools whose ids travel
    as objects, ``id_attr``): without it those probes are skipped. ``reserved`` ids are never
    handed out and may be ignored by ``free()`` (vLLM's null block 0). ``source`` writes the same
    calls as Python for the regression tests: keys ``allocate``, ``free``, ``share`` (with
    ``{a}``, ``{n}``, ``{ids}``), ``block`` (``{a}``, ``{id}``), ``free_count`` (``{a}``),
    ``refcount`` (``{a}``, ``{id}``), ``plain_ids`` (how ``free``/``share`` convert a list of
    plain ints, ``{ids}``), ``setup`` (lines after the allocator is made) and ``imports``.
    ``block`` gives only the pool's own objects (its ``blocks[i]``): one made up for an id it
    could not have handed out would test nothing a caller can do.
    """

    allocate: Callable[[Any, int], Any] | None = None
    free: Callable[[Any, Any], Any] | None = None
    share: Callable[[Any, Any], Any] | None = None
    block: Callable[[Any, int], Any] | None = None
    size: Callable[[Any], int] | None = None
    free_count: Callable[[Any], int] | None = None
    reserved: tuple = ()
    source: dict = field(default_factory=dict)
    release: Callable[[Any, Any], Any] | None = None
    """The engine's own reference-count release of one block object, which frees it at zero
    (LMCache's ``obj.ref_count_down()``): a second path to a double free, probed beside
    ``free`` (``source['release']``, with ``{obj}``)."""
    refcount: Callable[[Any, int], int] | None = None
    """A block's reference count as the pool keeps it (refcounted pools): a count gone
    negative is the harm a release past zero does, before anything else shows it."""
    typed: bool = False
    """``free`` takes a declared type that is not a list of ints (numpy arrays): bools,
    tensors, masks and generators are the robustness tier there, as for block objects."""


class Broken(Exception):
    """A clause broken at one step of a run: raised to stop it, and carried to the report."""

    def __init__(self, clause: str, did: str, required: str | None = None,
                 check: str | None = None) -> None:
        super().__init__(f"{clause}: {did}")
        self.clause = clause
        """The clause charged: a probe's own, when a later call shows what the probe did."""
        self.check = check or clause
        """The check that failed at this step."""
        self.did = did
        self.required = required or CLAUSES[clause].requires


@dataclass
class Step:
    """One call the run made, as the report and the regression test show it."""

    op: str
    """``allocate``, ``free``, ``share``, or the clause name of a probe."""
    ids: list
    value: Any = None
    """What reaches the allocator's method (ids as a list, tensor, objects, generator...)."""
    form: str = "list"
    """How ``ids`` were passed: list, objects, tensor, tensor-elements, scalar-tensor, bool,
    bool-list, mask-tensor, mask-array, generator."""
    n: int = 0
    outcome: str = ""
    rejected: bool = False
    broken: Broken | None = None
    must_reject: bool = False
    effect: list | None = None
    """The ids a probe that is accepted must free (None: it must be rejected)."""
    free_before: int | None = None
    free_after: int | None = None
    via_release: bool = False
    """Made through ``Driver.release`` on the one block object, not through ``free``."""
    mutate_to: int | None = None
    """A tensor probe: the value the caller's tensor is overwritten with after the call."""
    expect_live: list = field(default_factory=list)
    expect_free: int | None = None
    error: BaseException | None = None
    """What the call raised, if it raised."""
    harm: bool = False
    """Made after the break, to show what it corrupted."""


def typed_api(spec: AllocatorSpec, driver: Driver | None = None) -> bool:
    """Whether ``free`` declares an input narrower than "ids": block objects, a tensor, an
    array. Values outside it are the robustness tier there (``Clause.typed_input``)."""
    return spec.id_attr is not None or spec.tensor_ok or bool(driver and driver.typed)


def applicable(spec: AllocatorSpec, driver: Driver | None = None) -> list:
    """The clauses that make sense for an allocator read with ``spec``, both tiers."""
    return [name for name in CLAUSES if not_applicable(name, spec, driver) is None]


def not_applicable(name: str, spec: AllocatorSpec, driver: Driver | None = None):
    """Why ``name`` does not apply to an allocator read with ``spec`` (None: it does)."""
    clause = CLAUSES[name]
    if clause.refcounted is True and not spec.refcounted:
        return "does not apply: not a refcounted pool"
    if clause.refcounted is False and spec.refcounted:
        return "does not apply: a refcounted pool (see release-past-zero)"
    objects = spec.id_attr is not None
    if name == "tensor-id" and (spec.tensor_ok or objects):
        return "does not apply: free() takes " + ("tensors" if spec.tensor_ok else "objects")
    if name == "bool-mask" and objects:
        return "does not apply: free() takes block objects"
    if name == "invalid-id" and objects:
        return "does not apply: block objects carry their ids, none can be made up"
    if name == "foreign-id" and objects and not (driver and driver.block):
        return "does not apply: block objects the pool never handed out cannot be had"
    return None


def robustness_tier(spec: AllocatorSpec, driver: Driver | None = None) -> list:
    """The applicable clauses that are the robustness tier for this API (none on a plain
    list-of-ints API, where they are promises like the others)."""
    if not typed_api(spec, driver):
        return []
    return [n for n in applicable(spec, driver) if CLAUSES[n].typed_input]
