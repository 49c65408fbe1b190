"""The SP context of the micro-batch being trained, read by the attention function.

The strategy activates the level's group and SP kind before the forward; the module sets the
micro-batch's context-parallel geometry (``set_shard``) for each forward; attention reads them. One
process trains one micro-batch at a time, so module-level slots are enough.
"""

from __future__ import annotations

from lit_hbp.data.batch import CPShard
from lit_hbp.parallel.groups import SPContext
from lit_hbp.parallel.kind import SPKind, resolve_sp_kind

_active: list = [None, None]
_shard: list[CPShard | None] = [None]


def set_shard(shard: CPShard | None) -> None:
    """The CP geometry of the micro-batch being trained (None without CP); stays set through its
    backward, whose checkpointed layers attend again."""
    _shard[0] = shard


def active_shard() -> CPShard | None:
    return _shard[0]


def activate(ctx: SPContext | None, kind: SPKind | str = "ulysses") -> None:
    _active[0], _active[1] = ctx, (resolve_sp_kind(kind) if isinstance(kind, str) else kind)


def active() -> SPContext | None:
    return _active[0]


def active_kind() -> SPKind:
    """How the active context splits the pack (Ulysses unless a level named another kind)."""
    return _active[1] if _active[1] is not None else resolve_sp_kind("ulysses")
