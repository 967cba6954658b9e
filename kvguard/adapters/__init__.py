"""Built-in specs for the allocators the serving engines ship, registered by dotted name.

Nothing here imports an engine: a spec is a plain ``AllocatorSpec`` keyed by the class's dotted
name, and it takes effect only once the engine's own module is imported.
"""

from __future__ import annotations

from .deepspeed import SPECS as _DEEPSPEED

BUILTIN_SPECS = {**_DEEPSPEED}
