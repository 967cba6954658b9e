"""A broken clause written down as a pytest regression test, ready to paste.

The fuzzer (``kvguard.testing``) and ``kvguard replay --emit-test`` both end with a short call
sequence on a real allocator and the step where it broke the contract. This module writes that
sequence as plain calls on the allocator (literal ids, so a reader sees exactly what happened)
ending in the assertion the contract makes: the test fails on the allocator as it is, and
passes once it is fixed.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from .clauses import CLAUSES, Step
from .probes import PROBES
from .run import Run


def factory_source(factory, cls) -> str | None:
    """``factory`` as an expression building the allocator, if it can be told: a class, a
    ``functools.partial`` of one, or a one-line ``lambda: Cls(...)``."""
    import functools
    if factory is cls:
        return f"{cls.__name__}()"
    if isinstance(factory, functools.partial) and factory.func is cls:
        args = [repr(a) for a in factory.args]
        args += [f"{k}={v!r}" for k, v in factory.keywords.items()]
        return f"{cls.__name__}({', '.join(args)})"
    if getattr(factory, "__name__", "") != "<lambda>":
        return None
    try:
        text = textwrap.dedent(inspect.getsource(factory)).strip()
    except (OSError, TypeError):
        return None
    for candidate in (text, text.rstrip(",)"), f"({text}"):
        try:
            tree = ast.parse(candidate)
        except SyntaxError:
            continue
        lambdas = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda) and not n.args.args]
        if len(lambdas) != 1:
            return None
        body = lambdas[0].body
        if isinstance(body, ast.Call):
            # ``ds.BlockedAllocator(16)`` -> ``BlockedAllocator(16)``, the name imported above
            func = ast.unparse(body.func)
            if func.rsplit(".", 1)[-1] == cls.__name__:
                return cls.__name__ + ast.unparse(body)[len(func):]
        return ast.unparse(body)
    return None


class Writer:
    """Writes one run's steps as the body of a test."""

    def __init__(self, run: Run, make: str | None) -> None:
        self.run = run
        self.spec = run.spec
        self.source = dict(run.driver.source)
        self.make = make
        self.imports: set = set(self.source.get("imports", ()))
        self.helpers: set = set()
        self.lines: list = []
        self.tensors = 0

    # --- how to write a value ---

    def item(self, x) -> str:
        if isinstance(x, (bool, int)):
            return repr(x)
        if type(x).__module__ == "torch":
            self.imports.add("import torch")
            return f"torch.tensor({x.item()!r})"
        b = _path(x, self.spec.id_attr)
        if self.run.objects.get(b) is x:
            return f"held[{b}]"
        block = self.source.get("block")
        if block is None:
            return f"<block {b}: set Driver.source['block']>"
        return block.format(a="a", id=b)

    def value(self, step: Step) -> str:
        v, form = step.value, step.form
        if form in ("tensor", "scalar-tensor"):  # from the ids: the caller may have reused it
            self.imports.add("import torch")
            return f"torch.tensor({step.ids if form == 'tensor' else step.ids[0]!r})"
        if form == "mask-tensor":
            self.imports.add("import torch")
            return f"torch.tensor({v.tolist()!r})"
        if form == "mask-array":
            self.imports.add("import numpy")
            return f"numpy.array({v.tolist()!r})"
        if form == "tensor-elements":
            self.imports.add("import torch")
            return f"list(torch.tensor({[int(x) for x in v]!r}))"
        if form == "generator":
            items = step.ids if self.spec.id_attr is None else [
                self.item(self.run.objects.get(b, b)) for b in step.ids]
            inner = "[" + ", ".join(map(str, items)) + "]"
            return f"(b for b in {inner})"
        if form == "bool":
            return repr(v)
        text = "[" + ", ".join(self.item(x) for x in v) + "]"
        if "plain_ids" in self.source and all(type(x) is int for x in v):
            return self.source["plain_ids"].format(ids=text)
        return text

    def call(self, op: str, value: str = "", n: int = 0) -> str:
        spec = self.spec
        default = {"allocate": "{a}.%s({n})" % spec.alloc, "free": "{a}.%s({ids})" % spec.free,
                   "share": "{a}.%s({ids})" % spec.share}[op]
        return self.source.get(op, default).format(a="a", n=n, ids=value)

    def free_count(self) -> str | None:
        if "free_count" in self.source:
            return self.source["free_count"].format(a="a")
        how = self.spec.free_count
        if callable(how):
            from ..registry import spec_for
            if spec_for(type(self.run.allocator)) is not self.spec:
                return None  # a callable of the caller's own: set Driver.source['free_count']
            self.imports.update(("from kvguard.registry import spec_for",
                                 "from kvguard.spec import read"))
            return "read(a, spec_for(type(a)).free_count)"
        if not isinstance(how, str):
            return None
        return f"a.{how}()" if callable(getattr(self.run.allocator, how, None)) else f"a.{how}"

    # --- steps ---

    def emit(self, line: str = "") -> None:
        self.lines.append(line)

    def step(self, step: Step, last: bool) -> None:
        if step.op == "allocate":
            self.allocate(step, last)
        elif step.op in PROBES:
            self.probe(step, last)
        else:
            call = self.call(step.op, self.value(step))
            self.emit(call)
            if last:
                self.count_assert(step)

    def allocate(self, step: Step, last: bool) -> None:
        call = self.call("allocate", n=step.n)
        broken = step.broken.check if last and step.broken else None
        if self.spec.id_attr is not None:
            self.helpers.add("by_id")
            self.emit(f"got = {call}  # {step.outcome}")
            self.emit(f"held.update(by_id(got, {self.spec.id_attr!r}))")
            got = "list(by_id(got, %r))" % self.spec.id_attr
        else:
            got = None
        if broken in ("valid-trace", "no-live-handout"):
            self.helpers.add("ids_of")
            self.emit(f"got = ids_of({call if got is None else 'got'})  # {step.outcome}")
            if broken == "valid-trace":
                self.emit(f"assert len(got) == {step.n}, got")
                return
            live = sorted(step.expect_live)
            size = self.run.size
            self.emit(f"assert len(set(got)) == len(got) == {step.n}, got")
            if size is not None:
                self.emit(f"assert all(0 <= b < {size} for b in got), got")
            if live:
                self.emit(f"assert not set(got) & {set(live)!r}, "
                          "'allocate() handed out a live block'")
        elif got is None:
            self.emit(f"{call}  # {step.outcome}")
        if last and broken == "free-count" or (last and broken and broken in PROBES):
            self.count_assert(step)

    def count_assert(self, step: Step) -> None:
        count = self.free_count()
        if count is not None and step.expect_free is not None:
            self.emit(f"assert {count} == {step.expect_free}, 'the free count must match the "
                      "blocks handed out and freed'")

    def probe(self, step: Step, last: bool) -> None:
        value = self.value(step)
        if step.mutate_to is not None:
            self.tensors += 1
            name = f"t{self.tensors}" if self.tensors > 1 else "t"
            self.emit(f"{name} = {value}")
            value = name
        call = self.call("free", value)
        count = self.free_count()
        final = last and step.broken is not None and step.broken.clause == step.op
        if final and count is not None:
            self.emit(f"before = {count}")
        if step.must_reject or (step.rejected and not final):
            self.imports.add("import pytest")
            self.emit("with pytest.raises(Exception):  # the contract: rejected...")
            self.emit(f"    {call}")
            if final and count is not None:
                self.emit(f"assert {count} == before, '...and nothing freed'")
        elif final:
            self.emit("try:")
            self.emit(f"    {call}")
            self.emit("except Exception:")
            if count is not None:
                self.emit(f"    assert {count} == before, 'rejected: must free nothing'")
            else:
                self.emit("    pass  # rejected: fine")
            self.emit("else:")
            if count is not None and step.expect_free is not None:
                self.emit(f"    assert {count} == {step.expect_free}, 'accepted: must free "
                          f"exactly {step.effect}'")
            else:
                self.emit("    pass")
        else:
            self.emit(f"{call}  # {step.outcome}")
        if step.mutate_to is not None:
            self.emit(f"{value}.fill_({step.mutate_to})  # the caller reuses its tensor")

    def test(self, name: str, doc: str) -> str:
        steps = self.run.steps
        for i, s in enumerate(steps):
            self.step(s, i == len(steps) - 1)
        cls = type(self.run.allocator)
        head = []
        make = self.make or f"make_allocator()  # TODO: build a fresh {cls.__name__} here"
        body = [f"a = {make}"]
        for line in self.source.get("setup", ()):
            body.append(line.format(a="a"))
        if self.spec.id_attr is not None:
            body.append("held = {}  # block id -> the object allocate() returned")
        body += self.lines
        imports = sorted(self.imports)
        if self.helpers:
            imports.append(f"from kvguard.testing import {', '.join(sorted(self.helpers))}")
        if cls.__module__ not in ("__main__", "builtins"):
            imports.append(f"from {cls.__module__} import {cls.__qualname__.split('.')[0]}")
        head += imports
        text = "\n".join(head) + "\n\n\n" if head else ""
        text += f"def {name}():\n"
        text += textwrap.indent(f'"""{doc}"""\n' + "\n".join(body), "    ") + "\n"
        return text


def _path(item, path):
    for part in (path or "").split("."):
        item = getattr(item, part, None)
    return item


def regression_test(run: Run, *, make: str | None = None, origin: str = "") -> str:
    """The test for the clause the last step of ``run`` broke."""
    broken = run.steps[-1].broken
    clause = CLAUSES[broken.clause]
    cls = type(run.allocator).__name__
    name = f"test_{cls.lower()}_{broken.clause.replace('-', '_')}"
    paragraphs = [f"kvguard conformance, {clause.name}: {clause.summary}.",
                  f"The contract: {clause.requires}. {origin}".strip()]
    doc = "\n\n".join(textwrap.fill(p, 88) for p in paragraphs)
    return Writer(run, make).test(name, doc + "\n")
