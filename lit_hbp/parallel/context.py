"""The SP context of the micro-batch being trained, read by the attention function.

The strategy activates the level's group and SP kind when it hands a micro-batch over; attention
reads them inside a packed call (the micro-batch's context-parallel geometry travels with the call,
``hbp_cp_shard``). One process trains one micro-batch at a time, so module-level slots are enough.
"""

from __future__ import annotations

from lit_hbp.parallel.groups import SPContext
from lit_hbp.parallel.kind import SPKind, resolve_sp_kind

_active: list = [None, None]


def activate(ctx: SPContext | None, kind: SPKind | str = "ulysses") -> None:
    _active[0], _active[1] = ctx, (resolve_sp_kind(kind) if isinstance(kind, str) else kind)


def active() -> SPContext | None:
    return _active[0]


def active_kind() -> SPKind:
    """How the active context splits the pack (Ulysses unless a level named another kind)."""
    return _active[1] if _active[1] is not None else resolve_sp_kind("ulysses")
