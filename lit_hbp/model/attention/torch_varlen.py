"""torch's own varlen kernel (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10) as a backend,
adapted to its signature across torch versions, and its forward keeping the LSE with torch's backward
op (``torch_attn::_varlen_attn_backward``), both on flash's kernel.
"""

from __future__ import annotations

import contextlib
import importlib
from functools import cache

import torch

from lit_hbp.model.attention.kernel import (
    HALF,
    AttnArgs,
    Backend,
    LseKernels,
    flat,
    installed,
    lse_unusable,
    params_of,
    unflat,
)


def _torch_varlen_fn():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def _torch_varlen_unusable(device_type: str, dtype: torch.dtype) -> str | None:
    if device_type != "cuda":
        return "CUDA only"
    if dtype not in HALF:
        return f"fp16/bf16 only, not {dtype}"
    if not installed("torch.nn.attention.varlen"):
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch 2.10 or newer)"
    params = params_of(_torch_varlen_fn())
    if not {"window_size", "is_causal"} & params:
        return "this torch's varlen_attn takes neither window_size nor is_causal: no causal mask"
    return None


def _torch_varlen_supports() -> frozenset[str]:
    return frozenset({"window"} if "window_size" in params_of(_torch_varlen_fn()) else ())


def _torch_varlen_run(q, k, v, a: AttnArgs, **extra):
    """torch's varlen kernel, adapted to its signature: torch 2.10 has ``is_causal`` and no
    ``scale``/``window_size``/``enable_gqa``, 2.11 adds ``scale`` and ``window_size``, 2.13 ``enable_gqa``.
    A missing ``scale`` is applied to q (the kernel's default is 1/sqrt(D)); a missing
    ``enable_gqa`` repeats the k/v heads. With ``extra`` (``return_aux``), (out, lse)."""
    fn = _torch_varlen_fn()
    params = params_of(fn)
    kw = dict(extra)
    if "scale" in params:
        kw["scale"] = a.scale
    elif a.scale != q.shape[-1] ** -0.5:
        q = q * (a.scale * q.shape[-1] ** 0.5)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    if "window_size" in params:
        kw["window_size"] = (a.window - 1 if a.window is not None else -1, 0 if a.causal else -1)
    else:
        kw["is_causal"] = a.causal
    res = fn(flat(q), flat(k), flat(v), a.cu, a.keys_cu, a.max_len, a.keys_max_len, **kw)
    return (unflat(res[0]), res[1]) if extra else unflat(res)


_TORCH_VARLEN_BACKWARD = {"grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k", "max_q", "max_k",
                          "is_causal", "rng_state", "scale"}  # fmt: skip


def _torch_varlen_backward_op():
    _torch_varlen_fn()  # registers torch.ops.torch_attn
    return getattr(torch.ops.torch_attn, "_varlen_attn_backward", None)


def _torch_varlen_cudnn_problem() -> str | None:
    """None when the LSE pair's calls run flash's kernel in both directions (cuDNN's LSE is not one
    flash's backward takes, and its causal mask is not bottom-right aligned for CP's key ranges):
    a torch whose backward op takes ``backend`` is pinned (``_torch_varlen_forward``); torch <= 2.13
    never runs cuDNN (its ``_should_use_cudnn`` is False); torch 2.14 chooses cuDNN by
    ``_can_use_cudnn(..., window_size)``, only for a full window ``[-1, -1]`` (non-causal) in both its
    forward and backward, and lit-hbp's calls are causal (``window_size=[left, 0]``)."""
    if _torch_varlen_picks_backend():
        return None
    module = importlib.import_module("torch.nn.attention.varlen")
    chooser = getattr(module, "_can_use_cudnn", None)
    if chooser is None or "window_size" in params_of(chooser):
        return None
    return f"torch {torch.__version__}'s varlen_attn may run cuDNN's kernel for causal calls and cannot be pinned"


