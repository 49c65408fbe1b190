"""Brute-force reference implementations, written straight from each definition (slow, obvious)."""

from __future__ import annotations

import numpy as np


def _fit(order, lengths, capacity, bins, rooms, best, open_new=True):
    unplaced = []
    for i in order:
        v = int(lengths[i])
        fits = [b for b in range(len(bins)) if rooms[b] >= v]
        if fits:
            b = min(fits, key=lambda b: (rooms[b], b)) if best else fits[0]
        elif open_new:
            bins.append([])
            rooms.append(capacity)
            b = len(bins) - 1
        else:
            unplaced.append(i)
            continue
        bins[b].append(i)
        rooms[b] -= v
    return bins, rooms, unplaced


def decreasing(lengths, items=None):
    items = range(len(lengths)) if items is None else items
    return sorted(items, key=lambda i: (-int(lengths[i]), i))


def ffd(lengths, capacity):
    return _fit(decreasing(lengths), lengths, capacity, [], [], best=False)[0]


def bfd(lengths, capacity):
    return _fit(decreasing(lengths), lengths, capacity, [], [], best=True)[0]


def greedy_fill(lengths, items, free, capacity):
    """Best fit decreasing of ``items`` into existing bins with ``free`` room; no new bins."""
    bins = [[] for _ in free]
    bins, rooms, unplaced = _fit(decreasing(lengths, items), lengths, capacity, bins, list(free), True, False)
    return bins, unplaced


def ffs(lengths, capacity, seed):
    order = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    return _fit(order, lengths, capacity, [], [], best=False)[0]


def next_fit(order, lengths, capacity):
    bins, room = [], 0
    for i in order:
        v = int(lengths[i])
        if not bins or v > room:
            bins.append([])
            room = capacity
        bins[-1].append(i)
        room -= v
    return bins


def greedy(lengths, capacity):
    return next_fit(range(len(lengths)), lengths, capacity)


def random(lengths, capacity, seed):
    return next_fit(np.random.default_rng(seed).permutation(len(lengths)).tolist(), lengths, capacity)


def isf(lengths, capacity, seed, iterations, threshold):
    rng = np.random.default_rng(seed)
    pending = np.arange(len(lengths))
    kept = []
    for it in range(iterations):
        if pending.size == 0:
            break
        bins = next_fit(rng.permutation(pending).tolist(), lengths, capacity)
        rejected = []
        for b in bins:
            if it == iterations - 1 or sum(int(lengths[i]) for i in b) >= threshold * capacity:
                kept.append(b)
            else:
                rejected.extend(b)
        pending = np.array(rejected, dtype=np.int64)
    return kept


def mffd(lengths, capacity):
    """Johnson & Garey's MFFD, phase by phase, on plain lists (ties: lowest index)."""
    c = capacity
    L = [int(x) for x in lengths]
    n = len(L)
    large = decreasing(L, [i for i in range(n) if 2 * L[i] > c])
    medium = [i for i in range(n) if 2 * L[i] <= c < 3 * L[i]]
    small = [i for i in range(n) if 3 * L[i] <= c < 6 * L[i]]
    tiny = [i for i in range(n) if 6 * L[i] <= c]
    bins = [[i] for i in large]
    room = [c - L[i] for i in large]

    def largest_fitting(pool, r):
        cands = [i for i in pool if L[i] <= r]
        return min(cands, key=lambda i: (-L[i], i)) if cands else None

    for b in range(len(bins)):
        if medium and min(L[i] for i in medium) <= room[b]:
            i = largest_fitting(medium, room[b])
            medium.remove(i)
            bins[b].append(i)
            room[b] -= L[i]
    for b in reversed(range(len(bins))):
        if len(small) >= 2:
            two = sorted(small, key=lambda i: (L[i], i))[:2]
            if L[two[0]] + L[two[1]] <= room[b]:
                small.remove(two[0])
                bins[b].append(two[0])
                room[b] -= L[two[0]]
                i = largest_fitting(small, room[b])
                small.remove(i)
                bins[b].append(i)
                room[b] -= L[i]
    rest = medium + small + tiny
    for b in range(len(bins)):
        while True:
            i = largest_fitting(rest, room[b])
            if i is None:
                break
            rest.remove(i)
            bins[b].append(i)
            room[b] -= L[i]
    tail = _fit(decreasing(L, rest), L, c, [], [], best=False)[0]
    return bins + tail


def spfhp(lengths, capacity, max_per_pack=None):
    """Krell et al.'s histogram packing on a list of (lengths tuple, count) strategies."""
    hist = np.bincount(lengths, minlength=capacity + 1)
    strategies = []  # [lens tuple, count]
    for v in range(capacity, 0, -1):
        left = int(hist[v])
        while left:
            open_ = [
                (capacity - sum(s[0]), k)
                for k, s in enumerate(strategies)
                if s[1] > 0 and capacity - sum(s[0]) >= v and (max_per_pack is None or len(s[0]) < max_per_pack)
            ]
            if not open_:
                strategies.append([(v,), left])
                left = 0
                continue
            room = min(r for r, _ in open_)
            k = max(k for r, k in open_ if r == room)  # the last created among the least room
            take = min(left, strategies[k][1])
            strategies[k][1] -= take
            strategies.append([strategies[k][0] + (v,), take])
            left -= take
    return [lens for lens, count in strategies for _ in range(count)]


def length_multisets(bins, lengths):
    return sorted(tuple(sorted(int(lengths[i]) for i in b)) for b in bins)


def metrics(plan) -> dict:
    """docs/design.md section 4 computed by looping over steps, micro-steps and ranks."""
    dbr, abr, ave_t = [], [], []
    for step in plan.steps:
        lv = plan.levels[step.level]
        for m in range(plan.accumulate):
            T, A = [], []
            for rank in range(plan.world_size):
                packs = step.micro[m][rank // lv.sp]
                lens = [int(plan.lengths[i]) for p in packs for i in p]
                T.append(sum(lens) / lv.sp)
                A.append(sum(x * x for x in lens) / lv.sp)
            n = plan.world_size
            dbr.append(sum(max(T) - t for t in T) / (max(T) * n) if max(T) > 0 else 0.0)
            abr.append(sum(max(A) - a for a in A) / (max(A) * n) if max(A) > 0 else 0.0)
            ave_t.append(sum(T) / n)
    tokens = cap = sp_tokens = real_tokens = real_cap = 0
    for p in range(len(plan.offsets) - 1):
        members = plan.pack(p)
        t = int(plan.lengths[members].sum())
        tokens += t
        cap += int(plan.pack_capacity[p])
        if members.size:
            real_tokens += t
            real_cap += int(plan.pack_capacity[p])
        if plan.levels[plan.pack_level[p]].sp > 1:
            sp_tokens += t
    return dict(
        dbr=float(np.mean(dbr)),
        abr=float(np.mean(abr)),
        pr=1 - tokens / cap,
        cr=sp_tokens / tokens,
        ave_t=float(np.mean(ave_t)),
        fill=real_tokens / real_cap,
    )
