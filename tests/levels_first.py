"""Force the levels a short test run visits, instead of hoping the plan draws them.

A plan's step order is a seeded shuffle of the data's packs; which levels the first few steps of a
test run hit depends on the data, and the demo data is built from the machine's own Python standard
library, so it differs between Python builds. A test that asserts a behaviour of every level runs
with ``EachLevelFirst``: the first optimizer step of each level moves to the front of the epoch (in
level order), the rest keep the plan's order. The steps themselves (packs, loss normalizer) are the
plan's, untouched.
"""

from __future__ import annotations

import dataclasses

import lightning as L
import numpy as np

from lit_hbp.packing import Plan


def each_level_first(plan: Plan) -> Plan:
    """``plan`` with the first step of every level that has one moved to the front, in level order."""
    levels = plan.step_level
    first = [int(np.flatnonzero(levels == lv)[0]) for lv in range(len(plan.levels)) if (levels == lv).any()]
    order = np.r_[first, np.setdiff1d(np.arange(plan.n_steps), first)].astype(np.int64)
    counts = np.diff(plan.step_offsets)[order]
    packs = np.concatenate([np.arange(plan.step_offsets[s], plan.step_offsets[s + 1]) for s in order])
    sizes = np.diff(plan.offsets)[packs]
    members = np.concatenate([plan.pack(int(p)) for p in packs]) if packs.size else plan.members
    return dataclasses.replace(
        plan,
        members=members,
        offsets=np.r_[0, np.cumsum(sizes)].astype(np.int64),
        pack_capacity=plan.pack_capacity[packs],
        step_level=levels[order],
        step_offsets=np.r_[0, np.cumsum(counts)].astype(np.int64),
        step_loss_tokens=plan.step_loss_tokens[order],
    )


class EachLevelFirst(L.Callback):
    """Train the first step of each level first in epoch 0 (``each_level_first``): a run of
    ``len(levels)`` optimizer steps visits every level with data. Usable from the command line
    (``--trainer.callbacks+=levels_first.EachLevelFirst`` with ``tests/`` on the PYTHONPATH)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = trainer.datamodule
        planned, reordered = dm.plan_for_epoch, {}

        def plan_for_epoch(epoch: int) -> Plan:
            plan = planned(epoch)
            if epoch:
                return plan
            if reordered.get("of") is not plan:  # the data module re-plans after set_curriculum
                reordered.update(of=plan, plan=each_level_first(plan))
            return reordered["plan"]

        dm.plan_for_epoch = plan_for_epoch
