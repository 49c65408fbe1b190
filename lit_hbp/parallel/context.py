"""The SP context of the micro-batch being trained, read by the attention function.

The strategy activates the level's context before the forward; attention reads it. One
process trains one micro-batch at a time, so a module-level slot is enough.
"""

from __future__ import annotations

from lit_hbp.parallel.groups import SPContext

_active: list[SPContext | None] = [None]


def activate(ctx: SPContext | None) -> None:
    _active[0] = ctx


def active() -> SPContext | None:
    return _active[0]
