"""The ``kvguard`` logger, and ``emit``, which logs through it and never raises.

A handler or filter on the ``kvguard`` logger that raises (disk full, a JSON handler without
``handleError``) costs the line, never the guarded call: ``EMISSIONS.lost`` counts such lines.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("kvguard")


class _Emissions:
    """Log lines kvguard could not emit."""

    lost = 0


EMISSIONS = _Emissions()


def emit(level: int, message: str, *args, **kwargs) -> None:
    """Log through the ``kvguard`` logger; never raises (see ``EMISSIONS``)."""
    try:
        logger.log(level, message, *args, **kwargs)
    except Exception:
        EMISSIONS.lost += 1
