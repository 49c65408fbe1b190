"""The test helper that forces the levels a short run visits (``levels_first``): the reordered plan
is the same steps, with the first step of each level in front."""

import numpy as np
from hypothesis import given
from levels_first import each_level_first
from test_plan import setups

from lit_hbp.packing import plan_hbp


def _same_step(a, b) -> bool:
    flat = lambda step: [p.tolist() for micro in step.micro for group in micro for p in group]  # noqa: E731
    return a.level == b.level and a.loss_norm == b.loss_norm and flat(a) == flat(b)


@given(setups())
def test_each_level_first_moves_each_levels_first_step_to_the_front(kw):
    plan = plan_hbp(**kw)
    moved = each_level_first(plan)
    firsts = []
    for s, step in enumerate(plan.steps):  # brute force: scan for each level's first step
        if step.level not in [plan.steps[f].level for f in firsts]:
            firsts.append(s)
    firsts.sort(key=lambda s: plan.steps[s].level)
    order = firsts + [s for s in range(plan.n_steps) if s not in firsts]
    assert moved.n_steps == plan.n_steps
    assert all(_same_step(moved.steps[i], plan.steps[s]) for i, s in enumerate(order))
    assert [moved.steps[i].level for i in range(len(firsts))] == sorted({s.level for s in plan.steps})
    for i, s in enumerate(order):  # each pack keeps its capacity
        a, b = moved.step_offsets[i : i + 2], plan.step_offsets[s : s + 2]
        np.testing.assert_array_equal(moved.pack_capacity[a[0] : a[1]], plan.pack_capacity[b[0] : b[1]])
    np.testing.assert_array_equal(np.sort(moved.members), np.sort(plan.members))
