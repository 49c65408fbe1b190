"""The HBP planner: invariants over random inputs, hand-computed metrics, curriculum, bad input."""

import subprocess
import sys

import numpy as np
import packing_reference as ref
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lit_hbp.errors import ConfigError
from lit_hbp.packing import Level, plan_hbp, plan_single_level, plan_sorted_batching
from lit_hbp.packing.levels import as_level


@st.composite
def setups(draw):
    world = draw(st.sampled_from([1, 2, 4, 8]))
    n_levels = draw(st.integers(1, 3))
    lens = sorted(draw(st.lists(st.integers(8, 600), min_size=n_levels, max_size=n_levels, unique=True)))
    levels = []
    for pack_len in lens:
        sp = draw(st.sampled_from([d for d in (1, 2, 4, 8) if world % d == 0 and d <= pack_len]))
        levels.append(Level(pack_len, sp, draw(st.integers(0, 3)), draw(st.integers(1, 3))))
    n = draw(st.integers(1, 150))
    top = lens[-1]
    sizes = st.one_of(st.integers(0, top + 50), st.sampled_from(sorted({0, 1, top, top + 1, *lens})))
    lengths = np.array(draw(st.lists(sizes, min_size=n, max_size=n)), dtype=np.int64)
    lengths[draw(st.integers(0, n - 1))] = draw(st.integers(1, top))  # at least one packable sample
    loss = np.array([draw(st.integers(0, max(int(x) - 1, 0))) for x in lengths], dtype=np.int64)
    return dict(
        lengths=lengths,
        loss_tokens=loss,
        levels=levels,
        world_size=world,
        accumulate=draw(st.integers(1, 4)),
        seed=draw(st.integers(0, 2**32 - 1)),
        over_length=draw(st.sampled_from(["drop", "truncate"])),
        packer=draw(st.sampled_from(["bfd", "ffd", "isf", "ffs", "mffd", "spfhp", "greedy", "random"])),
        warmup_steps=draw(st.integers(0, 5)),
    )


def check_plan(plan, kw):
    lengths, levels = kw["lengths"], plan.levels
    top = levels[-1].pack_len
    over = np.flatnonzero(lengths > top)
    zero = np.flatnonzero(lengths == 0)
    if kw["over_length"] == "drop":
        assert np.array_equal(plan.dropped, over) and plan.truncated.size == 0
    else:
        assert np.array_equal(plan.truncated, over) and plan.dropped.size == 0
        assert np.all(plan.lengths[over] == top)
    assert np.array_equal(plan.zero_length, zero)
    expected = np.setdiff1d(np.arange(lengths.size), np.r_[plan.dropped, zero])
    assert np.array_equal(np.sort(plan.members), expected), "every kept sample in exactly one pack"

    for p in range(len(plan.offsets) - 1):
        lv = levels[plan.pack_level[p]]
        members = plan.pack(p)
        assert plan.lengths[members].sum() <= lv.pack_len
        # GroupData: a sample never goes to a level smaller than its own; GreedyFill may lift it.
        for i in members:
            assert plan.lengths[i] <= lv.pack_len

    n_loss = np.zeros(plan.n_steps)
    for s, step in enumerate(plan.steps):
        lv = levels[step.level]
        assert len(step.micro) == plan.accumulate
        for micro in step.micro:
            assert len(micro) == plan.world_size // lv.sp
            assert all(len(group) == lv.packs_per_rank for group in micro)
            n_loss[s] += sum(int(plan.loss_tokens[p].sum()) for group in micro for p in group)
        assert step.loss_norm == pytest.approx(max(n_loss[s], 1) / (plan.world_size * plan.accumulate))
    # A level's steps are all full except for completion packs, which only its last step holds.
    for i, lv in enumerate(levels):
        per_step = plan.accumulate * plan.world_size // lv.sp * lv.packs_per_rank
        level_steps = np.flatnonzero(plan.step_level == i)
        empties = sum(
            int(plan.offsets[p + 1] == plan.offsets[p])
            for s in level_steps
            for p in range(plan.step_offsets[s], plan.step_offsets[s + 1])
        )
        assert empties == plan.report["levels"][i]["empty_packs"] < per_step
    assert plan.loss_tokens[plan.members].sum() == sum(n_loss)


