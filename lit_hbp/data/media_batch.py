"""A pack's images and videos as the model's inputs: each record's fields as tensors (``media_of``),
joined in pack order (``collate_media``), and the multimodal-RoPE positions of families whose positions
depend on the images (``MRopePositions``). How the model then encodes them: ``lit_hbp.model.vision``.

- pixels and per-image metadata concatenate along their first dimension in record order (the model
  scatters image features into the placeholders in order); anyres tiles ([images, tiles, C, H, W])
  are zero-padded to the pack's widest, as the family's own batching pads them (the model reads only
  each image's own tiles); per-record counts (``batch_num_images``) stay per record;
- per-token fields (``mm_token_type_ids``, ``token_type_ids``) concatenate like the ids;
- positions restart per record; a family whose positions depend on the images numbers each record
  alone with its own ``get_rope_index``, the rows stacked under the pack's text row ([4, 1, T]: what
  transformers' own packed path reads).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lit_hbp.errors import DataError

# Concatenated along their first dimension, in record order.
CONCAT_KEYS = (
    "pixel_values", "image_grid_thw", "image_sizes", "batch_num_images", "pixel_attention_mask", "spatial_shapes",
    "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
)  # fmt: skip
# One value per token, concatenated like the ids (ERNIE 4.5-VL's experts' routing: moe_mm_token_type_ids)
TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids", "moe_mm_token_type_ids")
MM_KEYS = CONCAT_KEYS + TOKEN_KEYS
IMAGE_ARGS = ("pixel_values", "image_grid_thw", "image_sizes", "batch_num_images", "pixel_attention_mask",
              "spatial_shapes")  # fmt: skip
VIDEO_ARGS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def has_media(mm: Mapping | None) -> bool:
    """Whether a pack's multimodal inputs hold any image or video."""
    if not mm:
        return False
    if any(mm.get(k) is not None and mm[k].numel() for k in ("pixel_values", "pixel_values_videos")):
        return True
    return any(mm.get(k) is not None and bool((mm[k] != 0).any()) for k in TOKEN_KEYS)


def media_of(record: Mapping, i: int, length: int) -> dict[str, torch.Tensor]:
    """The multimodal fields of ``record`` (sample ``i`` of ``length`` tokens) as tensors, per-token
    fields checked for their length."""
    out = {}
    for key in MM_KEYS:
        if record.get(key) is None:
            continue
        value = torch.as_tensor(np.asarray(record[key])) if not torch.is_tensor(record[key]) else record[key]
        if key in TOKEN_KEYS:
            value = value.reshape(-1)
            if value.numel() != length:
                raise ValueError(f"sample {i}: {key} must hold one value per token ({value.numel()} for {length})")
        out[key] = value
    return out


# Vision towers that cut each image back to its ``image_sizes`` before any work on it (Pixtral's: a patch
# convolution whose stride is its kernel, then each image's own patches), or read it within its
# ``pixel_attention_mask`` down to a feature count that does not grow with the padding (Idefics2's: the tower masks
# the padded patches, its perceiver resamples the rest to a fixed number of latents): their processor pads a batch's
# images to one height and width, bottom and right, and so may a pack. Idefics3's and SmolVLM's connectors shuffle
# the padded patches into features too, so a pack of their images of different sizes is refused.
CROPPING_TOWERS = frozenset({"pixtral", "idefics2_vision"})


def pads_images(config: Any) -> bool:
    """Whether a pack of ``config``'s records may pad their images to one size (``CROPPING_TOWERS``)."""
    return getattr(getattr(config, "vision_config", None), "model_type", None) in CROPPING_TOWERS


