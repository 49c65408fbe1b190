"""Bin-packing algorithms for sample lengths (numpy only).

Every packer has the signature ``packer(lengths, capacity, seed=0, **options) -> Bins`` where ``Bins``
holds, for each bin, the indices of its items (into ``lengths``). ``pack()`` is the public entry
point and returns a plain list of index arrays.

The fit-decreasing family (ffd, bfd, the last phase of mffd, and the GreedyFill of HBP) is exact and
fast because of one observation: items are processed in decreasing size, so once the chosen bin
takes an item of size v it stays the chosen bin for the next item of size v until its free space
drops below v. A bin therefore takes ``min(free // v, remaining)`` equal items in one operation, and
the work is proportional to (distinct sizes + bin visits), not to items x bins.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from lit_hbp.packing.bins import Bins, check_lengths, describe_indices

# --------------------------------------------------------------------------------------------
# Fit-decreasing core (FFD / BFD, with optional pre-existing bins for GreedyFill)
# --------------------------------------------------------------------------------------------


def fit_decreasing(
    lengths: np.ndarray,
    capacity: int,
    *,
    best: bool,
    free: np.ndarray | None = None,
    open_new: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """First-fit (best=False) or best-fit (best=True) decreasing.

    Items are taken in decreasing length (ties by index). ``free`` gives the free space of bins
    that already exist (GreedyFill); with ``open_new=False`` items that fit nowhere stay unplaced.
    Returns ``(bin_of, free_after)``: the bin id of every item (-1 = unplaced) and each bin's free
    space. First fit picks the lowest bin id with room, best fit the least room (ties: lowest id).
    """
    n = len(lengths)
    order = np.argsort(-lengths, kind="stable")
    sizes = lengths[order]
    rem: list[int] = [] if free is None else [int(x) for x in free]
    starts = np.flatnonzero(np.r_[True, sizes[1:] != sizes[:-1]]) if n else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], n].astype(np.int64)

    # Bins with room >= the current size sit in `heap`; the others wait in `waiting[room]` until the
    # size being placed drops to their room (sizes only decrease, so a waiting bin never misses).
    heap: list = []
    waiting: dict[int, list[int]] = {}
    waiting_keys: list[int] = []

    def park(b: int, room: int, v: int) -> None:
        if room >= v:
            heapq.heappush(heap, (room, b) if best else b)
        elif room > 0:
            if room in waiting:
                waiting[room].append(b)
            else:
                waiting[room] = [b]
                bisect.insort(waiting_keys, room)

    first_v = int(sizes[0]) if n else 0
    for b, room in enumerate(rem):
        park(b, room, first_v)

    run_bin: list[int] = []
    run_count: list[int] = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        v = int(sizes[s])
        while waiting_keys and waiting_keys[-1] >= v:
            room = waiting_keys.pop()
            for b in waiting.pop(room):
                heapq.heappush(heap, (room, b) if best else b)
        left = e - s
        while left:
            if heap:
                top = heapq.heappop(heap)
                b = top[1] if best else top
                room = rem[b]
                q = min(room // v, left)
                rem[b] = room - q * v
                run_bin.append(b)
                run_count.append(q)
                left -= q
                park(b, rem[b], v)
            elif open_new:
                per_bin = capacity // v
                k = -(-left // per_bin)
                for i in range(k):
                    q = per_bin if i < k - 1 else left - per_bin * (k - 1)
                    b = len(rem)
                    rem.append(capacity - q * v)
                    run_bin.append(b)
                    run_count.append(q)
                    park(b, rem[b], v)
                left = 0
            else:
                run_bin.append(-1)
                run_count.append(left)
                left = 0
    bin_of = np.empty(n, dtype=np.int64)
    bin_of[order] = np.repeat(np.asarray(run_bin, dtype=np.int64), np.asarray(run_count, dtype=np.int64))
    return bin_of, np.asarray(rem, dtype=np.int64)


def ffd(lengths: np.ndarray, capacity: int, seed: int = 0) -> Bins:
    """First fit decreasing: sort by length, put each item in the first bin with room."""
    bin_of, free = fit_decreasing(lengths, capacity, best=False)
    return Bins.from_assignment(bin_of, len(free))


def bfd(lengths: np.ndarray, capacity: int, seed: int = 0) -> Bins:
    """Best fit decreasing: sort by length, put each item in the bin it leaves with least room."""
    bin_of, free = fit_decreasing(lengths, capacity, best=True)
    return Bins.from_assignment(bin_of, len(free))


# --------------------------------------------------------------------------------------------
# Next fit (greedy, random, and the inner loop of ISF)
# --------------------------------------------------------------------------------------------


def _next_fit_starts(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Start positions of next-fit bins over ``lengths`` in the given order."""
    n = len(lengths)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    cs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=cs[1:])
    # A bin starting at i ends before the first j with cs[j+1] - cs[i] > capacity.
    nxt = (np.searchsorted(cs, cs[:-1] + capacity, side="right") - 1).tolist()
    starts = [0]
    i = nxt[0]
    while i < n:
        starts.append(i)
        i = nxt[i]
    return np.asarray(starts, dtype=np.int64)


