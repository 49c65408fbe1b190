"""Images and videos of a pack on a sequence-parallel level: each rank of the SP group encodes its
share, and each rank gets the features of the placeholder tokens its shard holds.

Every rank of the group carries the whole pack's media (``PackedBatch.mm``: pixels are small next to
the activations of a long pack); the items (images, or videos) are dealt to the ranks largest-first by
the patches their encoder sees (``owners``), so the vision tower's work is split, not repeated. After
encoding, one all-reduce of the pack's placeholder positions says which rank's shard holds which
feature row, and one all-to-all sends each row from the rank that encoded it to the rank that needs it
(its backward sends the gradients back to the encoder). The shard's features reach the model through
``mm_encoder_outputs`` as one block in its placeholders' order, which the families read as
``torch.cat(pooler_output)`` and scatter into the shard's placeholder tokens.

Features the model reads per placeholder at later layers (Qwen3-VL's deepstack features: per deepstack
layer, one block of rows per item, row for row with the item's features) travel the same way, each
layer's rows along the same route, so each shard adds to its own image tokens what they would get alone.
An encoder of no pooled output whose deepstack features are (language layer, blocks) pairs (Granite 4
Vision: the first pair's blocks are the features the placeholders take) gets its pairs back so, each
pair's rows moved alike.

Refused rather than trained wrong, on every rank at once: an encoder whose output is not one block of
feature rows per item, or carries fields beyond those (``PER_ROW``), and a pack whose placeholder tokens
do not match the feature rows one for one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from lit_hbp.model.vision import encoder_outputs
from lit_hbp.parallel.context import SPCall


@dataclass(frozen=True)
class MediaKind:
    """The inputs of one kind of media (images or videos) in a family's processor output."""

    name: str  # the key of ``mm_encoder_outputs``
    pixels: str
    grid: str  # multimodal-RoPE families: one (t, h, w) row per item, pixels flattened to patches
    per_item: tuple[str, ...]
    token_ids: tuple[str, ...]  # config attributes naming its placeholder token


KINDS = (
    MediaKind("image", "pixel_values", "image_grid_thw",
              ("image_sizes", "image_grid_thw", "pixel_attention_mask", "spatial_shapes"),
              ("image_token_id", "image_token_index")),
    MediaKind("video", "pixel_values_videos", "video_grid_thw", ("video_grid_thw", "second_per_grid_ts"),
              ("video_token_id", "video_token_index")),
)  # fmt: skip
PLAIN_OUTPUT = ("last_hidden_state", "pooler_output", "hidden_states", "attentions")
PER_ROW = ("deepstack_features",)  # per layer, one block per item row for row with pooler_output: moved alike
# Families whose media of some kinds a pack split over an SP group cannot train, and why: Ovis2.5's forward checks a
# call's image (video) start and end tokens against its feature blocks (a shard may hold an image's start and not
# its end); Ovis2's image encoder also returns the embeddings of its visual indicator tokens, which the forward puts
# wherever those tokens stand, not row for row with the image's features. Refused on every rank alike (the config
# decides) when the call holds such media, and when an epoch's plan puts such a sample on an SP level.
WHOLE_ITEMS = {
    "ovis2_5": (("image", "video"), "'s forward checks a call's image (or video) start and end tokens against its "
                "feature blocks, which a pack split over an SP group does not keep together"),
    "ovis2": (("image",), "'s image encoder also returns its visual indicator tokens' embeddings, which its forward "
              "puts wherever those tokens stand, not row for row with the image's features as an SP group needs"),
}  # fmt: skip


def whole_items_problem(family: str | None, plan, media: np.ndarray, levels) -> str | None:
    """Why a plan cannot train a ``WHOLE_ITEMS`` family: it puts a sample with media of the kinds the family's SP
    call refuses (``media``: per sample, how many of those) on a level with sp > 1; said when the epoch is planned,
    before a step of it trains. None otherwise."""
    if family not in WHOLE_ITEMS or not media.any():
        return None
    member_level = np.repeat(plan.pack_level, np.diff(plan.offsets))
    split = [i for i, lv in enumerate(levels) if lv.sp > 1 and media[plan.members[member_level == i]].any()]
    if not split:
        return None
    lv = levels[split[0]]
    kinds, why = WHOLE_ITEMS[family]
    return (
        f"data.levels[{split[0]}] (pack_len {lv.pack_len}, sp {lv.sp}) holds samples with {_plural(kinds)}, and "
        f"{family}{why}: give the levels that hold them sp: 1"
    )


