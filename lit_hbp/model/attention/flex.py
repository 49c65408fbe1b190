"""FlexAttention as a backend (``flex_backend``), and the block mask of a pack: causal attention inside
each document (and a window), or attention both ways inside each (a vision tower's images).

Built from ``cu_seqlens`` on the device at block granularity (128 x 128 tiles), never evaluating
the T x T mask: a 128K pack has 1024 x 1024 tiles. Tile (i, j) of query block i and key block j
is *full* when every pair in it attends (j < i, one document, inside the window), *partial* when
some do (the mask function decides element-wise), else skipped. No host-device sync. The masks of
a pack are kept on its ``cu_seqlens`` tensor, so every layer of its forward and backward shares one
per window and they go with the pack; attention runs FlexAttention inside the opaque
``hbp::varlen_attention_v4`` op, so no compiled graph guards on them.
"""

from __future__ import annotations

import torch

from lit_hbp.model.attention.kernel import AttnArgs, Backend, installed, params_of

BLOCK = 128
MASKS = "_hbp_block_masks"  # on a pack's cu_seqlens tensor: its masks, by (total, window)


def document_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of each of the pack's ``total`` positions."""
    positions = torch.arange(total, device=cu.device, dtype=cu.dtype)
    return torch.searchsorted(cu[1:].contiguous(), positions, right=True)


