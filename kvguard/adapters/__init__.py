"""Built-in specs for the allocators the serving engines ship, registered by dotted name.

Nothing here imports an engine (or torch): a spec is a plain ``AllocatorSpec`` keyed by the
class's dotted name, and it takes effect only once the engine's own module is imported. One
module per engine, each with ``SPECS``; ``methods`` holds the wrappers for what a spec's
keywords cannot say (extra allocating/freeing methods, resets, deferred frees).
"""

from __future__ import annotations

from .deepspeed import BOUNDARIES as _DEEPSPEED_BOUNDARIES
from .deepspeed import SPECS as _DEEPSPEED
from .huggingface import BOUNDARIES as _HUGGINGFACE_BOUNDARIES
from .huggingface import SPECS as _HUGGINGFACE
from .lmcache import BOUNDARIES as _LMCACHE_BOUNDARIES
from .lmcache import SPECS as _LMCACHE
from .sglang import BOUNDARIES as _SGLANG_BOUNDARIES
from .sglang import FUNCTION_BOUNDARIES as _SGLANG_FUNCTIONS
from .sglang import SPECS as _SGLANG
from .vllm import BOUNDARIES as _VLLM_BOUNDARIES
from .vllm import SPECS as _VLLM

BUILTIN_SPECS = {**_DEEPSPEED, **_VLLM, **_SGLANG, **_HUGGINGFACE, **_LMCACHE}

BUILTIN_BOUNDARIES = {**_DEEPSPEED_BOUNDARIES, **_VLLM_BOUNDARIES, **_HUGGINGFACE_BOUNDARIES,
                      **_SGLANG_BOUNDARIES, **_LMCACHE_BOUNDARIES}
"""The engines' request and step boundaries (``kvguard.boundaries``), by dotted class name."""

BUILTIN_FUNCTION_BOUNDARIES = {**_SGLANG_FUNCTIONS}
"""Module-level functions that act for one request (``kvguard.boundaries.declare_function``)."""
