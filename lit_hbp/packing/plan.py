"""The epoch plan: HBP balance packing, and the naive baselines on the same API (numpy only).

A plan is a pure function of (lengths, loss_tokens, levels, world_size, accumulate, seed): every rank
computes the same plan and reads its own part, so no data placement is ever communicated.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

from lit_hbp.errors import ConfigError, DataError
from lit_hbp.packing.bins import Bins, check_lengths, describe_indices
from lit_hbp.packing.levels import Level, as_level, sp_coords, validate_levels
from lit_hbp.packing.metrics import plan_metrics
from lit_hbp.packing.packers import DEFAULT_PACKER, fit_decreasing, run_packer

OVER_LENGTH = ("error", "drop", "truncate")


@dataclass(frozen=True)
class Step:
    """One optimizer step: ``micro[m][g]`` is the list of B packs (sample index arrays) that SP group
    g holds at micro-step m. ``level`` indexes ``Plan.levels``."""

    level: int
    micro: list[list[list[np.ndarray]]]
    loss_norm: float


@dataclass(frozen=True)
class MicroBatch:
    """What one rank trains on at one micro-step."""

    step: int
    micro: int
    level: int
    packs: list[np.ndarray]
    loss_norm: float


@dataclass
class Plan:
    """An epoch of level-tagged steps, in training order, in compact arrays.

    Packs are stored in CSR form in training order: step s covers packs
    ``[step_offsets[s], step_offsets[s + 1])``, laid out micro-step by micro-step, SP group by
    SP group, B packs per group. Empty packs (completions of a level's last step) have no members.
    """

    levels: tuple[Level, ...]
    world_size: int
    accumulate: int
    seed: int
    lengths: np.ndarray
    loss_tokens: np.ndarray
    members: np.ndarray
    offsets: np.ndarray
    pack_capacity: np.ndarray
    step_level: np.ndarray
    step_offsets: np.ndarray
    step_loss_tokens: np.ndarray
    dropped: np.ndarray
    truncated: np.ndarray
    zero_length: np.ndarray
    zero_loss: np.ndarray
    report: dict = field(default_factory=dict)

    @property
    def n_steps(self) -> int:
        return len(self.step_level)

    @cached_property
    def step_loss_norm(self) -> np.ndarray:
        """Ave-Token normalizer of every step: loss tokens of the step / (N * A), at least 1 token."""
        return np.maximum(self.step_loss_tokens, 1) / (self.world_size * self.accumulate)

    @cached_property
    def pack_level(self) -> np.ndarray:
        return np.repeat(self.step_level, np.diff(self.step_offsets))

    @cached_property
    def pack_tokens(self) -> np.ndarray:
        return Bins(self.members, self.offsets).loads(self.lengths)

    @cached_property
    def pack_attention(self) -> np.ndarray:
        """Attention work of each pack: sum of squared sample lengths (float64, no overflow)."""
        sq = self.lengths.astype(np.float64) ** 2
        return Bins(self.members, self.offsets).loads(sq)

    def pack(self, p: int) -> np.ndarray:
        return self.members[self.offsets[p] : self.offsets[p + 1]]

    @cached_property
    def steps(self) -> list[Step]:
        out = []
        norms = self.step_loss_norm
        for s in range(self.n_steps):
            lv = self.levels[self.step_level[s]]
            groups, b = self.world_size // lv.sp, lv.packs_per_rank
            base = int(self.step_offsets[s])
            micro = [
                [[self.pack(base + (m * groups + g) * b + k) for k in range(b)] for g in range(groups)]
                for m in range(self.accumulate)
            ]
            out.append(Step(int(self.step_level[s]), micro, float(norms[s])))
        return out

    def micro_batch(self, rank: int, k: int) -> MicroBatch:
        """What ``rank`` trains on at global micro-step ``k`` of the epoch."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        if not 0 <= k < self.n_micro_steps:
            raise IndexError(f"micro-step {k} outside the plan's {self.n_micro_steps}")
        s, m = divmod(k, self.accumulate)
        level = int(self.step_level[s])
        lv = self.levels[level]
        groups, b = self.world_size // lv.sp, lv.packs_per_rank
        g, _ = sp_coords(rank, lv.sp)
        base = int(self.step_offsets[s]) + (m * groups + g) * b
        return MicroBatch(s, m, level, [self.pack(base + j) for j in range(b)], float(self.step_loss_norm[s]))

    def micro_batches(self, rank: int, start: int = 0) -> Iterator[MicroBatch]:
        """The micro-batches of ``rank`` in training order, from global micro-step ``start`` on."""
        for k in range(start, self.n_micro_steps):
            yield self.micro_batch(rank, k)

    @property
    def n_micro_steps(self) -> int:
        return self.n_steps * self.accumulate

    def metrics(self) -> dict:
        """DBR, ABR, PR, CR, Ave-T, fill and counts (docs/design.md section 4)."""
        return plan_metrics(self)

    def summary(self) -> str:
        """Human-readable report of what was packed, dropped, truncated and padded."""
        r = self.report
        lines = [
            f"plan: {r['n_samples']} samples, {r['n_packed']} packed into {self.n_steps} steps "
            f"(world {self.world_size}, accumulate {self.accumulate}, seed {self.seed})"
        ]
        for i, lv in enumerate(self.levels):
            d = r["levels"][i]
            lines.append(
                f"  level {i}: pack_len {lv.pack_len} sp {lv.sp}{lv.layout_note} ckpt {lv.ckpt_layers}{lv.memory_note} "
                f"B {lv.packs_per_rank}: "
                f"{d['samples']} samples ({d['filled_from_below']} filled in from smaller levels), "
                f"{d['packs']} packs, fill {d['fill']:.4f}, {d['steps']} steps, {d['empty_packs']} empty packs"
            )
        for key, what in (
            ("dropped", "dropped (over length)"),
            ("truncated", "truncated to the largest level"),
            ("zero_length", "zero-length, not packed"),
            ("zero_loss", "without supervised tokens (packed)"),
        ):
            arr = getattr(self, key)
            if arr.size:
                lines.append(f"  {arr.size} sample(s) {what}: {describe_indices(arr, self.lengths)}")
        if r.get("curriculum_requested"):
            lines.append(
                f"  curriculum: {r['curriculum_moved']} of {r['curriculum_requested']} warm-up steps "
                f"moved to the front from levels {r['short_levels']}"
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Input handling
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Inputs:
    """Validated lengths and loss tokens (over-length policy applied) and the index sets reported."""

    lengths: np.ndarray
    loss: np.ndarray
    keep: np.ndarray
    dropped: np.ndarray
    truncated: np.ndarray
    zero_length: np.ndarray
    zero_loss: np.ndarray
    work: np.ndarray  # per sample, what balancing weighs: its squared length plus its extra work


def _prepare(lengths, loss_tokens, max_len: int, over_length: str, extra_work=None) -> _Inputs:
    """Validate inputs and apply the over-length policy."""
    arr = check_lengths(lengths)
    if arr.size == 0:
        raise DataError("empty dataset: no sample lengths given (every source empty, or every sample skipped)")
    if over_length not in OVER_LENGTH:
        raise ValueError(f"over_length must be one of {OVER_LENGTH}, got {over_length!r}")
    if loss_tokens is None:
        loss = np.maximum(arr - 1, 0)
    else:
        loss = check_lengths(loss_tokens, what="loss_tokens")
        if loss.shape != arr.shape:
            raise ValueError(f"loss_tokens has {loss.size} entries but lengths has {arr.size}")
        bad = np.flatnonzero(loss > np.maximum(arr - 1, 0))
        if bad.size:
            raise ValueError(
                "loss_tokens exceed the supervised targets a sample can have (length - 1): "
                + ", ".join(f"index {int(i)}: {loss[i]} > {max(int(arr[i]) - 1, 0)}" for i in bad[:5])
            )
    over = np.flatnonzero(arr > max_len)
    dropped = truncated = np.zeros(0, dtype=np.int64)
    if over.size:
        if over_length == "error":
            raise ValueError(
                f"{over.size} sample(s) longer than the largest level ({max_len} tokens): "
                f"{describe_indices(over, arr)}. Add a larger level, or set over_length='drop' or 'truncate'."
            )
        if over_length == "drop":
            dropped = over
        else:
            truncated = over
            arr = arr.copy()
            loss = loss.copy()
            arr[over] = max_len
            # Without the label mask the planner cannot know which targets survive; this bound is
            # exact when the caller truncates itself and passes the surviving counts.
            loss[over] = np.minimum(loss[over], max_len - 1)
    zero_length = np.flatnonzero(arr == 0)
    zero_loss = np.flatnonzero((loss == 0) & (arr > 0))
    work = arr.astype(np.float64) ** 2
    if extra_work is not None:
        extra = np.asarray(extra_work, dtype=np.float64)
        if extra.shape != arr.shape or not np.all(np.isfinite(extra)) or (extra < 0).any():
            raise ValueError(
                f"extra_work must hold one finite value >= 0 per sample ({arr.size}), got shape {extra.shape}"
            )
        work = work + extra
    keep = np.ones(arr.size, dtype=bool)
    keep[dropped] = False
    keep[zero_length] = False
    if not keep.any():
        raise ValueError(
            f"nothing to pack: all {arr.size} samples are zero-length ({zero_length.size}) "
            f"or dropped as longer than {max_len} tokens ({dropped.size})"
        )
    return _Inputs(arr, loss, keep, dropped, truncated, zero_length, zero_loss, work)


def _check_common(accumulate: int, warmup_steps: int, seed: int = 0) -> None:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, (int, np.integer)) or accumulate < 1:
        raise ValueError(f"accumulate must be a positive int, got {accumulate!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, np.integer)) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")


# --------------------------------------------------------------------------------------------
# Batching packs into micro-steps and steps
# --------------------------------------------------------------------------------------------


def _order_level(
    attention: np.ndarray, level: Level, world_size: int, accumulate: int, order: str, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """Order a level's packs into steps. Returns (pack slots, steps) where a slot is a pack index or
    -1 (an empty completion pack), laid out step -> micro-step -> SP group -> B packs.

    order: "balance" (attention-balance sort, LPT inside a micro-step when B > 1), "random", or
    "given" (keep the packer's order)."""
    n = attention.size
    groups, b = world_size // level.sp, level.packs_per_rank
    per_micro = groups * b
    per_step = per_micro * accumulate
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    if order == "balance":
        ranked = np.argsort(-attention, kind="stable")
    elif order == "random":
        ranked = rng.permutation(n)
    else:
        ranked = np.arange(n)
    n_steps = -(-n // per_step)
    slots = np.full(n_steps * per_step, -1, dtype=np.int64)
    slots[:n] = ranked
    if order == "balance" and b > 1:
        slots = _lpt_within_micro_steps(slots, attention, groups, b)
    return slots, n_steps


def _lpt_within_micro_steps(slots: np.ndarray, attention: np.ndarray, groups: int, b: int) -> np.ndarray:
    """Within each micro-step, give packs (largest attention first) to the SP group with the least
    attention so far that still has a free slot: longest-processing-time-first scheduling."""
    per_micro = groups * b
    out = np.empty_like(slots)
    work = np.where(slots >= 0, attention[np.maximum(slots, 0)], 0.0)
    for start in range(0, slots.size, per_micro):
        load = [0.0] * groups
        fill = [0] * groups
        for k in range(start, start + per_micro):
            g = min((x for x in range(groups) if fill[x] < b), key=lambda x: load[x])
            out[start + g * b + fill[g]] = slots[k]
            load[g] += work[k]
            fill[g] += 1
    return out


def _assemble(
    levels: tuple[Level, ...],
    level_bins: list[Bins],
    lengths: np.ndarray,
    loss: np.ndarray,
    world_size: int,
    accumulate: int,
    seed: int,
    order: str,
    warmup_steps: int,
    short_levels,
    capacities: list[np.ndarray] | None = None,
    work: np.ndarray | None = None,
) -> tuple[dict, dict]:
    """Turn per-level bins into the plan arrays: balance sort, batching, completion, shuffle, curriculum.
    ``work``: per sample, what the balance weighs (default: its squared length, the attention work)."""
    rng_order, rng_steps = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    sq = lengths.astype(np.float64) ** 2 if work is None else work
    # One CSR over all levels' bins, plus an empty sentinel pack at the end.
    all_members = np.concatenate([b.members for b in level_bins] + [np.zeros(0, np.int64)])
    sizes = np.concatenate([b.sizes() for b in level_bins] + [np.zeros(1, np.int64)])
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    sentinel = sizes.size - 1
    caps = []
    level_slots, level_steps, step_levels = [], [], []
    first_pack = 0
    for i, (lv, bins) in enumerate(zip(levels, level_bins)):
        slots, n_steps = _order_level(bins.loads(sq), lv, world_size, accumulate, order, rng_order)
        glob = np.where(slots >= 0, slots + first_pack, sentinel)
        level_slots.append(glob.reshape(n_steps, -1) if n_steps else np.zeros((0, 0), np.int64))
        level_steps.append(n_steps)
        step_levels.append(np.full(n_steps, i, dtype=np.int64))
        first_pack += len(bins)
        cap = np.full(len(bins), lv.pack_len, np.int64) if capacities is None else capacities[i]
        caps.append(cap)
    caps.append(np.zeros(1, np.int64))
    cap_all = np.concatenate(caps)
    level_len = np.array([lv.pack_len for lv in levels], dtype=np.int64)

    step_level = np.concatenate(step_levels) if step_levels else np.zeros(0, np.int64)
    step_index = np.concatenate([np.arange(n) for n in level_steps]) if step_levels else step_level
    perm = rng_steps.permutation(step_level.size)
    short = _short_level_ids(levels, short_levels)
    moved = 0
    if warmup_steps:
        is_short = np.isin(step_level[perm], short)
        front = np.flatnonzero(is_short)[:warmup_steps]
        moved = front.size
        rest = np.setdiff1d(np.arange(perm.size), front, assume_unique=True)
        perm = perm[np.r_[front, rest]]
    step_level = step_level[perm]
    step_index = step_index[perm]

    per_step = np.array([level_slots[lv].shape[1] if level_steps[lv] else 0 for lv in range(len(levels))])
    step_sizes = per_step[step_level]
    pack_ids = (
        np.concatenate([level_slots[lv][k] for lv, k in zip(step_level.tolist(), step_index.tolist())])
        if step_level.size
        else np.zeros(0, np.int64)
    )
    psz = sizes[pack_ids]
    offsets = np.r_[0, np.cumsum(psz)].astype(np.int64)
    gather = np.repeat(starts[pack_ids] - offsets[:-1], psz) + np.arange(offsets[-1])
    members = all_members[gather]
    step_offsets = np.r_[0, np.cumsum(step_sizes)].astype(np.int64)
    step_loss = np.zeros(step_level.size, dtype=np.int64)
    if members.size:
        pack_loss = np.zeros(psz.size, dtype=np.int64)
        nz = psz > 0
        pack_loss[nz] = np.add.reduceat(loss[members], offsets[:-1][nz])
        step_loss = np.add.reduceat(pack_loss, step_offsets[:-1]) if step_level.size else step_loss
    arrays = dict(
        members=members,
        offsets=offsets,
        # An empty completion pack wastes a whole pack of its level.
        pack_capacity=np.where(pack_ids == sentinel, level_len[np.repeat(step_level, step_sizes)], cap_all[pack_ids]),
        step_level=step_level,
        step_offsets=step_offsets,
        step_loss_tokens=step_loss,
    )
    info = dict(
        curriculum_requested=int(warmup_steps),
        curriculum_moved=int(moved),
        short_levels=[levels[i].pack_len for i in short],
        level_steps=level_steps,
        level_empty=[int(level_steps[i] * per_step[i] - len(level_bins[i])) for i in range(len(levels))],
    )
    return arrays, info


def _short_level_ids(levels: tuple[Level, ...], short_levels) -> list[int]:
    """The levels the curriculum puts first: by default those without sequence parallelism, but
    never the largest level (with every level at sp 1, e.g. on one GPU, it is the long one)."""
    if short_levels is None:
        return [i for i, lv in enumerate(levels[:-1]) if lv.sp == 1]
    by_len = {lv.pack_len: i for i, lv in enumerate(levels)}
    out = []
    for x in short_levels:
        key = as_level(x).pack_len if not isinstance(x, (int, np.integer)) else int(x)
        if key not in by_len:
            raise ConfigError(
                f"HBPCurriculum short_levels: {x!r} is not the pack_len of a level ({sorted(by_len)}): name levels "
                "the data has, or leave short_levels out (every level without sp but the largest)"
            )
        out.append(by_len[key])
    return sorted(set(out))


def _build(
    levels: tuple[Level, ...],
    inputs: _Inputs,
    level_bins: list[Bins],
    world_size: int,
    accumulate: int,
    seed: int,
    order: str,
    warmup_steps: int = 0,
    short_levels=None,
    filled: list[int] | None = None,
    capacities: list[np.ndarray] | None = None,
) -> Plan:
    lengths, loss = inputs.lengths, inputs.loss
    filled = filled or [0] * len(levels)
    arrays, info = _assemble(
        levels, level_bins, lengths, loss, world_size, accumulate, seed, order, warmup_steps, short_levels, capacities,
        inputs.work,
    )  # fmt: skip
    report = dict(
        n_samples=int(lengths.size),
        n_packed=int(sum(b.members.size for b in level_bins)),
        curriculum_requested=info["curriculum_requested"],
        curriculum_moved=info["curriculum_moved"],
        short_levels=info["short_levels"],
        levels=[],
    )
    for i, (lv, bins) in enumerate(zip(levels, level_bins)):
        tokens = int(lengths[bins.members].sum())
        cap = int(lv.pack_len * len(bins)) if capacities is None else int(capacities[i].sum())
        report["levels"].append(
            dict(
                samples=int(bins.members.size),
                filled_from_below=int(filled[i]),
                packs=len(bins),
                tokens=tokens,
                fill=tokens / cap if cap else 0.0,
                steps=int(info["level_steps"][i]),
                empty_packs=int(info["level_empty"][i]),
            )
        )
    plan = Plan(
        levels=levels,
        world_size=world_size,
        accumulate=int(accumulate),
        seed=int(seed),
        lengths=lengths,
        loss_tokens=loss,
        dropped=inputs.dropped,
        truncated=inputs.truncated,
        zero_length=inputs.zero_length,
        zero_loss=inputs.zero_loss,
        report=report,
        **arrays,
    )
    if report["n_packed"] != int(inputs.keep.sum()):
        raise AssertionError(f"planner lost samples: packed {report['n_packed']} of {int(inputs.keep.sum())}")
    return plan


# --------------------------------------------------------------------------------------------
# Public planners
# --------------------------------------------------------------------------------------------


def plan_hbp(
    lengths: npt.ArrayLike,
    levels: Sequence[Level | dict | str | int],
    world_size: int,
    accumulate: int = 1,
    seed: int = 0,
    packer: str = DEFAULT_PACKER,
    loss_tokens: npt.ArrayLike | None = None,
    over_length: str = "error",
    warmup_steps: int = 0,
    short_levels: Sequence[int] | None = None,
    balance: bool = True,
    extra_work: npt.ArrayLike | None = None,
) -> Plan:
    """Hierarchical Balance Packing of one epoch.

    GroupData splits samples by level (pack_len_{i-1} < length <= pack_len_i); from the largest
    level down, each level's samples are packed with ``packer`` and the free space of its packs is
    GreedyFilled from the still-unpacked samples of the smaller levels (largest first, best fit).
    Packs are sorted by attention work (sum of squared lengths) so each micro-step carries nearly
    equal work on every SP group; A micro-steps make a step; steps are shuffled with ``seed`` and
    ``warmup_steps`` steps of ``short_levels`` (pack lengths; default: the sp == 1 levels other than
    the largest) go first. ``balance=False`` gives the paper's "hierarchical only" ablation (packs
    batched in random order). ``over_length="truncate"`` caps a sample at the largest level and its
    loss tokens at that length minus one, an upper bound: callers that know the label mask (the
    data module does) should truncate themselves and pass the surviving counts. ``extra_work``: per
    sample, work beside its attention in squared-length units (a vision-language sample's image
    encoding, ``lit_hbp.data.media.vision_work``): the balance weighs each pack's squared lengths plus it.
    """
    levels = validate_levels(levels, world_size)
    _check_common(accumulate, warmup_steps, seed)
    inputs = _prepare(lengths, loss_tokens, levels[-1].pack_len, over_length, extra_work)
    lens = inputs.lengths
    bounds = np.array([lv.pack_len for lv in levels])
    group = np.searchsorted(bounds, lens, side="left")  # level i holds (pack_len_{i-1}, pack_len_i]
    pools = [np.flatnonzero(inputs.keep & (group == i)) for i in range(len(levels))]
    packer_seeds = np.random.SeedSequence(seed).spawn(len(levels) + 1)[1:]
    level_bins: list[Bins | None] = [None] * len(levels)
    filled = [0] * len(levels)
    for i in reversed(range(len(levels))):
        cap = levels[i].pack_len
        own = pools[i]
        bins = run_packer(lens[own], cap, packer, int(packer_seeds[i].generate_state(1)[0]))
        members = own[bins.members]
        below = np.concatenate(pools[:i]) if i else np.zeros(0, np.int64)
        if below.size and len(bins):
            bin_of, _ = fit_decreasing(lens[below], cap, best=True, free=cap - bins.loads(lens[own]), open_new=False)
            used = bin_of >= 0
            filled[i] = int(used.sum())
            members, offsets = _merge_fill(members, bins.offsets, below[used], bin_of[used])
            bins = Bins(members, offsets)
            taken = np.zeros(lens.size, dtype=bool)
            taken[below[used]] = True
            pools = [p[~taken[p]] for p in pools[:i]] + pools[i:]
        else:
            bins = Bins(members, bins.offsets)
        level_bins[i] = bins
    order = "balance" if balance else "random"
    return _build(levels, inputs, level_bins, world_size, accumulate, seed, order, warmup_steps, short_levels, filled)


def _merge_fill(members: np.ndarray, offsets: np.ndarray, extra: np.ndarray, extra_bin: np.ndarray):
    """Append ``extra`` items to their bins in a CSR layout."""
    n_bins = len(offsets) - 1
    bin_ids = np.concatenate([np.repeat(np.arange(n_bins), np.diff(offsets)), extra_bin])
    items = np.concatenate([members, extra])
    order = np.argsort(bin_ids, kind="stable")
    new_offsets = np.r_[0, np.cumsum(np.bincount(bin_ids, minlength=n_bins))].astype(np.int64)
    return items[order], new_offsets


def plan_single_level(
    lengths: npt.ArrayLike,
    level: Level | dict | str | int,
    world_size: int,
    accumulate: int = 1,
    seed: int = 0,
    packer: str = "isf",
    balance: bool = False,
    loss_tokens: npt.ArrayLike | None = None,
    over_length: str = "error",
) -> Plan:
    """Naive packing: every sample in packs of one pack_len and sp (the paper's ISF baseline)."""
    levels = validate_levels([level], world_size)
    _check_common(accumulate, 0, seed)
    inputs = _prepare(lengths, loss_tokens, levels[0].pack_len, over_length)
    own = np.flatnonzero(inputs.keep)
    bins = run_packer(inputs.lengths[own], levels[0].pack_len, packer, seed)
    bins = Bins(own[bins.members], bins.offsets)
    return _build(levels, inputs, [bins], world_size, accumulate, seed, "balance" if balance else "random")


def plan_sorted_batching(
    lengths,
    max_len: int,
    world_size: int,
    batch_size: int = 1,
    accumulate: int = 1,
    seed: int = 0,
    loss_tokens=None,
    over_length: str = "error",
) -> Plan:
    """Sorted batching (LongAlign): no packing; samples sorted by length, each rank gets
    ``batch_size`` neighbours padded to the longest of them. A "pack" here is one sample and its
    capacity is the padded length, so PR measures padding."""
    levels = validate_levels([Level(max_len, 1, 0, batch_size)], world_size)
    _check_common(accumulate, 0, seed)
    inputs = _prepare(lengths, loss_tokens, max_len, over_length)
    lens = inputs.lengths
    own = np.flatnonzero(inputs.keep)
    own = own[np.argsort(-lens[own], kind="stable")]
    bins = Bins(own, np.arange(own.size + 1, dtype=np.int64))
    # Consecutive runs of batch_size samples share a padded length: the first (longest) of the run;
    # batching keeps this order, so each SP group's B samples are exactly one run.
    longest = lens[own][(np.arange(own.size) // batch_size) * batch_size]
    return _build(levels, inputs, [bins], world_size, accumulate, seed, "given", capacities=[longest])
