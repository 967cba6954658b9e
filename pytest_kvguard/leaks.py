"""``--kvguard-leaks=summary`` (the default): leaks that matter, told once at the end of the run.

An engine's own tests routinely end with requests still holding blocks on a pool that dies with
the test; warning about each (vLLM's core suite: 534 tests) buries the leaks that matter, blocks
lost on an allocator that lives on. So, as LeakSanitizer does at exit:

- a test's leaks (found at its teardown, as in the other modes) are only candidates. They are
  reported if their allocator outlived the test: still alive at the end of the run, or alive
  after a full garbage collection that ran after the test's teardown (a module-scoped pool that
  died later). Blocks freed again since (by a fixture's teardown, say) are not reported.
- allocators still alive at the end of the run report the blocks handed out outside any test
  (at import, or by fixtures wider than a test) that are still live: session-wide leaks.

Everything is listed in one section of the terminal summary and in the JSON report; nothing
warns per test. ``--kvguard-leaks=warn`` and ``fail`` (or the marker) judge every test's leaks
at its teardown, whatever becomes of the allocator.
"""

from __future__ import annotations

import gc

from kvguard.owners import OWNERS

from .tracking import leak_violation, owned_live

OUTSIDE_TESTS = "outside any test"
"""The ``nodeid`` of a session-wide leak (blocks handed out at import or by a wide fixture)."""


class Candidate:
    """One test's leaked blocks on one allocator, noted at the test's teardown."""

    __slots__ = ("test", "record", "pool", "stamps", "outlived")

    def __init__(self, test, record, pool, ids) -> None:
        self.test = test
        self.record = record
        self.pool = pool
        stamp = record.ledgers[pool].stamp
        self.stamps = {b: stamp[b] for b in ids}
        """Each block's hand-out stamp: a block freed and handed out again since is not it."""
        self.outlived = False

    def still_leaked(self) -> list[int]:
        stamp = self.record.ledgers[self.pool].stamp
        return [b for b, s in self.stamps.items() if stamp[b] == s]


class LeakSummary:
    """The candidates of the run, judged at its end."""

    def __init__(self, tracker) -> None:
        self.tracker = tracker
        self.candidates: list[Candidate] = []
        self.wide_labels: set = set()
        """Owner labels of blocks handed out outside tests (the plugin's fixture labels)."""

    def install(self) -> None:
        gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase, info) -> None:
        # After a full collection, an allocator still alive outlived every test noted before
        # it. Runs inside the collector: flags only, no list changes.
        if phase == "stop" and info.get("generation") == 2:
            for candidate in self.candidates:
                if not candidate.outlived and candidate.record.ref() is not None:
                    candidate.outlived = True

    def note(self, test: str, found) -> None:
        """``found``: the ``(record, pool, ids)`` a test left live at its teardown."""
        for record, pool, ids in found:
            self.candidates.append(Candidate(test, record, pool, ids))

    def judge(self) -> list:
        """The leak violations of the run, as ``(nodeid, violation)``: a full collection first,
        so that only allocators something still references count as alive."""
        gc.collect()
        out = []
        for c in self.candidates:
            if c.record.ref() is None and not c.outlived:
                continue  # died with its test
            ids = c.still_leaked()
            if ids:
                ledger = c.record.ledgers[c.pool]
                out.append((c.test, leak_violation(
                    c.record, c.pool, ledger, ids, c.test,
                    "at the end of the run, on an allocator that outlived the test")))
        self.candidates = []
        index = OWNERS.index
        wanted = {index[label] for label in self.wide_labels if label in index} | {0}
        for record in self.tracker.records():
            if record.ref() is None:
                continue
            for pool, ledger in list(record.ledgers.items()):
                ids = owned_live(ledger, wanted)
                if ids:
                    out.append((OUTSIDE_TESTS, leak_violation(
                        record, pool, ledger, ids, "the session (at import or by a fixture "
                        "wider than a test)", "at the end of the run")))
        return out
