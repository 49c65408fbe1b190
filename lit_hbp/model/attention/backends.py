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
reported with its reason (``choose``). A flash-attn backend counts only on the GPUs it is built for,
from the distribution that ships it (flash-attn 4 is the ``flash-attn-4`` distribution; flash-attn
2.8's preview ``flash_attn/cute`` is never flash-attn 4) at a version whose backward runs what the
layer needs (``FLASH_4_FLOORS``), and when its module imports, probed on the first selection (never
at import) and once: a broken install is skipped with its error. Kernels that differ between library
versions (flash-attn 2/3/4, torch's ``varlen_attn``) are adapted from their signatures: a
parameter is passed by name when the kernel has it, a required parameter this module does not
supply is passed None when its own annotation allows None, and otherwise the backend is refused,
so no kernel is called with missing arguments.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from packaging.version import InvalidVersion, Version

from lit_hbp.model.attention.flex import cross_block_mask, document_block_mask
from lit_hbp.model.calls import TOWER_NAME

FEATURES = ("window", "softcap", "sinks", "dropout")
HALF = (torch.float16, torch.bfloat16)


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


def _installed(module: str) -> bool:
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
def _params(fn) -> frozenset[str]:
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


def _complete(fn, positional: int, kw: dict) -> dict:
    """``kw`` with None for every required parameter it leaves out that accepts None (``unsupplied``)."""
    return {**kw, **dict.fromkeys(unsupplied(fn, positional, kw)[0])}


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> [T, H, D], the varlen kernels' layout."""
    return x[0].transpose(0, 1)


def _unflat(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)[None]


# ------------------------------------------------------------------------------------- flash-attn

FLASH_MODULES = {
    "flash_attn_3": ("flash_attn_interface", "flash-attn 3 (hopper build)"),
    "flash_attn_4": ("flash_attn.cute", "flash-attn 4 (flash_attn.cute)"),
    "flash_attn": ("flash_attn", "flash-attn 2"),
}
# The GPUs (compute capability) each kernel is built for, from the upstream READMEs and the asserts
# in their interfaces: flash-attn 2 Ampere, Ada and Hopper (and newer; bf16 needs SM80+ too),
# flash-attn 3 Hopper only, flash-attn 4 (CuTe DSL) Hopper and Blackwell (SM9x, SM10x).
FLASH_ARCHS: dict[str, tuple[Callable[[tuple[int, int]], bool], str]] = {
    "flash_attn_3": (lambda cap: cap == (9, 0), "SM90 (Hopper) only"),
    "flash_attn_4": (lambda cap: cap[0] in (9, 10), "SM90/SM100 (Hopper, Blackwell) only"),
    "flash_attn": (lambda cap: cap >= (8, 0), "SM80 or newer (Ampere, Ada, Hopper)"),
}
# The distributions flash-attn 4 comes as (``flash-attn4`` for its first betas). flash-attn 2.8 wheels
# ship a preview flash_attn/cute/ too, whose varlen backward raises NotImplementedError and whose
# varlen forward (2.8.2, 2.8.3) takes no max_seqlen_q: never flash-attn 4, whatever imports.
FLASH_4_DIST = "flash-attn-4"
FLASH_4_DISTS = (FLASH_4_DIST, "flash-attn4", "fa4")
# The first flash-attn-4 release whose backward runs each of these (read in flash_attn/cute/interface.py
# at the fa4-v4.0.0.betaN tags of Dao-AILab/flash-attention); an older one is refused for the layer
# that needs it, which takes the next backend.
FLASH_4_FLOORS: dict[str, tuple[Version, str]] = {
    "sm90": (Version("4.0.0b5"), "its backward asserts 'varlen backward is not yet supported on sm90'"),
    "softcap": (Version("4.0.0b24"), "its varlen backward refuses soft-capping ('varlen + score_mod not supported')"),
    "sinks": (Version("4.0.0b26"), "its backward gives learnable_sink no gradient (the sinks would stay frozen)"),
}


def _flash_fn(name: str):
    return importlib.import_module(FLASH_MODULES[name][0]).flash_attn_varlen_func


def _flash_limits(name: str) -> dict[str, str]:
    """Features this flash-attn install's forward takes and its backward cannot do, with why."""
    if name != "flash_attn_4":
        return {}
    version = _flash4_version()  # None: no release is known, so no floor is known to be met
    return {
        feature: f"flash-attn-4 {version or '(no release installed)'}: {why} (fixed in {floor})"
        for feature, (floor, why) in FLASH_4_FLOORS.items()
        if feature in FEATURES and (version is None or version < floor)
    }


def _flash_supports(name: str) -> frozenset[str]:
    params = _params(_flash_fn(name))
    keyword = dict(window="window_size", softcap="softcap", sinks="learnable_sink", dropout="dropout_p")
    return frozenset(f for f, kw in keyword.items() if kw in params) - _flash_limits(name).keys()


def _record_hash(path: Path) -> str:
    """A file's hash as a wheel's RECORD writes it (sha256, urlsafe base64 without padding)."""
    return base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


def _provider(module: str) -> tuple[str, str] | None:
    """(name, version) of the installed distribution that holds ``module``: of those whose RECORD lists
    its file, the one whose recorded hash is the file on disk (two wheels that write the same file,
    flash-attn 2.8 and flash-attn-4's ``flash_attn/cute``: the last installed); else, for a top-level
    module, the one whose top_level.txt names it; None if none does."""
    top = module.split(".")[0]
    names = importlib.metadata.packages_distributions().get(top, [])
    listing = _listed(module)
    for dist_name, dist, f in listing:
        on_disk = Path(dist.locate_file(f))
        if f.hash is not None and on_disk.is_file() and _record_hash(on_disk) == f.hash.value:
            return dist_name, dist.version
    if len({name for name, _, _ in listing}) == 1:
        return listing[0][0], listing[0][1].version
    if listing:  # several wheels wrote the file and none's hash is the file on disk: whose it is, is unknown
        return None
    return (names[0], importlib.metadata.version(names[0])) if names and top == module else None


def _listed(module: str) -> list:
    """(distribution name, distribution, RECORD entry) of every installed distribution whose RECORD
    lists ``module``'s file."""
    top, path = module.split(".")[0], module.replace(".", "/")
    files = {f"{path}/__init__.py", f"{path}.py"}
    listing = []
    for dist_name in dict.fromkeys(importlib.metadata.packages_distributions().get(top, [])):
        dist = importlib.metadata.distribution(dist_name)
        listing += [(dist_name, dist, f) for f in dist.files or () if str(f) in files]
    return listing


def _normalized(dist_name: str) -> str:
    return re.sub(r"[-_.]+", "-", dist_name).lower()


@cache
def _flash4_version() -> Version | None:
    """The installed flash-attn-4 release (its distribution's version: ``flash_attn.cute.__version__``
    reads another distribution's name and says 0.0.0), or None."""
    provider = _provider(FLASH_MODULES["flash_attn_4"][0])
    if provider is None and not _listed(FLASH_MODULES["flash_attn_4"][0]):  # an editable install: no RECORD lists it
        installed = [d for d in FLASH_4_DISTS if _has_dist(d)]
        provider = (installed[0], importlib.metadata.version(installed[0])) if installed else None
    try:
        return Version(provider[1]) if provider and _normalized(provider[0]) in FLASH_4_DISTS else None
    except (InvalidVersion, TypeError):  # a distribution without a (valid) version
        return None


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@cache
def _probe(name: str) -> str | None:
    """Import flash backend ``name``'s module once, on the first selection that gets this far (never
    at lit_hbp's import): None when it imports and has the kernel, else the reason, naming the
    distribution it came from. A broken install (a missing dependency, an undefined CUDA symbol)
    may raise anything: it rejects the backend instead of crashing the first forward. flash-attn 4
    counts only from its own distribution, at a release version (its backward's abilities depend on it)."""
    module, what = FLASH_MODULES[name]
    provider = _provider(module)
    source = f" (from {' '.join(map(str, provider))})" if provider else ""
    if name == "flash_attn_4" and _flash4_version() is None:
        if provider is not None and _normalized(provider[0]) == "flash-attn":
            return (
                f"{module}{source} is flash-attn {provider[1]}'s preview of flash-attn 4, whose varlen backward "
                f"raises NotImplementedError; flash-attn 4 is the {FLASH_4_DIST} distribution"
            )
        return f"{module}{source} is not a release of flash-attn 4 (the {FLASH_4_DIST} distribution)"
    try:
        if hasattr(importlib.import_module(module), "flash_attn_varlen_func"):
            return None
        error = "has no flash_attn_varlen_func"
    except Exception as e:  # whatever a broken install raises
        error = f"does not import: {type(e).__name__}: {e}"
    return f"{module}{source} {error}"


def reset_probes() -> None:
    """Forget what was probed of the installed kernels, and the choices made from it (after installing
    or removing one)."""
    for fn in (_probe, _flash4_version, _flash_lse_problem, decide):
        fn.cache_clear()


# The keywords every call of a flash-attn varlen function passes (``_flash_run``), beside q, k, v.
_FLASH_RUN_KEYWORDS = frozenset(
    {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal"}
)


def _flash_unusable(name: str) -> Callable[[str, torch.dtype], str | None]:
    module, what = FLASH_MODULES[name]
    supported, archs = FLASH_ARCHS[name]

    def unusable(device_type: str, dtype: torch.dtype) -> str | None:
        if device_type != "cuda":
            return "CUDA only"
        if dtype not in HALF:
            return f"fp16/bf16 only, not {dtype}"
        if not _installed(module):
            return f"{what} is not installed"
        major, minor = torch.cuda.get_device_capability()
        if not supported((major, minor)):
            return f"{what} runs on {archs}, this GPU is SM{major}{minor}"
        reason = _probe(name)
        if reason is None and name == "flash_attn_4" and major == 9:
            floor, why = FLASH_4_FLOORS["sm90"]
            if _flash4_version() < floor:
                reason = f"flash-attn-4 {_flash4_version()} on SM90: {why} (fixed in {floor})"
        if reason is None:
            _, missing = unsupplied(_flash_fn(name), 3, _FLASH_RUN_KEYWORDS)
            if missing:
                reason = f"{module}.flash_attn_varlen_func requires {', '.join(missing)}, which lit-hbp does not pass"
        return reason

    return unusable


def _flash_documents(a: AttnArgs) -> dict:
    """The query and key documents and the scale, as every flash-attn function names them."""
    return dict(
        cu_seqlens_q=a.cu,
        cu_seqlens_k=a.keys_cu,
        max_seqlen_q=a.max_len,
        max_seqlen_k=a.keys_max_len,
        softmax_scale=a.scale,
    )


def _flash_run(name: str):
    def run(q, k, v, a: AttnArgs) -> torch.Tensor:
        # causal is bottom-right aligned when keys outnumber queries (flash-attn >= 2.1)
        kw = dict(_flash_documents(a), causal=a.causal)
        if a.window is not None:
            kw["window_size"] = (a.window - 1, 0)
        if a.softcap:
            kw["softcap"] = a.softcap
        if a.dropout:
            kw["dropout_p"] = a.dropout
        if a.sinks is not None:
            kw["learnable_sink"] = a.sinks
        fn = _flash_fn(name)
        out = fn(_flat(q), _flat(k), _flat(v), **_complete(fn, 3, kw))
        return _unflat(out[0] if isinstance(out, tuple) else out)  # flash-attn 3 (some builds) and 4 add the LSE

    return run


# ------------------------------------------------------------------------------ torch varlen_attn


def _torch_varlen_fn():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def _torch_varlen_unusable(device_type: str, dtype: torch.dtype) -> str | None:
    if device_type != "cuda":
        return "CUDA only"
    if dtype not in HALF:
        return f"fp16/bf16 only, not {dtype}"
    if not _installed("torch.nn.attention.varlen"):
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch 2.10 or newer)"
    params = _params(_torch_varlen_fn())
    if not {"window_size", "is_causal"} & params:
        return "this torch's varlen_attn takes neither window_size nor is_causal: no causal mask"
    return None


def _torch_varlen_supports() -> frozenset[str]:
    return frozenset({"window"} if "window_size" in _params(_torch_varlen_fn()) else ())


def _torch_varlen_run(q, k, v, a: AttnArgs, **extra):
    """torch's varlen kernel, adapted to its signature: torch 2.10 has ``is_causal`` and no
    ``scale``/``window_size``/``enable_gqa``, 2.11 adds ``scale`` and ``window_size``, 2.13 ``enable_gqa``.
    A missing ``scale`` is applied to q (the kernel's default is 1/sqrt(D)); a missing
    ``enable_gqa`` repeats the k/v heads. With ``extra`` (``return_aux``), (out, lse)."""
    fn = _torch_varlen_fn()
    params = _params(fn)
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
    res = fn(_flat(q), _flat(k), _flat(v), a.cu, a.keys_cu, a.max_len, a.keys_max_len, **kw)
    return (_unflat(res[0]), res[1]) if extra else _unflat(res)


# ---------------------------------------------------------------------------------- FlexAttention

_flex_compiled: list = []


def _flex_fn():
    """flex_attention compiled once (dynamic over pack lengths): uncompiled it materializes scores."""
    from torch.nn.attention.flex_attention import flex_attention

    if not _flex_compiled:
        _flex_compiled.append(torch.compile(flex_attention, dynamic=True))
    return _flex_compiled[0]


def _flex_unusable(device_type: str, dtype: torch.dtype) -> str | None:
    if device_type != "cuda":
        return "CUDA only (torch's FlexAttention has no backward on CPU)"
    if not _installed("torch.nn.attention.flex_attention"):
        return f"torch {torch.__version__} has no FlexAttention"
    return None


def flex_run(q, k, v, a: AttnArgs, fn=None) -> torch.Tensor:
    """FlexAttention with a document block mask (built once per pack, ``flex.document_block_mask``),
    soft-capping as a score modification, and sinks from the log-sum-exp: with a sink logit s per
    head, softmax over the tokens and the sink scales the tokens-only output by sigmoid(lse - s)."""
    fn = fn or _flex_fn()
    if a.cu_k is None:
        block_mask = document_block_mask(a.cu, q.shape[2], a.window, causal=a.causal)
    else:
        block_mask = cross_block_mask(a.cu, a.cu_k, q.shape[2], k.shape[2], a.window)
    score_mod = None
    if a.softcap:
        # A tensor, not a Python float: compiled dynamic, torch 2.15 traces a captured float as a SymFloat,
        # which FlexAttention's score_mod buffers refuse (only tensors and ints); a tensor is one on every torch.
        cap = torch.tensor(float(a.softcap), dtype=torch.float32, device=q.device)

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

    kw = dict(score_mod=score_mod, block_mask=block_mask, scale=a.scale, enable_gqa=q.shape[1] != k.shape[1])
    if a.sinks is None:
        return fn(q, k, v, **kw)
    from torch.nn.attention import flex_attention as flex_module

    if hasattr(flex_module, "AuxRequest") and "return_aux" in _params(flex_module.flex_attention):
        out, aux = fn(q, k, v, return_aux=flex_module.AuxRequest(lse=True), **kw)
        lse = aux.lse
    else:
        out, lse = fn(q, k, v, return_lse=True, **kw)
    keep = torch.sigmoid(lse.float() - a.sinks.float()[None, :, None])
    return (out.float() * keep[..., None]).to(out.dtype)


# ------------------------------------------------------------------------- per-document loops


def _documents(a: AttnArgs) -> list[tuple[slice, slice]]:
    """(query rows, key rows) of every document (the same rows for self-attention)."""
    cu = a.cu.tolist()  # the loops need host values: one sync per call on a GPU (fallback backends)
    cu_k = cu if a.cu_k is None else a.cu_k.tolist()
    return [(slice(s, e), slice(ks, ke)) for s, e, ks, ke in zip(cu[:-1], cu[1:], cu_k[:-1], cu_k[1:])]


@torch.compiler.disable
def _sdpa_run(q, k, v, a: AttnArgs) -> torch.Tensor:
    """A causal scaled_dot_product_attention per document. Inputs stay 4-D: on CPU torch takes its
    flash kernel only for 4-D inputs (about 9x faster than the math fallback of 3-D inputs). SDPA's
    ``is_causal`` is top-left aligned, so query ranges shorter than their keys (and windows) pass
    the bottom-right band as a mask."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for qs, ks in _documents(a):
        n, m = qs.stop - qs.start, ks.stop - ks.start
        if n != m or (a.window is not None and n > a.window):
            kwargs = dict(attn_mask=_band(n, a.window, q.device, m))
        else:
            kwargs = dict(is_causal=a.causal)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, qs], k[:, :, ks], v[:, :, ks], dropout_p=a.dropout, scale=a.scale, enable_gqa=gqa, **kwargs
            )
        )
    return torch.cat(outs, dim=2)


def _band(n: int, window: int | None, device, m: int | None = None) -> torch.Tensor:
    """[n, m] bool: n queries that are the last n of m keys (m = n: self-attention) see the keys up to
    their own position (causal, bottom-right), and within the window when there is one."""
    m = n if m is None else m
    i = torch.arange(n, device=device)[:, None] + (m - n)
    j = torch.arange(m, device=device)[None, :]
    keep = j <= i
    if window is not None:
        keep &= j > i - window
    return keep


@torch.compiler.disable
def eager_run(q, k, v, a: AttnArgs) -> torch.Tensor:
    """The definition, document by document: scores, soft-cap, causal (and window) mask, softmax in
    fp32 with the sink logit as an extra column, dropout, weighted values. Slow; runs anywhere and
    differentiates everywhere, so every feature trains on CPU."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for rows, keys in _documents(a):
        n, m = rows.stop - rows.start, keys.stop - keys.start
        qs = q[0, :, rows]
        ks, vs = (x[0, :, keys].repeat_interleave(group, dim=0) for x in (k, v))
        scores = (qs @ ks.transpose(-1, -2)).to(torch.promote_types(qs.dtype, torch.float32)) * a.scale
        if a.softcap:
            scores = a.softcap * torch.tanh(scores / a.softcap)
        if a.causal:
            scores = scores.masked_fill(~_band(n, a.window, q.device, m), float("-inf"))
        if a.sinks is not None:
            sink = a.sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, n, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        if a.dropout:
            probs = F.dropout(probs, a.dropout, training=True)
        outs.append((probs.to(vs.dtype) @ vs)[None])
    return torch.cat(outs, dim=2)


# ---------------------------------------------------------- forward with the LSE, backward from it
#
# The flash-attn kernels that return the LSE and take it back are the libraries' private functions
# (those their autograd functions call; ring-flash-attention calls the same). They are adapted by
# parameter name like the public ones: flash-attn 2.6 takes ``window_size=(left, right)`` and returns
# (out, q, k, v, out_padded, lse, S_dmask, rng_state), 2.7+ takes ``window_size_left/right`` and
# returns (out, lse, S_dmask, rng_state); flash-attn 3 (hopper) and 4 (CuTe) have functions of their
# own. A version lacking a parameter used here has no pair: the caller recomputes, and says why.

FLASH_LSE = {
    "flash_attn": ("flash_attn.flash_attn_interface", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward"),
    "flash_attn_3": ("flash_attn_interface", "_flash_attn_forward", "_flash_attn_backward"),
    "flash_attn_4": ("flash_attn.cute.interface", "_flash_attn_fwd", "_flash_attn_bwd"),
}
_VARLEN = frozenset({"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "softcap"})
_GRADS = frozenset({"dout", "q", "k", "v", "out", "dq", "dk", "dv"})
_FLASH_LSE_PARAMS = {  # (forward, backward) parameters each pair is called with; "window" is either spelling
    "flash_attn": (
        _VARLEN | {"causal", "dropout_p", "alibi_slopes", "return_softmax", "window"},
        _VARLEN
        | _GRADS
        | {"softmax_lse", "causal", "dropout_p", "alibi_slopes", "deterministic", "rng_state", "window"},
    ),
    "flash_attn_3": (
        _VARLEN | {"causal", "window_size_left", "window_size_right"},
        _VARLEN | _GRADS | {"softmax_lse", "is_causal", "window_size_left", "window_size_right"},
    ),
    "flash_attn_4": (
        _VARLEN | {"causal", "window_size_left", "window_size_right", "return_lse"},
        _VARLEN | {"q", "k", "v", "out", "dout", "lse", "causal", "window_size_left", "window_size_right"},
    ),
}
NO_DROPOUT = "attention dropout: the backward kernels are called without it (the backward recomputes instead)"


def _flash_lse_fns(name: str) -> tuple[Callable, Callable]:
    module, fwd, bwd = FLASH_LSE[name]
    mod = importlib.import_module(module)
    return getattr(mod, fwd), getattr(mod, bwd)


def _named(params: frozenset[str]) -> frozenset[str]:
    """``params`` with either window spelling read as "window"."""
    return params | ({"window"} if params & {"window_size", "window_size_left"} else set())


def _spelled(params: frozenset[str], want: frozenset[str]) -> frozenset[str]:
    """``want`` with "window" as the spelling ``params`` has."""
    window = {"window_size"} if "window_size" in params else {"window_size_left", "window_size_right"}
    return want - {"window"} | (window if "window" in want else set())


@cache
def _flash_lse_problem(name: str) -> str | None:
    """None when the installed flash backend ``name`` has its forward-with-LSE and backward functions
    with every parameter used here, and every required parameter of theirs is passed (or accepts None),
    else what is missing."""
    module, fwd_name, bwd_name = FLASH_LSE[name]
    try:
        fns = _flash_lse_fns(name)
    except Exception as e:  # an older or broken install
        return f"{module} has no {fwd_name} / {bwd_name} ({type(e).__name__}: {e})"
    # The forwards take q, k, v by position, the backwards everything by name.
    for fn, fn_name, want, positional in zip(fns, (fwd_name, bwd_name), _FLASH_LSE_PARAMS[name], (3, 0)):
        missing = want - _named(_params(fn))
        if missing:
            return f"{module}.{fn_name} takes no {', '.join(sorted(missing))}"
        _, required = unsupplied(fn, positional, _spelled(_params(fn), want))
        if required:
            return f"{module}.{fn_name} requires {', '.join(required)}, which lit-hbp does not pass"
    return None


def _flash_lse_supports(name: str) -> frozenset[str]:
    both = _params(_flash_lse_fns(name)[0]) & _params(_flash_lse_fns(name)[1])
    taken = {"window", "softcap"} | ({"sinks"} if "learnable_sink" in both else set())
    return frozenset(taken) - _flash_limits(name).keys()


def _lse_unusable(supports: Callable[[], frozenset[str]], problem: Callable[[], str | None]):
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


def _pad8(x: torch.Tensor) -> torch.Tensor:
    """The head dimension padded with zeros to a multiple of 8, as flash-attn 2's kernels need (its
    autograd function pads the same way; the padded output columns are exactly zero)."""
    return F.pad(x, [0, -x.shape[-1] % 8]) if x.shape[-1] % 8 else x


def _window(a: AttnArgs) -> tuple[int, int]:
    return (a.window - 1, 0) if a.window is not None else (-1, -1)


def _flash_varlen_kw(params: frozenset[str], a: AttnArgs) -> dict:
    """The keywords every flash pair takes: documents, scale, causal, window and soft-capping."""
    left, right = _window(a)
    kw = dict(_flash_documents(a), softcap=float(a.softcap or 0.0))
    if "window_size" in params:
        kw["window_size"] = (left, right)
    else:
        kw["window_size_left"], kw["window_size_right"] = left, right
    kw["is_causal" if "is_causal" in params else "causal"] = True  # bottom-right aligned, as in the forward
    return kw


def _flash2_forward(q, k, v, a: AttnArgs):
    fwd, _ = _flash_lse_fns("flash_attn")
    kw = _flash_varlen_kw(_params(fwd), a)
    kw = _complete(fwd, 3, dict(kw, dropout_p=0.0, alibi_slopes=None, return_softmax=False))
    res = fwd(*(_pad8(_flat(x)) for x in (q, k, v)), **kw)
    out, lse = (res[0], res[5]) if len(res) == 8 else (res[0], res[1])  # 2.6 returns q, k, v, out_padded too
    return _unflat(out[..., : q.shape[-1]]), lse


def _flash2_backward(dout, q, k, v, out, lse, a: AttnArgs):
    _, bwd = _flash_lse_fns("flash_attn")
    dout_, q_, k_, v_, out_ = (_pad8(_flat(x)) for x in (dout, q, k, v, out))
    grads = [x.new_empty(x.shape) for x in (q_, k_, v_)]  # contiguous, as flash-attn allocates them
    kw = dict(
        dropout_p=0.0, alibi_slopes=None, deterministic=False, rng_state=None, **_flash_varlen_kw(_params(bwd), a)
    )
    kw.update(dout=dout_, q=q_, k=k_, v=v_, out=out_, softmax_lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    bwd(**_complete(bwd, 0, kw))
    return (*(_unflat(g[..., : q.shape[-1]]) for g in grads), None)


def _flash3_forward(q, k, v, a: AttnArgs):
    fwd, _ = _flash_lse_fns("flash_attn_3")
    res = fwd(_flat(q), _flat(k), _flat(v), **_complete(fwd, 3, _flash_varlen_kw(_params(fwd), a)))
    return _unflat(res[0]), res[1]


def _flash3_backward(dout, q, k, v, out, lse, a: AttnArgs):
    _, bwd = _flash_lse_fns("flash_attn_3")
    q_, k_, v_ = _flat(q), _flat(k), _flat(v)
    grads = [x.new_empty(x.shape) for x in (q_, k_, v_)]  # contiguous, as flash-attn allocates them
    kw = dict(_flash_varlen_kw(_params(bwd), a), dout=_flat(dout), q=q_, k=k_, v=v_, out=_flat(out), softmax_lse=lse)
    bwd(**_complete(bwd, 0, dict(kw, dq=grads[0], dk=grads[1], dv=grads[2])))
    return (*(_unflat(g) for g in grads), None)


def _flash4_kw(params: frozenset[str], a: AttnArgs) -> dict:
    """flash-attn 4 reads None as "no window" and "no soft-capping"; sinks join its softmax."""
    kw = _flash_varlen_kw(params, a)
    if a.window is None:
        kw["window_size_left"] = kw["window_size_right"] = None
    if not a.softcap:
        kw.pop("softcap")
    if a.sinks is not None:
        kw["learnable_sink"] = a.sinks
    return kw


def _flash4_forward(q, k, v, a: AttnArgs):
    fwd, _ = _flash_lse_fns("flash_attn_4")
    res = fwd(_flat(q), _flat(k), _flat(v), **_complete(fwd, 3, dict(_flash4_kw(_params(fwd), a), return_lse=True)))
    return _unflat(res[0]), res[1]


def _flash4_backward(dout, q, k, v, out, lse, a: AttnArgs):
    _, bwd = _flash_lse_fns("flash_attn_4")
    kw = dict(_flash4_kw(_params(bwd), a), lse=lse)
    kw.update(q=_flat(q), k=_flat(k), v=_flat(v), out=_flat(out), dout=_flat(dout))
    res = bwd(**_complete(bwd, 0, kw))
    dsinks = res[3].to(a.sinks.dtype) if a.sinks is not None else None
    return (*(_unflat(g) for g in res[:3]), dsinks)


FLASH_LSE_KERNELS = {
    "flash_attn": (_flash2_forward, _flash2_backward),
    "flash_attn_3": (_flash3_forward, _flash3_backward),
    "flash_attn_4": (_flash4_forward, _flash4_backward),
}


def _flash_lse(name: str) -> LseKernels:
    forward, backward = FLASH_LSE_KERNELS[name]
    return LseKernels(
        _lse_unusable(lambda: _flash_lse_supports(name), lambda: _flash_lse_problem(name)), forward, backward
    )


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
    if chooser is None or "window_size" in _params(chooser):
        return None
    return f"torch {torch.__version__}'s varlen_attn may run cuDNN's kernel for causal calls and cannot be pinned"


def _torch_varlen_lse_problem() -> str | None:
    """None when this torch's varlen_attn returns the LSE (``return_aux``), its backward op takes
    what the forward was called with, and both run flash's kernel (``_torch_varlen_cudnn_problem``)."""
    params = _params(_torch_varlen_fn())
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
    op = _torch_varlen_backward_op()
    return op is not None and any(x.name == "backend" for x in op.default._schema.arguments)


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
    params = _params(_torch_varlen_fn())
    group = 1 if "enable_gqa" in params else q.shape[1] // k.shape[1]
    k_, v_ = (x.repeat_interleave(group, dim=1) if group > 1 else x for x in (k, v))
    left = a.window - 1 if a.window is not None else -1
    kw = dict(scale=a.scale)
    if "window_size" in params:
        kw["window_size"] = [left, 0]
    if _torch_varlen_picks_backend():
        from torch.nn.attention import SDPBackend

        kw["backend"] = SDPBackend.FLASH_ATTENTION.value  # the kernel ``_torch_varlen_forward`` pinned
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    dq, dk, dv = _torch_varlen_backward_op()(
        _flat(dout), _flat(q), _flat(k_), _flat(v_), _flat(out), lse, a.cu, a.keys_cu, a.max_len, a.keys_max_len,
        left == -1, rng, **kw,
    )  # fmt: skip
    dk, dv = (_unflat(x) for x in (dk, dv))
    if group > 1:
        dk, dv = (x.unflatten(1, (k.shape[1], group)).sum(2) for x in (dk, dv))
    return _unflat(dq), dk, dv, None


def _cpu_doc_mask(n: int, m: int, window: int | None, like: torch.Tensor) -> dict:
    """Arguments of torch's CPU flash kernel for n queries that are the last n of m keys: its own
    causal flag where that is the mask, else the band as an additive mask of the query's dtype."""
    if n == m and (window is None or n <= window):
        return dict(is_causal=True, attn_mask=None)
    band = _band(n, window, like.device, m)
    return dict(is_causal=False, attn_mask=torch.zeros(n, m, dtype=like.dtype).masked_fill(~band, float("-inf")))


@cache
def _cpu_flash_takes_gqa() -> bool:
    """Whether this torch's CPU flash kernel takes fewer key/value heads than query heads (probed
    once on a tiny call); else K/V are repeated per document."""
    q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kv, kv, 0.0, True)
        return True
    except RuntimeError:
        return False


def _sdpa_lse_unusable(device_type: str, needs: frozenset[str]) -> str | None:
    if "dropout" in needs:
        return NO_DROPOUT
    if device_type != "cpu":
        return f"its LSE kernel is torch's CPU flash kernel, not on {device_type}"
    if needs - {"window"}:
        return f"its backward kernel does not take {', '.join(sorted(needs - {'window'}))}"
    return None


@torch.compiler.disable
def _sdpa_forward(q, k, v, a: AttnArgs):
    """torch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, what SDPA runs on
    CPU) document by document, keeping its LSE (as [1, Hq, T]; returned as [Hq, T])."""
    group = 1 if _cpu_flash_takes_gqa() else q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))
    for qs, ks in _documents(a):
        n, m = qs.stop - qs.start, ks.stop - ks.start
        if n:
            kd, vd = (x[:, :, ks] if group == 1 else x[:, :, ks].repeat_interleave(group, 1) for x in (k, v))
            mask = _cpu_doc_mask(n, m, a.window, q)
            out[:, :, qs], lse[:, :, qs] = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, qs], kd, vd, 0.0, mask["is_causal"], attn_mask=mask["attn_mask"], scale=a.scale
            )
    return out, lse[0]


@torch.compiler.disable
def _sdpa_backward(dout, q, k, v, out, lse, a: AttnArgs):
    """The CPU flash kernel's backward document by document, from the saved output and LSE."""
    hkv, group = k.shape[1], 1 if _cpu_flash_takes_gqa() else q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    lse = lse[None]
    for qs, ks in _documents(a):
        n, m = qs.stop - qs.start, ks.stop - ks.start
        if n:
            kd, vd = (x[:, :, ks] if group == 1 else x[:, :, ks].repeat_interleave(group, 1) for x in (k, v))
            mask = _cpu_doc_mask(n, m, a.window, q)
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *(x[:, :, qs].contiguous() for x in (dout, q)), kd, vd, out[:, :, qs].contiguous(),
                lse[:, :, qs].contiguous(), 0.0, mask["is_causal"], attn_mask=mask["attn_mask"], scale=a.scale,
            )  # fmt: skip
            dq[:, :, qs] = gq
            dk[:, :, ks] += gk.unflatten(1, (hkv, group)).sum(2)
            dv[:, :, ks] += gv.unflatten(1, (hkv, group)).sum(2)
    return dq, dk, dv, None


