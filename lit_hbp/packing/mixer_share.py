"""How the ranks of a Ulysses level share a hybrid's stateful token mixers (pure Python, no torch).

A mixer that carries a state along the sequence (Mamba, the gated delta rule, a short convolution) runs
each document of a pack whole (``lit_hbp.model.mixers``); on a level of ``ranks`` ranks it either shares
the documents (each run whole by one rank), or, where its class splits by heads, runs every document on
1/ranks of its heads, or, neither possible, runs every document on every rank. The packed call decides
this per call with these functions, and the cost model prices a hybrid's levels with the same decision
(``mixer_tokens``), so the level search sees the work the run will do.
"""

from __future__ import annotations

from collections.abc import Sequence

EVENLY = 1.1
"""A pack's documents are shared rather than the heads split when the busiest rank's tokens are at most this
times an even share: with 2 ranks, a split costs more per step than sharing evenly (sharing 0.73 of every rank
running every document, the split 0.78, 8 documents) and less than sharing one document (0.69 against 0.99):
``bench/sp_mixers.py``."""


PAD_SLACK = 0.25
"""How much padding a batch of documents may add to their tokens: a mixer runs the documents of a pack as the
rows of a few batches (``lit_hbp.model.mixers``), each row one document right-padded to its batch's longest,
a batch padded by at most this much of its tokens (``bench/mixer_batches.py``)."""


def length_batches(lengths: Sequence[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """The documents (indices into ``lengths``) grouped into batches, longest first: a batch takes the next
    document while its rows, each as long as its longest, hold at most ``1 + slack`` times their tokens (below
    0: every document a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    tokens = 0
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= (1 + slack) * (tokens + lengths[i]):
            batches[-1].append(i)
            tokens += lengths[i]
        else:
            batches.append([i])
            tokens = lengths[i]
    return batches


def padded_tokens(lengths: Sequence[int]) -> int:
    """Tokens a mixer runs for documents of ``lengths``, their batches' padding included (``length_batches``)."""
    return sum(len(b) * lengths[b[0]] for b in length_batches(lengths, PAD_SLACK))


def document_owners(lengths: Sequence[int], ranks: int) -> list[int] | None:
    """The rank that runs each document (of ``lengths`` tokens) of a pack in a mixer on an SP level: longest
    first, each to the rank with the fewest tokens so far (ties: the lowest rank), so the ranks share the
    mixer's work (linear in a document's length) instead of each doing all of it. None when there are fewer
    documents than ranks (a rank without one would leave the mixer's weights out of its step)."""
    if len(lengths) < ranks:
        return None
    load, owners = [0] * ranks, [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[i], load[rank] = rank, load[rank] + lengths[i]
    return owners


def owner_loads(lengths: Sequence[int], owners: Sequence[int], ranks: int) -> list[int]:
    """Tokens each rank runs when ``owners`` (``document_owners``) give it its documents."""
    load = [0] * ranks
    for rank, n in zip(owners, lengths):
        load[rank] += n
    return load


def shares_evenly(lengths: Sequence[int], owners: Sequence[int] | None, ranks: int) -> bool:
    """Whether ``owners`` give no rank more than ``EVENLY`` times an even share of the documents' tokens."""
    if owners is None:
        return False
    return max(owner_loads(lengths, owners, ranks)) <= EVENLY * sum(lengths) / ranks


def splits(heads: int | None, ranks: int) -> bool:
    """Whether a mixer that splits by ``heads`` (None: it does not) runs on 1/``ranks`` of them."""
    return heads is not None and heads % ranks == 0


def mixer_tokens(lengths: Sequence[int], ranks: int, heads: int | None) -> float:
    """Tokens, at the mixer's full width, that the busiest of ``ranks`` ranks runs through one stateful mixer
    layer for a pack of documents of ``lengths`` tokens, as the packed call decides it, its batches' padding
    included (``padded_tokens``): the busiest owner's documents where they share evenly; else 1/ranks of every
    document's heads where the mixer splits by ``heads`` (``splits``); else the busiest owner's documents, or
    every document (fewer than ``ranks``)."""
    total = padded_tokens(lengths)
    if ranks == 1:
        return float(total)
    owners = document_owners(lengths, ranks)
    if shares_evenly(lengths, owners, ranks) or (owners is not None and not splits(heads, ranks)):
        mine = [[n for n, rank in zip(lengths, owners) if rank == r] for r in range(ranks)]
        return float(max(padded_tokens(docs) for docs in mine))
    return total / ranks if splits(heads, ranks) else float(total)