@given(setups())
def test_plan_invariants(kw):
    plan = plan_hbp(**kw)
    check_plan(plan, kw)
    got = plan.metrics()
    expected = ref.metrics(plan)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@given(setups())
def test_same_seed_same_plan(kw):
    a, b = plan_hbp(**kw), plan_hbp(**kw)
    for name in ("members", "offsets", "step_level", "step_offsets", "step_loss_tokens", "pack_capacity"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def mixed_lengths(n, seed=0, top=4096):
    """Mostly short samples and a few long ones, like a chat + long-context mix."""
    rng = np.random.default_rng(seed)
    short = np.clip(np.rint(rng.lognormal(np.log(100), 1.0, n)), 1, top // 4)
    long_ = rng.integers(top // 4, top + 1, max(1, n // 50))
    return rng.permutation(np.r_[short, long_]).astype(np.int64)


def test_other_seed_other_order():
    lengths = mixed_lengths(5000)
    levels = [Level(1024), Level(4096, 2)]
    orders = {tuple(plan_hbp(lengths, levels, 4, seed=s).step_level.tolist()) for s in range(5)}
    assert len(orders) == 5
    a, b = plan_hbp(lengths, levels, 4, seed=0), plan_hbp(lengths, levels, 4, seed=1)
    assert not np.array_equal(a.members, b.members)

    # Same packs, other order: the seed shuffles steps, it does not change what is packed.
    def packs(p):
        return sorted(tuple(sorted(p.pack(i).tolist())) for i in range(len(p.offsets) - 1))

    assert packs(a) == packs(b)


@given(setups())
def test_micro_batches_follow_the_sp_topology(kw):
    plan = plan_hbp(**kw)
    per_rank = [list(plan.micro_batches(r)) for r in range(plan.world_size)]
    assert all(len(x) == plan.n_micro_steps for x in per_rank)
    seen = []
    for k in range(plan.n_micro_steps):
        batches = [per_rank[r][k] for r in range(plan.world_size)]
        lv = plan.levels[batches[0].level]
        assert len({(b.step, b.micro, b.level, b.loss_norm) for b in batches}) == 1, "all ranks on one level"
        for r, b in enumerate(batches):
            same_group = batches[(r // lv.sp) * lv.sp]
            assert all(np.array_equal(x, y) for x, y in zip(b.packs, same_group.packs))
            if r % lv.sp == 0:
                seen.extend(int(i) for p in b.packs for i in p)
    assert sorted(seen) == sorted(plan.members.tolist())
    # Resuming at any micro-step yields exactly the rest.
    start = plan.n_micro_steps // 2
    rest = list(plan.micro_batches(plan.world_size - 1, start=start))
    assert [(b.step, b.micro) for b in rest] == [(b.step, b.micro) for b in per_rank[-1][start:]]


def test_curriculum_moves_short_steps_first_and_drops_nothing():
    lengths = mixed_lengths(4000, top=8192)
    levels = [Level(1024), Level(8192, 4)]
    base = plan_hbp(lengths, levels, 8, seed=3)
    cur = plan_hbp(lengths, levels, 8, seed=3, warmup_steps=10)
    assert np.all(cur.step_level[:10] == 0)
    assert cur.report["curriculum_moved"] == 10

    def steps(p):
        return sorted(
            tuple(p.members[p.offsets[a] : p.offsets[b]].tolist())
            for a, b in zip(p.step_offsets[:-1], p.step_offsets[1:])
        )

    assert steps(base) == steps(cur), "deferred, never dropped"
    # The long steps keep their relative order; only short ones move ahead.
    long_base = [tuple(base.pack(p).tolist()) for p in range(len(base.offsets) - 1) if base.pack_level[p] == 1]
    long_cur = [tuple(cur.pack(p).tolist()) for p in range(len(cur.offsets) - 1) if cur.pack_level[p] == 1]
    assert long_base == long_cur
    # Asking for more warm-up than there are short steps moves them all and says so.
    many = plan_hbp(lengths, levels, 8, seed=3, warmup_steps=10_000)
    n_short = int((many.step_level == 0).sum())
    assert np.all(many.step_level[:n_short] == 0) and many.report["curriculum_moved"] == n_short
    # short_levels picks the levels by pack length.
    chosen = plan_hbp(lengths, levels, 8, seed=3, warmup_steps=5, short_levels=[8192])
    assert np.all(chosen.step_level[:5] == 1)


def test_paper_attention_example_two_ranks():
    """Packs {1K,1K,1K,1K} and {2K,2K}: attention 4K^2 vs 8K^2 on two ranks.

    docs/design.md's ABR = sum_i (A_max - A_i) / (A_max * N) is the idle share of all device time:
    (8 - 4) / (8 * 2) = 0.25. The paper quotes 0.5 for this example, which is the idle share of
    the lighter rank alone, (A_max - A_min) / A_max."""
    K = 1024
    plan = plan_single_level([K, K, K, K, 2 * K, 2 * K], Level(4 * K), world_size=2, packer="greedy")
    m = plan.metrics()
    assert m["abr"] == pytest.approx(0.25)
    attention = sorted(plan.pack_attention.tolist())
    assert attention == [4 * K * K, 8 * K * K]
    assert (attention[1] - attention[0]) / attention[1] == pytest.approx(0.5)
    assert m["dbr"] == 0 and m["pr"] == 0 and m["cr"] == 0 and m["ave_t"] == 4 * K


def test_hand_computed_metrics_with_sp_and_completion():
    # World 4, one level sp 2: two SP groups per micro-step. Packs (greedy, in order): [400],
    # [200, 200], [100]; accumulate 1 -> micro-steps of 2 packs -> 2 steps, one empty pack.
    plan = plan_single_level([400, 200, 200, 100], Level(400, 2), world_size=4, packer="greedy", balance=True)
    m = plan.metrics()
    # Sorted by attention: [400] (160000), [200,200] (80000) | [100] (10000), empty.
    # Step 1 ranks: T = 200,200,200,200; A = 80000,80000,40000,40000 -> DBR 0, ABR 0.25.
    # Step 2 ranks: T = 50,50,0,0 -> DBR 0.5; A = 5000,5000,0,0 -> ABR 0.5.
    assert m["dbr"] == pytest.approx(0.25)
    assert m["abr"] == pytest.approx((0.25 + 0.5) / 2)
    assert m["pr"] == pytest.approx(1 - 900 / 1600)
    assert m["fill"] == pytest.approx(900 / 1200)
    assert m["cr"] == 1.0
    assert m["ave_t"] == pytest.approx((800 / 4 + 100 / 4) / 2)
    assert (m["n_steps"], m["n_packs"], m["n_empty_packs"]) == (2, 3, 1)


def test_hierarchical_levels_fill_and_communication_ratio():
    # Level 0 (sp 1) gets 3 x 100; level 1 (sp 2) gets one 300 sample and GreedyFill tops its
    # 400-token pack up with one 100 sample from level 0.
    plan = plan_hbp([100, 100, 100, 300], [Level(100), Level(400, 2)], world_size=2)
    assert plan.report["levels"][1]["filled_from_below"] == 1
    m = plan.metrics()
    assert m["cr"] == pytest.approx(400 / 600)
    assert m["fill"] == 1.0 and m["n_empty_packs"] == 0


def test_packs_per_rank_balances_groups_longest_first():
    # World 2, B = 2: the four packs of one micro-step go to two groups, largest attention first.
    # One sample per pack; attention 8100, 6400, 4900, 3600. LPT: 90 -> g0, 80 -> g1, 70 -> g1
    # (6400 < 8100), 60 -> g0. Plain consecutive batching would give [90, 80] and [70, 60].
    lengths = [70, 90, 60, 80]
    plan = plan_single_level(lengths, Level(90, 1, 0, 2), world_size=2, packer="greedy", balance=True)
    (step,) = plan.steps
    groups = [sorted(int(plan.lengths[i]) for p in g for i in p) for g in step.micro[0]]
    assert groups == [[60, 90], [70, 80]]


def test_sorted_batching_pads_to_the_longest_of_each_batch():
    plan = plan_sorted_batching([10, 50, 20, 40, 30, 60], max_len=64, world_size=2, batch_size=2)
    # Sorted: 60 50 | 40 30 | 20 10 -> capacities 60 60 40 40 20 20 (+2 empty completions of 64).
    assert sorted(plan.pack_capacity.tolist()) == [20, 20, 40, 40, 60, 60, 64, 64]
    m = plan.metrics()
    assert m["fill"] == pytest.approx(210 / 240)
    groups = [sorted(int(plan.lengths[i]) for p in g for i in p) for s in plan.steps for g in s.micro[0]]
    assert sorted(groups) == [[], [10, 20], [30, 40], [50, 60]]


def test_zero_length_and_zero_loss_samples_are_reported():
    plan = plan_hbp([5, 0, 7, 3], [Level(16)], world_size=1, loss_tokens=[4, 0, 0, 2])
    assert plan.zero_length.tolist() == [1]
    assert plan.zero_loss.tolist() == [2]
    assert sorted(plan.members.tolist()) == [0, 2, 3]
    text = plan.summary()
    assert "zero-length, not packed: index 1 = 0" in text
    assert "without supervised tokens (packed): index 2 = 7" in text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lengths=[]), "empty dataset"),
        (dict(lengths=[5, -3]), "negative at index 1 = -3"),
        (dict(lengths=[5, 2.5]), "must be integers: index 1 = 2.5"),
        (dict(levels=[Level(64), Level(32)]), "strictly increasing in pack_len, got [64, 32]"),
        (dict(levels=[Level(32), Level(32, 2)]), "strictly increasing"),
        (dict(levels=[Level(32, 3)]), "world_size 4 is not divisible by sp 3 of level 0"),
        (dict(levels=[Level(32, 8)]), "sp 8 > world_size 4"),
        (dict(levels=[]), "no levels given"),
        (dict(lengths=[5, 40, 50]), "2 sample(s) longer than the largest level (32 tokens): index 1 = 40"),
        (dict(over_length="clip"), "over_length must be one of"),
        (dict(loss_tokens=[1, 2]), "loss_tokens has 2 entries but lengths has 3"),
        (dict(loss_tokens=[4, 0, 0]), "index 0: 4 > 3"),
        (dict(accumulate=0), "accumulate must be a positive int"),
        (dict(warmup_steps=-1), "warmup_steps must be an int >= 0"),
        (dict(seed=-1), "seed must be an int >= 0, got -1"),
        (dict(world_size=0), "world_size must be a positive int, got 0"),
        (dict(short_levels=[7]), "HBPCurriculum short_levels: 7 is not the pack_len of a level"),
        (dict(packer="nope"), "unknown packer"),
        (dict(lengths=[0, 40], over_length="drop"), "nothing to pack: all 2 samples are zero-length (1)"),
    ],
)
def test_bad_input(kwargs, message):
    args = dict(lengths=[4, 9, 16], levels=[Level(32)], world_size=4)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError)) as e:
        plan_hbp(**args)
    assert message in str(e.value)