def tile_masks(cu: torch.Tensor, total: int, window: int | None, block: int = BLOCK, causal: bool = True):
    """(partial, full): [nb, nb] bool tile maps of the pack's mask, nb = ceil(total / block)."""
    doc = document_ids(cu, total)
    nb = -(-total // block)
    start = torch.arange(nb, device=cu.device) * block
    end = torch.clamp(start + block, max=total) - 1
    first, last = doc[start], doc[end]
    complete = end - start == block - 1  # a short last block stays partial, as torch marks it
    if not causal:  # tiles whose document ranges overlap; full where both blocks are all one document
        some = (first[None, :] <= last[:, None]) & (last[None, :] >= first[:, None])
        one = (first == last) & complete
        full = one[:, None] & one[None, :] & (first[:, None] == first[None, :])
        return some & ~full, full
    i, j = start[:, None] // block, start[None, :] // block
    below = j < i
    # Documents are contiguous, so key block j < i shares a document with query block i iff j's
    # last document is i's first, and is all one document with it iff j's first is i's last.
    some = (j == i) | (below & (last[None, :] == first[:, None]))
    full = below & (first[None, :] == last[:, None])
    full &= complete[:, None] & complete[None, :]
    if window is not None:
        nearest = start[:, None] - end[None, :]  # smallest query - key distance in the tile
        farthest = end[:, None] - start[None, :]
        some &= (j == i) | (nearest < window)
        full &= farthest < window
    return some & ~full, full


def _as_kv_blocks(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [1, 1, nb], indices [1, 1, nb, nb]): each row's marked key blocks listed first, row-major
    as torch's kernels read them (a sort keeps a transposed input's strides: the query-side lists of the
    backward were read column-wise on a GPU, wrong wherever a key block had several query blocks)."""
    tiles = tiles.contiguous()
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None].contiguous(), order[None, None].contiguous()


def block_mask(partial: torch.Tensor, full: torch.Tensor, block: int, mask_mod, seq_lengths: tuple[int, int]):
    """The BlockMask of [q blocks, kv blocks] tile maps, its query-side lists (the backward's) from the
    transposed maps: ``BlockMask.from_kv_blocks`` derives them under vmap, which fails inside a custom
    op of a compiled graph ("Cannot access storage of BatchedTensorImpl": flex under torch.compile)."""
    from torch.nn.attention.flex_attention import BlockMask

    kv, full_kv = _as_kv_blocks(partial), _as_kv_blocks(full)
    q, full_q = _as_kv_blocks(partial.T), _as_kv_blocks(full.T)
    return BlockMask(
        seq_lengths=seq_lengths, kv_num_blocks=kv[0], kv_indices=kv[1], full_kv_num_blocks=full_kv[0],
        full_kv_indices=full_kv[1], q_num_blocks=q[0], q_indices=q[1], full_q_num_blocks=full_q[0],
        full_q_indices=full_q[1], BLOCK_SIZE=(block, block), mask_mod=mask_mod,
    )  # fmt: skip


def document_block_mask(cu: torch.Tensor, total: int, window: int | None, block: int = BLOCK, causal: bool = True):
    """The BlockMask of a pack with documents ``cu`` (global cu_seqlens) over ``total`` positions, built
    on its first use per window and kept on ``cu`` itself: every layer of the pack's forward and
    backward shares it, and it goes when the pack's tensors go (no module state holds a pack)."""
    if block != BLOCK:
        return build_block_mask(cu, total, window, block, causal)
    masks = cu.__dict__.setdefault(MASKS, {})
    if (total, window, causal) not in masks:
        masks[(total, window, causal)] = build_block_mask(cu, total, window, causal=causal)
    return masks[(total, window, causal)]


def build_block_mask(cu: torch.Tensor, total: int, window: int | None, block: int = BLOCK, causal: bool = True):
    """A new BlockMask of documents ``cu`` over ``total`` positions (causal, or both ways)."""

    doc = document_ids(cu, total)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = doc[q_idx] == doc[kv_idx]
        if causal:
            keep = keep & (q_idx >= kv_idx)  # not in place: inductor lowers a mask_mod pointwise
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    partial, full = tile_masks(cu, total, window, block, causal)
    return block_mask(partial, full, block, mask_mod, (total, total))


def cross_block_mask(
    cu_q: torch.Tensor, cu_k: torch.Tensor, q_len: int, k_len: int, window: int | None, block: int = BLOCK
):
    """The BlockMask of query ranges ``cu_q`` against key prefixes ``cu_k`` (context parallelism:
    segment d's queries are the last ``len_q(d)`` positions of its ``len_k(d)`` keys, causal
    bottom-right). Query s of segment d sees key t of the same segment iff t <= s + cu_k[d + 1] -
    cu_q[d + 1] (its aligned key), within the window. Tiles are marked partial where a pair may
    attend (segment ranges overlap and the tile's first key is not past the block's last aligned
    key), never full: exact through the mask function, built on the device without a host read.
    Built per call: the layout changes with every micro-batch and CP calls are few."""

    seg_q = document_ids(cu_q, q_len)
    seg_k = document_ids(cu_k, k_len)
    aligned = torch.arange(q_len, device=cu_q.device) + (cu_k[1:] - cu_q[1:])[seg_q]

    def mask_mod(b, h, q_idx, kv_idx):
        keep = (seg_q[q_idx] == seg_k[kv_idx]) & (kv_idx <= aligned[q_idx])
        if window is not None:
            keep = keep & (aligned[q_idx] - kv_idx < window)  # not in place (a pointwise subgraph)
        return keep

    nq, nk = -(-q_len // block), -(-k_len // block)
    q0 = torch.arange(nq, device=cu_q.device) * block
    q1 = torch.clamp(q0 + block, max=q_len) - 1
    k0 = torch.arange(nk, device=cu_q.device) * block
    k1 = torch.clamp(k0 + block, max=k_len) - 1
    pad = torch.full((nq * block - q_len,), -1, device=cu_q.device, dtype=aligned.dtype)
    blocks = torch.cat([aligned, pad]).view(nq, block)
    most = blocks.max(-1).values
    least = torch.where(blocks >= 0, blocks, torch.iinfo(blocks.dtype).max).min(-1).values
    some = (seg_k[k0][None, :] <= seg_q[q1][:, None]) & (seg_k[k1][None, :] >= seg_q[q0][:, None])
    some &= k0[None, :] <= most[:, None]
    if window is not None:
        some &= k1[None, :] > least[:, None] - window
    return block_mask(some, torch.zeros_like(some), block, mask_mod, (q_len, k_len))


# ------------------------------------------------------------------------------------- the backend

_flex_compiled: list = []


def _flex_fn():
    """flex_attention compiled once (dynamic over pack lengths): uncompiled it materializes scores."""
    from torch.nn.attention.flex_attention import flex_attention

    if not _flex_compiled:
        _flex_compiled.append(torch.compile(flex_attention, dynamic=True))
    return _flex_compiled[0]


def _flex_unusable(device_type: str, dtype: torch.dtype) -> str | None:
    if device_type != "cuda":
        return "CUDA only (torch's FlexAttention has no backward on CPU)"
    if not installed("torch.nn.attention.flex_attention"):
        return f"torch {torch.__version__} has no FlexAttention"
    return None


def flex_run(q, k, v, a: AttnArgs, fn=None) -> torch.Tensor:
    """FlexAttention with a document block mask (built once per pack, ``flex.document_block_mask``),
    soft-capping as a score modification, and sinks from the log-sum-exp: with a sink logit s per
    head, softmax over the tokens and the sink scales the tokens-only output by sigmoid(lse - s)."""
    fn = fn or _flex_fn()
    if a.cu_k is None:
        block_mask = document_block_mask(a.cu, q.shape[2], a.window, causal=a.causal)
    else:
        block_mask = cross_block_mask(a.cu, a.cu_k, q.shape[2], k.shape[2], a.window)
    score_mod = None
    if a.softcap:
        # A tensor, not a Python float: compiled dynamic, torch 2.15 traces a captured float as a SymFloat,
        # which FlexAttention's score_mod buffers refuse (only tensors and ints); a tensor is one on every torch.
        cap = torch.tensor(float(a.softcap), dtype=torch.float32, device=q.device)

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

    kw = dict(score_mod=score_mod, block_mask=block_mask, scale=a.scale, enable_gqa=q.shape[1] != k.shape[1])
    if a.sinks is None:
        return fn(q, k, v, **kw)
    from torch.nn.attention import flex_attention as flex_module

    if hasattr(flex_module, "AuxRequest") and "return_aux" in params_of(flex_module.flex_attention):
        out, aux = fn(q, k, v, return_aux=flex_module.AuxRequest(lse=True), **kw)
        lse = aux.lse
    else:
        out, lse = fn(q, k, v, return_lse=True, **kw)
    keep = torch.sigmoid(lse.float() - a.sinks.float()[None, :, None])
    return (out.float() * keep[..., None]).to(out.dtype)


def flex_backend() -> Backend:
    """FlexAttention's backward is generated by the compiler from its forward: no backward kernel to call."""
    return Backend("flex", _flex_unusable, lambda: frozenset({"window", "softcap", "sinks"}), flex_run)