def _next_fit(items: np.ndarray, lengths: np.ndarray, capacity: int) -> Bins:
    starts = _next_fit_starts(lengths[items], capacity)
    return Bins(items.astype(np.int64, copy=False), np.r_[starts, len(items)].astype(np.int64))


def greedy(lengths: np.ndarray, capacity: int, seed: int = 0) -> Bins:
    """Next fit in dataset order: append to the current bin until the next sample does not fit."""
    return _next_fit(np.arange(len(lengths)), lengths, capacity)


def random(lengths: np.ndarray, capacity: int, seed: int = 0) -> Bins:
    """Random packing: shuffle, then next fit."""
    return _next_fit(np.random.default_rng(seed).permutation(len(lengths)), lengths, capacity)


def isf(lengths: np.ndarray, capacity: int, seed: int = 0, *, iterations: int = 100, threshold: float = 0.995) -> Bins:
    """Iterative sampling and filtering: shuffle and next-fit; keep the bins filled to at least
    ``threshold``; shuffle and re-pack the samples of the other bins; the last round keeps all."""
    if iterations < 1:
        raise ValueError(f"isf iterations must be >= 1, got {iterations}")
    rng = np.random.default_rng(seed)
    pending = np.arange(len(lengths))
    kept_members: list[np.ndarray] = []
    kept_sizes: list[np.ndarray] = []
    for it in range(iterations):
        if pending.size == 0:
            break
        bins = _next_fit(rng.permutation(pending), lengths, capacity)
        keep = np.ones(len(bins), dtype=bool)
        if it < iterations - 1:
            keep = bins.loads(lengths) >= threshold * capacity
        sizes = bins.sizes()
        member_keep = np.repeat(keep, sizes)
        kept_members.append(bins.members[member_keep])
        kept_sizes.append(sizes[keep])
        pending = bins.members[~member_keep]
    sizes = np.concatenate(kept_sizes) if kept_sizes else np.zeros(0, np.int64)
    members = np.concatenate(kept_members) if kept_members else np.zeros(0, np.int64)
    return Bins(members, np.r_[0, np.cumsum(sizes)].astype(np.int64))


# --------------------------------------------------------------------------------------------
# First fit in shuffled order
# --------------------------------------------------------------------------------------------