def split_items_problem(family: str | None, store, plan, levels) -> str | None:
    """``whole_items_problem`` of a plan of ``store``'s samples (a ``SampleStore``), their media of the kinds the
    family's SP call refuses counted only where it has such kinds and the levels split a pack."""
    if family not in WHOLE_ITEMS or not store.has_media or all(lv.sp == 1 for lv in levels):
        return None
    return whole_items_problem(family, plan, store.media_counts(WHOLE_ITEMS[family][0]), levels)


def _plural(kinds: tuple[str, ...]) -> str:
    return " or ".join(f"{k}s" for k in kinds)


def owners(weights: np.ndarray, groups: np.ndarray, size: int) -> np.ndarray:
    """Per item, the SP rank that encodes it: groups of items (a record's images when the family
    reads them per record) dealt largest-first to the least-loaded rank (lowest on ties), so every
    rank computes the same answer and the ranks' encoder work is balanced."""
    weights = np.asarray(weights, dtype=np.float64)
    groups = np.asarray(groups, dtype=np.int64)
    ids, inverse = np.unique(groups, return_inverse=True)
    totals = np.bincount(inverse, weights=weights, minlength=ids.size)
    load = np.zeros(size)
    owner_of_group = np.zeros(ids.size, np.int64)
    for g in np.argsort(-totals, kind="stable"):
        r = int(np.argmin(load))
        owner_of_group[g] = r
        load[r] += totals[g]
    return owner_of_group[inverse]


# Families whose vision tower encodes each temporal patch of a video apart (attention within a frame's
# patches, positions by height and width): a video's frames encode alone as they do together, so a long
# video is dealt to the SP group frame by frame. Other families' videos are one item each.
FRAME_WISE = frozenset({"qwen2_vl", "qwen2_5_vl"})


@dataclass(frozen=True)
class Items:
    """The units of one kind of media a pack's SP group deals out: images, videos, or a video's frames."""

    rows: np.ndarray  # pixel rows of each unit, in order
    weight: np.ndarray  # its encoder work
    groups: np.ndarray  # units dealt together (a record's images when the family reads them per record)
    parent: np.ndarray  # the image or video each unit is of (per-item fields are its parent's)
    grid: np.ndarray | None  # (t, h, w) of each unit for multimodal-RoPE families


def _items(mm: Mapping[str, torch.Tensor], kind: MediaKind, frame_wise: bool = False) -> Items:
    """The units of ``kind`` in ``mm``: its items, or with ``frame_wise`` each video's temporal patches."""
    pixels = mm[kind.pixels]
    grid = None
    if mm.get(kind.grid) is not None:
        grid = mm[kind.grid].cpu().numpy().astype(np.int64)
        parent = np.arange(grid.shape[0])
        if frame_wise and kind.name == "video":
            parent = np.repeat(parent, grid[:, 0])
            grid = np.column_stack([np.ones(parent.size, np.int64), grid[parent, 1], grid[parent, 2]])
        rows = grid.prod(-1)
        weight = rows.astype(np.float64)
    elif pixels.dim() == 3 and mm.get("spatial_shapes") is not None:  # LFM2-VL's: an image's patches a row
        rows = np.ones(pixels.shape[0], np.int64)
        parent = np.arange(rows.size)
        weight = mm["pixel_attention_mask"].reshape(rows.size, -1).sum(-1).cpu().numpy().astype(np.float64)
    elif pixels.dim() >= 4:  # one image per row; anyres tiles zero-padded to the pack's widest
        rows = np.ones(pixels.shape[0], np.int64)
        parent = np.arange(rows.size)
        tiles = pixels.reshape(pixels.shape[0], -1, pixels.shape[-3] * pixels.shape[-2] * pixels.shape[-1])
        weight = (tiles.abs().sum(-1) > 0).sum(-1).cpu().numpy().astype(np.float64) if pixels.dim() == 5 else rows * 1.0
    else:
        raise ValueError(
            f"{kind.pixels} of shape {tuple(pixels.shape)} without {kind.grid}: lit-hbp cannot tell its "
            f"{kind.name}s apart to split their encoding over the SP group; train these samples on an sp 1 level"
        )
    groups = np.arange(rows.size)
    if kind.name == "image" and mm.get("batch_num_images") is not None:  # read per record: kept together
        groups = np.repeat(np.arange(mm["batch_num_images"].numel()), mm["batch_num_images"].cpu().numpy())
    return Items(rows, weight, groups, parent, grid)


