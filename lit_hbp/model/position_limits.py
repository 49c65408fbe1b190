"""Attention layers that take positions from the call's row rather than from each document, and how a packed
call gives them each document's own: what the layer computes for a pack is then what it computes for each
document alone. Where lit-hbp cannot, the pack is refused in the packed call, naming the limit and the fix (as
``rope.rope_scope`` refuses a rotary embedding rescaled by a call's longest position).

Llama 4's text layers (the only family with these today):

- its RoPE layers attend within chunks of ``attention_chunk_size`` positions (``layer_types``
  ``chunked_attention``: transformers' chunked causal mask, chunks counted from the row's first position). A packed
  call gives those layers the pack's boundaries cut at every ``attention_chunk_size`` positions of each document
  (``hbp_chunks``): each chunk is a document of its own to the varlen kernel, as it is to the mask for a document
  alone. Not under context parallelism, whose shards are cut by the planner's documents: a document longer than a
  chunk is refused there.
- its NoPE layers scale the queries by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` with ``p`` numbered
  over the call's row (``torch.arange`` over the hidden states). A packed call scales those layers' queries again by
  the ratio of that scale at each token's own position to the one the layer took (``hbp_query_scale``): the product
  is the document-alone scale. Only where the layer's source computes the scale so (``TEMPERATURE_SOURCE``); a
  release that computes it otherwise keeps the refusal."""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch

# What Llama 4's attention computes its query scale with, as transformers writes it (checked in the layer's source).
TEMPERATURE_SOURCE = (
    "positions = torch.arange(hidden_states.shape[1], device=hidden_states.device) + past_seen_tokens",
    "torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0",
)


class PositionLimit(NamedTuple):
    """``field``: the config's; ``length``: its value; ``per``: "document" (a document longer than it attends
    otherwise) or "row" (a document after the first, or a shard of a split pack, reaching it); ``exact``: whether a
    packed call gives the layers each document's positions (else such a pack is refused); ``scale``: the config's
    ``attn_scale`` (row)."""

    field: str
    length: int
    per: str
    exact: bool = False
    scale: float = 0.0


def position_limits(config: Any, decoder: torch.nn.Module | None = None) -> tuple[PositionLimit, ...]:
    """The limits the (text) config's layers set on a pack: none for most families. ``decoder``: its layers,
    whose attention's source says whether the query scale can be given per document."""
    kinds = list(getattr(config, "layer_types", None) or ())
    limits = []
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, int) and "chunked_attention" in kinds:
        limits.append(PositionLimit("attention_chunk_size", chunk, "document", exact=True))
    floor = getattr(config, "floor_scale", None)
    no_rope = getattr(config, "no_rope_layers", None) or ()
    if getattr(config, "attn_temperature_tuning", False) and isinstance(floor, int) and not all(no_rope):
        exact = decoder is not None and _scales_as_written(decoder)
        limits.append(PositionLimit("floor_scale", floor, "row", exact, float(getattr(config, "attn_scale", 0.0))))
    return tuple(limits)


def _scales_as_written(decoder: torch.nn.Module) -> bool:
    layer = next((m for m in decoder.modules() if scaled_layer(m)), None)
    try:
        source = inspect.getsource(type(layer).forward) if layer is not None else ""
    except (OSError, TypeError):
        return False
    return all(line in source for line in TEMPERATURE_SOURCE)


def chunked_layer(module: Any) -> bool:
    """Whether ``module`` (an attention layer) attends within chunks of positions."""
    kinds = getattr(getattr(module, "config", None), "layer_types", None)
    index = getattr(module, "layer_idx", None)
    return isinstance(index, int) and bool(kinds) and index < len(kinds) and kinds[index] == "chunked_attention"


def scaled_layer(module: Any) -> bool:
    """Whether ``module`` scales its queries by their row position (Llama 4's NoPE layers)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def query_scale(positions: torch.Tensor, limit: PositionLimit) -> torch.Tensor:
    """Per token of the call's row: the layer's scale at the token's own position over the one it took at its row
    position (fp32, [T])."""
    own = positions.reshape(-1, positions.shape[-1])[0].float()

    def scale(p: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((p + 1.0) / limit.length)) * limit.scale + 1.0

    return scale(own) / scale(torch.arange(own.numel(), device=own.device, dtype=torch.float32))


def chunk_bounds(bounds: tuple[int, ...], chunk: int, like: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The pack's boundaries cut at every ``chunk`` positions of each document (and the longest piece), on
    ``like``'s device and dtype."""
    cuts = [start + k for start, end in zip(bounds[:-1], bounds[1:]) for k in range(0, end - start, chunk)]
    cuts.append(bounds[-1])
    longest = max((b - a for a, b in zip(cuts[:-1], cuts[1:])), default=0)
    return torch.tensor(cuts, dtype=like.dtype).to(like.device, non_blocking=True), longest


def check_position_limits(
    limits: tuple[PositionLimit, ...],
    pack: dict,
    bounds: tuple[int, ...] | None,
    documents: int | None,
    positions: torch.Tensor | None = None,
) -> dict:
    """What a packed call (``pack``: its keywords; ``bounds``: the pack's document boundaries on the host where
    known, else read from the call's; ``documents``: its real documents, a padding segment not counted;
    ``positions``: the call's position ids) gives its layers so that ``limits`` bind each document as they would
    bind it alone (``hbp_chunks``, ``hbp_query_scale``); a pack they would make train otherwise is refused."""
    if not limits or "cu_seq_lens_q" not in pack:
        return {}
    if bounds is None:
        bounds = tuple(int(b) for b in pack["cu_seq_lens_q"].tolist())  # a model(**pack_inputs) call: read once
    documents = len(bounds) - 1 if documents is None else documents
    ends = list(bounds[1 : documents + 1])
    longest = max((e - s for s, e in zip(bounds[:documents], ends)), default=0)
    cp = pack.get("hbp_cp_shard") is not None
    sharded = pack.get("hbp_sp") is not None or cp
    given = {}
    for limit in limits:
        if limit.per == "document" and longest > limit.length:
            if limit.exact and not cp:
                given["hbp_chunks"] = chunk_bounds(bounds, limit.length, pack["cu_seq_lens_q"])
                continue
            what = (
                f"a document of {longest} tokens, longer than the config's attention_chunk_size ({limit.length}), "
                "split by context parallelism: its layers attend within chunks, which a CP shard's ranges do not cut"
            )
            bound = f"<= {limit.length}, or a level without cp,"
        elif limit.per == "row" and ends and ends[-1] >= limit.length and (documents > 1 or sharded):
            if limit.exact and positions is not None:
                given["hbp_query_scale"] = query_scale(positions, limit)
                continue
            where = "split over an SP group" if sharded else f"of {documents} documents"
            what = (
                f"a pack {where} reaching row position {ends[-1] - 1} (the config's floor_scale: {limit.length}): its "
                "layers without RoPE scale the queries by their position in the call's row, not in their document"
            )
            bound = f"< {limit.length}"
        else:
            continue
        raise ValueError(
            f"{what}, so the pack would train otherwise than each document alone (lit_hbp.model.position_limits). "
            f"Keep every level's pack_len {bound}"
        )
    return given
