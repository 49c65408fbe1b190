"""Context-parallel (CP) split of one pack: which token ranges of the pack each CP rank holds.

Under the all-gather K/V algorithm every CP rank holds a shard of the pack's queries, gathers the
whole pack's K/V and computes exact causal document-masked attention for its own queries. A query
range [a, b) of a document attends keys [0, b) of that document (flash-attn varlen, causal,
bottom-right aligned, q_len = b - a, k_len = b), so a rank may hold *any* token ranges: documents
can be cut at any token and nothing is ever padded to a multiple of 2 x cp.

What must be balanced is the causal attention area of each rank, the number of (query, key) pairs
it computes: a token at position p of its document sees p + 1 keys, so a range [a, b) costs

    area(a, b) = sum_{p=a}^{b-1} (p + 1) = (b (b + 1) - a (a + 1)) / 2.

A contiguous split of one long document gives the last rank (2 cp - 1) / cp times the mean area
(1.75 at cp 4, 1.875 at cp 8): the problem the planner solves here instead of the kernels.

Numpy only, like the rest of the packing core; everything is pure and deterministic, so every
rank of a CP group computes the same split from the pack's document lengths alone.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

DEFAULT_TOL = 0.01
"""Keep the all-whole split when its max / mean area is within this of 1 (the bar is 5%; the margin
covers a kernel whose real cost is not exactly the area); else cut documents to balance."""


# --------------------------------------------------------------------------------------------
# Attention area
# --------------------------------------------------------------------------------------------


def range_area(start, end) -> np.ndarray:
    """Causal attention area of query ranges [start, end) of a document (positions relative to its
    start): the keys each query sees, itself included, summed. Vectorized, exact in int64 (a pack
    of 2^31 tokens would still fit)."""
    a = np.asarray(start, dtype=np.int64)
    b = np.asarray(end, dtype=np.int64)
    return (b * (b + 1) - a * (a + 1)) // 2


def attention_area(doc_lengths) -> np.ndarray:
    """Causal attention area of whole documents: L (L + 1) / 2 each (int64)."""
    return range_area(0, doc_lengths)


# --------------------------------------------------------------------------------------------
# The split
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContextSplit:
    """Where every token of a pack goes over ``cp`` ranks, as ranges of documents (CSR by rank).

    Rank r holds ranges ``rank_offsets[r]:rank_offsets[r + 1]``; range i is positions
    ``[start[i], end[i])`` of document ``doc[i]`` (relative to the document's start, i.e. the
    position ids). A rank's ranges are in pack order and rank r's shard is their concatenation, so
    its queries are contiguous per range: the kernel's ``cu_seqlens_q`` are the range lengths and
    ``cu_seqlens_k`` the prefixes ``end`` (keys [0, end) of the document, starting in the pack at
    ``doc_starts[doc]``). Adjacent ranges of one document on one rank are merged.
    """

    cp: int
    doc_lengths: np.ndarray
    rank_offsets: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray

    # ---- shape ----------------------------------------------------------------------------

    @property
    def pack_len(self) -> int:
        return int(self.doc_lengths.sum())

    @property
    def shard_len(self) -> int:
        """Tokens every rank holds (T / cp)."""
        return self.pack_len // self.cp

    @cached_property
    def doc_starts(self) -> np.ndarray:
        """Offset of every document in the pack (int64 [D])."""
        return (np.cumsum(self.doc_lengths) - self.doc_lengths).astype(np.int64)

    @cached_property
    def range_rank(self) -> np.ndarray:
        return np.repeat(np.arange(self.cp), np.diff(self.rank_offsets))

    def _sl(self, rank: int) -> slice:
        if not 0 <= rank < self.cp:
            raise ValueError(f"rank {rank} outside a CP group of {self.cp}")
        return slice(int(self.rank_offsets[rank]), int(self.rank_offsets[rank + 1]))

    # ---- per rank -------------------------------------------------------------------------

    def ranges(self, rank: int) -> np.ndarray:
        """int64 [n, 3]: (document, start, end) of rank's ranges, in shard order."""
        s = self._sl(rank)
        return np.stack([self.doc[s], self.start[s], self.end[s]], axis=1)

    def gather_index(self, rank: int) -> np.ndarray:
        """Pack token indices rank holds, in shard order: ``pack_tokens[gather_index(r)]`` is its shard."""
        s = self._sl(rank)
        return _concat_aranges(self.doc_starts[self.doc[s]] + self.start[s], self.doc_starts[self.doc[s]] + self.end[s])

    def positions(self, rank: int) -> np.ndarray:
        """Position ids (in their document) of rank's tokens, in shard order."""
        s = self._sl(rank)
        return _concat_aranges(self.start[s], self.end[s])

    def cu_seqlens_q(self, rank: int) -> np.ndarray:
        """int32 [n + 1]: cumulative query lengths of rank's ranges (rows of its shard)."""
        s = self._sl(rank)
        return np.r_[0, np.cumsum(self.end[s] - self.start[s])].astype(np.int32)

    def cu_seqlens_k(self, rank: int) -> np.ndarray:
        """int32 [n + 1]: cumulative key lengths (each range sees keys [0, end) of its document)."""
        s = self._sl(rank)
        return np.r_[0, np.cumsum(self.end[s])].astype(np.int32)

    def key_index(self, rank: int) -> np.ndarray:
        """Pack token indices of the keys of rank's ranges, range after range (matches
        ``cu_seqlens_k``): gather the all-gathered, pack-ordered K/V with it for one varlen call.
        Ranges of one document overlap in keys; a kernel that loops over ranges needs only
        ``doc_starts`` and ``end`` instead."""
        s = self._sl(rank)
        first = self.doc_starts[self.doc[s]]
        return _concat_aranges(first, first + self.end[s])

    def key_rounds(self, rank: int) -> list[np.ndarray]:
        """Positions into ``key_index(rank)`` in rounds whose keys are distinct: round j holds the
        keys of the j-th range of every document on the rank. Ranges of one document overlap in
        keys, so their key gradients add up; summed round by round (one round: nothing adds up),
        that sum has one order on every run, unlike an atomic scatter-add."""
        s = self._sl(rank)
        docs, lengths = self.doc[s], self.end[s]
        order = np.argsort(docs, kind="stable")
        first = np.r_[True, docs[order][1:] != docs[order][:-1]]
        index = np.arange(docs.size)
        occurrence = np.empty_like(index)
        occurrence[order] = index - np.maximum.accumulate(np.where(first, index, 0))
        per_key = np.repeat(occurrence, lengths)
        return [np.flatnonzero(per_key == j) for j in range(int(occurrence.max(initial=0)) + 1)]

    # ---- the whole group ------------------------------------------------------------------

    def permutation(self) -> np.ndarray:
        """Pack indices of the rank-ordered concatenation of all shards (what an all-gather
        returns); ``gathered[inverse_permutation()]`` restores pack order."""
        return _concat_aranges(self.doc_starts[self.doc] + self.start, self.doc_starts[self.doc] + self.end)

    def inverse_permutation(self) -> np.ndarray:
        perm = self.permutation()
        inv = np.empty_like(perm)
        inv[perm] = np.arange(perm.size)
        return inv

    def tokens_per_rank(self) -> np.ndarray:
        return np.bincount(self.range_rank, weights=self.end - self.start, minlength=self.cp).astype(np.int64)

    def area_per_rank(self) -> np.ndarray:
        """Causal attention area of every rank's queries (int64 [cp])."""
        out = np.zeros(self.cp, dtype=np.int64)
        np.add.at(out, self.range_rank, range_area(self.start, self.end))
        return out

    def ranges_per_rank(self) -> np.ndarray:
        return np.diff(self.rank_offsets)

    def imbalance(self) -> float:
        """max / mean causal area over the ranks (1.0 = balanced; an empty pack counts as balanced)."""
        area = self.area_per_rank()
        mean = area.sum() / self.cp
        return float(area.max() / mean) if mean > 0 else 1.0


