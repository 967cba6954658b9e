"""``-p no_pin_memory``: DeepSpeed's ``BlockedAllocator`` builds its free list with
``torch.arange(..., pin_memory=True)``, which CPU-only torch refuses; without a GPU the flag is
dropped, as the project's own tests do (``tests/kvguard/adapters/engines.py``, ``NoPinTorch``)."""

import torch

_arange = torch.arange


def _arange_without_pinning(*args, **kwargs):
    if not torch.cuda.is_available():
        kwargs.pop("pin_memory", None)
    return _arange(*args, **kwargs)


torch.arange = _arange_without_pinning