def _subset(mm: Mapping[str, torch.Tensor], kind: MediaKind, items: Items, mine: np.ndarray):
    """The encoder inputs of the units ``mine`` (a boolean per unit) of ``kind``."""
    starts = np.r_[0, np.cumsum(items.rows)]
    take = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in np.flatnonzero(mine)] or [np.zeros(0, int)])
    out = {kind.pixels: mm[kind.pixels][torch.as_tensor(take, dtype=torch.long, device=mm[kind.pixels].device)]}
    sel = torch.as_tensor(items.parent[mine], dtype=torch.long)
    for key in kind.per_item:
        if mm.get(key) is not None:
            out[key] = mm[key][sel.to(mm[key].device)]
    if items.grid is not None:  # a unit's own (t, h, w): a video's frames are videos of one temporal patch
        out[kind.grid] = torch.as_tensor(items.grid[mine], dtype=mm[kind.grid].dtype, device=mm[kind.grid].device)
    if kind.name == "image" and mm.get("batch_num_images") is not None:
        kept = np.unique(items.groups[mine])
        out["batch_num_images"] = mm["batch_num_images"][torch.as_tensor(kept, dtype=torch.long)]
    return out


def _token_id(config, kind: MediaKind) -> int:
    for attr in kind.token_ids:
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(config).__name__} names no {kind.name} placeholder token ({' / '.join(kind.token_ids)})")


class _Exchange(torch.autograd.Function):
    """all_to_all of feature rows with per-rank counts; the backward sends the gradients back.
    ``anchor`` (a scalar leaf) makes every rank of the group run the backward, also one that sends
    nothing (it encoded no item)."""

    @staticmethod
    def forward(fctx, rows, anchor, send, recv, group):
        fctx.send, fctx.recv, fctx.group = send, recv, group
        out = rows.new_empty(sum(recv), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(fctx, grad):
        back = grad.new_empty(sum(fctx.send), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), fctx.send, fctx.recv, group=fctx.group)
        return back, None, None, None, None


