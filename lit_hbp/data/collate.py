"""Collate a rank's packs into one varlen micro-batch (a ``PackedBatch``, whose fields are documented
in ``lit_hbp.data.batch``).

T is padded to a multiple of lcm(8, sp) with a padding segment of its own, so any SP degree can cut
it into equal shards. Everything the training step needs to know about a micro-batch is computed
here, on the host, so the step never reads a value back from the device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lit_hbp.data.batch import PackedBatch
from lit_hbp.packing.context_split import padded_length


def collate_packs(
    packs: list[np.ndarray],
    tokens: Callable[[int], tuple[np.ndarray, np.ndarray]],
    *,
    sp: int = 1,
    sp_kind: str = "ulysses",
    cp: int = 1,
    pad_id: int = 0,
    level: int = 0,
    ckpt_layers: int = 0,
    offload: bool = False,
    mlp_tiles: int = 1,
    loss_norm: float | None = None,
    epoch: int = 0,
    micro_index: int = 0,
) -> PackedBatch:
    """The whole (unsharded) micro-batch of ``packs`` (arrays of sample ids), padded for ``sp``;
    ``tokens(i)`` gives (ids, supervised mask) of sample i; the rest are the plan's fields."""
    sample_ids = np.concatenate(packs) if packs else np.zeros(0, np.int64)
    parts = [tokens(int(i)) for i in sample_ids]
    lens = np.array([p[0].size for p in parts], dtype=np.int64)
    n = int(lens.sum())
    total = padded_length(n, sp)
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
    return PackedBatch(
        input_ids=torch.from_numpy(ids)[None],
        labels=labels,
        position_ids=torch.from_numpy(position_ids)[None],
        sample_targets=torch.from_numpy(sample_targets.astype(np.int32))[None],
        cu_seqlens=torch.from_numpy(cu),
        max_seqlen=int(seg_lens.max()),
        n_targets=int(supervised.sum()),
        n_loss_samples=n_samples,
        n_tokens=n,
        doc_sq=float((lens.astype(np.float64) ** 2).sum()),
        target_index=target_index(labels),
        sample_index=torch.from_numpy(sample_ids.astype(np.int64)),
        loss_norm=loss_norm,
        level=level,
        sp=sp,
        sp_kind=sp_kind,
        cp=cp,
        sp_rank=0,
        ckpt_layers=ckpt_layers,
        offload=offload,
        mlp_tiles=mlp_tiles,
        epoch=epoch,
        micro_index=micro_index,
    )


def target_index(labels: torch.Tensor) -> torch.Tensor:
    """Positions (in the row) of the supervised labels of a [1, T] host tensor."""
    return torch.nonzero(labels[0] != -100).flatten()


SAMPLE_INFO = frozenset({"source", "line", "index"})  # what `lit-hbp preview --json` adds about a sample


def pack_samples(
    samples: Sequence[Any],
    pad_id: int = 0,
    loss_norm: float | None = None,
    *,
    ckpt_layers: int = 0,
    offload: bool = False,
    mlp_tiles: int = 1,
) -> PackedBatch:
    """Your own samples packed into one micro-batch: the ``collate_fn`` of a plain DataLoader over
    ``(input_ids, supervised)`` pairs (``supervised[i]`` 1 when token i is a target of the loss), mappings
    with those keys (as ``lit-hbp preview --json`` prints them), or Hugging Face style records
    (``input_ids`` and ``labels``, -100 where a token is not trained, ``attention_mask`` all ones). Each
    sample keeps its own positions and attends only to itself. ``ckpt_layers``, ``offload`` and
    ``mlp_tiles`` are the level settings ``packed_loss`` applies for the call. Without ``loss_norm`` (the
    optimizer step's supervised tokens / (world size x accumulation): ``step_loss_norm`` computes it
    over the ranks) train with the ``token_mean`` or ``sum`` loss; levels with sequence parallelism
    need HBPDataModule's plan."""
    pairs = [_sample(i, sample) for i, sample in enumerate(samples)]
    if not pairs:
        raise ValueError("pack_samples got no samples")
    return collate_packs(
        [np.arange(len(pairs))], lambda i: pairs[i], pad_id=pad_id, loss_norm=loss_norm, ckpt_layers=ckpt_layers,
        offload=offload, mlp_tiles=mlp_tiles,
    )  # fmt: skip


def _sample(i: int, sample: Any) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, supervised mask) of one of ``pack_samples``' samples, or a ValueError naming it."""
    if not isinstance(sample, Mapping):
        ids, mask = sample
    else:
        unknown = sorted(set(sample) - {"input_ids", "supervised", "labels", "attention_mask"} - SAMPLE_INFO)
        if unknown:
            raise ValueError(
                f"sample {i}: pack_samples does not use {unknown}; give input_ids with supervised (1 per trained "
                "token) or labels (-100 where not trained)"
            )
        if "input_ids" not in sample or ("supervised" in sample) == ("labels" in sample):
            raise ValueError(f"sample {i}: give input_ids and one of supervised or labels, got {sorted(sample)}")
        ids = np.asarray(sample["input_ids"])
        if "attention_mask" in sample and not np.all(np.asarray(sample["attention_mask"]) == 1):
            raise ValueError(
                f"sample {i}: its attention_mask has zeros (padding): pack samples without padding, each attends "
                "only to itself"
            )
        if "labels" in sample:
            labels = np.asarray(sample["labels"])
            if labels.shape != ids.shape:
                raise ValueError(f"sample {i}: labels must hold one value per token ({labels.size} for {ids.size})")
            trained = labels != -100
            if not np.array_equal(labels[trained], ids[trained]):
                at = int(np.flatnonzero(trained & (labels != ids))[0])
                raise ValueError(
                    f"sample {i}: labels[{at}] is {int(labels[at])}, not -100 and not the token input_ids[{at}] "
                    f"({int(ids[at])}): causal-LM labels are the input ids (shifted by the loss) or -100"
                )
            mask = trained.astype(np.int64)
        else:
            mask = sample["supervised"]
    ids, mask = np.asarray(ids), np.asarray(mask)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(f"sample {i}: input_ids must be a flat sequence of integers")
    if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
        raise ValueError(f"sample {i}: supervised must hold one 0 or 1 per token ({mask.size} for {ids.size})")
    return ids.astype(np.int64), mask.astype(bool)