def _eager_scores(qs, ks, a: AttnArgs, n: int, m: int):
    """Scores of one document [H, n, m] in fp32 (or wider): scaled, soft-capped (with the tanh kept
    for the backward), masked outside the causal band with -inf."""
    raw = (qs @ ks.transpose(-1, -2)).to(torch.promote_types(qs.dtype, torch.float32)) * a.scale
    capped = torch.tanh(raw / a.softcap) if a.softcap else None
    scores = a.softcap * capped if a.softcap else raw
    return scores.masked_fill(~_band(n, a.window, qs.device, m), float("-inf")), capped


@torch.compiler.disable
def _eager_forward(q, k, v, a: AttnArgs):
    """``eager_run`` keeping the log-sum-exp [Hq, T] (the sink logit included in it)."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for rows, keys in _documents(a):
        n, m = rows.stop - rows.start, keys.stop - keys.start
        ks, vs = (x[0, :, keys].repeat_interleave(group, dim=0) for x in (k, v))
        scores, _ = _eager_scores(q[0, :, rows], ks, a, n, m)
        if a.sinks is not None:
            sink = a.sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, n, 1)
            lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
        else:
            lse = torch.logsumexp(scores, dim=-1)
        outs.append((torch.exp(scores - lse[..., None]).to(vs.dtype) @ vs)[None])
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=1)


@torch.compiler.disable
def _eager_backward(dout, q, k, v, out, lse, a: AttnArgs):
    """The softmax backward from the LSE, document by document (flash-attention's formulas): P =
    exp(S - lse), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), through the soft-cap's tanh, dQ = dS K
    scale, dK = dS^T Q scale; a sink's gradient is -sum_i P_sink,i rowsum(dO O)_i."""
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    dq, dk, dv = (torch.zeros_like(x, dtype=acc) for x in (q, k, v))
    dsinks = torch.zeros_like(a.sinks, dtype=acc) if a.sinks is not None else None
    for rows, keys in _documents(a):
        n, m = rows.stop - rows.start, keys.stop - keys.start
        qs = q[0, :, rows]
        ks, vs = (x[0, :, keys].repeat_interleave(group, dim=0) for x in (k, v))
        scores, capped = _eager_scores(qs, ks, a, n, m)
        lse_d = lse[:, rows].to(acc)[..., None]
        p = torch.exp(scores - lse_d)
        do, o = dout[0, :, rows].to(acc), out[0, :, rows].to(acc)
        rowsum = (do * o).sum(-1, keepdim=True)
        ds = p * (do @ vs.to(acc).transpose(-1, -2) - rowsum)
        if capped is not None:
            ds = ds * (1 - capped**2)
        dq[0, :, rows] = ds @ ks.to(acc) * a.scale
        dk[0, :, keys] += (ds.transpose(-1, -2) @ qs.to(acc) * a.scale).unflatten(0, (hkv, group)).sum(1)
        dv[0, :, keys] += (p.transpose(-1, -2) @ do).unflatten(0, (hkv, group)).sum(1)
        if dsinks is not None:
            dsinks -= (torch.exp(a.sinks.to(acc)[:, None] - lse_d[..., 0]) * rowsum[..., 0]).sum(-1)
    grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
    return (*grads, dsinks.to(a.sinks.dtype) if dsinks is not None else None)