def _torch_varlen_lse_problem() -> str | None:
    """None when this torch's varlen_attn returns the LSE (``return_aux``), its backward op takes
    what the forward was called with, and both run flash's kernel (``_torch_varlen_cudnn_problem``)."""
    params = params_of(_torch_varlen_fn())
    if not {"return_aux", "scale"} <= params:
        return f"torch {torch.__version__}'s varlen_attn takes no {'return_aux' if 'scale' in params else 'scale'}"
    cudnn = _torch_varlen_cudnn_problem()
    if cudnn is not None:
        return cudnn
    op = _torch_varlen_backward_op()
    arguments = op.default._schema.arguments if op is not None else []
    names = {x.name for x in arguments}
    want = _TORCH_VARLEN_BACKWARD | ({"window_size"} if "window_size" in params else set())
    if not want <= names:
        missing = ", ".join(sorted(want - names))
        return f"torch {torch.__version__} has no torch_attn._varlen_attn_backward taking {missing}"
    required = [x.name for x in arguments if not x.has_default_value() and x.name not in want]
    if required:
        return f"torch {torch.__version__}'s torch_attn._varlen_attn_backward requires {', '.join(required)}"
    return None


def _torch_varlen_picks_backend() -> bool:
    """Whether this torch's varlen backward op takes ``backend`` (2.13's and 2.14.1's take none; a later
    torch that adds it is pinned): its forward then runs cuDNN's kernel where eligible (SM90/SM100, causal with
    ``cu_seq_q is cu_seq_k``) unless pinned, and the op's backward runs flash's unless told otherwise."""
    return _takes_backend(_torch_varlen_backward_op())


@cache
def _takes_backend(op) -> bool:
    """Read once per op: its schema does not change, and every attention call of a step asks (6 us each)."""
    return op is not None and any(x.name == "backend" for x in op.default._schema.arguments)


@cache
def _zero_rng_state(device: torch.device) -> torch.Tensor:
    """The RNG state the backward op reads for a forward without dropout (never written): one per device,
    not an allocation and a fill on every backward call."""
    return torch.zeros(2, dtype=torch.uint64, device=device)


def _torch_varlen_forward(q, k, v, a: AttnArgs):
    """torch's varlen forward keeping the LSE, on flash's kernel: the one whose backward
    ``_torch_varlen_backward`` calls (a cuDNN output and LSE under flash's backward are wrong)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import AuxRequest

    pinned = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if _torch_varlen_picks_backend() else contextlib.nullcontext()
    with pinned:
        return _torch_varlen_run(q, k, v, a, return_aux=AuxRequest(lse=True))


def _torch_varlen_backward(dout, q, k, v, out, lse, a: AttnArgs):
    """torch's own backward op of varlen_attn (``torch_attn::_varlen_attn_backward``), called as its
    autograd formula calls it: the causal flag and window the forward used, a zero RNG state (the
    forward runs without dropout)."""
    params = params_of(_torch_varlen_fn())
    group = 1 if "enable_gqa" in params else q.shape[1] // k.shape[1]
    k_, v_ = (x.repeat_interleave(group, dim=1) if group > 1 else x for x in (k, v))
    left = a.window - 1 if a.window is not None else -1
    kw = dict(scale=a.scale)
    if "window_size" in params:
        kw["window_size"] = [left, 0]
    if _torch_varlen_picks_backend():
        from torch.nn.attention import SDPBackend

        kw["backend"] = SDPBackend.FLASH_ATTENTION.value  # the kernel ``_torch_varlen_forward`` pinned
    rng = _zero_rng_state(q.device)
    dq, dk, dv = _torch_varlen_backward_op()(
        flat(dout), flat(q), flat(k_), flat(v_), flat(out), lse, a.cu, a.keys_cu, a.max_len, a.keys_max_len,
        left == -1, rng, **kw,
    )  # fmt: skip
    dk, dv = (unflat(x) for x in (dk, dv))
    if group > 1:
        dk, dv = (x.unflatten(1, (k.shape[1], group)).sum(2) for x in (dk, dv))
    return unflat(dq), dk, dv, None


def torch_varlen_backend() -> Backend:
    return Backend(
        "torch_varlen",
        _torch_varlen_unusable,
        _torch_varlen_supports,
        _torch_varlen_run,
        LseKernels(
            lse_unusable(_torch_varlen_supports, _torch_varlen_lse_problem),
            _torch_varlen_forward,
            _torch_varlen_backward,
        ),
    )
