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

from .clauses import CLAUSES, Step, requirement
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
        body = _literals(lambdas[0].body, factory)
        if isinstance(body, ast.Call):
            # ``ds.BlockedAllocator(16)`` -> ``BlockedAllocator(16)``, the name imported above
            func = ast.unparse(body.func)
            if func.rsplit(".", 1)[-1] == cls.__name__:
                return cls.__name__ + ast.unparse(body)[len(func):]
        return ast.unparse(body)
    return None


def _literals(body, factory):
    """``body`` with each name the lambda closes over (or reads from its module) written as
    its value, when that is a plain literal: ``lambda: Pool(4, bug)`` in a loop -> ``Pool(4,
    'double-free')``, so the test stands alone."""
    values = dict(getattr(factory, "__globals__", {}))
    code, cells = factory.__code__, factory.__closure__ or ()
    values.update(zip(code.co_freevars, (c.cell_contents for c in cells)))

    class Inline(ast.NodeTransformer):
        def visit_Name(self, node):
            value = values.get(node.id, _NOTHING)
            if value is not _NOTHING and _plain_literal(value):
                return ast.copy_location(ast.Constant(value), node)
            return node
    return Inline().visit(body)


_NOTHING = object()


def _plain_literal(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain_literal(v) for v in value)
    return value is None or type(value) in (bool, int, float, str)


