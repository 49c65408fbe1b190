"""The kernel call as the ``torch.library`` custom op ``hbp::varlen_attention_v4`` and its backward op: a
compiled decoder layer sees one opaque op with a fake implementation (the output's shape and dtype) and
stays one graph on every backend, the per-document CPU loops included; backend choice, logging, imports
and host reads happen inside the op, at run time, never while tracing. The op keeps the kernel's LSE
where the backend has a backward kernel (``kernel.LseKernels``), and its backward runs that kernel;
otherwise (Flex, dropout) it recomputes the forward and differentiates it.
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey

from lit_hbp.model.attention.dispatch import _on_device, _run_op, lse_kernels
from lit_hbp.model.attention.kernel import AttnArgs, call_needs, lse_dtype

# Compiled graphs are cached on disk keyed by the ops they call, not by those ops' schemas or kernels
# (torch's AOTAutograd cache): the names carry the contract's version, so a graph cached by an older
# lit-hbp is never run against these ops.
OP = "hbp::varlen_attention_v4"


def _op_args(q, cu, sinks, max_len: int, scale: float, window, softcap, dropout: float) -> AttnArgs:
    return _on_device(AttnArgs(cu, int(max_len), scale, window, softcap, sinks, dropout), q)


def _op_lse_kernels(q, args: AttnArgs, backend: str, owner: int):
    """The backend's LSE pair for the op's call, or None (its backward then recomputes the forward,
    and the op's LSE is empty). Decided from the backend setting, device, dtype, features and head dim
    alone, so the fake and the kernel agree."""
    return lse_kernels(q.device.type, q.dtype, call_needs(q, args), backend, owner)


@torch.library.custom_op(OP, mutates_args=())
def _varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    sinks: torch.Tensor | None,
    max_len: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    dropout: float,
    backend: str,
    owner: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output [1, T, Hq, D], the LSE [Hq, T] its backward kernel takes (empty without one), the dropout seed
    the backward's recomputation replays; 0 without dropout). The output's layout is the varlen
    kernels' own and what the output projection takes: no copy of it on the GPU, and the tensor the
    backward keeps is the one the projection keeps."""
    args = _op_args(q, cu, sinks, max_len, scale, window, softcap, dropout)
    seed = torch.randint(2**62, (), dtype=torch.int64) if dropout else q.new_zeros((), dtype=torch.int64)
    kernels = _op_lse_kernels(q, args, backend, owner)
    with torch.no_grad():
        if kernels is not None:
            out, lse = kernels.forward(q, k, v, args)
            lse = lse.to(lse_dtype(q.dtype)).reshape(q.shape[1:3]).contiguous()
        else:
            run = (max_len, scale, window, softcap, dropout, backend, owner)
            out, lse = _run_op(q, k, v, cu, sinks, seed, *run), q.new_empty(0, dtype=lse_dtype(q.dtype))
    out = out.transpose(1, 2).contiguous()
    if out.untyped_storage().data_ptr() in {x.untyped_storage().data_ptr() for x in (q, k, v)}:
        out = out.clone()  # a custom op's output never aliases an input
    return out, lse, seed


@_varlen_op.register_fake
def _(q, k, v, cu, sinks, max_len, scale, window, softcap, dropout, backend, owner):
    args = AttnArgs(cu, max_len, scale, window, softcap, sinks, dropout)
    has_lse = _op_lse_kernels(q, args, backend, 0) is not None  # decided here, not run: nothing to record
    out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    lse = q.new_empty(q.shape[1:3] if has_lse else (0,), dtype=lse_dtype(q.dtype))
    return out, lse, _seed_like(q, dropout)


def _seed_like(q: torch.Tensor, dropout: float) -> torch.Tensor:
    """The seed output's tensor: on the host with dropout (the backward seeds the RNG from it), else on q's
    device, unread: a host tensor among a CUDA graph's outputs makes inductor skip the layer's graph (and
    stopped torch 2.11's graph partitions: the H200, 2026-11-30 and 2026-12-04)."""
    return torch.empty((), dtype=torch.int64, device="cpu" if dropout else q.device)


_AUTOGRAD_KEYS = [
    DispatchKey.ADInplaceOrView,
    *(k for n, k in DispatchKey.__members__.items() if n.startswith("Autograd")),
]


def _recomputed_grads(grad, q, k, v, cu, sinks, seed, max_len, scale, window, softcap, dropout, backend, owner):
    """The forward recomputed by its backend with autograd on (a custom op's kernel runs below
    autograd, which is switched back on here) and differentiated. Exact: the same kernel, inputs
    and dropout seed as the forward."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (q, k, v, *([sinks] if sinks is not None else []))]
        run = (max_len, scale, window, softcap, dropout, backend, owner)
        out = _run_op(*inputs[:3], cu, inputs[3] if sinks is not None else None, seed, *run)
        grads = torch.autograd.grad(out, inputs, grad)
    return (*grads[:3], grads[3] if sinks is not None else None)


@torch.library.custom_op(f"{OP}_backward", mutates_args=())
def _varlen_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    seed: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    dropout: float,
    backend: str,
    owner: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks; dsinks empty without sinks) for the gradient of the output [1, T, Hq, D]:
    the backend's backward kernel from the saved output and LSE, or, where the forward saved no LSE,
    ``_recomputed_grads``."""
    grad = grad.contiguous().transpose(1, 2)  # [1, Hq, T, D], the kernels' view (flash-attn: stride 1 last)
    if lse.numel():
        args = _op_args(q, cu, sinks, max_len, scale, window, softcap, dropout)
        kernels = lse_kernels(q.device.type, q.dtype, call_needs(q, args), backend, owner)
        grads = kernels.backward(grad, q, k, v, out.transpose(1, 2), lse, args)
    else:
        run = (max_len, scale, window, softcap, dropout, backend, owner)
        grads = _recomputed_grads(grad, q, k, v, cu, sinks, seed, *run)
    dsinks = grads[3] if sinks is not None else q.new_empty(0)
    taken = {x.untyped_storage().data_ptr() for x in (grad, q, k, v, cu, sinks, out, lse, seed) if x is not None}
    return (*(_in_kernel_layout(g, x, taken) for g, x in zip(grads[:3], (q, k, v))), dsinks.contiguous())


def kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped as ``x`` ([1, H, T, D]) laid out as the varlen kernels write their
    gradients: [1, T, H, D] in memory (their [T, H, D], the model's own q/k/v layout too)."""
    return x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2)


def _in_kernel_layout(g: torch.Tensor, like: torch.Tensor, taken: set[int]) -> torch.Tensor:
    """``g`` as the backward op returns it (its fake's strides): the kernel's own tensor where its layout
    is already that (the flash-attn kernels, torch's varlen, the CPU kernels on the model's layout) and its
    memory is none of the op's inputs' (``taken``: their storages' addresses, read once a call), a copy only
    otherwise (a head dim padded for flash-attn 2, repeated K/V heads summed)."""
    b, h, t, d = like.shape
    strides = (t * h * d, d, h * d, 1)  # kernel_layout's
    same = g.shape == like.shape and g.dtype == like.dtype and g.storage_offset() == 0
    if same and all(a == s for a, s, n in zip(g.stride(), strides, g.shape) if n > 1):
        if g.untyped_storage().data_ptr() not in taken:
            return g.as_strided(like.shape, strides)
    return kernel_layout(like).copy_(g)


@_varlen_backward_op.register_fake
def _(grad, q, k, v, cu, sinks, out, lse, seed, max_len, scale, window, softcap, dropout, backend, owner):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    return kernel_layout(q), kernel_layout(k), kernel_layout(v), dsinks


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu, sinks, *ctx.host = inputs
    ctx.save_for_backward(q, k, v, cu, sinks, *output)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad: torch.Tensor, _lse_grad, _seed_grad):
    q, k, v, cu, sinks, out, lse, seed = ctx.saved_tensors
    dq, dk, dv, dsinks = _varlen_backward_op(grad, q, k, v, cu, sinks, out, lse, seed, *ctx.host)
    return dq, dk, dv, None, dsinks if sinks is not None else None, None, None, None, None, None, None, None


_varlen_op.register_autograd(_backward, setup_context=_setup_context)
