"""What a level's packs hold, drawn from the data's length distribution as the planner fills packs: the
synthetic packs the cost model, the level search and the measured probes price (``pack_stats``)."""

from __future__ import annotations

import numpy as np

from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing.context_split import padded_length, split_micro_batch
from lit_hbp.packing.mixer_share import mixer_tokens


def synthetic_pack(lengths: np.ndarray, pack_len: int, rng: np.random.Generator, window: int = 4096) -> np.ndarray:
    """Sample lengths of one pack of ``pack_len`` drawn from the data's length distribution, filled
    the way the planner fills packs: draws that do not fit the space left are skipped, until the
    pack is full or no drawn sample fits (samples longer than the pack are cut to it)."""
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), pack_len)
    return lengths[synthetic_members(lengths, pack_len, rng, window)]


def synthetic_members(lengths: np.ndarray, pack_len: int, rng: np.random.Generator, window: int = 4096) -> np.ndarray:
    """The samples (indices into ``lengths``, each at most ``pack_len``) ``synthetic_pack`` draws.

    Vectorized over ``window`` draws at a time (a 4M-token pack takes ~10^5 draws): the next draw
    that fits is found by a scan, and the run of draws after it whose running sum fits is taken at
    once; the first draw past that run does not fit, so the next scan skips it, as one draw at a
    time would."""
    valid = np.flatnonzero(lengths > 0)
    smallest = int(lengths[valid].min())
    draws = valid[rng.integers(0, valid.size, size=4 * pack_len // max(smallest, 1) + 1)]
    drawn = lengths[draws]
    room, pos, take = pack_len, 0, []
    while pos < draws.size and room >= smallest:
        hit = np.flatnonzero(drawn[pos : pos + window] <= room)
        if not hit.size:
            pos += window
            continue
        start = pos + int(hit[0])
        run = drawn[start : start + window]
        k = int(np.searchsorted(np.cumsum(run), room, side="right"))
        take.append(draws[start : start + k])
        room -= int(run[:k].sum())
        pos = start + k
    return np.concatenate(take) if take else np.zeros(0, np.int64)


def _synthetic_packs(lengths, pack_len: int, seed: int, max_packs: int) -> tuple[np.ndarray, list, list]:
    """The lengths cut to ``pack_len``, and ``max_packs`` synthetic packs' members and lengths (``seed``)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), pack_len)
    members = [synthetic_members(lengths, pack_len, rng) for _ in range(max_packs)]
    return lengths, members, [lengths[m] for m in members]


def pack_mixer_tokens(lengths, pack_len: int, sp: int, heads: int | None, seed: int = 0, max_packs: int = 64) -> float:
    """Mean over the packs ``pack_stats`` draws (same ``seed``) of the tokens the busiest of ``sp`` ranks runs
    through each of a hybrid's stateful mixers (``mixer_share.mixer_tokens``; ``heads``:
    ``ModelSpec.mixer_heads``)."""
    _, _, packs = _synthetic_packs(lengths, pack_len, seed, max_packs)
    return float(np.mean([mixer_tokens(p.tolist(), sp, heads) for p in packs]))


def _imbalance(memo: dict, pack: tuple, docs: np.ndarray, sp: int, cp: int) -> float:
    """``split_micro_batch(docs, sp, cp).imbalance()``, kept in ``memo`` by the pack, its padding and ``cp``."""
    total = int(docs.sum())
    key = (pack, padded_length(total, sp) - total, cp)
    if key not in memo:
        memo[key] = split_micro_batch(docs, sp, cp).imbalance()
    return memo[key]


def pack_stats(
    lengths,
    pack_len: int,
    seed: int = 0,
    max_packs: int = 64,
    sp: int = 1,
    cp: int = 1,
    extra_work=None,
    model: ModelSpec | None = None,
    memo: dict | None = None,
) -> tuple[float, float, float]:
    """Mean tokens, mean sum of squared lengths and mean extra work (per sample ``extra_work``: a
    vision-language sample's image encoding, ``VisionLoad.work``; 0 without it) of a pack of ``pack_len``
    filled from the data's length distribution: what a level's packs hold. With ``cp`` > 1 the sum of
    squares is priced at the busiest CP rank (times its max / mean area under the split training uses at
    degree ``sp``, ``split_micro_batch``), as the simulator prices CP groups. ``model``: its sliding windows and
    chunks bound a long document's weight (``ModelSpec.attention_sq``). ``memo``: a dict kept across calls on the
    same ``lengths`` (a search prices every layout of a length): the packs are drawn once per ``pack_len`` and each
    split once per padding and ``cp`` (what it depends on), with the same results."""
    memo = {} if memo is None else memo
    key = (pack_len, seed, max_packs)
    if key not in memo:
        memo[key] = _synthetic_packs(lengths, pack_len, seed, max_packs)
    lengths, members, packs = memo[key]
    busiest = [_imbalance(memo, (key, i), p, sp, cp) if cp > 1 else 1.0 for i, p in enumerate(packs)]
    weigh = (lambda p: (p.astype(np.float64) ** 2).sum()) if model is None else model.attention_sq
    sum_sq = [weigh(p) * b for p, b in zip(packs, busiest)]
    work = None if extra_work is None else np.asarray(extra_work, dtype=np.float64)
    extra = 0.0 if work is None else float(np.mean([work[m].sum() for m in members]))
    return float(np.mean([p.sum() for p in packs])), float(np.mean(sum_sq)), extra