class Writer:
    """Writes one run's steps as the body of a test that needs nothing of kvguard: the
    allocator's module, pytest, and torch or numpy where the calls pass their values."""

    def __init__(self, run: Run, make: str | None, rejects_with: str = "") -> None:
        self.run = run
        self.spec = run.spec
        self.source = dict(run.driver.source)
        self.make = make
        self.rejects_with = rejects_with or "Exception"
        """The exception class the contract names for a rejected call, when it names one."""
        self.imports: set = set(self.source.get("imports", ()))
        self.lines: list = []
        self.tensors = 0
        self.returns = False

    # --- how to write a value ---

    def item(self, x) -> str:
        if x is None or isinstance(x, (bool, int, float, str)):
            return repr(x)
        if type(x).__module__ == "torch":
            self.imports.add("import torch")
            return f"torch.tensor({x.item()!r})"
        b = _path(x, self.spec.id_attr)
        if self.run.objects.get(b) is x:
            return f"held[{b}]"
        block = self.source.get("block")
        if block is None:
            return f"<block {b!r}: set Driver.source['block']>"
        return block.format(a="a", id=b)

    def value(self, step: Step) -> str:
        v, form = step.value, step.form
        if form in ("tensor", "scalar-tensor"):  # from the ids: the caller may have reused it
            self.imports.add("import torch")
            return f"torch.tensor({step.ids if form == 'tensor' else step.ids[0]!r})"
        if form == "mask-tensor":
            self.imports.add("import torch")
            return f"torch.tensor({v.tolist()!r})"
        if form in ("mask-array", "array"):
            self.imports.add("import numpy")
            return f"numpy.{'array' if form == 'mask-array' else 'asarray'}({v.tolist()!r})"
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
        if form == "release":
            return self.item(v)
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
        if not isinstance(how, str):
            return None  # a callable: say how to read it in Driver.source['free_count']
        return f"a.{how}()" if callable(getattr(self.run.allocator, how, None)) else f"a.{how}"

    def ids_of(self, got: str) -> str:
        """The ids in an allocation's result as plain ints (list, tensor, array, objects)."""
        if self.spec.id_attr is not None:
            return f"[b.{self.spec.id_attr} for b in {got}]"
        return f"[int(b) for b in {got}]"

    def error_class(self, step: Step) -> str:
        """What a rejected call is expected to raise: the class the contract names; for a
        call the allocator did reject, the built-in class it raised."""
        error = step.error
        if error is not None and type(error).__module__ == "builtins" \
                and not isinstance(error, AssertionError):
            return type(error).__name__
        return self.rejects_with

    # --- steps ---

    def emit(self, line: str = "") -> None:
        # one physical line each: text that came from a log or an allocator (a repr in a
        # comment) can never start a line of code
        self.lines.append(line.replace("\r", "\\r").replace("\n", "\\n"))

    def step(self, step: Step, last: bool, final_probe: bool) -> None:
        if step.op == "count":
            self.count_assert(step, "the free count says {got} where {want} block(s) are "
                              "free")
        elif step.op == "refcount":
            read = self.source.get("refcount")
            if read is not None:
                b = step.ids[0]
                if step.expect_free is None:
                    self.emit(f"assert {read.format(a='a', id=b)} >= 0, 'block {b} released "
                              f"past zero: its reference count is {step.outcome}'")
                else:
                    self.emit(f"assert {read.format(a='a', id=b)} == {step.expect_free}, "
                              f"'block {b} holds {step.expect_free} reference(s), the pool "
                              f"counts {step.outcome}'")
        elif step.op == "allocate":
            self.allocate(step, last)
        elif step.op in PROBES:
            self.probe(step, final_probe)
        else:
            call = self.call(step.op, self.value(step))
            self.emit(call)
            if last:
                self.count_assert(step, "the free count must match the blocks handed out "
                                  "and freed")

    def allocate(self, step: Step, last: bool) -> None:
        call = self.call("allocate", n=step.n)
        broken = step.broken.check if last and step.broken else None
        if broken == "valid-trace" and step.error is not None:
            self.emit(f"{call}  # raises {_short(step.error)}")
            return
        if broken in ("valid-trace", "no-live-handout"):
            self.emit(f"got = {self.ids_of(call)}  # {step.outcome}")
            if broken == "valid-trace":
                self.emit(f"assert len(got) == {step.n}, got")
                return
            live = sorted(step.expect_live)
            size = self.run.size
            self.emit("assert len(set(got)) == len(got), f'a block handed to two owners in "
                      "one call: {got}'")
            if live:
                self.emit(f"assert not set(got) & {set(live)!r}, f'a block handed out while "
                          "its owner holds it (two owners): {got}'")
            reserved = list(self.run.driver.reserved)
            if size is not None:
                self.emit(f"assert all(0 <= b < {size} for b in got), f'not a block of the "
                          "pool: {got}'")
            if reserved:
                self.emit(f"assert not set(got) & {set(reserved)!r}, f'a reserved block "
                          "handed out: {got}'")
            return
        if self.spec.id_attr is not None:
            self.emit(f"got = {call}  # {step.outcome}")
            self.emit(f"held.update((b.{self.spec.id_attr}, b) for b in got)")
        else:
            self.emit(f"{call}  # {step.outcome}")
        if last and broken == "free-count":
            self.count_assert(step, "the free count must match the blocks handed out and "
                              "freed")

    def count_assert(self, step: Step, message: str) -> None:
        count = self.free_count()
        if count is not None and step.expect_free is not None:
            text = message.format(got=step.free_after, want=step.expect_free)
            self.emit(f"assert {count} == {step.expect_free}, {text!r}")

    def probe(self, step: Step, final: bool) -> None:
        """The bad call: its argument built first. Where the break is this call, a rejection
        of the contract's class ends the test (nothing freed); otherwise the harm follows."""
        value = self.value(step)
        name = "bad"
        if step.mutate_to is not None:
            self.tensors += 1
            name = f"t{self.tensors}" if self.tensors > 1 else "t"
        self.emit(f"{name} = {value}")
        call = self.source["release"].format(obj=name) if step.via_release \
            else self.call("free", name)
        count = self.free_count()
        if step.rejected:
            self.imports.add("import pytest")
            self.emit(f"with pytest.raises({self.error_class(step)}):  # {step.outcome}")
            self.emit(f"    {call}")
        elif final:
            self.emit("try:")
            self.emit(f"    {call}  # {step.outcome}")
            self.emit(f"except {self.rejects_with}:")
            if count is not None and step.free_before is not None:
                self.emit(f"    assert {count} == {step.free_before}, 'rejected: nothing may "
                          "be freed'")
            self.emit("    return  # the contract: rejected")
            self.returns = True
        else:
            self.emit(f"{call}  # {step.outcome}")
        if step.mutate_to is not None:
            self.emit(f"{name}.fill_({step.mutate_to})  # the caller reuses its tensor")

    def after_probe(self, step: Step, harmed: bool) -> None:
        """A final bad call with no harm steps after it ends on its own assertion."""
        if harmed:
            return
        if step.rejected or step.effect is not None:
            what = ("rejected: nothing may be freed" if step.rejected
                    else f"accepted: it must free exactly {step.effect}")
            self.count_assert(step, what)
        else:
            self.emit(f"raise AssertionError({'accepted it: ' + step.outcome!r})")

    def test(self, name: str, doc: str) -> str:
        steps = self.run.steps
        probe_at = _final_probe(steps)
        harmed = any(s.harm for s in steps)
        for i, s in enumerate(steps):
            self.step(s, i == len(steps) - 1, i == probe_at)
            if i == probe_at:
                self.after_probe(s, harmed)
                if harmed:
                    self.emit("# what that call corrupted, shown:")
        return self.assemble(name, doc)

    def assemble(self, name: str, doc: str) -> str:
        """The test function around the lines emitted so far, with its imports."""
        cls = type(self.run.allocator)
        make = self.make or f"make_allocator()  # TODO: build a fresh {cls.__name__} here"
        body = [f"a = {make}"]
        for line in self.source.get("setup", ()):
            body.append(line.format(a="a"))
        if self.spec.id_attr is not None:
            body.append("held = {}  # block id -> the object the allocation returned")
        body += self.lines
        imports = sorted(self.imports)
        if cls.__module__ not in ("__main__", "builtins"):
            imports.append(f"from {cls.__module__} import {cls.__qualname__.split('.')[0]}")
        text = "\n".join(imports) + "\n\n\n" if imports else ""
        text += f"def {name}():\n"
        text += textwrap.indent(docstring_literal(doc) + "\n" + "\n".join(body), "    ") + "\n"
        return text


