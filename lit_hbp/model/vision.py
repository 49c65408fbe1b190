"""Vision-language packs in a model: the images and videos of several records in one packed call, each
record computed as it alone would be (how a pack's media are batched: ``lit_hbp.data.media_batch``).

A record of a vision-language model is its token ids, each image or video already expanded into its
placeholder tokens by the family's processor, the pixels the processor made of its images and videos,
their per-image metadata (grids, sizes) and, for families with multimodal RoPE (Qwen2-VL and kin),
per-token media types. Packing keeps each record's computation its own:

- pixels and per-image metadata concatenate along their first dimension in record order (the model
  scatters image features into the placeholders in order); anyres tiles ([images, tiles, C, H, W])
  are zero-padded to the pack's widest, as the family's own batching pads them (the model reads only
  each image's own tiles); per-record counts (``batch_num_images``) stay per record;
- per-token fields (``mm_token_type_ids``, ``token_type_ids``) concatenate like the ids;
- positions restart per record; a family whose positions depend on the images numbers each record
  alone with its own ``get_rope_index`` (``MRopePositions``), the rows stacked under the pack's text
  row ([4, 1, T]: what transformers' own packed path reads);
- the vision tower keeps its own attention: a packed call routes only the language model's configs
  to lit-hbp's varlen attention (``lit_hbp.model.causal_lm.prepare_model``), and ``packed_loss`` encodes the
  images outside the packed call (``mm_encoder_outputs``).

Refused rather than trained wrong: families whose language model lets an image's tokens attend to
each other both ways (``BIDIRECTIONAL``): one causal kernel per document is not their computation.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lit_hbp.data.media_batch import IMAGE_ARGS, VIDEO_ARGS, has_media

# model_type -> why a causal kernel per document cannot be its language model's attention over images
BIDIRECTIONAL = {
    "gemma3": "an image's tokens attend to each other both ways (token_type_ids)",
    "gemma3n": "an image's tokens attend to each other both ways",
    "gemma4": "an image's tokens attend to each other both ways",
    "gemma4_unified": "an image's tokens attend to each other both ways",
    "paligemma": "the image and the prompt attend to each other both ways (a prefix LM)",
    "pi0": "the prefix attends both ways",
    "pi05": "the prefix attends both ways",
    "git": "the image tokens attend to each other both ways",
    "molmo2": "an image's tokens attend to each other both ways",
    "unlimited_ocr": "its image blocks attend both ways",
    "step3p7": "its attention is bidirectional",
    "shieldgemma2": "an image's tokens attend to each other both ways (Gemma 3)",
}


def is_multimodal(net: torch.nn.Module) -> bool:
    """A Hugging Face model with a vision tower: its inner model encodes images (``get_image_features``)."""
    inner = getattr(net, "model", None)
    return inner is not None and callable(getattr(inner, "get_image_features", None))


VISION_TOWERS = ("vision_tower", "visual", "vision_model")  # the inner model's image encoder, by family


def tower_beside_language_model(net: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """(name, module) of a vision tower the top module holds itself, beside its language model, with no inner
    ``model`` that encodes images (Llama 4's and Nemotron-H Omni's ``vision_model``): a vision-language layout
    lit-hbp's packed calls do not run (``is_multimodal`` is False); None otherwise."""
    if is_multimodal(net):
        return None
    return next(((name, child) for name, child in net.named_children() if name in VISION_TOWERS), None)


def vision_tower(net: torch.nn.Module) -> torch.nn.Module | None:
    """The image encoder of a vision-language model (LLaVA's ``vision_tower``, Qwen's ``visual``, ...), which
    for some families holds their projector too (Qwen's ``visual.merger``); None for a text-only model."""
    inner = getattr(net, "model", None)
    towers = (getattr(inner, n, None) for n in VISION_TOWERS)
    return next((t for t in towers if isinstance(t, torch.nn.Module)), None)


# The projector of a family that keeps it inside its vision tower (Qwen-VL's ``visual.merger``, Qwen3-VL's
# deepstack mergers too): it trains with freeze_vision, as a projector beside the tower does.
PROJECTORS_IN_TOWER = frozenset({"merger", "deepstack_merger_list"})


def encoder_parameters(tower: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of a vision tower's encoder: all of them but a projector inside it."""
    return [p for n, p in tower.named_parameters() if not PROJECTORS_IN_TOWER & set(n.split("."))]


def language_linears(net: torch.nn.Module, decoder: torch.nn.Module) -> list[str]:
    """The names (in ``net``) of the language model's linear layers: LoRA's default targets on a
    vision-language model, whose vision tower and projector keep their weights."""
    inside = {id(m) for m in decoder.modules()}
    return [n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear) and id(m) in inside]


