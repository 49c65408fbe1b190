"""Which backend a packed call's attention runs on, and the call itself: per device, the dtype the kernel
runs in (the autocast dtype under autocast) and the features the layer needs, the fastest backend that can
run it (``lit_hbp.model.attention.backends``) or the one the model was prepared with, logged and kept for
``choices`` the first time each model makes such a call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_hbp.model.attention.backends import REGISTRY, decide, lse_why_not
from lit_hbp.model.attention.kernel import AttnArgs, call_needs
from lit_hbp.model.calls import ATTN_NAME
from lit_hbp.model.packed_call import record_by_owner, record_of


def check_backend(name: str) -> str:
    """``name`` if it is ``auto`` or a registered backend, else a ValueError naming them."""
    if name != "auto" and name not in REGISTRY:
        raise ValueError(f"attention backend must be one of {('auto', *REGISTRY)}, got {name!r}")
    return name


def backend_for(
    device_type: str, dtype: torch.dtype, needs: frozenset[str] = frozenset(), backend: str = "auto", owner: int = 0
) -> str:
    """The backend for a call on ``device_type`` running in ``dtype`` that needs ``needs``: ``backend``
    when a model was prepared with one (refused where it cannot run the call), else the fastest that
    can. Logged, and kept for ``choices``, the first time the model ``owner`` makes such a call."""
    name, why = decide(backend, device_type, dtype, needs)
    record = record_by_owner(owner) if owner else None
    if record is not None and (device_type, dtype, needs) not in record.ran:
        record.ran[device_type, dtype, needs] = [name, why, ""]
        what = f"{dtype} on {device_type}" + (f" with {', '.join(sorted(needs))}" if needs else "")
        rank_zero_info(f"{ATTN_NAME} attention: {name} backend for {what} ({why})")
    return name


def choices(model: torch.nn.Module) -> list[dict[str, str]]:
    """The backends the packed calls of ``model`` (a prepared model) ran, one per kind of call its
    layers made (device, dtype, the features they need: a sliding window, sinks, ...), with why the
    faster ones were not taken and how the backward runs: what a run or a benchmark reports it
    trained with."""
    record = record_of(model)
    if record is None:
        raise ValueError(f"choices: {type(model).__name__} is not prepared (lit_hbp.prepare_model)")
    return [
        {
            "device": device,
            "dtype": str(dtype).removeprefix("torch."),
            "needs": ",".join(sorted(needs)) or "plain",
            "backend": name,
            "why": why,
            "backward": backward,
        }
        for (device, dtype, needs), (name, why, backward) in record.ran.items()
    ]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: the autocast dtype under autocast (rotary embeddings leave q and
    k in fp32 while v is already low precision), else the query's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def _on_device(args: AttnArgs, q: torch.Tensor) -> AttnArgs:
    """``args`` with its document offsets as int32 on q's device, as every kernel takes them."""
    for field in ("cu", "cu_k"):
        cu = getattr(args, field)
        if cu is not None and (cu.device != q.device or cu.dtype != torch.int32):
            args = AttnArgs(**{**args.__dict__, field: cu.to(device=q.device, dtype=torch.int32)})
    return args


def _attend(q, k, v, args: AttnArgs, backend: str = "auto", owner: int = 0) -> torch.Tensor:
    name = backend_for(q.device.type, q.dtype, call_needs(q, args), backend, owner)
    return REGISTRY[name].run(q, k, v, _on_device(args, q))


@contextlib.contextmanager
def replay_rng(device: torch.device, seed: int, active: bool = True) -> Iterator[None]:
    """The device's RNG seeded with ``seed`` inside and restored after (when ``active``): a backward
    that recomputes an attention forward draws the forward's dropout mask again."""
    if not active:
        yield
        return
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], device_type=device.type):
        (torch.cuda if cuda else torch.random.default_generator).manual_seed(int(seed))
        yield


def _run_op(
    q, k, v, cu, sinks, seed, max_len: int, scale: float, window, softcap, dropout: float, backend: str, owner: int
) -> torch.Tensor:
    """The kernel; with dropout, on the device's RNG seeded with ``seed`` (restored after), so the
    backward's recomputation draws the forward's dropout mask again."""
    args = AttnArgs(cu=cu, max_len=max_len, scale=scale, window=window, softcap=softcap, sinks=sinks, dropout=dropout)
    with replay_rng(q.device, seed, active=bool(dropout)):
        return _attend(q, k, v, args, backend, owner)


def lse_kernels(device_type: str, dtype: torch.dtype, needs: frozenset[str], backend: str = "auto", owner: int = 0):
    """The chosen backend's forward-with-LSE / backward pair for such a call (``kernel.LseKernels``),
    or None when it has none (the backward then recomputes the forward); logged with the choice."""
    name = backend_for(device_type, dtype, needs, backend, owner)
    reason = lse_why_not(name, device_type, needs)
    record = record_by_owner(owner) if owner else None
    ran = None if record is None else record.ran.get((device_type, dtype, needs))
    if ran is not None and not ran[2]:
        ran[2] = "its backward kernel from the saved LSE" if reason is None else f"recomputes the forward ({reason})"
        rank_zero_info(
            f"{ATTN_NAME} attention: the backward on {name} for {', '.join(sorted(needs)) or 'plain'} calls runs "
            f"{ran[2]}"
        )
    return REGISTRY[name].lse if reason is None else None
