"""Pausing Python's cyclic garbage collector while the checker builds many objects.

The conversion and the analysis of a module, and reading the project index from its
cache, make hundreds of thousands of small objects and no reference cycles worth
collecting on the way: with the cyclic collector on, its passes over the whole heap
(flake8's included) take as long as the work itself. It is paused for one such piece
of work and restored as it was. What the checker leaves behind holds no cycle
(events.py breaks the one it makes), so reference counting frees it.
"""

from __future__ import annotations

import gc


class gc_paused:
    """`with gc_paused():` the cyclic collector off, then back as it was."""

    def __enter__(self):
        self.enabled = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            gc.enable()
        return False
