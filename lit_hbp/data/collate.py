"""Collate a rank's packs into one varlen micro-batch, and cut an SP rank's shard out of it.

A micro-batch is one row of concatenated samples: ``input_ids`` [1, T], pre-shifted ``labels``
(labels[t] = input_ids[t + 1] inside a sample when that token is supervised, else -100, so a shard
needs no neighbour token), ``position_ids`` restarting at every sample, and the pack's
``cu_seqlens``/``max_seqlen`` for varlen attention. T is padded to a multiple of lcm(8, sp) with a
padding segment of its own. Per-token ``sample_targets`` (targets of the token's sample) and the
micro-batch totals let the module apply any loss normalizer on a shard.

Everything the training step needs to know about a micro-batch is computed here, on the host, so the
step never reads a value back from the device: ``target_index`` (positions of this rank's supervised
labels, for the LM head), ``doc_sq`` (sum of squared document lengths, for the FLOP count),
``n_tokens``/``n_targets`` and the plan's loss normalizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

TOKEN_KEYS = ("input_ids", "labels", "position_ids", "sample_targets")


def pad_multiple(sp: int, base: int = 8) -> int:
    return base * sp // math.gcd(base, sp)


def collate_packs(
    packs: list[np.ndarray],
    tokens: Callable[[int], tuple[np.ndarray, np.ndarray]],
    *,
    sp: int = 1,
    pad_id: int = 0,
    meta: dict | None = None,
) -> dict:
    """Build the micro-batch of ``packs`` (arrays of sample ids); ``tokens(i)`` gives (ids, target)."""
    sample_ids = np.concatenate(packs) if packs else np.zeros(0, np.int64)
    parts = [tokens(int(i)) for i in sample_ids]
    lens = np.array([p[0].size for p in parts], dtype=np.int64)
    n = int(lens.sum())
    multiple = pad_multiple(sp)
    total = max(multiple, -(-n // multiple) * multiple)
    pad = total - n
    ids = np.full(total, pad_id, dtype=np.int64)
    target = np.zeros(total + 1, dtype=bool)
    if n:
        ids[:n] = np.concatenate([p[0] for p in parts])
        target[:n] = np.concatenate([p[1] for p in parts])
    seg_lens = np.r_[lens, pad] if pad else lens
    cu = np.r_[0, np.cumsum(seg_lens)].astype(np.int32)
    starts = np.repeat(cu[:-1], seg_lens)
    position_ids = np.arange(total) - starts
    # Pre-shifted labels: position t predicts t + 1 when t + 1 is a supervised token of the same sample.
    last = np.zeros(total, dtype=bool)
    last[cu[1:] - 1] = True
    supervised = target[1:] & ~last
    labels = np.where(supervised, np.r_[ids[1:], pad_id], -100)
    per_sample = np.add.reduceat(supervised.astype(np.int64), cu[:-1]) if seg_lens.size else np.zeros(0, np.int64)
    sample_targets = np.repeat(per_sample, seg_lens)
    n_samples = int((per_sample[: lens.size] > 0).sum())
    labels = torch.from_numpy(labels)[None]
    batch = dict(
        input_ids=torch.from_numpy(ids)[None],
        labels=labels,
        position_ids=torch.from_numpy(position_ids)[None],
        sample_targets=torch.from_numpy(sample_targets.astype(np.float32))[None],
        cu_seqlens=torch.from_numpy(cu),
        max_seqlen=int(seg_lens.max()),
        n_targets=int(supervised.sum()),
        n_loss_samples=n_samples,
        n_tokens=n,
        doc_sq=float((lens.astype(np.float64) ** 2).sum()),
        target_index=target_index(labels),
        sample_index=torch.from_numpy(sample_ids.astype(np.int64)),
        sp=sp,
        sp_rank=0,
    )
    batch.update(meta or {})
    return batch


def shard(batch: dict, sp: int, sp_rank: int) -> dict:
    """The contiguous 1/sp slice of the token tensors that rank ``sp_rank`` of the SP group holds.
    ``cu_seqlens``/``max_seqlen`` stay global: attention runs over the whole pack after all-to-all."""
    total = batch["input_ids"].shape[1]
    if total % sp:
        raise ValueError(f"micro-batch of {total} tokens cannot be split over sp {sp}: pad it to a multiple of sp")
    size = total // sp
    out = dict(batch)
    for key in TOKEN_KEYS:
        out[key] = batch[key][:, sp_rank * size : (sp_rank + 1) * size]
    out["sp"], out["sp_rank"] = sp, sp_rank
    out["target_index"] = target_index(out["labels"])
    return out


def target_index(labels: torch.Tensor) -> torch.Tensor:
    """Positions (in the row) of the supervised labels of a [1, T] host tensor."""
    return torch.nonzero(labels[0] != -100).flatten()