def _concat_aranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """concatenate(arange(s, e) for s, e in zip(starts, ends)), vectorized."""
    starts = np.asarray(starts, dtype=np.int64)
    lens = np.asarray(ends, dtype=np.int64) - starts
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    keep = lens > 0
    starts, lens = starts[keep], lens[keep]
    first = np.r_[0, np.cumsum(lens)[:-1]]
    return np.arange(total, dtype=np.int64) - np.repeat(first - starts, lens)


def _check(doc_lengths, cp: int) -> np.ndarray:
    if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
        raise ValueError(f"cp must be a positive int, got {cp!r}")
    lengths = np.asarray(doc_lengths)
    if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
        raise ValueError(f"doc_lengths must be a 1-D array of ints, got dtype {lengths.dtype} shape {lengths.shape}")
    lengths = lengths.astype(np.int64)
    if (lengths < 0).any():
        raise ValueError(f"negative document length at index {int(np.flatnonzero(lengths < 0)[0])}")
    total = int(lengths.sum())
    if total % cp:
        raise ValueError(f"pack of {total} tokens cannot be split into {cp} equal shards: pad it to a multiple of cp")
    return lengths


def _build(cp: int, lengths: np.ndarray, rank, doc, start, end) -> ContextSplit:
    """Sort ranges into (rank, pack order), drop empty ones and merge adjacent pieces."""
    rank, doc, start, end = (np.asarray(x, dtype=np.int64) for x in (rank, doc, start, end))
    keep = end > start
    rank, doc, start, end = rank[keep], doc[keep], start[keep], end[keep]
    if rank.size == 0:  # a pack without tokens: every rank holds nothing
        return ContextSplit(cp, lengths, np.zeros(cp + 1, dtype=np.int64), rank, start, end)
    order = np.lexsort((start, doc, rank))
    rank, doc, start, end = rank[order], doc[order], start[order], end[order]
    new = np.concatenate(([True], (rank[1:] != rank[:-1]) | (doc[1:] != doc[:-1]) | (start[1:] != end[:-1])))
    head = np.flatnonzero(new)
    last = np.append(head[1:], rank.size) - 1
    rank, doc, start, end = rank[head], doc[head], start[head], end[last]
    offsets = np.concatenate(([0], np.cumsum(np.bincount(rank, minlength=cp)))).astype(np.int64)
    return ContextSplit(cp, lengths, offsets, doc, start, end)