def test_numpy_integers_are_taken_for_the_world_as_for_the_seed_and_accumulation():
    plan = plan_hbp([4, 9, 16], [Level(32)], world_size=np.int64(2), accumulate=np.int64(1), seed=np.int64(3))
    same = plan_hbp([4, 9, 16], [Level(32)], world_size=2, accumulate=1, seed=3)
    assert plan.summary() == same.summary() and plan.n_micro_steps == same.n_micro_steps
    for k in range(plan.n_micro_steps):
        for r in (0, 1):
            assert [list(p) for p in plan.micro_batch(r, k).packs] == [list(p) for p in same.micro_batch(r, k).packs]


def test_level_validation_and_parsing():
    assert Level.parse("16K:1") == Level(16384, 1)
    assert Level.parse("131072:8:28:2") == Level(131072, 8, 28, 2)
    for bad, message in [("x:1", "not a non-negative integer"), ("1:2:3:4:5", "expected PACK_LEN")]:
        with pytest.raises(ValueError, match=message):
            Level.parse(bad)
    with pytest.raises(ValueError, match="sp must be >= 1"):
        Level(10, 0)
    with pytest.raises(TypeError, match="pack_len must be an int"):
        Level(10.5)
    with pytest.raises(ValueError, match="smaller than its sp"):
        Level(2, 4)
    # A config's mapping takes the suffixes its strings take; a bad value names the level and the field.
    assert as_level({"pack_len": "4k", "sp": "2", "ckpt_layers": 3}) == Level(4096, 2, 3)
    for bad, message in [
        ({"pack_len": "4x"}, r"data.levels\[1\]: pack_len must be a whole number .* got '4x'"),
        ({"pack_len": 4096.5}, r"data.levels\[1\]: pack_len must be a whole number"),
        ({"pack_len": 4096, "spp": 2}, r"data.levels\[1\]: unknown level field\(s\) \['spp'\]"),
        ("4K:x", r"data.levels\[1\]: bad level spec '4K:x'"),
        ([4096], r"data.levels\[1\]: cannot read a level from \[4096\]"),
    ]:
        with pytest.raises(ConfigError, match=message):
            as_level(bad, "data.levels[1]")


