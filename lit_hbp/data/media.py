"""Images and videos of chat records, on the data side: loaded from the files a record names, counted
into tokens by the checkpoint's own processor when the source is tokenized, and turned into the
processor's pixels again in the DataLoader workers. The token cache keeps each sample's image and
video files and sizes, never pixels, so it grows with samples.

Tokenizing a record with media: the chat template renders one placeholder per image or video
(``<image>``, ``<|image_pad|>``, ``<|video_pad|>``); the processor expands each placeholder into the
tokens it becomes; the supervised mask of the rendering is carried over to the expanded ids (image and
video tokens never train). A video is a folder of frames, a list of frame files or a video file, which
the processor's own loader decodes (its optional dependency, torchcodec, installed).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from lit_hbp.data.media_batch import MM_KEYS
from lit_hbp.data.message_fields import Frames
from lit_hbp.errors import DataError
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing.vision_load import VisionLoad


class Image(NamedTuple):
    """An image of a sample, as the token cache keeps it: its file and size, the pixels its encoder sees
    and in how many tiles (``encoded_pixels``)."""

    file: str
    width: int
    height: int
    pixels: int
    tiles: int


class Video(NamedTuple):
    """A video of a sample, as the token cache keeps it: its frames' folder, list or video file, one
    frame's size, the pixels its encoder sees (every frame) and in how many tiles, its frame count, and
    the rate its record gave its frames (0: none given, the processor's default; a video file its own)."""

    source: str | tuple[str, ...]
    width: int
    height: int
    pixels: int
    tiles: int
    frames: int
    fps: float = 0.0


def media_entry(row: Sequence) -> Image | Video:
    """A token cache row (``media.json``) as the entry it is: a video's has its frame count and rate too."""
    if len(row) == len(Video._fields):
        source = row[0] if isinstance(row[0], str) else tuple(row[0])
        return Video(source, *(int(x) for x in row[1:-1]), float(row[-1]))
    return Image(row[0], *(int(x) for x in row[1:]))


def load_image(path: str, where: str):
    """The RGB image in ``path``, fully decoded and turned upright as its EXIF orientation says (a phone's photo,
    as transformers' own ``load_image`` gives the processor); a DataError naming the record for a missing,
    unreadable or truncated file."""
    from PIL import Image as PILImage
    from PIL import ImageOps, UnidentifiedImageError

    try:
        with PILImage.open(path) as im:
            im.load()
            return ImageOps.exif_transpose(im).convert("RGB")
    except FileNotFoundError:
        raise DataError(f"{where}: image {path} does not exist") from None
    except PILImage.DecompressionBombError as e:  # not an OSError: it escaped as PIL's traceback
        raise DataError(
            f"{where}: image {path} cannot be read ({e}): make it smaller, or raise PIL.Image.MAX_IMAGE_PIXELS"
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"{where}: image {path} cannot be read ({type(e).__name__}: {e})") from None


def _natural(name: str) -> list:
    """``frame_2`` before ``frame_10``: digits compare as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def frame_files(folder: str, where: str) -> list[str]:
    """A frame folder's image files in frame order (names compared with their numbers as numbers)."""
    from PIL import Image as PILImage

    kinds = set(PILImage.registered_extensions())
    files = [f for f in os.listdir(folder) if os.path.splitext(f)[1].lower() in kinds]
    if not files:
        raise DataError(f"{where}: video {folder} is a folder without image files (a video's frames)")
    return [os.path.join(folder, f) for f in sorted(files, key=_natural)]


class Clip(NamedTuple):
    """A video loaded: its frames (RGB images, or the loader's array for a video file), the loader's
    metadata (None for frames: the processor makes its own), one frame's size and the frame count."""

    frames: Any
    metadata: Any
    width: int
    height: int
    count: int


def load_video(source: str | Sequence[str] | Frames, where: str, processor) -> Clip:
    """A video's frames: a folder of frame images, a list of frame files (at a rate of their record's:
    ``Frames``, else none, so the processor takes its default), or a video file decoded by the processor's own
    loader (transformers' ``fetch_videos``; a DataError naming the missing decoder when it cannot). Frames
    must share one size."""
    fps = source.fps if isinstance(source, Frames) else None
    source = source.source if isinstance(source, Frames) else source
    if not isinstance(source, str) or os.path.isdir(source):
        files = frame_files(source, where) if isinstance(source, str) else list(source)
        frames = [load_image(f, f"{where}: video frame {k}") for k, f in enumerate(files)]
        sizes = {im.size for im in frames}
        if len(sizes) > 1:
            raise DataError(
                f"{where}: video {source}'s frames differ in size ({sorted(sizes)}): give frames of one size"
            )
        ((width, height),) = sizes
        n = len(frames)
        metadata = (
            None
            if fps is None
            else dict(  # what a decoder reports of a file, for frames at their rate
                total_num_frames=n, fps=fps, duration=n / fps, frames_indices=list(range(n)), height=height, width=width
            )
        )
        return Clip(frames, metadata, width, height, n)
    if not os.path.exists(source):
        raise DataError(f"{where}: video {source} does not exist")
    if fps is not None:
        raise DataError(
            f"{where}: video {source} is a video file, which has a frame rate of its own: 'fps' is the rate of "
            "frames given as a folder or a list; remove it"
        )
    try:
        array, metadata = processor.video_processor.fetch_videos(source)
    except ImportError as e:
        raise DataError(
            f"{where}: video {source} is a video file and the processor cannot decode it here ({e}): install its "
            "decoder (pip install torchcodec), or give the video's frames (a folder of images or a list of frames)"
        ) from None
    except (OSError, RuntimeError, ValueError, TypeError) as e:
        raise DataError(f"{where}: video {source} cannot be read ({type(e).__name__}: {e})") from None
    return Clip(array, metadata, *_frame_size(array, metadata), int(np.shape(array)[0]))


def _frame_size(array, metadata) -> tuple[int, int]:
    """(width, height) of a decoded video's frames: the decoder's metadata, else the frames' layout (torchcodec
    gives [frames, channels, height, width], the older decoders [frames, height, width, channels])."""
    if getattr(metadata, "width", None) and getattr(metadata, "height", None):
        return int(metadata.width), int(metadata.height)
    shape = np.shape(array)
    return (int(shape[3]), int(shape[2])) if shape[1] in (1, 3, 4) else (int(shape[2]), int(shape[1]))


def _token_id(processor, kind: str) -> int | None:
    token_id = getattr(processor, f"{kind}_token_id", None)
    if token_id is None:
        token = getattr(processor, f"{kind}_token", None)
        token_id = processor.tokenizer.convert_tokens_to_ids(token) if token else None
    return None if token_id is None else int(token_id)


def image_token_id(processor) -> int:
    """The id of the token a processor repeats for each image."""
    token_id = _token_id(processor, "image")
    if token_id is None:
        raise DataError(f"{type(processor).__name__} names no image token: its records with images cannot be packed")
    return token_id


def video_token_id(processor) -> int | None:
    """The id of the token a processor repeats for each video; None for a processor without videos."""
    return _token_id(processor, "video") if getattr(processor, "video_processor", None) is not None else None


def processor_fingerprint(processor) -> str:
    """What decides how many tokens an image or video becomes (part of the token cache's key): the image (and
    video) processor's settings and the processor's own (LLaVA's ``patch_size``, ``num_additional_image_tokens``,
    ``vision_feature_select_strategy``, ``image_seq_length``: an edit of processor_config.json changes every
    record's image tokens, where the cache kept the old ones). Its plain values only: an object's repr names its
    address, which would never key the same cache twice."""
    import json

    if processor is None:
        return ""
    settings = processor.image_processor.to_dict()
    video = getattr(processor, "video_processor", None)
    if video is not None:
        settings["video_processor"] = video.to_dict()
    own = {k: v for k, v in _processor_settings(processor).items() if k not in ("image_processor", "video_processor")}
    settings["processor_settings"] = {k: v for k, v in own.items() if _plain(v)}
    return json.dumps({"processor": type(processor).__name__, **settings}, sort_keys=True, default=str)


def _processor_settings(processor) -> dict:
    try:
        return processor.to_dict()
    except Exception:  # a processor whose to_dict fails: its attributes as set
        return dict(vars(processor))


def _plain(value) -> bool:
    """Whether ``value`` is JSON's own (numbers, strings, booleans, None, lists and dicts of them)."""
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def processor_inputs(clips: Sequence[Clip]) -> dict:
    """The processor's ``videos`` (and ``video_metadata`` where a video file's loader gave it; frames get
    transformers' own default, as when no metadata is passed)."""
    if not clips:
        return {}
    out: dict = {"videos": [c.frames for c in clips]}
    if any(c.metadata is not None for c in clips):
        out["video_metadata"] = [
            c.metadata if c.metadata is not None else
            {"total_num_frames": c.count, "fps": None, "duration": None, "frames_indices": list(range(c.count)),
             "height": c.height, "width": c.width}
            for c in clips
        ]  # fmt: skip
    return out


class MediaExpander:
    """The ids of a rendered record with images and videos, as the processor makes them, with the
    rendering's supervised mask carried over; the media's files and sizes for the cache."""

    def __init__(self, processor):
        self.processor = processor
        self.image_id = image_token_id(processor)
        self.video_id = video_token_id(processor)
        self.token_types = False  # the processor returned mm_token_type_ids (the workers rebuild them)

    def refuse_placeholders(self, ids: np.ndarray, where: str) -> None:
        """A record without media whose text holds the image or video token (an ``<image>`` marker with no
        ``images`` list): the model would look for pixels that are not there."""
        for kind, token_id in (("image", self.image_id), ("video", self.video_id)):
            if token_id is not None and (ids == token_id).any():
                token = self.processor.tokenizer.convert_ids_to_tokens(token_id)
                raise DataError(
                    f"{where}: the text holds the {kind} token {token!r} but the record has no {kind}s: give the "
                    f"{kind}s (an {kind}s list, or {kind} parts), or remove the marker"
                )

    def _placed(self, ids: np.ndarray, kind: str, token_id: int | None, count: int, where: str) -> None:
        if token_id is None:
            raise DataError(
                f"{where}: the record has {count} {kind}(s) and the checkpoint's {type(self.processor).__name__} "
                f"takes no {kind}s"
            )
        placeholders = int((ids == token_id).sum())
        if placeholders != count:
            raise DataError(
                f"{where}: {count} {kind}(s) but the chat template rendered {placeholders} {kind} placeholder(s): "
                f"each {kind} needs its place in the text (an {kind} part, or an <{kind}> marker)"
            )

    def __call__(
        self, text: str, ids: np.ndarray, target: np.ndarray, images: Sequence[str], videos: Sequence, where: str
    ) -> tuple[np.ndarray, np.ndarray, list[Image | Video]]:
        self._placed(ids, "image", self.image_id, len(images), where)
        if videos or self.video_id is not None:
            self._placed(ids, "video", self.video_id, len(videos), where)
        loaded = [load_image(p, where) for p in images]
        clips = [load_video(v, where, self.processor) for v in videos]
        rates = [v.fps if isinstance(v, Frames) else 0.0 for v in videos]
        videos = [v.source if isinstance(v, Frames) else v for v in videos]
        try:
            enc = self.processor(
                text=[text], images=[loaded] if loaded else None, **processor_inputs(clips), add_special_tokens=False,
                return_text_replacement_offsets=True, return_offsets_mapping=self.processor.tokenizer.is_fast,
            )  # fmt: skip
        except (ValueError, TypeError) as e:
            raise DataError(f"{where}: the processor refused the record: {e}") from None
        self.token_types |= "mm_token_type_ids" in enc
        _one_tensor(enc, where)
        expanded = np.asarray(enc["input_ids"][0], dtype=ids.dtype)
        media_ids = [t for t in (self.image_id, self.video_id) if t is not None]
        replaced = replaced_tokens(ids, enc, self.processor.tokenizer, media_ids)
        out_target = carry_mask(ids, target, expanded, expansions(enc, media_ids), replaced, where)
        seen = encoded_of_record(enc, "image", len(loaded)) or [
            encoded_pixels(self.processor.image_processor, im) for im in loaded
        ]
        out: list[Image | Video] = [Image(p, *im.size, *s) for p, im, s in zip(images, loaded, seen)]
        seen = encoded_of_record(enc, "video", len(clips)) or [encoded_video_pixels(self.processor, c) for c in clips]
        out += [Video(v, c.width, c.height, *s, c.count, r) for v, c, s, r in zip(videos, clips, seen, rates)]
        return expanded, out_target, out


def _one_tensor(enc, where: str) -> None:
    """A record's pixels must stack into one tensor, as the model's forward takes them: a processor set not to
    pad (LLaVA-NeXT's ``do_pad: false``) gives images of different tile counts as a ragged list, which its own
    ``return_tensors="pt"`` cannot stack either."""
    for key in ("pixel_values", "pixel_values_videos"):
        values = enc.get(key)
        if isinstance(values, (list, tuple)) and len({np.shape(v) for v in values}) > 1:
            shapes = [tuple(np.shape(v)) for v in values]
            raise DataError(
                f"{where}: the processor gives this record's items {key} of different shapes {shapes}, which the "
                "model takes as one tensor (a processor set not to pad, data.processor_kwargs do_pad: false?): "
                "let the processor pad (do_pad: true) or give the record images that encode alike"
            )


def encoded_of_record(enc, kind: str, count: int) -> list[tuple[int, int]] | None:
    """Each image's (or video's) encoded pixels and tiles read off the processor's encoding of the whole
    record, where its layout tells them apart: Qwen's patch rows by their grids, images padded to one size by
    their ``image_sizes`` (Pixtral's processor sizes them as its image processor alone does not: patches of its
    merged size), or the record's only item; None otherwise (each is then encoded alone, ``encoded_pixels``)."""
    key = "pixel_values" if kind == "image" else "pixel_values_videos"
    values, grid = enc.get(key), enc.get(f"{kind}_grid_thw")
    if not count or values is None:
        return None if count else []
    shape = np.shape(values)
    sizes = enc.get("image_sizes") if kind == "image" else None
    if sizes is not None and len(shape) == 4 and len(sizes) == count:  # one [images, C, H, W], padded to the largest
        return [(int(h) * int(w), 1) for h, w in np.asarray(sizes).reshape(-1, 2)]  # (Pixtral's): each its own size
    if grid is not None and len(shape) == 2:  # patch rows of C x T x p x p values: T x p x p pixels a row
        grid = np.asarray(grid).reshape(-1, 3)
        per_row = shape[1] // 3
        return [(int(np.prod(g)) * per_row, int(g[0]) if kind == "video" else 1) for g in grid]
    if count == 1 and len(shape) in (4, 5):  # [tiles (crops), C, H, W] or [1, tiles (frames), C, H, W]
        tiles = shape[1] if len(shape) == 5 else shape[0]
        return [(int(np.prod(shape)) // 3, int(tiles))]
    return None


def encoded_pixels(image_processor, image) -> tuple[int, int]:
    """What the vision tower encodes of ``image``: its pixels as the image processor cuts them (tiles or
    patches, each pixel once per frame), and in how many tiles (each attended apart: LLaVA-NeXT's anyres
    tiles; 1 where the whole image is one sequence, Qwen's)."""
    shape = np.shape(image_processor(images=[image], return_tensors="np")["pixel_values"])
    tiles = shape[1] if len(shape) == 5 else shape[0] if len(shape) == 4 else 1
    return int(np.prod(shape)) // 3, int(tiles)


def encoded_video_pixels(processor, clip: Clip) -> tuple[int, int]:
    """What the vision tower encodes of a video: its pixels as the video processor cuts them (every
    frame's), and in how many pieces its tower attends apart: Qwen's temporal patches (the grid's first
    number), one per frame where frames are encoded as images (LLaVA-OneVision's)."""
    metadata = {"video_metadata": [clip.metadata]} if clip.metadata is not None else {}
    out = processor.video_processor(videos=[clip.frames], return_tensors="np", **metadata)
    shape = np.shape(out["pixel_values_videos"])
    grid = out.get("video_grid_thw")
    tiles = int(np.asarray(grid)[0][0]) if grid is not None else shape[1] if len(shape) == 5 else 1
    return int(np.prod(shape)) // 3, tiles


def expansions(enc, media_ids) -> np.ndarray:
    """Which of the processor's ids stand where it expanded a placeholder: the characters it replaced
    (``text_replacement_offsets``) located by the tokenizer's offsets, so text a processor adds of its
    own (Qwen3-VL's frame timestamps) counts as the expansion; with a slow tokenizer (no offsets), the
    image and video tokens alone."""
    ids = np.asarray(enc["input_ids"][0])
    offsets = enc.get("offset_mapping")
    if offsets is None:
        return np.isin(ids, media_ids)
    tokens = np.asarray(offsets[0], dtype=np.int64).reshape(-1, 2)
    inside = np.zeros(ids.size, dtype=bool)
    for r in (enc.get("text_replacement_offsets") or [[]])[0]:
        start, end = r["new_span"]
        inside |= (tokens[:, 0] < end) & (tokens[:, 1] > start)
    return inside | np.isin(ids, media_ids)


def replaced_tokens(ids: np.ndarray, enc, tokenizer, media_ids) -> np.ndarray:
    """Which of the rendering's ``ids`` the processor replaced: each image and video token, and the tokens
    around it that its replacement took in too, the replaced text (``text_replacement_offsets``' ``text``)
    tokenized and laid over the rendering around its media token: transformers 5.25's Qwen3-VL replaces a video's
    ``<|vision_start|><|video_pad|><|vision_end|>`` whole (each frame then comes in a pair of its own)."""
    out = np.isin(ids, media_ids)
    at = np.flatnonzero(out)
    replacements = (enc.get("text_replacement_offsets") or [[]])[0]
    if len(replacements) != len(at):  # one replacement a placeholder, in order; else the media tokens alone
        return out
    for i, replacement in zip(at, replacements):
        text = replacement.get("text")
        tokens = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else np.zeros(0)
        own = np.flatnonzero(tokens == ids[i])
        if tokens.size < 2 or own.size != 1:
            continue
        start = i - int(own[0])
        if start >= 0 and np.array_equal(ids[start : start + tokens.size], tokens):
            out[start : start + tokens.size] = True
    return out


def carry_mask(
    ids: np.ndarray, target: np.ndarray, expanded: np.ndarray, inside: np.ndarray, replaced: np.ndarray, where: str
) -> np.ndarray:
    """``target`` of the rendering's ``ids`` on the processor's ``expanded`` ids: both hold the same
    tokens once the rendering's tokens the processor replaced (``replaced_tokens``: the image and video tokens,
    the wrapper a replacement took in) and the processor's expansions of them (``inside``) are removed; an
    expansion never trains."""
    mine = ~replaced
    if not np.array_equal(ids[mine], expanded[~inside]):
        raise DataError(
            f"{where}: the processor tokenizes this record otherwise than its tokenizer does beyond expanding the "
            "image and video placeholders, so its supervised tokens cannot be located"
        )
    out = np.zeros(expanded.size, dtype=bool)
    out[np.flatnonzero(~inside)] = target[mine]
    return out


class ConfigOnly:
    """What a family's ``get_rope_index`` reads of its model: its config and the class's own methods,
    without weights (a DataLoader worker numbers positions without the model)."""

    def __init__(self, cls: type, config):
        self.config = config
        self._cls = cls

    def __getattr__(self, name: str) -> Any:
        if name == "spatial_merge_size" and not hasattr(self._cls, name):  # set in __init__ (the Omni thinkers')
            return self.config.vision_config.spatial_merge_size
        return getattr(self._cls, name).__get__(self)


def rope_stand_in(config) -> ConfigOnly | None:
    """A stand-in for the inner model of a family whose positions depend on its images (multimodal
    RoPE), built from the checkpoint's config; None for other families."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    cls = getattr(transformers, name, None) if name is not None else None  # its module by the class (the thinkers')
    return ConfigOnly(cls, config) if callable(getattr(cls, "get_rope_index", None)) else None


PER_TEXT = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "moe_mm_token_type_ids")  # the
# placeholders' own, not the record's: the worker makes the record's from its ids


class WorkerMedia:
    """A sample's images and videos as the processor's tensors (``pixel_values``, grids, sizes, the video
    fields) and its per-token fields, built in a DataLoader worker from the files the cache names; an
    image or video whose size or frame count changed since tokenizing is refused (its token count would
    not match)."""

    def __init__(self, processor, token_types: bool):
        self.processor = processor
        self.image_id = image_token_id(processor)
        self.video_id = video_token_id(processor)
        self.token_types = token_types  # the processor returns mm_token_type_ids (1 on image tokens, 2 on video's)

    def _placeholder(self, kind: str, token_id: int) -> str:
        return getattr(self.processor, f"{kind}_token", None) or self.processor.tokenizer.convert_ids_to_tokens(
            token_id
        )

    def __call__(self, ids: np.ndarray, media: Sequence[Image | Video], where: str) -> dict[str, torch.Tensor]:
        images = [m for m in media if isinstance(m, Image)]
        videos = [m for m in media if isinstance(m, Video)]
        if not media:
            return {}
        loaded, clips = [], []
        for path, width, height, *_ in images:
            im = load_image(path, where)
            _same(f"image {path}", im.size, (width, height), where)
            loaded.append(im)
        for v in videos:
            clip = load_video(Frames(v.source, v.fps) if v.fps else v.source, where, self.processor)
            _same(f"video {v.source}", (clip.width, clip.height, clip.count), (v.width, v.height, v.frames), where)
            clips.append(clip)
        # The processor itself, on the media's placeholders alone: its own fields, as it returns them for
        # the record (Qwen2.5-VL's seconds per temporal patch, LLaVA-OneVision's images per record), none
        # of its image processor's that it keeps to itself (Gemma 3's num_crops).
        text = self._placeholder("image", self.image_id) * len(loaded)
        if clips:
            text += self._placeholder("video", self.video_id) * len(clips)
        images = [loaded] if loaded else None  # nested: the record's images read together, as its processor does
        enc = self.processor(text=[text], images=images, **processor_inputs(clips), return_tensors="pt")
        out = {k: v for k, v in enc.items() if k not in PER_TEXT}
        unknown = sorted(set(out) - set(MM_KEYS))
        if unknown:
            raise DataError(f"{where}: the processor returns {unknown}, which lit-hbp does not pack")
        if self.token_types:
            ids = np.asarray(ids)
            types = (ids == self.image_id).astype(np.int64)
            if self.video_id is not None:
                types[ids == self.video_id] = 2
            out["mm_token_type_ids"] = torch.as_tensor(types)
        if callable(getattr(self.processor, "create_moe_mm_token_type_ids", None)):  # ERNIE 4.5-VL's expert routing
            out["moe_mm_token_type_ids"] = torch.as_tensor(self.processor.create_moe_mm_token_type_ids(np.asarray(ids)))
        return out


def _same(what: str, now: tuple, then: tuple, where: str) -> None:
    if now != then:
        say = lambda t: f"{t[0]}x{t[1]}" + (f", {t[2]} frames" if len(t) > 2 else "")  # noqa: E731
        raise DataError(
            f"{where}: {what} is {say(now)} now, {say(then)} when the source was tokenized: remove the token cache "
            "(data.cache_dir) to tokenize it again"
        )


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


def vision_work(media_pixels: Sequence[Sequence[tuple[int, int]]], config) -> np.ndarray:
    """Per sample, its images' encoding in the planner's units of balance (squared lengths: a token
    pair's attention work in the language model, ``ModelSpec.pair_flops``, ``plan_hbp(extra_work=...)``),
    so a pack heavy with images weighs what it costs."""
    flat, owner, counts = _flat(media_pixels)
    per_image = encoder_flops(flat[:, 0], flat[:, 1], config) / _spec(config).pair_flops
    return np.bincount(owner, weights=per_image, minlength=counts.size)


def vision_load(media_pixels: Sequence[Sequence[tuple[int, int]]], config) -> VisionLoad:
    """Per sample, the patches its images and videos give the vision tower and their encoding's work
    (``vision_work``): what the level search prices a vision-language run's levels with."""
    flat, owner, counts = _flat(media_pixels)
    vision = _spec(config).vision
    if vision is None:
        raise ValueError(f"{getattr(config, 'model_type', 'the model')}: its vision_config names no depth and width")
    patches = np.bincount(owner, weights=flat[:, 0] / vision.patch_pixels, minlength=counts.size)
    return VisionLoad(patches, vision_work(media_pixels, config))


def _flat(media_pixels) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    counts = np.array([len(p) for p in media_pixels], dtype=np.int64)
    flat = np.array([im for p in media_pixels for im in p], dtype=np.float64).reshape(-1, 2)
    return flat, np.repeat(np.arange(counts.size), counts), counts


def _spec(config) -> ModelSpec:
    return ModelSpec.from_config(config.to_dict() if hasattr(config, "to_dict") else dict(config))
