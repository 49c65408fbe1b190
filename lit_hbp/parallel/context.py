"""The SP group a packed call runs its attention over: it travels with the call.

``HBPStrategy`` hands each micro-batch over with its level's group and SP kind (``PackedBatch.sp_group``,
an ``SPCall``); ``pack_inputs`` puts it into the call's keywords (``hbp_sp``), which
transformers passes down to every attention call, and a checkpointed layer's recomputation gets the
same keywords back. Nothing is activated in the process: a call made after the micro-batch (a
recomputation in the backward, another micro-batch's call on another level) cannot read a group
that is not its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lit_hbp.parallel.groups import SPContext
from lit_hbp.parallel.kind import SPKind, resolve_sp_kind

if TYPE_CHECKING:
    from lit_hbp.data.batch import PackedBatch


@dataclass(frozen=True)
class SPCall:
    """The group (``ctx``: this rank's view of the level's layout) and the kind that split a packed
    call's pack."""

    ctx: SPContext
    kind: SPKind

    @property
    def size(self) -> int:
        return self.ctx.size

    @classmethod
    def of(cls, ctx: SPContext, kind: str | SPKind) -> SPCall:
        """The call's SP group from a layout's context and a kind (its name, or the kind)."""
        return cls(ctx, resolve_sp_kind(kind) if isinstance(kind, str) else kind)


def sp_call(batch: PackedBatch) -> SPCall | None:
    """The SP group and kind of ``batch``'s level (None at sp 1), refusing a shard without its group."""
    if int(batch.sp) == 1:
        return None
    group = batch.sp_group
    if group is None or group.size != int(batch.sp) or group.kind.name != resolve_sp_kind(batch.sp_kind).name:
        have = "none" if group is None else f"{group.kind.name} over {group.size} rank(s)"
        raise ValueError(
            f"this micro-batch (level {batch.level}) is a shard for sequence parallelism {batch.sp} but came with "
            f"{have} as its SP group: levels with sp > 1 train under lit_hbp.HBPStrategy, which hands each "
            "micro-batch over with its level's group"
        )
    return group
