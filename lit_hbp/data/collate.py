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
from lit_hbp.data.media_batch import MM_KEYS, MRopePositions, collate_media, media_items, media_of, pads_images
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
    media: Callable[[int], Mapping[str, torch.Tensor]] | None = None,
    rope: MRopePositions | None = None,
    where: Callable[[int], str] | None = None,
    pad_images: bool = False,
) -> PackedBatch:
    """The whole (unsharded) micro-batch of ``packs`` (arrays of sample ids), padded for ``sp``;
    ``tokens(i)`` gives (ids, supervised mask) of sample i; ``media(i)`` its images and videos (a
    vision-language record, ``lit_hbp.model.vision``), ``rope`` numbers a record's positions when the family's
    depend on its images, ``where(i)`` names sample i's record in a refusal, ``pad_images`` lets images of
    different sizes join (``media_batch.pads_images``); the rest are the plan's fields."""
    sample_ids = np.concatenate(packs) if packs else np.zeros(0, np.int64)
    parts = [tokens(int(i)) for i in sample_ids]
    lens = np.array([p[0].size for p in parts], dtype=np.int64)
    if lens.size and not lens.all():
        empty = int(sample_ids[np.flatnonzero(lens == 0)[0]])
        raise ValueError(f"sample {empty} has no tokens: an empty sample trains nothing, leave it out of the pack")
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
    mm = items = None
    if media is not None:
        extra = [media(int(i)) for i in sample_ids]
        if any(extra):
            named = lambda j: where(int(sample_ids[j])) if where else f"sample {int(sample_ids[j])}"  # noqa: E731
            mm = collate_media(extra, lens.tolist(), total, named, pad_images)  # named: read on a refusal only
            items = media_items(extra)
            if rope is not None:
                mm["position_ids"] = rope.pack([p[0] for p in parts], extra, total)
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
        mm=mm,
        media_items=items or None,
        media_ids=ids if items else None,
        bounds=tuple(cu.tolist()),
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
    model: torch.nn.Module | None = None,
) -> PackedBatch:
    """Your own samples packed into one micro-batch: the ``collate_fn`` of a plain DataLoader over
    ``(input_ids, supervised)`` pairs (``supervised[i]`` 1 when token i is a target of the loss), mappings
    with those keys (as ``lit-hbp preview --json`` prints them), or Hugging Face style records
    (``input_ids`` and ``labels``, -100 where a token is not trained, ``attention_mask`` all ones), also a
    vision-language processor's (its ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``, video
    fields, ...: ``lit_hbp.model.vision``). Each sample keeps its own positions and attends only to itself;
    ``model`` (the model the batch is for) numbers a record's positions when its family's depend on its
    images (multimodal RoPE: Qwen2-VL and kin) and lets images of different sizes join where its tower cuts
    each back to its ``image_sizes`` (Pixtral's: Mistral 3). ``ckpt_layers``, ``offload`` and ``mlp_tiles`` are the
    level settings ``packed_loss`` applies for the call. Without ``loss_norm`` (the optimizer step's
    supervised tokens / (world size x accumulation): ``step_loss_norm`` computes it over the ranks) train
    with the ``token_mean`` or ``sum`` loss; levels with sequence parallelism need HBPDataModule's plan."""
    embed = getattr(model, "get_input_embeddings", lambda: None)() if model is not None else None
    vocab = getattr(embed, "num_embeddings", None)
    if not isinstance(pad_id, (int, np.integer)) or isinstance(pad_id, bool) or not 0 <= pad_id < (vocab or np.inf):
        raise ValueError(f"pad_id must be a token id in [0, {vocab or 'vocabulary size'}), got {pad_id!r}")
    parts = [_sample(i, sample) for i, sample in enumerate(samples)]
    if not parts:
        raise ValueError("pack_samples got no samples")
    rope = MRopePositions.of(model)
    grids = [i for i, (_, _, m) in enumerate(parts) if "image_grid_thw" in m or "video_grid_thw" in m]
    if grids and model is None:  # (a model without get_rope_index numbers its positions 1-D, as text)
        raise ValueError(
            f"sample {grids[0]}: records with image_grid_thw number their positions by their images (multimodal "
            "RoPE): pass the model they are for, pack_samples(samples, model=model)"
        )
    return collate_packs(
        [np.arange(len(parts))], lambda i: parts[i][:2], pad_id=pad_id, loss_norm=loss_norm, ckpt_layers=ckpt_layers,
        offload=offload, mlp_tiles=mlp_tiles, media=lambda i: parts[i][2], rope=rope,
        pad_images=pads_images(getattr(model, "config", None)),
    )  # fmt: skip