def collate_media(
    parts: Sequence[Mapping[str, torch.Tensor]],
    lengths: Sequence[int],
    total: int,
    names: Callable[[int], str] | None = None,
    pad_images: bool = False,
) -> dict:
    """The pack's multimodal inputs from each record's (``media_of``) in pack order; per-token fields
    padded with 0 to the pack's ``total`` tokens; the same keys present in every record or refused
    (``names(j)``: part j's record, for the refusal). Anyres tiles are padded to the pack's most tiles;
    with ``pad_images`` (``pads_images``) images of different sizes, each with its ``image_sizes``, to the
    pack's largest height and width, as the family's processor pads a batch."""
    keys = {k for p in parts for k in p}
    out: dict[str, torch.Tensor] = {}
    for key in TOKEN_KEYS:
        if key in keys:
            row = torch.zeros(total, dtype=torch.long)
            at = 0
            for part, n in zip(parts, lengths):
                if key in part:
                    row[at : at + n] = part[key].long()
                at += n
            out[key] = row[None]
    masked = _pad_masked_images(parts, names, pad_images) if "pixel_attention_mask" in keys else {}
    out.update(masked)
    for key in CONCAT_KEYS:
        holders = [j for j, p in enumerate(parts) if key in p]
        values = [parts[j][key] for j in holders]
        if not values or key in masked:
            continue
        if key == "pixel_values" and values[0].dim() == 5:  # anyres: [images, tiles, C, H, W]
            tiles = max(v.shape[1] for v in values)
            values = [torch.nn.functional.pad(v, (0, 0, 0, 0, 0, 0, 0, tiles - v.shape[1])) for v in values]
        sized = all("image_sizes" in parts[j] for j in holders)  # without them the tower would see the padding
        if key == "pixel_values" and pad_images and sized and values[0].dim() == 4:
            height, width = max(v.shape[2] for v in values), max(v.shape[3] for v in values)
            values = [torch.nn.functional.pad(v, (0, width - v.shape[3], 0, height - v.shape[2])) for v in values]
        values = [v.reshape(1) if v.dim() == 0 else v for v in values]
        if len({v.shape[1:] for v in values}) > 1:
            first: dict[tuple, int] = {}
            for j, v in zip(holders, values):
                first.setdefault(tuple(v.shape[1:]), j)
            shapes = ", ".join(f"{list(shape)} ({names(j) if names else f'record {j} of the pack'})"
                               for shape, j in first.items())  # fmt: skip
            hint = (
                ": the family's forward takes a pack's videos as one [videos, frames, ...] tensor (LLaVA-OneVision's), "
                "so they need one frame count; set its video processor's num_frames with do_sample_frames: true, or "
                "give videos of one length"
                if key == "pixel_values_videos" else
                ": images of different sizes are padded to one only for a vision tower that cuts each back to its "
                "image_sizes (Pixtral's: pack_samples needs the model, model=, to know it)"
                if key == "pixel_values" and sized and not pad_images else ""
            )  # fmt: skip
            raise DataError(f"a pack's records give {key} of different shapes: {shapes}, which cannot be joined{hint}")
        out[key] = torch.cat(values, dim=0)
    return out


def _pad_masked_images(parts: Sequence[Mapping[str, torch.Tensor]], names: Callable[[int], str] | None,
                       pad_sizes: bool) -> dict:  # fmt: skip
    """Idefics2's, Idefics3's, SmolVLM's and Granite-Docling's images: a record's as ``[1, images, C, H, W]`` with its
    ``pixel_attention_mask``, ``[1, images, H, W]`` (each image's valid pixels) or ``[1, images]`` (Granite-Docling's
    real tiles); a pack's one row per record with images, each padded with zeros to the pack's most images (padding
    images, which the model drops) and, with ``pad_sizes`` (``pads_images``: Idefics2's), to its tallest and widest,
    as their processor pads a batch."""
    holders = [j for j, p in enumerate(parts) if "pixel_values" in p]
    where = lambda j: names(j) if names else f"record {j} of the pack"  # noqa: E731
    if any(parts[j]["pixel_values"].dim() == 3 for j in holders):
        return _pad_patch_rows(parts, holders, where)
    for j in holders:
        pixels, mask = parts[j]["pixel_values"], parts[j].get("pixel_attention_mask")
        if (
            pixels.dim() != 5 or pixels.shape[0] != 1 or mask is None
            or mask.shape not in (pixels[:, :, 0].shape, pixels.shape[:2])
        ):  # fmt: skip
            raise DataError(
                f"{where(j)}: its pixel_values {list(pixels.shape)} and pixel_attention_mask "
                f"{list(mask.shape) if mask is not None else None} are not one record's images as its processor "
                "gives them ([1, images, C, H, W] and [1, images, H, W] or [1, images]); give each record both, as "
                "the processor returns them"
            )
    pixels = [parts[j]["pixel_values"] for j in holders]
    masks = [parts[j]["pixel_attention_mask"] for j in holders]
    sizes = {tuple(v.shape[3:]): j for j, v in reversed(list(zip(holders, pixels)))}
    if len(sizes) > 1 and not (pad_sizes and all(m.dim() == 4 for m in masks)):
        said = ", ".join(f"{h}x{w} ({where(j)})" for (h, w), j in sorted(sizes.items(), key=lambda s: s[1]))
        raise DataError(
            f"a pack's records give images of different sizes: {said}; this family's connector makes features of the "
            "padding too, so they cannot be padded to one: give its images at one size (its processor's own resizing "
            "does: a tile of its max_image_size)"
        )
    images, height, width = (max(v.shape[d] for v in pixels) for d in (1, 3, 4))

    def pad(v: torch.Tensor) -> torch.Tensor:  # a record's pixels or mask: its images, then its rows and columns
        sized = (0, width - v.shape[-1], 0, height - v.shape[-2]) + (0, 0) * (v.dim() - 4) if v.dim() >= 4 else ()
        return torch.nn.functional.pad(v, sized + (0, images - v.shape[1]))

    return {
        "pixel_values": torch.cat([pad(v) for v in pixels]),
        "pixel_attention_mask": torch.cat(list(map(pad, masks))),
    }


