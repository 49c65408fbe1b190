"""Attention kernels for one packed row, as a registry: name -> (can it run here, what it supports, run).

Every backend computes causal attention inside each document of a pack (a vision tower's images attend
both ways inside each: ``AttnArgs.causal``): q [1, Hq, T, D] and k/v
[1, Hkv, T, D] (grouped-query heads not repeated) -> [1, Hq, T, D], the documents given by
``cu_seqlens`` (int32, on q's device). A call may also need a sliding ``window`` (a token sees
itself and the window - 1 tokens before it), logit ``softcap`` (softcap * tanh(score / softcap)),
attention ``sinks`` (one learned logit per head that joins every softmax and takes probability
mass from the tokens) and ``dropout``.

The registry is ordered fastest first. For a device, a dtype and the features a call needs, the
first backend whose forward *and* backward can do them is taken; each skipped faster backend is
reported with its reason (``choose``). The backends live by family, each a ``Backend``
(``lit_hbp.model.attention.kernel``): ``flash`` (flash-attn 2, 3 and 4, each probed once on the first
selection), ``torch_varlen`` (torch's ``varlen_attn``), ``flex`` (FlexAttention), ``loops`` (SDPA and
the eager definition, document by document). A new backend is one entry here and a module of its own.
"""

from __future__ import annotations

from functools import cache

import torch

from lit_hbp.model.attention.flash import FLASH_MODULES, _flash4_version, _flash_lse_problem, _probe, flash_backend
from lit_hbp.model.attention.flex import flex_backend
from lit_hbp.model.attention.kernel import Backend, LseKernels
from lit_hbp.model.attention.loops import eager_backend, sdpa_backend
from lit_hbp.model.attention.torch_varlen import torch_varlen_backend
from lit_hbp.model.calls import TOWER_NAME

REGISTRY: dict[str, Backend] = {
    **{name: flash_backend(name) for name in FLASH_MODULES},
    "torch_varlen": torch_varlen_backend(),
    "flex": flex_backend(),
    "sdpa": sdpa_backend(),
    "eager": eager_backend(),
}


def reset_probes() -> None:
    """Forget what was probed of the installed kernels, and the choices made from it (after installing
    or removing one)."""
    for fn in (_probe, _flash4_version, _flash_lse_problem, decide, _lse_reason):
        fn.cache_clear()


def lse_why_not(name: str, device_type: str, needs: frozenset[str]) -> str | None:
    """None when backend ``name`` runs this call as a forward keeping the LSE and a backward kernel
    from it, else the reason (the caller then recomputes the forward in the backward)."""
    return _lse_reason(REGISTRY[name].lse, device_type, needs)


@cache
def _lse_reason(lse: LseKernels | None, device_type: str, needs: frozenset[str]) -> str | None:
    """``lse_why_not`` of a registry entry's LSE pair (keyed by the pair itself, so a replaced entry is asked
    again): read once per device and needs, not on each of a step's attention calls (torch's varlen pair
    reads its backward op's schema to answer: 17 us a call). Cached until ``reset_probes``."""
    return "the library exposes no backward kernel" if lse is None else lse.unusable(device_type, needs)


def why_not(name: str, device_type: str, dtype: torch.dtype, needs: frozenset[str]) -> str | None:
    """None when backend ``name`` can run this call, else the reason."""
    backend = REGISTRY[name]
    reason = backend.unusable(device_type, dtype)
    if reason is None:
        missing = needs - backend.supports()
        limits = backend.limits()
        if missing & limits.keys():
            reason = "; ".join(f"no {f} in the backward: {limits[f]}" for f in sorted(missing & limits.keys()))
        elif missing:
            reason = f"does not support {', '.join(sorted(missing))}"
    return reason


def choose(device_type: str, dtype: torch.dtype, needs: frozenset[str]) -> tuple[str, dict[str, str]]:
    """The fastest backend for the call, and why each faster one was not taken."""
    skipped = {}
    for name in REGISTRY:
        reason = why_not(name, device_type, dtype, needs)
        if reason is None:
            return name, skipped
        skipped[name] = reason
    raise AssertionError("the eager backend runs everywhere")  # pragma: no cover


# transformers' own attention for a vision tower, by the lit-hbp backend whose kernel it runs
TOWER_FLASH = {"flash_attn": "flash_attention_2", "flash_attn_3": "flash_attention_3"}
# backends that run every document of a call in one kernel: a tower takes them through lit-hbp's tower attention
ONE_KERNEL = frozenset({"flash_attn_4", "torch_varlen", "flex", *TOWER_FLASH})


def tower_attention(backend: str, device_type: str, dtype: torch.dtype) -> str | None:
    """The attention a vision tower runs in a packed call: where the language model's packed calls run a
    varlen kernel on ``device_type`` in ``dtype``, that kernel over all of a pack's images in one call a
    layer (Qwen's towers by their ``cu_seqlens``): transformers' flash implementation of flash-attn 2 and 3,
    lit-hbp's tower attention (``lit_hbp.model.attention.tower``) for the others. None (the tower's own
    attention) where the packed calls loop over documents (a CPU, sdpa, eager): the tower's own is as fast."""
    if device_type != "cuda":
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = decide(backend, device_type, dtype, frozenset())[0]
    if TOWER_FLASH.get(name) in ALL_ATTENTION_FUNCTIONS:
        return TOWER_FLASH[name]
    return TOWER_NAME if name in ONE_KERNEL else None


@cache
def decide(backend: str, device_type: str, dtype: torch.dtype, needs: frozenset[str]) -> tuple[str, str]:
    """The backend a call runs with and why: ``backend`` when a model was prepared with one (a
    ValueError where it cannot run the call), else ``choose``'s. Cached until ``reset_probes``."""
    if backend != "auto":
        reason = why_not(backend, device_type, dtype, needs)
        if reason is not None:
            what = f"{dtype} on {device_type}" + (f" with {', '.join(sorted(needs))}" if needs else "")
            raise ValueError(f"attention backend {backend!r} cannot run {what}: {reason}")
        return backend, "forced"
    name, skipped = choose(device_type, dtype, needs)
    return name, "; ".join(f"not {k}: {v}" for k, v in skipped.items()) or "the fastest"
