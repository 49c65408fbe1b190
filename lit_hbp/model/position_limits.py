"""Lengths past which a family's attention layers compute from a call's row what they would compute from each
document's own positions, so a pack of documents (or a shard of one) would train otherwise than each document
alone. Refused in the packed call, naming the limit and the fix (as ``rope.rope_scope`` refuses a rotary
embedding rescaled by a call's longest position).

Llama 4's text layers: its RoPE layers attend within chunks of ``attention_chunk_size`` positions through
the chunked causal mask, which a packed call's varlen attention does not build (a document longer than a chunk
would attend across its chunks); its NoPE layers scale the queries by ``log1p(floor((p + 1) / floor_scale))``
with ``p`` numbered over the call's row (``torch.arange`` over the hidden states), so a token of a document
after the first (or of a shard after the first) at a row position past ``floor_scale`` takes another scale."""

from __future__ import annotations

from typing import Any, NamedTuple


class PositionLimit(NamedTuple):
    """``field``: the config's; ``length``: its value; ``per``: "document" (a document longer than it trains
    otherwise) or "row" (a document after the first, or a shard of a split pack, reaching it)."""

    field: str
    length: int
    per: str


def position_limits(config: Any) -> tuple[PositionLimit, ...]:
    """The limits the (text) config's layers set on a pack: none for most families."""
    kinds = list(getattr(config, "layer_types", None) or ())
    limits = []
    chunk = getattr(config, "attention_chunk_size", None)
    if isinstance(chunk, int) and "chunked_attention" in kinds:
        limits.append(PositionLimit("attention_chunk_size", chunk, "document"))
    floor = getattr(config, "floor_scale", None)
    no_rope = getattr(config, "no_rope_layers", None) or ()
    if getattr(config, "attn_temperature_tuning", False) and isinstance(floor, int) and not all(no_rope):
        limits.append(PositionLimit("floor_scale", floor, "row"))  # a layer without RoPE scales by row position
    return tuple(limits)


def check_position_limits(
    limits: tuple[PositionLimit, ...], pack: dict, bounds: tuple[int, ...] | None, documents: int | None
) -> None:
    """Refuse a packed call (``pack``: its keywords; ``bounds``: the pack's document boundaries on the host where
    known, else read from the call's; ``documents``: its real documents, a padding segment not counted) that one of
    ``limits`` would make train otherwise than each document alone."""
    if not limits or "cu_seq_lens_q" not in pack:
        return
    if bounds is None:
        bounds = tuple(int(b) for b in pack["cu_seq_lens_q"].tolist())  # a model(**pack_inputs) call: read once
    documents = len(bounds) - 1 if documents is None else documents
    ends = list(bounds[1 : documents + 1])
    longest = max((e - s for s, e in zip(bounds[:documents], ends)), default=0)
    sharded = pack.get("hbp_sp") is not None or pack.get("hbp_cp_shard") is not None
    for limit in limits:
        if limit.per == "document" and longest > limit.length:
            what = (
                f"a document of {longest} tokens, longer than the config's attention_chunk_size ({limit.length}): its "
                "layers attend within chunks through a mask a packed call does not build"
            )
            bound = f"<= {limit.length}"
        elif limit.per == "row" and ends and ends[-1] >= limit.length and (documents > 1 or sharded):
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