def _final_probe(steps) -> int:
    """Index of the bad call the break is charged to, when the break is at it or after it."""
    for i in range(len(steps) - 1, -1, -1):
        s = steps[i]
        if s.op in PROBES and not s.harm:
            broken = next((t.broken for t in steps[i:] if t.broken), None)
            if broken is not None and broken.clause == s.op and (
                    i == len(steps) - 1 or all(t.harm or t.op == "count"
                                               for t in steps[i + 1:])):
                return i
            return -1
    return -1


def _short(error: BaseException) -> str:
    text = repr(error)
    return text if len(text) <= 70 else text[:67] + "..."


def docstring_literal(doc: str) -> str:
    """``doc`` as a string literal: triple-quoted when it reads back as exactly ``doc`` (no
    quote, backslash or control character in it to misread), else ``repr(doc)``. A log's
    guard or file name reaches the docstring: it is data, never code."""
    plain = '"""' not in doc and "\\" not in doc and not doc.endswith('"') and all(
        c == "\n" or c.isprintable() for c in doc)
    if plain:
        literal = f'"""{doc}"""'
        try:
            if ast.literal_eval(literal) == doc:
                return literal
        except (SyntaxError, ValueError):
            pass
    return repr(doc)


def validated(text: str, name: str, doc: str) -> str:
    """``text`` if it is what the writer means to print: imports and one test function whose
    docstring is ``doc``, compiling as it stands. Anything else (a value the writer did not
    expect, reaching the code) is a ``ValueError``: the test is not printed."""
    try:
        tree = ast.parse(text)
        compile(tree, f"<{name}>", "exec")
    except (SyntaxError, ValueError) as exc:
        raise ValueError(f"the emitted test does not compile ({exc}): not printed") from None
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    others = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom,
                                                         ast.FunctionDef))]
    if others or len(defs) != 1 or defs[0].name != name or \
            ast.get_docstring(defs[0]) != inspect.cleandoc(doc):
        raise ValueError("the emitted test is not one test function with its docstring: "
                         "not printed")
    return text


def _path(item, path):
    for part in (path or "").split("."):
        item = getattr(item, part, None)
    return item


def regression_test(run: Run, *, make: str | None = None, origin: str = "",
                    rejects_with: str = "", harm: str = "") -> str:
    """The test for the clause ``run`` broke (its last step, or the step before the harm
    shown after it)."""
    broken = next(s.broken for s in reversed(run.steps) if s.broken and not s.harm) \
        if any(s.broken and not s.harm for s in run.steps) else run.steps[-1].broken
    clause = CLAUSES[broken.clause]
    cls = type(run.allocator).__name__
    name = f"test_{cls.lower()}_{broken.clause.replace('-', '_')}"
    paragraphs = [f"kvguard conformance, {clause.name}: {clause.summary}.",
                  f"The contract: {requirement(clause.name, run.spec)}. {origin}".strip()]
    if harm:
        paragraphs.append(f"The harm: {harm}.")
    doc = "\n\n".join(textwrap.fill(p, 88) for p in paragraphs)
    return validated(Writer(run, make, rejects_with).test(name, doc + "\n"), name, doc + "\n")
