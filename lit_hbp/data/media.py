"""Images of chat records, on the data side: loaded from the files a record names, counted into tokens
by the checkpoint's own processor when the source is tokenized, and turned into the processor's
pixels again in the DataLoader workers. The token cache keeps each sample's image files and sizes,
never pixels, so it grows with samples.

Tokenizing a record with images: the chat template renders one placeholder per image (``<image>``,
``<|image_pad|>``); the processor expands each placeholder into the tokens its image becomes; the
supervised mask of the rendering is carried over to the expanded ids (image tokens never train).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lit_hbp.errors import DataError
from lit_hbp.vision import MM_KEYS


def load_image(path: str, where: str):
    """The RGB image in ``path``, fully decoded; a DataError naming the record for a missing, unreadable
    or truncated file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except FileNotFoundError:
        raise DataError(f"{where}: image {path} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"{where}: image {path} cannot be read ({type(e).__name__}: {e})") from None


def image_token_id(processor) -> int:
    """The id of the token a processor repeats for each image."""
    token_id = getattr(processor, "image_token_id", None)
    if token_id is None:
        token = getattr(processor, "image_token", None)
        token_id = processor.tokenizer.convert_tokens_to_ids(token) if token else None
    if token_id is None:
        raise DataError(f"{type(processor).__name__} names no image token: its records with images cannot be packed")
    return int(token_id)


def processor_fingerprint(processor) -> str:
    """What decides how many tokens an image becomes: the image processor's settings (part of the
    token cache's key)."""
    import json

    if processor is None:
        return ""
    settings = processor.image_processor.to_dict()
    return json.dumps({"processor": type(processor).__name__, **settings}, sort_keys=True, default=str)


class ImageExpander:
    """The ids of a rendered record with images, as the processor makes them, with the rendering's
    supervised mask carried over; the images' files and sizes for the cache."""

    def __init__(self, processor):
        self.processor = processor
        self.image_id = image_token_id(processor)
        self.token_types = False  # the processor returned mm_token_type_ids (the workers rebuild them)

    def refuse_placeholders(self, ids: np.ndarray, where: str) -> None:
        """A record without images whose text holds the image token (an ``<image>`` marker with no
        ``images`` list): the model would look for pixels that are not there."""
        if (ids == self.image_id).any():
            token = self.processor.tokenizer.convert_ids_to_tokens(self.image_id)
            raise DataError(
                f"{where}: the text holds the image token {token!r} but the record has no images: give the images "
                "(an images list, or image parts), or remove the marker"
            )

    def __call__(
        self, text: str, ids: np.ndarray, target: np.ndarray, images: Sequence[str], where: str
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[str, int, int, int]]]:
        loaded = [load_image(p, where) for p in images]
        placeholders = int((ids == self.image_id).sum())
        if placeholders != len(loaded):
            raise DataError(
                f"{where}: {len(loaded)} image(s) but the chat template rendered {placeholders} image placeholder(s): "
                "each image needs its place in the text (an image part, or an <image> marker)"
            )
        try:
            enc = self.processor(text=[text], images=loaded, add_special_tokens=False)
        except (ValueError, TypeError) as e:
            raise DataError(f"{where}: the processor refused the record: {e}") from None
        self.token_types |= "mm_token_type_ids" in enc
        expanded = np.asarray(enc["input_ids"][0], dtype=ids.dtype)
        out_target = carry_mask(ids, target, expanded, self.image_id, where)
        seen = [encoded_pixels(self.processor.image_processor, im) for im in loaded]
        return expanded, out_target, [(p, *im.size, *s) for p, im, s in zip(images, loaded, seen)]


def encoded_pixels(image_processor, image) -> tuple[int, int]:
    """What the vision tower encodes of ``image``: its pixels as the image processor cuts them (tiles or
    patches, each pixel once per frame), and in how many tiles (each attended apart: LLaVA-NeXT's anyres
    tiles; 1 where the whole image is one sequence, Qwen's)."""
    shape = np.shape(image_processor(images=[image], return_tensors="np")["pixel_values"])
    tiles = shape[1] if len(shape) == 5 else shape[0] if len(shape) == 4 else 1
    return int(np.prod(shape)) // 3, int(tiles)


def carry_mask(ids: np.ndarray, target: np.ndarray, expanded: np.ndarray, image_id: int, where: str) -> np.ndarray:
    """``target`` of the rendering's ``ids`` on the processor's ``expanded`` ids: both hold the same
    tokens once image tokens are removed; image tokens never train."""
    mine, theirs = ids != image_id, expanded != image_id
    if not np.array_equal(ids[mine], expanded[theirs]):
        raise DataError(
            f"{where}: the processor tokenizes this record otherwise than its tokenizer does beyond expanding the "
            "image placeholders, so its supervised tokens cannot be located"
        )
    out = np.zeros(expanded.size, dtype=bool)
    out[np.flatnonzero(theirs)] = target[mine]
    return out