def _row(value: Any) -> np.ndarray:
    """A per-token field as a flat array (a processor's [1, L] tensors too)."""
    value = np.asarray(value.cpu() if torch.is_tensor(value) else value)
    return value[0] if value.ndim == 2 and value.shape[0] == 1 else value


def _pair(i: int, sample: Any) -> tuple[np.ndarray, np.ndarray]:
    """An ``(input_ids, supervised)`` pair's two rows, or a ValueError naming the sample."""
    flat = (torch.is_tensor(sample) or isinstance(sample, np.ndarray)) and sample.ndim < 2
    if flat or not isinstance(sample, Sequence | torch.Tensor | np.ndarray) or len(sample) != 2:
        got = f"a {type(sample).__name__}" + (f" of shape {tuple(sample.shape)}" if hasattr(sample, "shape") else "")
        raise ValueError(
            f"sample {i}: pack_samples takes (input_ids, supervised) pairs, mappings with input_ids and supervised or "
            f"labels, or processor records; got {got}: pair each sample's token ids with its supervised mask (1 per "
            "trained token)"
        )
    return _row(sample[0]), _row(sample[1])


def _sample(i: int, sample: Any) -> tuple[np.ndarray, np.ndarray, dict]:
    """(token ids, supervised mask, images and videos) of one of ``pack_samples``' samples, or a
    ValueError naming it."""
    media: dict = {}
    if not isinstance(sample, Mapping):
        ids, mask = _pair(i, sample)
    else:
        sample = {k: v for k, v in sample.items() if v is not None}  # None is no value, as a model's forward reads it
        known = {"input_ids", "supervised", "labels", "attention_mask", *MM_KEYS}
        unknown = sorted(set(sample) - known - SAMPLE_INFO)
        if unknown:
            raise ValueError(
                f"sample {i}: pack_samples does not use {unknown}; give input_ids with supervised (1 per trained "
                "token) or labels (-100 where not trained), and a vision-language processor's "
                f"{', '.join(MM_KEYS)}"
            )
        if "input_ids" not in sample or ("supervised" in sample) == ("labels" in sample):
            raise ValueError(f"sample {i}: give input_ids and one of supervised or labels, got {sorted(sample)}")
        ids = _row(sample["input_ids"])
        if "attention_mask" in sample:
            attend = _row(sample["attention_mask"])
            if attend.shape != ids.shape:
                raise ValueError(
                    f"sample {i}: its attention_mask must hold one value per token ({attend.size} for {ids.size}): "
                    "the mask of another sample, or of the sample before a cut?"
                )
            if not np.all(attend == 1):
                raise ValueError(
                    f"sample {i}: its attention_mask has zeros (padding): pack samples without padding, each "
                    "attends only to itself"
                )
        if "labels" in sample:
            labels = _row(sample["labels"])
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
            mask = _row(sample["supervised"])
        media = media_of(sample, i, ids.size)
    ids, mask = np.asarray(ids), np.asarray(mask)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise ValueError(f"sample {i}: input_ids must be a flat sequence of integers")
    if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
        raise ValueError(f"sample {i}: supervised must hold one 0 or 1 per token ({mask.size} for {ids.size})")
    return ids.astype(np.int64), mask.astype(bool), media
