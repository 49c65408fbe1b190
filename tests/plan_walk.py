"""The independent reference of the simulator's epoch: a walk over a plan's steps, micro-steps and SP groups."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def epoch_seconds(plan, cost, group_seconds: Callable[[object, np.ndarray], float]) -> float:
    """Each micro-step as long as its slowest group (``group_seconds(level, the group's sample indices)``), each
    optimizer step's gradient sync after it, summed over the plan."""
    total = 0.0
    for step in plan.steps:
        lv = plan.levels[step.level]
        for micro in step.micro:
            total += max(group_seconds(lv, np.concatenate(group).astype(int)) for group in micro)
        total += cost.grad_sync_seconds(plan.accumulate)
    return total
