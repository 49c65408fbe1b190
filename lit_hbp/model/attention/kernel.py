"""What an attention backend is: the arguments of a call (``AttnArgs``), a kernel as a forward keeping
the log-sum-exp and a backward from it (``LseKernels``), a registry entry (``Backend``), and how a
kernel whose signature changes between library versions is called: a parameter passed by name when
the kernel has it, a required one lit-hbp does not supply passed None when its own annotation allows
None, otherwise the backend refused (``unsupplied``), so no kernel is called with missing arguments.
The kernels themselves live by family: ``flash`` (flash-attn 2/3/4), ``torch_varlen`` (torch's
``varlen_attn``), ``flex`` (FlexAttention), ``loops`` (SDPA and the eager definition per document);
``backends`` is the registry that chooses among them.
"""

from __future__ import annotations

import importlib.util
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

FEATURES = ("window", "softcap", "sinks", "dropout")
HALF = (torch.float16, torch.bfloat16)
# What a head dim asks of a kernel: flash kernels (flash-attn's, torch's varlen) run head dims that are multiples
# of 8 up to 256 (torch's varlen_attn: "head_size must be a multiple of 8"); the loops run any.
HEAD_DIM_NEEDS = ("a head dim not a multiple of 8", "a head dim over 256")


def call_needs(q: torch.Tensor, args: AttnArgs) -> frozenset[str]:
    """What a call on ``q`` [1, H, T, D] with ``args`` needs of a kernel: ``args.needs`` and its head dim's."""
    d = q.shape[-1]
    if d % 8 == 0 and d <= 256:
        return args.needs
    return args.needs | frozenset(need for need, off in zip(HEAD_DIM_NEEDS, (d % 8 != 0, d > 256)) if off)


@dataclass(frozen=True)
class AttnArgs:
    """Everything about a call but q, k, v. ``cu``/``max_len`` are the query documents; with
    ``cu_k``/``max_len_k`` the keys have documents of their own (context parallelism: a query range
    [a, b) of a document against keys [0, b)), and causal is bottom-right aligned: the last query
    of a document sees its last key."""

    cu: torch.Tensor
    max_len: int
    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    dropout: float = 0.0
    cu_k: torch.Tensor | None = None
    max_len_k: int | None = None
    causal: bool = True
    """False: each document attends both ways (a vision tower's images, ``lit_hbp.model.attention.tower``), taken
    by every backend's ``run``; the LSE pairs serve the language model's causal calls only."""

    def __post_init__(self) -> None:
        if not self.causal and (self.window is not None or self.cu_k is not None):
            raise ValueError("attention both ways takes no sliding window and no key ranges of its own")

    @property
    def keys_cu(self) -> torch.Tensor:
        """The key documents: ``cu_k``, or the query documents for self-attention."""
        return self.cu if self.cu_k is None else self.cu_k

    @property
    def keys_max_len(self) -> int:
        return self.max_len if self.max_len_k is None else self.max_len_k

    @property
    def needs(self) -> frozenset[str]:
        present = dict(
            window=self.window is not None,
            softcap=bool(self.softcap),
            sinks=self.sinks is not None,
            dropout=self.dropout > 0,
        )
        return frozenset(k for k, v in present.items() if v)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The LSE's dtype for inputs of ``dtype``: fp32, or the inputs' own when wider."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class LseKernels:
    """A backend's kernel as two calls: ``forward(q, k, v, args) -> (out, lse)`` keeps the softmax's
    log-sum-exp, [Hq, T] in ``lse_dtype(q.dtype)`` (the varlen kernels' own layout), ``backward(dout,
    q, k, v, out, lse, args) -> (dq, dk, dv, dsinks or None)`` computes the gradients from them
    without running the forward again. What flash-attention's autograd functions do inside, exposed
    so that context parallelism can run the backward on K/V it gathers again rather than keep them,
    and the compiled custom op can save the LSE. ``unusable(device_type, needs)`` is None when the
    pair runs such a call, else the reason."""

    unusable: Callable[[str, frozenset[str]], str | None]
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttnArgs], tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class Backend:
    """``unusable(device_type, dtype)`` is None when the backend can run there, else the reason;
    ``supports()`` the features it implements; ``run(q, k, v, args)`` the kernel (differentiable by
    autograd); ``lse`` the same kernel as a forward keeping the LSE and a backward from it, where the
    library exposes them."""

    name: str
    unusable: Callable[[str, torch.dtype], str | None]
    supports: Callable[[], frozenset[str]]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttnArgs], torch.Tensor]
    lse: LseKernels | None = None
    limits: Callable[[], dict[str, str]] = dict
    """Features the forward takes that this install's backward cannot do, with why (left out of
    ``supports``): a layer that needs one takes another backend, never a frozen or wrong gradient."""