def ffs(lengths: np.ndarray, capacity: int, seed: int = 0) -> Bins:
    """First fit shuffle: shuffle, then put each item in the first bin with room.

    A max-segment-tree over bin free space finds the leftmost bin with room in O(log bins); unopened
    bins sit to the right with full capacity, so opening a bin is just reaching a fresh leaf.
    First fit leaves at most one bin at most half full, which bounds the number of bins.
    """
    n = len(lengths)
    order = np.random.default_rng(seed).permutation(n)
    bound = max(1, min(n, 2 * int(-(-int(lengths.sum()) // capacity)) + 1))
    size = 1 << (bound - 1).bit_length()
    tree = [capacity] * (2 * size)
    bin_of = np.empty(n, dtype=np.int64)
    items = lengths[order].tolist()
    out: list[int] = []
    for v in items:
        node = 1
        while node < size:
            node <<= 1
            if tree[node] < v:
                node += 1
        out.append(node - size)
        room = tree[node] - v
        tree[node] = room
        node >>= 1
        while node:
            a, c = tree[2 * node], tree[2 * node + 1]
            best = a if a > c else c
            if tree[node] == best:
                break
            tree[node] = best
            node >>= 1
    bin_of[order] = out
    used = int(bin_of.max()) + 1 if n else 0
    return Bins.from_assignment(bin_of, used)


# --------------------------------------------------------------------------------------------
# Modified first fit decreasing (Johnson & Garey, 1985)
# --------------------------------------------------------------------------------------------


class _Pool:
    """Unplaced items grouped by length: largest-that-fits and smallest queries in O(log distinct)."""

    def __init__(self, items: np.ndarray, lengths: np.ndarray):
        self.by_len: dict[int, list[int]] = {}
        for i in items[np.argsort(lengths[items], kind="stable")[::-1]].tolist():
            self.by_len.setdefault(int(lengths[i]), []).append(i)
        self.keys = sorted(self.by_len)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def smallest(self) -> int | None:
        return self.keys[0] if self.keys else None

    def second_smallest(self) -> int | None:
        if not self.keys:
            return None
        if len(self.by_len[self.keys[0]]) > 1:
            return self.keys[0]
        return self.keys[1] if len(self.keys) > 1 else None

    def largest_fitting(self, room: int) -> int | None:
        k = bisect.bisect_right(self.keys, room)
        return self.keys[k - 1] if k else None

    def take(self, length: int) -> int:
        stack = self.by_len[length]
        item = stack.pop()
        if not stack:
            del self.by_len[length]
            del self.keys[bisect.bisect_left(self.keys, length)]
        return item

    def remaining(self) -> list[int]:
        return [i for k in self.keys for i in self.by_len[k]]


def mffd(lengths: np.ndarray, capacity: int, seed: int = 0) -> Bins:
    """Modified first fit decreasing (Johnson & Garey, 1985), in the five phases of NeMo-RL's note.

    Items are large (> C/2), medium (> C/3), small (> C/6) or tiny. One bin per large item in
    decreasing order; forward over those bins, add the largest medium item that fits when the
    smallest one does; backward over them, add the smallest small item plus the largest small
    item that still fits when the two smallest fit; forward again, add the largest remaining item
    that fits until none does; first fit decreasing for whatever is left, in new bins.
    """
    n = len(lengths)
    idx = np.arange(n)
    c = capacity
    large = idx[2 * lengths > c]
    large = large[np.argsort(-lengths[large], kind="stable")]
    medium = _Pool(idx[(2 * lengths <= c) & (3 * lengths > c)], lengths)
    small = _Pool(idx[(3 * lengths <= c) & (6 * lengths > c)], lengths)
    tiny = idx[6 * lengths <= c]
    bins: list[list[int]] = [[int(i)] for i in large.tolist()]
    room = [c - int(lengths[i]) for i in large.tolist()]

    for b in range(len(bins)):
        if medium and medium.smallest() <= room[b]:
            v = medium.largest_fitting(room[b])
            bins[b].append(medium.take(v))
            room[b] -= v
    for b in reversed(range(len(bins))):
        lo, lo2 = small.smallest(), small.second_smallest()
        if lo is not None and lo2 is not None and lo + lo2 <= room[b]:
            bins[b].append(small.take(lo))
            room[b] -= lo
            v = small.largest_fitting(room[b])
            bins[b].append(small.take(v))
            room[b] -= v
    rest = _Pool(np.array(medium.remaining() + small.remaining() + tiny.tolist(), dtype=np.int64), lengths)
    for b in range(len(bins)):
        while rest:
            v = rest.largest_fitting(room[b])
            if v is None:
                break
            bins[b].append(rest.take(v))
            room[b] -= v
    leftover = np.array(rest.remaining(), dtype=np.int64)
    bin_of, free = fit_decreasing(lengths[leftover], capacity, best=False)
    tail = Bins.from_assignment(bin_of, len(free), items=leftover)
    head_sizes = np.array([len(x) for x in bins], dtype=np.int64)
    head = np.array([i for x in bins for i in x], dtype=np.int64)
    members = np.concatenate([head, tail.members])
    offsets = np.r_[0, np.cumsum(head_sizes), head_sizes.sum() + tail.offsets[1:]].astype(np.int64)
    return Bins(members, offsets)


# --------------------------------------------------------------------------------------------
# Shortest-pack-first histogram packing (Krell et al., 2021)
# --------------------------------------------------------------------------------------------


def spfhp(lengths: np.ndarray, capacity: int, seed: int = 0, *, max_per_pack: int | None = None) -> Bins:
    """Shortest-pack-first histogram packing.

    Works on the length histogram and on pack "strategies" (a multiset of lengths with a repeat
    count). Lengths are taken longest first; each goes to the strategy with the least free space
    that fits it (the last one created among equals); when the strategy has more repeats than
    there are items left, it is split. ``max_per_pack`` caps the items per pack (Krell et al. used
    3 for 512-token BERT packs; None, the default here, leaves it uncapped).
    """
    if max_per_pack is not None and max_per_pack < 1:
        raise ValueError(f"spfhp max_per_pack must be >= 1 or None, got {max_per_pack}")
    counts = np.bincount(lengths, minlength=capacity + 1)
    strat_lens: list[tuple[int, ...]] = []
    strat_count: list[int] = []
    by_room: dict[int, list[int]] = {}
    rooms: list[int] = []

    def add(lens: tuple[int, ...], count: int) -> None:
        sid = len(strat_lens)
        strat_lens.append(lens)
        strat_count.append(count)
        room = capacity - sum(lens)
        if room > 0 and (max_per_pack is None or len(lens) < max_per_pack):
            if room not in by_room:
                by_room[room] = []
                bisect.insort(rooms, room)
            by_room[room].append(sid)

    for v in np.flatnonzero(counts)[::-1].tolist():
        left = int(counts[v])
        while left:
            k = bisect.bisect_left(rooms, v)
            if k == len(rooms):
                add((v,), left)
                left = 0
                continue
            room = rooms[k]
            sid = by_room[room][-1]
            take = min(left, strat_count[sid])
            strat_count[sid] -= take
            if strat_count[sid] == 0:
                by_room[room].pop()
                if not by_room[room]:
                    del by_room[room]
                    del rooms[k]
            add(strat_lens[sid] + (v,), take)
            left -= take

    stacks: dict[int, list[int]] = {}
    for i in np.argsort(lengths, kind="stable")[::-1].tolist():
        stacks.setdefault(int(lengths[i]), []).append(i)
    members: list[int] = []
    sizes: list[int] = []
    for lens, count in zip(strat_lens, strat_count):
        for _ in range(count):
            members.extend(stacks[v].pop() for v in lens)
            sizes.append(len(lens))
    return Bins(np.asarray(members, dtype=np.int64), np.r_[0, np.cumsum(sizes)].astype(np.int64))


PackerFn = Callable[..., Bins]

PACKERS: dict[str, PackerFn] = {
    "bfd": bfd,
    "ffd": ffd,
    "isf": isf,
    "ffs": ffs,
    "mffd": mffd,
    "spfhp": spfhp,
    "greedy": greedy,
    "random": random,
}

# Packers that draw (their ``seed``): an epoch's packs, and how many there are, change with seed + epoch.
SEEDED_PACKERS = ("isf", "ffs", "random")

# Chosen by bench/plan_quality.py and bench/plan_speed.py (bench/RESULTS.md): best fill together
# with ffd, fastest of the exact packers.
DEFAULT_PACKER = "bfd"


def run_packer(lengths: np.ndarray, capacity: int, packer: str, seed: int = 0, **options) -> Bins:
    """Pack already-validated int64 lengths (all in [1, capacity]) with a named packer."""
    try:
        fn = PACKERS[packer]
    except KeyError:
        raise ValueError(f"unknown packer {packer!r}; choose one of {sorted(PACKERS)}") from None
    if len(lengths) == 0:
        return Bins(np.zeros(0, np.int64), np.zeros(1, np.int64))
    return fn(lengths, capacity, seed, **options)


def pack(
    lengths: npt.ArrayLike, capacity: int, packer: str = DEFAULT_PACKER, seed: int = 0, **options
) -> list[np.ndarray]:
    """Pack samples into bins of ``capacity`` tokens; returns the sample indices of each bin.

    Every sample appears in exactly one bin. Lengths must be integers in [1, capacity]: zero-length
    samples and samples over the capacity are an error here (the planner reports and routes them).
    """
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    arr = check_lengths(lengths, int(capacity))
    zero = np.flatnonzero(arr == 0)
    if zero.size:
        raise ValueError(f"{zero.size} zero-length sample(s) cannot be packed: {describe_indices(zero, arr)}")
    return run_packer(arr, int(capacity), packer, seed, **options).as_list()
