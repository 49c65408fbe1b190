"""Sequence-parallel process groups for every degree the levels use, built once at setup.

``torch.distributed.new_group`` is a collective over the whole world: every rank must create every
group, in the same order. So all groups of all degrees are created up front, and switching level
later only picks an existing group: no creation, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lit_hbp.parallel.topology import sp_coords, sp_group_ranks


@dataclass(frozen=True)
class SPContext:
    """This rank's view of one SP degree: its group handle, the group size, its rank inside it."""

    group: object
    size: int
    rank: int
    ranks: tuple[int, ...]


class SPGroups:
    """All SP contexts of a run, keyed by degree (degree 1 needs no group)."""

    def __init__(self, degrees, world_size: int, rank: int):
        self.world_size, self.rank = world_size, rank
        self.contexts: dict[int, SPContext] = {1: SPContext(None, 1, 0, (rank,))}
        self.ensure(degrees)

    def ensure(self, degrees) -> None:
        """Build the groups of the degrees not built yet (a collective: every rank, same degrees).
        Lets one set of groups serve many short runs, e.g. the measured level search's probes."""
        for sp in sorted({int(d) for d in degrees} - set(self.contexts)):
            mine = None
            for ranks in sp_group_ranks(self.world_size, sp):
                group = dist.new_group(ranks)  # collective: every rank creates every group
                if self.rank in ranks:
                    mine = SPContext(group, sp, sp_coords(self.rank, sp)[1], tuple(ranks))
            self.contexts[sp] = mine

    def __getitem__(self, sp: int) -> SPContext:
        try:
            return self.contexts[sp]
        except KeyError:
            raise KeyError(f"no SP group of degree {sp} was built (degrees: {sorted(self.contexts)})") from None
