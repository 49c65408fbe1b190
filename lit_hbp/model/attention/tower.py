"""A vision tower's attention in a packed call, on the kernel the language model's packed calls run.

A pack's images are encoded together (``causal_lm._encoded``), each image (or, for Qwen2.5-VL's windowed
layers, each window) attending both ways within itself. transformers' towers hand their images' boundaries
(``cu_seq_lens_q``) only to an attention implementation whose name says flash
(``is_flash_attention_requested``), and loop over the images one kernel each otherwise; so this function is
registered as ``TOWER_NAME``, which says flash, and runs the call's varlen kernel (torch's ``varlen_attn``,
FlexAttention, flash-attn 4: ``backends.REGISTRY``, ``AttnArgs(causal=False)``) over all of a pack's images
in one call a layer. ``backends.tower_attention`` names it for the tower's configs while a packed call
encodes on a GPU whose language model runs one of those kernels; nothing else ever names it.

The backend travels with the call: the model's setting (``prepare_model(attn_backend=...)``) and the
device and dtype of the call's query, read from the packed call this thread runs (``lit_hbp.model.calls``).
Like transformers' flash implementation it takes a tower's padding mask as [batch, patches] (each row's
kept patches one document, padded rows zero) and refuses a mask of any other shape, weights asked back
or a keyword it does not implement.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from lit_hbp.model import calls
from lit_hbp.model.attention import backend_for, compute_dtype
from lit_hbp.model.attention.backends import REGISTRY
from lit_hbp.model.attention.kernel import AttnArgs, call_needs
from lit_hbp.model.calls import TOWER_NAME

# what towers pass that the boundaries or this function's own arguments already say, or that asks the tower,
# not its attention, for something (LLaVA's CLIP layers pass the model's output_hidden_states on; LFM3-VL's layers
# pass every item's grid on, which its convolution reads and its attention, bounded by cu_seqlens, does not)
IGNORED = frozenset(
    {"cu_seq_lens_k", "max_length_k", "position_ids", "output_attentions", "output_hidden_states", "grid_thw"}
)


def documents(query: torch.Tensor, mask: torch.Tensor | None, cu: torch.Tensor | None, longest: int | None):
    """(the rows' tokens kept, as indices into the batch's flattened rows or None for all, cu_seqlens, the
    longest document) of a tower's call: its own boundaries, each row one document, or each row's kept
    patches one document under a [batch, patches] mask."""
    batch, _, length, _ = query.shape
    if mask is not None:
        if mask.dim() != 2 or tuple(mask.shape) != (batch, length):
            raise NotImplementedError(
                f"{TOWER_NAME} takes a vision tower's padding mask as [batch, patches] = {(batch, length)}, got "
                f"{tuple(mask.shape)}: build the tower's attention with its own implementation"
            )
        keep = mask.bool()
        counts = keep.sum(1, dtype=torch.int32)
        cu = torch.nn.functional.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))
        return keep.flatten().nonzero().squeeze(1), cu, int(counts.max())
    if cu is not None:
        if batch != 1:
            raise ValueError(f"{TOWER_NAME}: boundaries (cu_seq_lens_q) come with one packed row, got {batch}")
        return None, cu, int(longest if longest is not None else (cu[1:] - cu[:-1]).max())  # the tower's, once a call
    cu = torch.arange(batch + 1, device=query.device, dtype=torch.int32) * length
    return None, cu, length


def tower_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, H, S, D], key/value [B, Hkv, S, D] -> ([B, S, H, D],
    None), each image of ``cu_seq_lens_q`` (or each row) attending within itself on the packed call's
    backend."""
    where = type(module).__name__
    unknown = sorted(k for k, v in kwargs.items() if v is not None and v is not False and k not in IGNORED)
    if kwargs.get("output_attentions") or unknown:
        what = "attention weights" if kwargs.get("output_attentions") else f"the keyword(s) {unknown}"
        raise NotImplementedError(f"{where} asks {TOWER_NAME} for {what}, which it does not implement")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    call = calls.running()
    backend, owner = (call.prepared.backend, call.prepared.owner) if call is not None else ("auto", 0)
    dtype = compute_dtype(query)
    batch, heads, length, dim = query.shape
    kept, cu, longest = documents(query, attention_mask, cu_seq_lens_q, max_length_q)

    def row(x: torch.Tensor) -> torch.Tensor:  # [B, H, S, D] -> [1, H, N, D]: the kept patches in one row
        x = x.to(dtype).transpose(1, 2).reshape(batch * length, x.shape[1], x.shape[-1])
        return (x if kept is None else x[kept]).transpose(0, 1)[None]

    args = AttnArgs(
        cu.to(device=query.device, dtype=torch.int32),
        longest,
        float(scaling) if scaling is not None else dim**-0.5,
        dropout=float(dropout),  # the tower's: 0 outside training
        causal=causal,
    )
    q, k, v = row(query), row(key), row(value)
    name = backend_for(query.device.type, dtype, call_needs(q, args), backend, owner)
    out = REGISTRY[name].run(q, k, v, args)[0].transpose(0, 1)  # [N, H, D]
    if kept is not None:
        out = out.new_zeros(batch * length, *out.shape[1:]).index_copy(0, kept, out)
    return out.reshape(batch, length, heads, -1), None


AttentionInterface.register(TOWER_NAME, tower_attention)
