"""Sequence-parallel process groups for every layout the levels use, built once at setup.

``torch.distributed.new_group`` is a collective over the whole world: every rank must create every
group, in the same order. So all groups of all layouts are created up front, and switching level
later only picks an existing group: no creation, no communication.

A layout is (sp, cp): sp = ulysses x cp ranks, Ulysses groups contiguous (inside a node), CP groups
strided across them (``lit_hbp.parallel.topology``). Degree d of Ulysses alone is the layout (d, 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lit_hbp.parallel.topology import cp_group_ranks, layout_coords, sp_coords, sp_group_ranks


@dataclass(frozen=True)
class SPContext:
    """This rank's view of one SP layout: its group handle, the group size, its rank inside it; with
    context parallelism (cp > 1) also the contexts of its Ulysses and CP sub-groups."""

    group: object
    size: int
    rank: int
    ranks: tuple[int, ...]
    ulysses: SPContext | None = None
    cp: SPContext | None = None

    @property
    def cp_size(self) -> int:
        return self.cp.size if self.cp is not None else 1


Layout = tuple[int, int]


def as_layout(key: int | Layout) -> Layout:
    """A degree d is the layout (d, 1)."""
    return (int(key), 1) if isinstance(key, int) else (int(key[0]), int(key[1]))


class SPGroups:
    """All SP contexts of a run, keyed by layout (sp, cp); a bare degree d means (d, 1). Degree 1
    needs no group."""

    def __init__(self, layouts, world_size: int, rank: int, timeout: timedelta | None = None):
        self.world_size, self.rank, self.timeout = world_size, rank, timeout  # the strategy's, as its world's
        self.contexts: dict[Layout, SPContext] = {(1, 1): SPContext(None, 1, 0, (rank,))}
        self.ensure(layouts)

    def ensure(self, layouts) -> None:
        """Build the groups of the layouts not built yet (a collective: every rank, same layouts).
        Lets one set of groups serve many short runs, e.g. the measured level search's probes."""
        wanted = {as_layout(x) for x in layouts}
        plain = {(sp, 1) for sp, _ in wanted} | {(sp // cp, 1) for sp, cp in wanted}
        for sp, _ in sorted(plain - set(self.contexts)):
            self.contexts[(sp, 1)] = self._build(sp_group_ranks(self.world_size, sp), sp_coords(self.rank, sp)[1])
        for sp, cp in sorted(wanted - set(self.contexts)):
            u = sp // cp
            if u == 1:  # CP alone: its group is the whole SP group, already built
                cp_ctx = self.contexts[(sp, 1)]
            else:
                cp_rank = layout_coords(sp_coords(self.rank, sp)[1], u)[0]
                cp_ctx = self._build(cp_group_ranks(self.world_size, sp, cp), cp_rank)
            whole = self.contexts[(sp, 1)]
            self.contexts[(sp, cp)] = SPContext(
                whole.group, sp, whole.rank, whole.ranks, ulysses=self.contexts[(u, 1)], cp=cp_ctx
            )

    def _build(self, all_ranks: list[list[int]], rank_in_group: int) -> SPContext | None:
        """One group per rank list (a collective: every rank creates every group); this rank's."""
        mine = None
        for ranks in all_ranks:
            group = dist.new_group(ranks, timeout=self.timeout) if len(ranks) > 1 else None
            if self.rank in ranks:
                mine = SPContext(group, len(ranks), rank_in_group, tuple(ranks))
        return mine

    def __getitem__(self, key: int | Layout) -> SPContext:
        try:
            return self.contexts[as_layout(key)]
        except KeyError:
            raise KeyError(f"no SP group of layout {key} was built (layouts: {sorted(self.contexts)})") from None