def _pad_patch_rows(parts: Sequence[Mapping[str, torch.Tensor]], holders: list[int], where: Callable) -> dict:
    """LFM2-VL's images (SigLIP 2's patches): an image a row of ``[images, patches, C x P x P]`` with its
    ``pixel_attention_mask`` ``[images, patches]`` and ``spatial_shapes``; a pack's rows padded with zeros to its
    most patches (masked: the tower attends past none, the model reads each image's tokens off its shape)."""
    for j in holders:
        pixels, mask = parts[j]["pixel_values"], parts[j].get("pixel_attention_mask")
        if pixels.dim() != 3 or mask is None or mask.shape != pixels.shape[:2] or "spatial_shapes" not in parts[j]:
            raise DataError(
                f"{where(j)}: its pixel_values {list(pixels.shape)} and pixel_attention_mask "
                f"{list(mask.shape) if mask is not None else None} are not one record's image patches as its processor "
                "gives them ([images, patches, C x P x P] and [images, patches], with spatial_shapes); give each "
                "record all three, as the processor returns them"
            )
    most = max(int(parts[j]["pixel_values"].shape[1]) for j in holders)
    pad = lambda v: torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, most - v.shape[1]))  # noqa: E731
    return {key: torch.cat([pad(parts[j][key]) for j in holders]) for key in ("pixel_values", "pixel_attention_mask")}


MEDIA_KINDS = {  # kind: (its pixels, fields with one row per item, first found counts them)
    "image": ("pixel_values", ("image_grid_thw", "image_sizes", "spatial_shapes")),
    "video": ("pixel_values_videos", ("video_grid_thw",)),
}


def media_items(parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, tuple[int, ...]]:
    """Per kind of media, how many items each record (``media_of``) holds, in pack order: the rows of a per-item
    field, else of pixels with one item per row (an image [C, H, W] or its tiles, a video's frames). A kind some
    record's fields cannot count is left out."""
    out = {}
    for kind, (pixels, per_item) in MEDIA_KINDS.items():
        counts = []
        for r, part in enumerate(parts):
            _check_grid_rows(part, pixels, per_item[0], f"record {r} of the pack")
            field = next((k for k in per_item if part.get(k) is not None), None)
            if field is not None:
                counts.append(int(part[field].shape[0]))
            elif part.get(pixels) is None:
                counts.append(0)
            elif part[pixels].dim() >= (4 if kind == "image" else 5):
                counts.append(int(part[pixels].shape[0]))
            else:
                break
        else:
            if any(counts):
                out[kind] = tuple(counts)
    return out


