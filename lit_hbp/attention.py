"""Varlen (packed) causal attention, registered in transformers' ``AttentionInterface``.

Any Hugging Face causal LM built with ``attn_implementation="hbp_varlen"`` calls ``varlen_attention``
for its attention; the packed batch's ``cu_seq_lens_q`` / ``max_length_q`` arrive as forward kwargs.
No T x T mask is ever built: a mask function returning None is registered under the same name.
When the strategy has activated a sequence-parallel context (``lit_hbp.parallel.context``), the
function runs Ulysses: all-to-all to head shards, attention over the whole pack, all-to-all back.

Backends, chosen once per run from the device and what is installed:
``flash_attn`` (flash-attn 2 varlen kernel, CUDA, fp16/bf16), ``torch_varlen`` (torch's own CUDA
varlen kernel), ``sdpa`` (a causal scaled_dot_product_attention per document; CPU and tests).
"""

from __future__ import annotations

import importlib.util
import inspect

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from transformers import AttentionInterface, AttentionMaskInterface

from lit_hbp.parallel import context as sp_context
from lit_hbp.parallel.ulysses import check_heads, heads_to_seq, replicate_kv, seq_to_heads

ATTN_NAME = "hbp_varlen"
BACKENDS = ("auto", "flash_attn", "torch_varlen", "sdpa")
_forced: list[str | None] = [None]
_chosen: dict[tuple[str, torch.dtype], str] = {}
_TORCH_VARLEN_KWARGS = {"scale", "window_size", "enable_gqa"}


def _torch_varlen_usable() -> bool:
    """torch's varlen kernel with the keywords used here (scale, window_size, enable_gqa: torch 2.11+)."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return False
    from torch.nn.attention.varlen import varlen_attn

    return _TORCH_VARLEN_KWARGS <= set(inspect.signature(varlen_attn).parameters)


def available_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The fastest backend that can run here."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attn"
        if _torch_varlen_usable():
            return "torch_varlen"
    return "sdpa"


def set_backend(name: str) -> None:
    """Force a backend for the run, or "auto": the fastest for each device and dtype seen."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch_varlen" and not _torch_varlen_usable():
        raise ValueError(
            "attention backend torch_varlen needs torch.nn.attention.varlen with scale, window_size "
            "and enable_gqa (torch 2.11 or newer)"
        )
    _forced[0] = None if name == "auto" else name
    _chosen.clear()


def backend_for(device: torch.device, dtype: torch.dtype) -> str:
    """The backend used for inputs on ``device`` in ``dtype``, chosen once and logged once (a fp32
    profiling pass on a GPU does not pin the slow backend on the bf16 training that follows)."""
    key = (device.type, dtype)
    if key not in _chosen:
        _chosen[key] = _forced[0] or available_backend(device, dtype)
        rank_zero_info(f"{ATTN_NAME} attention: {_chosen[key]} backend for {dtype} on {device.type}")
    return _chosen[key]


def _sdpa(q, k, v, cu: list[int], scaling, window, dropout):
    """q [1, Hq, T, D], k/v [1, Hkv, T, D] -> [1, Hq, T, D]: causal attention inside each document.

    Inputs stay 4-D: on CPU, torch only takes its flash kernel for 4-D inputs (about 9x faster
    than the math fallback that 3-D inputs get)."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        n = e - s
        if window is not None and n > window:
            i = torch.arange(n, device=q.device)
            band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
            kwargs = dict(attn_mask=band)
        else:
            kwargs = dict(is_causal=True)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], dropout_p=dropout, scale=scaling, enable_gqa=gqa, **kwargs
            )
        )
    return torch.cat(outs, dim=2)


def _varlen_kernel(backend, q, k, v, cu, max_len, scaling, window, dropout) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] on CUDA."""
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        win = (window - 1, window - 1) if window is not None else (-1, -1)
        return flash_attn_varlen_func(
            q, k, v, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scaling, causal=True, window_size=win
        )
    from torch.nn.attention.varlen import varlen_attn

    if dropout:
        raise ValueError("torch's varlen attention has no dropout: set attention_dropout to 0 or install flash-attn")
    win = (window - 1, 0) if window is not None else (-1, 0)
    return varlen_attn(
        q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=win, enable_gqa=q.shape[1] != k.shape[1]
    )


def _attend(query, key, value, cu: torch.Tensor, max_len: int, scaling, window, dropout) -> torch.Tensor:
    """Causal attention inside each document of one packed row: [1, H, T, D] in and out."""
    backend = backend_for(query.device, query.dtype)
    if backend == "sdpa":
        return _sdpa(query, key, value, cu.tolist(), scaling, window, dropout)
    cu = cu.to(device=query.device, dtype=torch.int32)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    return _varlen_kernel(backend, q, k, v, cu, int(max_len), scaling, window, dropout).transpose(0, 1)[None]


def varlen_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
):
    """transformers attention function: query [1, Hq, T, D], key/value [1, Hkv, T, D] (GQA not
    repeated) -> ([1, T, Hq, D], None). Under an active SP context T is this rank's shard, and
    Ulysses all-to-alls run attention over the whole pack on 1/sp of the heads."""
    if query.shape[0] != 1:
        raise ValueError(f"{ATTN_NAME} takes one packed row per micro-batch, got batch size {query.shape[0]}")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{ATTN_NAME} does not support attention logit soft-capping")
    ctx = sp_context.active()
    sp = ctx.size if ctx is not None else 1
    total = query.shape[2] * sp
    if cu_seq_lens_q is None:
        cu_seq_lens_q = torch.tensor([0, total], dtype=torch.int32, device=query.device)
        max_length_q = total
    if cu_seq_lens_q.device.type == "cpu" and int(cu_seq_lens_q[-1]) != total:  # on a GPU this would sync
        raise ValueError(f"cu_seqlens cover {int(cu_seq_lens_q[-1])} tokens but the attention sees {total}")
    drop = dropout if module.training else 0.0
    if sp == 1:
        out = _attend(query, key, value, cu_seq_lens_q, max_length_q, scaling, sliding_window, drop)
        return out.transpose(1, 2), None
    check_heads(query.shape[1], key.shape[1], sp)
    q = seq_to_heads(query, ctx)
    k, v = (seq_to_heads(replicate_kv(x, sp), ctx) for x in (key, value))
    out = _attend(q, k, v, cu_seq_lens_q, max_length_q, scaling, sliding_window, drop)
    return heads_to_seq(out, ctx).transpose(1, 2), None


def _no_mask(*args, **kwargs):
    return None


AttentionInterface.register(ATTN_NAME, varlen_attention)
AttentionMaskInterface.register(ATTN_NAME, _no_mask)