def contiguous_split(doc_lengths, cp: int) -> ContextSplit:
    """The naive split: rank r holds pack tokens [r T / cp, (r + 1) T / cp). Equal tokens, but the
    later ranks see longer prefixes of the documents they hold (the comparison baseline)."""
    lengths = _check(doc_lengths, cp)
    shard = int(lengths.sum()) // cp
    ds = np.r_[0, np.cumsum(lengths)]
    # Cut every document at the shard boundaries that fall inside it.
    bounds = np.arange(1, cp) * shard
    cuts = np.unique(np.r_[ds, bounds])
    pos_doc = np.searchsorted(ds, cuts[:-1], side="right") - 1
    # Zero-length documents share their start with the next one: searchsorted picks the last.
    a, b = cuts[:-1], cuts[1:]
    rank = np.minimum(a // max(shard, 1), cp - 1) if shard else np.zeros_like(a)
    return _build(cp, lengths, rank, pos_doc, a - ds[pos_doc], b - ds[pos_doc])


def split_pack(doc_lengths, cp: int, *, tol: float = DEFAULT_TOL) -> ContextSplit:
    """Split a pack over ``cp`` ranks: exactly T / cp tokens each, causal areas balanced, few ranges.

    ``doc_lengths``: the pack's documents in pack order (the padding segment included: it costs
    attention like any document); their sum T must be a multiple of cp.

    Two candidates, the first kept when it is within ``tol`` of balance:

    1. Whole documents (one range each, the cheapest for the kernel): longest first onto the rank
       with the least area among those with room (LPT on area under the T / cp token capacity);
       what fits nowhere whole is cut into the ranks' remaining room, which makes tokens exact.
       Packs of many similar documents balance this way without a single cut.
    2. The stream split (``_stream_split``), balanced up to rounding for any pack: a head/tail
       (zigzag) layout makes the area of a document's share linear in its tokens, so balancing
       becomes a two-pointer walk over the documents sorted by length: every rank takes one chunk
       from each end of that stream, so at most four documents per rank are cut (the chunks'
       ends; two ranges each), all others stay whole, and a document longer than the shard is
       spread over consecutive ranks as head/tail pairs.

    The classic 2 x cp zigzag of one long document is the special case of 2 with one document
    (equal shares, head piece j and tail piece 2 cp - 1 - j on rank j), made exact for any length:
    no document is padded to a multiple of anything.
    """
    lengths = _check(doc_lengths, cp)
    n = lengths.size
    if cp == 1 or int(lengths.sum()) == 0:
        return _build(cp, lengths, np.zeros(n), np.arange(n), np.zeros(n), lengths)
    shard = int(lengths.sum()) // cp
    whole = _whole_first(lengths, cp, shard)
    if whole.imbalance() <= 1.0 + tol:
        return whole
    stream = _stream_split(lengths, cp, shard)
    return stream if stream.imbalance() <= whole.imbalance() else whole


def padded_length(n_tokens: int, sp: int) -> int:
    """Tokens of a micro-batch of ``n_tokens`` once collated for degree ``sp``: padded up to a
    multiple of lcm(8, sp), at least one multiple, so any SP degree cuts it into equal shards."""
    multiple = math.lcm(8, sp)
    return max(multiple, -(-n_tokens // multiple) * multiple)


def split_micro_batch(doc_lengths, sp: int, cp: int) -> ContextSplit:
    """``split_pack`` of a micro-batch of these documents as training cuts it: padded by collate
    (``padded_length``) with a padding segment of its own, which costs attention like a document."""
    docs = np.asarray(doc_lengths, dtype=np.int64)
    pad = padded_length(int(docs.sum()), sp) - int(docs.sum())
    return split_pack(np.append(docs, pad) if pad else docs, cp)


def _whole_first(lengths: np.ndarray, cp: int, shard: int) -> ContextSplit:
    """Documents whole, longest first on the least-loaded rank with room (ties: the most room, then
    the lowest rank); the rest filled in. Python ints in the loop: numpy calls per document cost more."""
    ranks, docs, ends = [], [], []
    room, area = [shard] * cp, [0] * cp
    keys = [(0, -shard, r) for r in range(cp)]  # the ranks by (area, -room, rank), kept sorted
    spill = []
    sizes = lengths.tolist()
    for d in np.argsort(-lengths, kind="stable").tolist():
        length = sizes[d]
        if length == 0:
            continue
        # the least key among the ranks with room: the first with room in key order
        i = next((i for i, key in enumerate(keys) if -key[1] >= length), None)
        if i is None:
            spill.append(d)
            continue
        r = keys.pop(i)[2]
        room[r] -= length
        area[r] += length * (length + 1) // 2
        bisect.insort(keys, (area[r], -room[r], r))
        ranks.append(r), docs.append(d), ends.append(length)
    rank, doc, start, end = np.array(ranks), np.array(docs), np.zeros(len(ranks)), np.array(ends)
    if spill:
        # Fill the ranks' remaining room with the spilled documents, lowest area first.
        room_left = np.array(room, dtype=np.int64)
        fill = np.argsort(np.array(area, dtype=np.int64), kind="stable")
        fill = fill[room_left[fill] > 0]
        sr, sd, ss, se = _fill(lengths[spill], np.asarray(spill), fill, room_left[fill])
        rank, doc, start, end = np.r_[rank, sr], np.r_[doc, sd], np.r_[start, ss], np.r_[end, se]
    return _build(cp, lengths, rank, doc, start, end)


def _solve(area, target: float, top: int) -> int:
    """The integer x in [0, top] whose (non-decreasing) area(x) is closest to target: a coarse grid
    of about sqrt(top) points, then every point of the bracketing cell."""
    step = max(1, int(np.sqrt(top)))
    grid = np.append(np.arange(0, top, step), top)
    i = int(area(grid).searchsorted(target))
    lo, hi = grid[max(i - 1, 0)], grid[min(i, grid.size - 1)]
    xs = np.arange(lo, hi + 1)
    a = area(xs)
    j = int(a.searchsorted(target))
    if j >= xs.size or (j > 0 and target - a[j - 1] <= a[j] - target):
        j -= 1
    return int(xs[j])


def _fill(lengths: np.ndarray, docs: np.ndarray, ranks: np.ndarray, room: np.ndarray):
    """Cut the documents, back to back, into the ranks' room in the order given (sums match)."""
    ds = np.concatenate(([0], np.cumsum(lengths)))
    rs = np.concatenate(([0], np.cumsum(room)))
    cuts = np.unique(np.concatenate((ds, rs)))
    a, b = cuts[:-1], cuts[1:]
    which_doc = np.searchsorted(ds, a, side="right") - 1
    which_rank = np.searchsorted(rs, a, side="right") - 1
    return ranks[which_rank], docs[which_doc], a - ds[which_doc], b - ds[which_doc]


def _stream_split(lengths: np.ndarray, cp: int, shard: int) -> ContextSplit:
    """Linear-area split: documents sorted by length form one token stream of falling density
    (L + 1) / 2; every rank takes x tokens from the dense front and shard - x from the sparse back,
    x chosen so its area is the remaining mean; each document's shares are then laid out head/tail
    (zigzag with unequal shares): heads from the front and tails from the back in the same rank
    order start at mirrored offsets, so an even share's area is exactly share x (L + 1) / 2 (an
    odd one is off by under L / 2), whatever the other shares are."""
    order = np.argsort(-lengths, kind="stable")
    order = order[lengths[order] > 0]
    L = lengths[order]
    w = (L + 1) / 2.0
    ctok = np.concatenate(([0], np.cumsum(L)))
    carea = np.concatenate(([0.0], np.cumsum(L * w)))
    last = L.size - 1

    def F(t):
        i = np.minimum(ctok.searchsorted(t, side="right") - 1, last)
        return carea[i] + (t - ctok[i]) * w[i]

    lo, hi = 0, int(ctok[-1])
    pieces = []
    for r in range(cp - 1):
        f_lo, f_hi = F(lo), F(hi)
        target = (f_hi - f_lo) / (cp - r)
        x = _solve(
            lambda x, lo=lo, hi=hi, f_lo=f_lo, f_hi=f_hi: F(lo + x) - f_lo + f_hi - F(hi - shard + x), target, shard
        )
        pieces += [(lo, lo + x, r), (hi - (shard - x), hi, r)]
        lo, hi = lo + x, hi - (shard - x)
    pieces.append((lo, hi, cp - 1))  # the last rank takes the middle: exactly shard tokens are left
    # The pieces tile the stream: cut them at the documents' ends, each cut in the piece holding it.
    s, e, r = (np.array(x, dtype=np.int64) for x in zip(*pieces))
    k = np.flatnonzero(e > s)  # the pieces' places in the list (a document's shares keep their order) ...
    k = k[np.argsort(s[k], kind="stable")]  # ... in stream order
    bounds = np.unique(np.concatenate([s, e, ctok]))
    a = bounds[:-1]
    piece = k[np.searchsorted(s[k], a, side="right") - 1]
    doc = np.searchsorted(ctok, a, side="right") - 1
    seq = np.lexsort((a, piece, doc))
    rank, doc, share = r[piece][seq], doc[seq], np.diff(bounds)[seq]
    head = share // 2
    tail = share - head
    first = np.concatenate(([True], doc[1:] != doc[:-1]))
    grp = np.cumsum(first) - 1
    h0 = np.cumsum(head) - head
    h0 -= h0[np.flatnonzero(first)][grp]
    t0 = np.cumsum(tail) - tail
    t0 -= t0[np.flatnonzero(first)][grp]
    tail_end = L[doc] - t0
    real = order[doc]
    return _build(
        cp,
        lengths,
        np.concatenate((rank, rank)),
        np.concatenate((real, real)),
        np.concatenate((h0, tail_end - tail)),
        np.concatenate((h0 + head, tail_end)),
    )
