"""Rotary embeddings whose frequencies transformers chooses from a call's longest position, in a packed call.

transformers' ``dynamic_rope_update`` picks one set of frequencies per call: ``longrope`` (Phi-3, Phi-3.5,
Phi-4-mini) takes its long factors when the call's longest position passes ``original_max_position_embeddings``,
``dynamic`` rescales past ``max_position_embeddings`` (``checks.rescaling_limit``). A pack is one call, so its
longest document would choose for its neighbours. A longrope pack trains exactly: each token takes the set its
own document alone takes (``per_document_longrope``). ``dynamic`` (whose frequencies also follow the longest
length the module has seen) and a document split over an SP group, whose ranks would each choose for their
shard, are refused past the limit (``rope_scope``)."""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch


def longrope_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's longrope rotary embedding as transformers builds it (one set of frequencies: ``inv_freq``, the
    short ``original_inv_freq``, a ``dynamic_rope_update``-decorated forward), else None."""
    for module in model.modules():
        if (
            getattr(module, "rope_type", None) == "longrope"
            and isinstance(getattr(module, "original_inv_freq", None), torch.Tensor)
            and isinstance(getattr(module, "inv_freq", None), torch.Tensor)
            and getattr(module, "config", None) is not None
            and hasattr(type(module).forward, "__wrapped__")
        ):
            return module
    return None


def _long_inv_freq(rotary: torch.nn.Module, limit: int, device: torch.device) -> torch.Tensor:
    """The long factors' frequencies, as ``longrope_frequency_update`` computes them (its ``rope_init_fn`` past
    the original length)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary.config, device, seq_len=limit + 1)
    return inv_freq.to(device)


@contextlib.contextmanager
def per_document_longrope(rotary: torch.nn.Module, cu_seqlens: torch.Tensor, limit: int) -> Iterator[None]:
    """For this call, ``rotary`` gives each token of a pack (documents at ``cu_seqlens``) the cosines and sines
    its document alone would get: the long factors' where the document is longer than ``limit``, the short
    ones' elsewhere (both from the rotary's own undecorated forward; the attention scaling is one for both). Only
    this thread's calls: another thread calling the same module meanwhile gets its own output."""
    plain = inspect.unwrap(type(rotary).forward)
    owner = threading.get_ident()  # the hook sits on the module: another thread's call keeps its own output

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> tuple[torch.Tensor, ...] | None:
        if threading.get_ident() != owner:
            return None
        x = args[0] if args else kwargs["x"]
        positions = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        total = int(positions.shape[-1])
        cu = cu_seqlens.to(positions.device)
        lengths = cu[1:] - cu[:-1]
        long_tokens = torch.repeat_interleave(lengths > limit, lengths, output_size=total)
        short_freq, kept = module.original_inv_freq, module.inv_freq
        try:
            module.inv_freq = _long_inv_freq(module, limit, kept.device)
            cos_long, sin_long = plain(module, x, positions)
            module.inv_freq = short_freq.to(kept.device)
            cos_short, sin_short = plain(module, x, positions)
        finally:
            module.inv_freq = kept
        pick = long_tokens.view(*([1] * (cos_long.dim() - 2)), total, 1)
        return torch.where(pick, cos_long, cos_short), torch.where(pick, sin_long, sin_short)

    handle = rotary.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def rope_scope(
    model: torch.nn.Module, rope_limit: tuple[str, int] | None, pack: dict, documents: int | None = None
) -> contextlib.AbstractContextManager:
    """What a packed call's rotary embedding needs (``rope_limit``: ``Prepared.rope_limit``): nothing while the
    pack's longest document is within the limit, or it holds one document unsplit; per-document frequencies for
    a longrope pack of several; else refused. ``documents``: the pack's documents where its token ids say
    (``DOCS_MARK``: a padding segment not counted), else its segments."""
    if rope_limit is None or "max_length_q" not in pack:
        return contextlib.nullcontext()
    kind, limit = rope_limit
    longest, cu = int(pack["max_length_q"]), pack.get("cu_seq_lens_q")
    if documents is None:
        documents = int(cu.numel()) - 1 if isinstance(cu, torch.Tensor) else 1
    sharded = pack.get("hbp_sp") is not None or pack.get("hbp_cp_shard") is not None
    if longest <= limit or (documents <= 1 and not sharded):
        return contextlib.nullcontext()
    rotary = longrope_module(model) if kind == "longrope" and isinstance(cu, torch.Tensor) else None
    if rotary is not None and not sharded:
        return per_document_longrope(rotary, cu, limit)
    where = f"{documents} documents" if not sharded else "a document split over an SP group"
    fix = (
        f"Keep levels past {limit} tokens at sp 1, where a longrope pack gives each document its own factors"
        if rotary is not None
        else f"Keep levels with more than one document (or sp > 1) at pack_len <= {limit}, or give the model a "
        "static rope_type (linear, yarn, llama3)"
    )
    raise ValueError(
        f"rope_parameters rope_type {kind!r}: a pack of {where} whose longest is {longest} tokens, past the "
        f"{limit} at which this rotary embedding rescales by the call's longest position: its other documents "
        f"(or shards) would take that scaling, unlike each alone. {fix}"
    )