def test_packing_core_does_not_import_torch():
    code = "import sys, lit_hbp.packing, lit_hbp.packing.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_extra_work_per_sample_is_balanced_across_ranks_beside_attention():
    """A vision-language epoch: 30% of the samples carry image-encoding work beside their attention.
    Planned with it (extra_work), each micro-step's slowest rank does less more than the mean than
    when the plan weighs attention alone, measured on the true work (squared lengths + extra); with no
    extra work the plan is the attention-only plan, pack for pack."""
    rng = np.random.default_rng(0)
    n = 3000
    lengths = rng.integers(200, 1000, n)
    extra = np.where(rng.random(n) < 0.3, rng.uniform(0, 3e6, n), 0.0)
    work = lengths.astype(np.float64) ** 2 + extra
    levels, world = [Level(2048)], 8

    def excess(plan) -> float:
        """Mean over micro-steps of (slowest rank's work / mean rank's work) - 1, on the true work."""
        out = []
        for step in plan.steps:
            for groups in step.micro:
                loads = np.array([sum(work[p].sum() for p in packs) for packs in groups])
                out.append(loads.max() / loads.mean() - 1)
        return float(np.mean(out))

    weighed = plan_hbp(lengths, levels, world, seed=0, extra_work=extra)
    blind = plan_hbp(lengths, levels, world, seed=0)
    assert excess(weighed) < 0.5 * excess(blind), (excess(weighed), excess(blind))
    same = plan_hbp(lengths, levels, world, seed=0, extra_work=np.zeros(n))
    assert np.array_equal(same.members, blind.members) and np.array_equal(same.offsets, blind.offsets)
    with pytest.raises(ValueError, match="extra_work must hold one finite value >= 0 per sample"):
        plan_hbp(lengths, levels, world, extra_work=-extra)