def _agree_or_refuse(problem: str | None, device, group, kind: str = "image", failure: Exception | None = None) -> None:
    """Raise on every rank when any rank found ``problem`` or failed encoding its share (``failure``, an OOM, the
    tower's own check: raised on its rank as it came), so none waits in a collective."""
    flag = torch.tensor([2.0 if failure is not None else 0.0 if problem is None else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if failure is not None:
        raise failure
    if flag.item() == 2:
        raise ValueError(
            f"another rank of the SP group failed encoding its share of this pack's {kind}s (its error names why)"
        )
    if flag.item() > 0:
        raise ValueError(
            problem
            or f"another rank of the SP group cannot split this pack's {kind} encoding (its error names why); "
            "train these samples on an sp 1 level"
        )


@torch.compiler.disable  # collectives with data-dependent sizes: kept out of compiled graphs
def split_encoder_outputs(
    inner: torch.nn.Module,
    mm: Mapping[str, torch.Tensor],
    input_ids: torch.Tensor,
    part: torch.Tensor,
    total: int,
    sp: SPCall,
) -> dict:
    """``mm_encoder_outputs`` for this rank's shard of a pack at sp > 1: this rank encodes its share
    of the pack's items (``owners``) with the model's own encoders (``lit_hbp.model.vision.encoder_outputs``),
    and receives the feature rows of the placeholder tokens its shard holds (``input_ids``, at the
    pack's positions ``part`` of ``total``), in their order."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    ctx = sp.ctx
    group, size, me = ctx.group, ctx.size, ctx.rank
    config = inner.config
    hidden = config.get_text_config().hidden_size
    dtype = inner.get_input_embeddings().weight.dtype
    device = input_ids.device
    language = {id(p) for p in inner.get_decoder().parameters()} if hasattr(inner, "get_decoder") else set()
    trains = torch.is_grad_enabled() and (
        any(p.requires_grad for p in inner.parameters() if id(p) not in language)
        or any(mm[k.pixels].requires_grad for k in KINDS if mm.get(k.pixels) is not None)
    )
    family = getattr(config, "model_type", None)
    kinds, why = WHOLE_ITEMS.get(family, ((), ""))
    if any(mm.get(k.pixels) is not None for k in KINDS if k.name in kinds):
        raise ValueError(
            f"{family}{why}: train its samples with {_plural(kinds)} on sp 1 levels (give the levels that hold "
            "them sp: 1)"
        )
    out = {}
    for kind in KINDS:
        if mm.get(kind.pixels) is None:
            continue
        items = _items(mm, kind, frame_wise=family in FRAME_WISE)
        rows = items.rows
        owner = owners(items.weight, items.groups, size)
        mine = owner == me
        pooled = torch.zeros(1, device=device)
        failure, problem, blocks, per_row, keys = None, None, [], {}, {}
        if mine.any():
            try:
                how, problem, blocks, per_row, keys = _encode_share(inner, _subset(mm, kind, items, mine), kind, hidden)
                pooled.fill_(how)
            except Exception as e:  # noqa: BLE001 (said to the group, then raised here: no peer waits in a collective)
                failure = e
        _agree_or_refuse(problem, device, group, kind.name, failure)
        # Feature rows per item (from the rank that encoded it), and who holds each placeholder token.
        counts = torch.zeros(rows.size, dtype=torch.long, device=device)
        if blocks:
            counts[torch.as_tensor(np.flatnonzero(mine), device=device)] = torch.tensor(
                [b.shape[0] for b in blocks], device=device
            )
        where = torch.zeros(total, dtype=torch.int32, device=device)
        local = (input_ids[0] == _token_id(config, kind)).to(device)
        where[part[local]] = me + 1
        dist.all_reduce(counts, group=group)
        dist.all_reduce(where, group=group)
        needer = where[where > 0].long().cpu().numpy() - 1
        item_rows = counts.cpu().numpy()
        if needer.size != int(item_rows.sum()):
            raise ValueError(
                f"this pack holds {needer.size} {kind.name} placeholder token(s) and its {kind.name}s encode to "
                f"{int(item_rows.sum())} feature row(s): they must match one for one (data.tokenizer must be the "
                "checkpoint's processor)"
            )
        route = Route.of(np.repeat(owner, item_rows), needer, me, size)
        anchor = torch.zeros((), device=device, requires_grad=trains)
        moved = partial(_moved, route=route, anchor=anchor, group=group, like=torch.zeros(0, hidden, dtype=dtype))
        dist.all_reduce(pooled, op=dist.ReduceOp.MAX, group=group)  # what a rank without items cannot see itself
        # Its placeholders' rows as the family's forward reads its encoder's output: one [items, rows, hidden]
        # tensor (here one item of all the rows), one block per item, or none (the rows come as a PER_ROW layer).
        how = int(pooled.item())
        mine_rows = moved(blocks) if how < 2 else None
        out[kind.name] = BaseModelOutputWithPooling(
            pooler_output=None if how == 2 else mine_rows[None] if how == 1 else (mine_rows,)
        )
        for field, (layers, layer_keys) in _per_row_layers(per_row, keys, device, group).items():
            got = [(moved(rows),) for rows in layers]
            setattr(
                out[kind.name], field, got if layer_keys is None else [(k, [r]) for k, (r,) in zip(layer_keys, got)]
            )
    return out


def _per_item(features, items: int):
    """A video encoder's one tensor of blocks per frame (Video-LLaVA's [videos x frames, patches, hidden], frames of a
    video in a row) as one block per video: the rows in the order the family's forward reads them."""
    if isinstance(features, torch.Tensor) and features.dim() == 3 and items and features.shape[0] % items == 0:
        return features.reshape(items, -1, features.shape[-1])
    return features


def _is_pair(layer) -> bool:
    """A (language layer index, blocks) pair, as Granite 4 Vision's deepstack features come."""
    return isinstance(layer, tuple) and len(layer) == 2 and isinstance(layer[0], int)


def _encode_share(inner: torch.nn.Module, subset: dict, kind: MediaKind, hidden: int):
    """This rank's items of ``kind`` through the family's own encoder: (how it hands back its features: 0 one block
    per item, 1 one tensor, 2 none pooled (the first PER_ROW layer's blocks are the features); why lit-hbp cannot
    split them, or None; the blocks per item; the PER_ROW fields' layers of blocks; the language layer of each of a
    field's layers where it came as (layer, blocks) pairs)."""
    items = len(subset[kind.grid]) if subset.get(kind.grid) is not None else len(subset[kind.pixels])
    encoded = encoder_outputs(inner, subset)[kind.name]
    how = 2 if encoded.pooler_output is None else int(isinstance(encoded.pooler_output, torch.Tensor))
    extra = [f for f, v in encoded.items() if v is not None and f not in PLAIN_OUTPUT + PER_ROW]
    per_row, keys, blocks, problem = {}, {}, [], None
    for f in [f for f in PER_ROW if getattr(encoded, f, None) is not None]:
        layers = list(getattr(encoded, f))
        if layers and all(_is_pair(layer) for layer in layers):  # (language layer, blocks) pairs
            keys[f] = [int(layer[0]) for layer in layers]
            layers = [layer[1] for layer in layers]
        per_row[f] = [list(layer) for layer in layers]
    if encoded.pooler_output is not None:
        blocks = list(_per_item(encoded.pooler_output, items) if kind.name == "video" else encoded.pooler_output)
    elif per_row and next(iter(per_row.values())):
        blocks = next(iter(per_row.values()))[0]
    name = type(inner).__name__
    if any(not isinstance(b, torch.Tensor) for f in per_row.values() for layer in f for b in layer):
        problem = (
            f"{name}: its {kind.name} encoder's {sorted(per_row)} are not blocks of feature rows per item, so lit-hbp "
            "cannot split them over the SP group: train these samples on an sp 1 level"
        )
    elif extra:
        problem = (
            f"{name}: its {kind.name} encoder also returns {extra}, which the model reads per placeholder token; "
            "lit-hbp does not split those over the SP group yet: train these samples on an sp 1 level"
        )
    elif any([b.shape for b in layer] != [b.shape for b in blocks] for f in per_row.values() for layer in f):
        problem = (
            f"{name}: its {kind.name} encoder's {sorted(per_row)} do not match its features row for row, so lit-hbp "
            "cannot split them over the SP group: train these samples on an sp 1 level"
        )
    elif len(blocks) != items or any(b.dim() != 2 or b.shape[1] != hidden for b in blocks):
        problem = (
            f"{name}: its {kind.name} encoder does not return one block of feature rows per {kind.name} "
            f"({len(blocks)} for {items}), so lit-hbp cannot split its work over the SP group: train these samples "
            "on an sp 1 level"
        )
    return how, problem, blocks, per_row, keys


def _moved(rows: list[torch.Tensor], route: Route, anchor: torch.Tensor, group, like: torch.Tensor) -> torch.Tensor:
    """This rank's feature rows (its items' blocks) sent along ``route``: the rows of its shard's
    placeholders, in their order (empty blocks shaped ``like``)."""
    device = anchor.device
    feats = torch.cat(rows).to(like.dtype) if rows else like.to(device)
    take = torch.as_tensor(route.take, dtype=torch.long, device=device)
    got = _Exchange.apply(feats[take], anchor, route.send, route.recv, group)
    return got[torch.as_tensor(route.order, dtype=torch.long, device=device)]


def _per_row_layers(
    per_row: dict, keys: dict, device, group
) -> dict[str, tuple[list[list[torch.Tensor]], list | None]]:
    """Each ``PER_ROW`` field the encoder returned, its layers on every rank of the group, a rank that encoded no
    item holding empty ones (the layer count agreed over the group, so every rank joins each layer's exchange; a
    field of no layers, Qwen3-VL's deepstack of none, kept as the family's forward reads it), with the layers'
    language layer indices where the field came as pairs (agreed too; None otherwise)."""
    out = {}
    for field in PER_ROW:
        count = torch.tensor([len(per_row[field]) + 1 if field in per_row else 0], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        n = int(count.item()) - 1
        if n < 0:
            continue
        paired = torch.zeros(max(n, 1), dtype=torch.long, device=device)  # 1 + each layer's index, 0 where unpaired
        if field in keys:
            paired[:n] = torch.tensor(keys[field], device=device) + 1
        dist.all_reduce(paired, op=dist.ReduceOp.MAX, group=group)
        layer_keys = (paired[:n] - 1).tolist() if n and bool(paired.any()) else None
        out[field] = (per_row.get(field) or [[] for _ in range(n)], layer_keys)
    return out


@dataclass(frozen=True)
class Route:
    """How one rank's feature rows travel: ``take`` (rows of its own features, in sending order),
    ``send``/``recv`` (rows per peer rank), ``order`` (the received rows put in its placeholders' order)."""

    take: np.ndarray
    send: list[int]
    recv: list[int]
    order: np.ndarray

    @classmethod
    def of(cls, holder: np.ndarray, needer: np.ndarray, me: int, size: int) -> Route:
        """Per global feature row (placeholder order), the rank that encoded it (``holder``) and the
        rank whose shard holds its placeholder (``needer``). Rows are sent grouped by the needing
        rank (all_to_all's layout), so they arrive grouped by sender; ``order`` undoes that."""
        own = np.flatnonzero(holder == me)  # the global rows this rank encoded, as its features hold them
        outgoing = own[np.argsort(needer[own], kind="stable")]
        wanted = np.flatnonzero(needer == me)
        arrival = wanted[np.argsort(holder[wanted], kind="stable")]
        return cls(
            take=np.searchsorted(own, outgoing),
            send=np.bincount(needer[own], minlength=size).tolist(),
            recv=np.bincount(holder[wanted], minlength=size).tolist(),
            order=np.argsort(arrival, kind="stable"),
        )