class ConfigOnly:
    """What a family's ``get_rope_index`` reads of its model: its config and the class's own methods,
    without weights (a DataLoader worker numbers positions without the model)."""

    def __init__(self, cls: type, config):
        self.config = config
        self._cls = cls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cls, name).__get__(self)


def rope_stand_in(config) -> ConfigOnly | None:
    """A stand-in for the inner model of a family whose positions depend on its images (multimodal
    RoPE), built from the checkpoint's config; None for other families."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    if name is None:
        return None
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    cls = getattr(module, name, None)
    return ConfigOnly(cls, config) if callable(getattr(cls, "get_rope_index", None)) else None


class WorkerMedia:
    """A sample's images as the processor's tensors (``pixel_values``, grids, sizes) and its per-token
    fields, built in a DataLoader worker from the files the cache names; an image whose size changed
    since tokenizing is refused (its token count would not match)."""

    def __init__(self, processor, token_types: bool):
        self.processor = processor
        self.image_id = image_token_id(processor)
        self.token_types = token_types  # the processor returns mm_token_type_ids (1 on image tokens)

    def __call__(self, ids: np.ndarray, images: Sequence[tuple], where: str) -> dict[str, torch.Tensor]:
        if not images:
            return {}
        loaded = []
        for path, width, height, *_ in images:
            im = load_image(path, where)
            if im.size != (width, height):
                raise DataError(
                    f"{where}: image {path} is {im.size[0]}x{im.size[1]} now, {width}x{height} when the source was "
                    "tokenized: remove the token cache (data.cache_dir) to tokenize it again"
                )
            loaded.append(im)
        out = dict(self.processor.image_processor(images=loaded, return_tensors="pt"))
        unknown = sorted(set(out) - set(MM_KEYS))
        if unknown:
            raise DataError(f"{where}: the image processor returns {unknown}, which lit-hbp does not pack")
        if self.token_types:
            out["mm_token_type_ids"] = torch.as_tensor((np.asarray(ids) == self.image_id).astype(np.int64))
        return out


def encoder_flops(pixels: np.ndarray, tiles: np.ndarray, config) -> np.ndarray:
    """Forward FLOPs of a vision tower encoding images of ``pixels`` in ``tiles`` (each image's), from its
    config: per patch the layers' dense work, per tile the attention among its own patches (both ways),
    within a window where the tower's layers attend in windows (Qwen2.5-VL's)."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return np.zeros(np.shape(pixels))
    get = lambda *names: next((getattr(vision, n) for n in names if getattr(vision, n, None)), None)  # noqa: E731
    hidden, layers = get("embed_dim", "hidden_size"), get("num_hidden_layers", "depth")  # Qwen2-VL: embed_dim
    inner = get("intermediate_size") or (get("mlp_ratio") or 4) * hidden
    patch, frames = get("patch_size") or 14, get("temporal_patch_size") or 1
    mlp = 3 if get("hidden_act") in ("silu", "swish") else 2  # a gated MLP (Qwen2.5-VL's) has three matrices
    n = np.asarray(pixels, dtype=np.float64) / (patch * patch * frames)
    per_tile = n / np.asarray(tiles)
    # Qwen2.5-VL: all but its fullatt_block_indexes layers attend within windows of (window_size / patch)^2 patches
    full = get("fullatt_block_indexes")
    window = (get("window_size") or 0) // patch
    windowed = layers - len(full) if full is not None and window else 0
    attention = (layers - windowed) * per_tile + windowed * np.minimum(per_tile, window * window)
    return layers * 2 * (4 * hidden * hidden + mlp * hidden * inner) * n + 4 * hidden * n * attention


def vision_work(image_pixels: Sequence[Sequence[tuple[int, int]]], config) -> np.ndarray:
    """Per sample, its images' encoding in the planner's units of balance (squared lengths: a token
    pair's attention work in the language model, ``plan_hbp(extra_work=...)``), so a pack heavy with
    images weighs what it costs."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    per_pair = 2 * text.num_hidden_layers * text.hidden_size  # causal attention's forward FLOPs per squared token
    counts = np.array([len(p) for p in image_pixels], dtype=np.int64)
    flat = np.array([im for p in image_pixels for im in p], dtype=np.float64).reshape(-1, 2)
    per_image = encoder_flops(flat[:, 0], flat[:, 1], config) / per_pair
    owner = np.repeat(np.arange(counts.size), counts)
    return np.bincount(owner, weights=per_image, minlength=counts.size)