def installed(module: str) -> bool:
    """Whether ``module``'s file is there, found without running any of its package's code: a broken
    package then fails its import probe with its own error instead of reading as missing."""
    top, *sub = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # a top-level module that is missing or has no spec
        return False
    if spec is None or not sub:
        return spec is not None
    *parents, leaf = sub
    return any(
        Path(where, *parents, leaf).is_dir() or Path(where, *parents, f"{leaf}.py").is_file()
        for where in spec.submodule_search_locations or ()
    )


@cache
def params_of(fn) -> frozenset[str]:
    """Parameter names of ``fn``; of the Python function behind a ``torch.library`` custom op (whose
    own signature is ``*args, **kwargs``), as flash-attn >= 2.7 and torch's varlen define them."""
    return frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


@cache
def _signature(fn) -> inspect.Signature:
    return inspect.signature(getattr(fn, "_init_fn", fn))


def _accepts_none(param: inspect.Parameter) -> bool:
    """Whether the parameter's own annotation allows None (``Optional[X]``, ``X | None``,
    ``Union[X, None]``, or any of them as text)."""
    a = param.annotation
    if isinstance(a, str):
        text = a.replace(" ", "")
        union = text.startswith("Optional[") or (text.startswith("Union[") and "None" in text)
        return union or "|None" in text or text.startswith("None|") or text == "None"
    return type(None) in typing.get_args(a)


def unsupplied(fn, positional: int, keywords) -> tuple[list[str], list[str]]:
    """(required parameters of ``fn`` a call with ``positional`` leading arguments and ``keywords``
    leaves out that accept None, those that do not): a kernel whose required parameters change
    between builds (flash-attn 3 source builds of 2025-07) is then called complete, or not at all."""
    none, other = [], []
    for i, (name, p) in enumerate(_signature(fn).parameters.items()):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if (i < positional and p.kind != p.KEYWORD_ONLY) or name in keywords:
            continue
        (none if _accepts_none(p) else other).append(name)
    return none, other


def completed(fn, positional: int, kw: dict) -> dict:
    """``kw`` with None for every required parameter it leaves out that accepts None (``unsupplied``)."""
    return {**kw, **dict.fromkeys(unsupplied(fn, positional, kw)[0])}


def flat(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> [T, H, D], the varlen kernels' layout."""
    return x[0].transpose(0, 1)


def unflat(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)[None]


NO_DROPOUT = "attention dropout: the backward kernels are called without it (the backward recomputes instead)"


def lse_unusable(supports: Callable[[], frozenset[str]], problem: Callable[[], str | None]):
    def unusable(device_type: str, needs: frozenset[str]) -> str | None:
        if "dropout" in needs:
            return NO_DROPOUT
        reason = problem()
        if reason is None:
            missing = needs - supports()
            if missing:
                reason = f"its backward kernel does not take {', '.join(sorted(missing))}"
        return reason

    return unusable


def documents(a: AttnArgs) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of every document (the same rows for self-attention)."""
    cu = a.cu.tolist()  # the loops need host values: one sync per call on a GPU (fallback backends)
    cu_k = cu if a.cu_k is None else a.cu_k.tolist()
    return [(slice(s, e), slice(ks, ke)) for s, e, ks, ke in zip(cu[:-1], cu[1:], cu_k[:-1], cu_k[1:])]