def _check_grid_rows(part: Mapping[str, torch.Tensor], pixels: str, grid: str, where: str) -> None:
    """A multimodal-RoPE record's pixel rows are its items' patches: as many as its grids' (t, h, w) products
    sum to, or the pack's joined pixels would give one record's patches to another's items."""
    if part.get(pixels) is None or not grid.endswith("grid_thw"):
        return
    rows = int(part[pixels].shape[0])
    if part.get(grid) is None:
        if part[pixels].dim() == 2:
            raise DataError(f"{where} has {pixels} ({rows} patch rows) but no {grid}: give the processor's {grid}")
        return
    want = int(part[grid].long().prod(-1).sum())
    if part[pixels].dim() == 2 and rows != want:
        raise DataError(
            f"{where}: its {pixels} has {rows} patch rows, its {grid} {part[grid].tolist()} make {want}: give each "
            "record its own items' pixels and grids, as the processor returns them"
        )


class MRopePositions:
    """Each record's multimodal-RoPE positions from the family's own ``get_rope_index``, computed on
    the record alone (so a pack gives each record what it gets alone), on the host."""

    def __init__(self, inner: torch.nn.Module):
        self.inner = inner

    @classmethod
    def of(cls, model: torch.nn.Module | None) -> MRopePositions | None:
        if model is None:
            return None
        net = getattr(model, "_orig_mod", model)  # torch.compile's wrapper, then peft's
        net = net.get_base_model() if hasattr(net, "get_base_model") else net
        inner = getattr(net, "model", None)
        return cls(inner) if callable(getattr(inner, "get_rope_index", None)) else None

    def rows(self, ids: np.ndarray, media: Mapping[str, torch.Tensor], where: str = "a record") -> torch.Tensor:
        """[3, L] positions of one record; its token types (``mm_token_type_ids``) are needed where it has media and
        the family's numbering takes them: without them the family's own model refuses the record, and its image
        tokens would be numbered as text."""
        ids_t = torch.tensor(np.asarray(ids), dtype=torch.long)[None]  # a copy: the cache's ids are read-only
        params = inspect.signature(self.inner.get_rope_index).parameters
        anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        # The record's grids and seconds per temporal patch under the names the family's own numbering takes
        # (Qwen2.5-VL's second_per_grid_ts; the Omni thinkers' second_per_grids), and its token types where it finds
        # images by type (not by a vision start token).
        kw = {k: media[k] for k in ("image_grid_thw", "video_grid_thw") if k in media}
        if "second_per_grid_ts" in media:
            kw["second_per_grids" if "second_per_grids" in params else "second_per_grid_ts"] = media[
                "second_per_grid_ts"
            ]
        if "mm_token_type_ids" in params or anything:
            types = media.get("mm_token_type_ids")
            if types is None and ("image_grid_thw" in kw or "video_grid_thw" in kw):
                raise DataError(
                    f"{where} has images or videos but no mm_token_type_ids, which the model's multimodal positions "
                    "need: pass the processor's (transformers >= 5 returns them; older saved records lack them)"
                )
            kw["mm_token_type_ids"] = (types if types is not None else torch.zeros(len(ids), dtype=torch.long))[None]
        if "attention_mask" in params:  # every token of a record alone is real (Qwen3-Omni's numbering reads it)
            kw["attention_mask"] = torch.ones_like(ids_t)
        with torch.no_grad():
            try:
                positions, _ = self.inner.get_rope_index(ids_t, **kw)
            except (StopIteration, IndexError, RuntimeError, ValueError) as e:  # the family's, on a record it refuses
                grids = {k: v.shape[0] for k, v in kw.items() if k.endswith("grid_thw")}
                raise DataError(
                    f"{where}: its multimodal positions cannot be numbered ({type(e).__name__}: {e}); its image and "
                    f"video placeholders must match its own {grids or 'grids'} (the processor's record does)"
                ) from e
        return positions[:, 0].cpu()

    def pack(self, ids: Sequence[np.ndarray], media: Sequence[Mapping], total: int) -> torch.Tensor:
        """[axes, 1, total] rows of the pack (HunYuan-VL's four axes, others' three): each record's, then an arange
        over the padding."""
        rows = [self.rows(i, m, f"record {k} of the pack") for k, (i, m) in enumerate(zip(ids, media))]
        n = sum(r.shape[1] for r in rows)
        rows.append(torch.arange(total - n).expand(rows[0].shape[0], -1))
        return torch.cat(rows, dim=1)[:, None]