def _anywhere(device_type: str, dtype: torch.dtype) -> None:
    return None


REGISTRY: dict[str, Backend] = {
    **{
        name: Backend(
            name,
            _flash_unusable(name),
            lambda name=name: _flash_supports(name),
            _flash_run(name),
            _flash_lse(name),
            lambda name=name: _flash_limits(name),
        )
        for name in FLASH_MODULES
    },
    "torch_varlen": Backend(
        "torch_varlen",
        _torch_varlen_unusable,
        _torch_varlen_supports,
        _torch_varlen_run,
        LseKernels(
            _lse_unusable(_torch_varlen_supports, _torch_varlen_lse_problem),
            _torch_varlen_forward,
            _torch_varlen_backward,
        ),
    ),
    # FlexAttention's backward is generated by the compiler from its forward: no backward kernel to call.
    "flex": Backend("flex", _flex_unusable, lambda: frozenset({"window", "softcap", "sinks"}), flex_run),
    "sdpa": Backend(
        "sdpa",
        _anywhere,
        lambda: frozenset({"window", "dropout"}),
        _sdpa_run,
        LseKernels(_sdpa_lse_unusable, _sdpa_forward, _sdpa_backward),
    ),
    "eager": Backend(
        "eager",
        _anywhere,
        lambda: frozenset(FEATURES),
        eager_run,
        LseKernels(
            _lse_unusable(lambda: frozenset({"window", "softcap", "sinks"}), lambda: None),
            _eager_forward,
            _eager_backward,
        ),
    ),  # fmt: skip
}


def lse_why_not(name: str, device_type: str, needs: frozenset[str]) -> str | None:
    """None when backend ``name`` runs this call as a forward keeping the LSE and a backward kernel
    from it, else the reason (the caller then recomputes the forward in the backward)."""
    lse = REGISTRY[name].lse
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