def attends_both_ways(net: torch.nn.Module) -> str | None:
    """Why some of ``net``'s tokens may attend to later ones when a call marks them (images, a prefix), or
    None: a family in ``BIDIRECTIONAL``, or a config with ``prefix_lm`` (its ``token_type_ids`` 1 mark a
    prefix that attends both ways)."""
    family = getattr(net.config, "model_type", None)
    if family in BIDIRECTIONAL:
        return BIDIRECTIONAL[family]
    if getattr(net.config.get_text_config(), "prefix_lm", False):
        return "its config sets prefix_lm, so tokens whose token_type_ids are 1 attend to each other both ways"
    return None


# Families whose language model numbers its own multimodal RoPE axes including a sequence axis (HunYuan-VL's: the
# sequence, then width, height and image index) and takes a text row before them without stripping it (its forward
# raises on the rows a packed call carries, [text row, axes]): a prepared model's packed call hands it its axes alone,
# the pack's boundaries travelling with the call. Its unprepared model keeps the refusal.
TEXT_ROW_UNREAD = frozenset({"hunyuan_vl"})


def without_unread_text_row(net: torch.nn.Module, positions: Any) -> torch.Tensor | None:
    """``positions`` without their text row where ``net``'s family reads its axes alone (``TEXT_ROW_UNREAD``), else
    None (as called)."""
    if getattr(net.config, "model_type", None) not in TEXT_ROW_UNREAD or not isinstance(positions, torch.Tensor):
        return None
    axes = len((net.config.get_text_config().rope_parameters or {}).get("mrope_section", ()))
    return positions[1:] if positions.dim() == 3 and positions.shape[0] == axes + 1 else None


def refuse_bidirectional(net: torch.nn.Module, mm: Mapping | None) -> None:
    """Raise when ``net``'s family lets marked tokens attend both ways and the pack holds such tokens
    (images, or ``token_type_ids`` 1)."""
    why = attends_both_ways(net)
    if why is not None and has_media(mm):
        raise ValueError(
            f"{type(net).__name__} ({net.config.model_type}): {why}, which lit-hbp's causal attention per document "
            "does not compute, so this pack would train wrong; train it on packs without them (text only), or "
            "another family (docs/vision.md)"
        )


def refuse_batch_statistics(net: torch.nn.Module, mm: Mapping | None, trained: bool = False) -> None:
    """Raise when the pack holds images and a module of ``net`` normalizes by its batch's statistics (a BatchNorm
    in training mode, or one keeping no running statistics): the pack's images encoded together would change each
    other's features, which each record alone does not see (Emu3's VQ tokenizer, frozen in eval by transformers,
    which ``train()`` switches back). ``trained``: as a run will train it (Lightning calls ``train()``), at set-up."""
    if not has_media(mm):
        return
    for name, module in _batch_norms(net):
        if trained or module.training or not module.track_running_stats:
            how = "" if trained else f"keep it in eval mode (net.get_submodule({name!r}).eval() after train()), or "
            raise ValueError(
                f"{type(net).__name__} ({net.config.model_type}): its {name} ({type(module).__name__}) normalizes by "
                f"the batch's statistics in training, so a pack's images would change each other's encodings; {how}"
                "train it on text only"
            )


_norms_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def has_batch_norms(net: torch.nn.Module) -> bool:
    """Whether ``net`` has a BatchNorm anywhere (found once per model)."""
    return bool(_batch_norms(net))


def _batch_norms(net: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    if net not in _norms_of:
        kind = torch.nn.modules.batchnorm._BatchNorm
        _norms_of[net] = [(n, m) for n, m in net.named_modules() if isinstance(m, kind)]
    return _norms_of[net]


def check_encoder_outputs(inner: torch.nn.Module) -> None:
    """Refuse a model whose forward cannot take the images' encodings computed apart
    (``mm_encoder_outputs``, transformers 5.18 on, not every family): its packed call would run the
    vision tower inside and hand the language model's attention the pack's keywords. Refuse too a model
    whose image encoder lit-hbp cannot call (``encoder_outputs``): none, or one that needs a field lit-hbp
    does not pack."""
    if not _takes_encoder_outputs(type(inner)):
        _refuse_encoder_outputs(inner)
    problem = unpacked_image_args(type(inner))
    if problem:
        raise ValueError(f"{type(inner).__name__}: {problem}, so lit-hbp cannot train it on images (packs without "
                         "images train)")  # fmt: skip


@functools.cache
def unpacked_image_args(cls: type) -> str:
    """Why lit-hbp cannot encode a pack's images with ``cls``'s own ``get_image_features`` (it has none, or it
    needs an argument outside the fields lit-hbp packs, ``IMAGE_ARGS``); empty when it can."""
    fn = getattr(cls, "get_image_features", None)
    if fn is None:
        return "it has no get_image_features to encode images apart from the packed call"
    params = inspect.signature(fn).parameters.items()
    needs = [n for n, p in params if n != "self" and p.default is p.empty and p.kind in NAMED and n not in IMAGE_ARGS]
    return f"its get_image_features needs {needs}, which lit-hbp does not pack" if needs else ""


NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@functools.cache
def _takes_encoder_outputs(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``mm_encoder_outputs`` (read once per class: packed_loss asks per pack)."""
    return "mm_encoder_outputs" in inspect.signature(cls.forward).parameters


def _refuse_encoder_outputs(inner: torch.nn.Module) -> None:
    import transformers
    from packaging.version import Version

    version = transformers.__version__
    fix = (
        "pip install 'transformers>=5.18', which has it"
        if Version(version) < Version("5.18")
        else "this family cannot train on images with lit-hbp"
    )
    raise ValueError(
        f"{type(inner).__name__}.forward takes no mm_encoder_outputs (transformers {version}): lit-hbp encodes a "
        f"pack's images apart from the packed call and hands them over so; {fix} (packs without images train)"
    )


def encoder_outputs(inner: torch.nn.Module, mm: Mapping[str, torch.Tensor]) -> dict:
    """The images' and videos' encodings by the model's own vision tower (``get_image_features`` /
    ``get_video_features`` with the arguments they take), as ``mm_encoder_outputs``: computed apart
    from the decoder's call, so the tower runs with its own attention and sees none of the pack's keywords
    (``packed_loss`` runs it in the packed call's scope with every config's own attention)."""
    out = {}
    for name, args, method in (
        ("image", IMAGE_ARGS, "get_image_features"),
        ("video", VIDEO_ARGS, "get_video_features"),
    ):
        if mm.get(args[0]) is None:
            continue
        fn = getattr(inner, method)
        takes = inspect.signature(fn).parameters
        kw = {k: mm[k] for k in args if k in mm and k in takes}
        if "return_dict" in takes or any(p.kind is p.VAR_KEYWORD for p in takes.values()):
            kw["return_dict"] = True
        out[name] = fn(**kw)
    return out


TOKEN_IDS = {"image": ("image_token_id", "image_token_index"), "video": ("video_token_id", "video_token_index")}


def check_record_placeholders(config: Any, items: Mapping | None, ids: Any, bounds: Any, encoded: Mapping) -> None:
    """Each record of a pack has as many placeholder tokens as its own images and videos encode to. The family's
    own check counts the whole pack: a record with one image too few beside one whose image has no placeholder
    trained the second record's image in the first's place (``pack_samples`` over records a user assembled).
    ``items``: each kind's items per record (``PackedBatch.media_items``), ``ids`` the pack's token ids on the host,
    ``bounds`` its records' boundaries; read from shapes and host ids alone (no device read)."""
    for kind, per_record in (items or {}).items():
        rows = _item_rows(encoded.get(kind))
        token = next((getattr(config, a) for a in TOKEN_IDS[kind] if getattr(config, a, None) is not None), None)
        if rows is None or token is None or len(rows) != sum(per_record):
            continue  # the encodings do not come per item, or the family names no placeholder: its own check
        ends = np.cumsum(per_record)
        features = [sum(rows[e - n : e]) for e, n in zip(ends, per_record)]
        placeholders = [int((ids[bounds[r] : bounds[r + 1]] == token).sum()) for r in range(len(per_record))]
        if sum(placeholders) != sum(features):
            continue  # the family adds rows of its own in its forward (or refuses the pack itself)
        for r, n in enumerate(per_record):
            if placeholders[r] != features[r]:
                raise ValueError(
                    f"sample {r} of the pack: {placeholders[r]} {kind} placeholder tokens for its {n} {kind}(s), which "
                    f"encode to {features[r]}: each record needs its own {kind}s' placeholders (alone, the model "
                    f"refuses it; packed, another record's {kind} would fill them); fix the record's {kind}s or text"
                )


def _item_rows(out: Any) -> list[int] | None:
    """The encoding rows of each item in an encoder's output (a list of [rows, width] or one [items, rows, width]
    tensor as ``pooler_output``), or None where they do not come per item."""
    features = getattr(out, "pooler_output", out)
    if isinstance(features, list | tuple) and all(torch.is_tensor(f) and f.dim() == 2 for f in features):
        return [int(f.shape[0]) for f in features]
    if torch.is_tensor(features) and features.dim() == 3:
        return [int(features.shape[1])] * int(features.shape[0])
    return None
