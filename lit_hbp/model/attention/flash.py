"""flash-attn 2, 3 (the Hopper build) and 4 (CuTe DSL) as backends: each counts only on the GPUs it is
built for, from the distribution that ships it (flash-attn 4 is the ``flash-attn-4`` distribution;
flash-attn 2.8's preview ``flash_attn/cute`` is never flash-attn 4) at a version whose backward runs
what the layer needs (``FLASH_4_FLOORS``), and when its module imports, probed on the first selection
(never at import) and once: a broken install is skipped with its error.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata
import os
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from packaging.version import InvalidVersion, Version

from lit_hbp.model.attention.kernel import (
    FEATURES,
    HALF,
    AttnArgs,
    Backend,
    LseKernels,
    completed,
    flat,
    installed,
    lse_unusable,
    params_of,
    unflat,
    unsupplied,
)

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


def deterministic() -> bool:
    """Whether the backward kernels run deterministically (flash-attn's ``deterministic``): where Hugging Face's
    switch asks (``FLASH_ATTENTION_DETERMINISTIC=1``, which its Trainer's ``full_determinism`` sets) or torch's
    (``torch.use_deterministic_algorithms``: Lightning's ``Trainer(deterministic=True)``)."""
    return os.getenv("FLASH_ATTENTION_DETERMINISTIC", "0") == "1" or torch.are_deterministic_algorithms_enabled()


def _deterministic_kw(fn) -> dict:
    return {"deterministic": True} if "deterministic" in params_of(fn) and deterministic() else {}


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
    params = params_of(_flash_fn(name))
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
        found = [d for d in FLASH_4_DISTS if _has_dist(d)]
        provider = (found[0], importlib.metadata.version(found[0])) if found else None
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
        if not installed(module):
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
        out = fn(flat(q), flat(k), flat(v), **completed(fn, 3, dict(kw, **_deterministic_kw(fn))))
        return unflat(out[0] if isinstance(out, tuple) else out)  # flash-attn 3 (some builds) and 4 add the LSE

    return run


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
        missing = want - _named(params_of(fn))
        if missing:
            return f"{module}.{fn_name} takes no {', '.join(sorted(missing))}"
        _, required = unsupplied(fn, positional, _spelled(params_of(fn), want))
        if required:
            return f"{module}.{fn_name} requires {', '.join(required)}, which lit-hbp does not pass"
    return None


def _flash_lse_supports(name: str) -> frozenset[str]:
    both = params_of(_flash_lse_fns(name)[0]) & params_of(_flash_lse_fns(name)[1])
    taken = {"window", "softcap"} | ({"sinks"} if "learnable_sink" in both else set())
    return frozenset(taken) - _flash_limits(name).keys()


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
    kw = _flash_varlen_kw(params_of(fwd), a)
    kw = completed(fwd, 3, dict(kw, dropout_p=0.0, alibi_slopes=None, return_softmax=False))
    res = fwd(*(_pad8(flat(x)) for x in (q, k, v)), **kw)
    out, lse = (res[0], res[5]) if len(res) == 8 else (res[0], res[1])  # 2.6 returns q, k, v, out_padded too
    return unflat(out[..., : q.shape[-1]]), lse


def _flash2_backward(dout, q, k, v, out, lse, a: AttnArgs):
    _, bwd = _flash_lse_fns("flash_attn")
    dout_, q_, k_, v_, out_ = (_pad8(flat(x)) for x in (dout, q, k, v, out))
    grads = [x.new_empty(x.shape) for x in (q_, k_, v_)]  # contiguous, as flash-attn allocates them
    kw = dict(
        dropout_p=0.0,
        alibi_slopes=None,
        deterministic=deterministic(),
        rng_state=None,
        **_flash_varlen_kw(params_of(bwd), a),
    )
    kw.update(dout=dout_, q=q_, k=k_, v=v_, out=out_, softmax_lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    bwd(**completed(bwd, 0, kw))
    return (*(unflat(g[..., : q.shape[-1]]) for g in grads), None)


def _flash3_forward(q, k, v, a: AttnArgs):
    fwd, _ = _flash_lse_fns("flash_attn_3")
    res = fwd(flat(q), flat(k), flat(v), **completed(fwd, 3, _flash_varlen_kw(params_of(fwd), a)))
    return unflat(res[0]), res[1]


def _flash3_backward(dout, q, k, v, out, lse, a: AttnArgs):
    _, bwd = _flash_lse_fns("flash_attn_3")
    q_, k_, v_ = flat(q), flat(k), flat(v)
    grads = [x.new_empty(x.shape) for x in (q_, k_, v_)]  # contiguous, as flash-attn allocates them
    kw = dict(_flash_varlen_kw(params_of(bwd), a), dout=flat(dout), q=q_, k=k_, v=v_, out=flat(out), softmax_lse=lse)
    bwd(**completed(bwd, 0, dict(kw, dq=grads[0], dk=grads[1], dv=grads[2], **_deterministic_kw(bwd))))
    return (*(unflat(g) for g in grads), None)


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
    res = fwd(flat(q), flat(k), flat(v), **completed(fwd, 3, dict(_flash4_kw(params_of(fwd), a), return_lse=True)))
    return unflat(res[0]), res[1]


def _flash4_backward(dout, q, k, v, out, lse, a: AttnArgs):
    _, bwd = _flash_lse_fns("flash_attn_4")
    kw = dict(_flash4_kw(params_of(bwd), a), lse=lse, **_deterministic_kw(bwd))
    kw.update(q=flat(q), k=flat(k), v=flat(v), out=flat(out), dout=flat(dout))
    res = bwd(**completed(bwd, 0, kw))
    dsinks = res[3].to(a.sinks.dtype) if a.sinks is not None else None
    return (*(unflat(g) for g in res[:3]), dsinks)


FLASH_LSE_KERNELS = {
    "flash_attn": (_flash2_forward, _flash2_backward),
    "flash_attn_3": (_flash3_forward, _flash3_backward),
    "flash_attn_4": (_flash4_forward, _flash4_backward),
}


def _flash_lse(name: str) -> LseKernels:
    forward, backward = FLASH_LSE_KERNELS[name]
    return LseKernels(
        lse_unusable(lambda: _flash_lse_supports(name), lambda: _flash_lse_problem(name)), forward, backward
    )


def flash_backend(name: str) -> Backend:
    """flash-attn backend ``name`` (a key of ``FLASH_MODULES``) as the registry holds it."""
    return Backend(
        name,
        _flash_unusable(name),
        lambda: _flash_supports(name),
        _flash_run(name),
        _flash_lse(name),
        lambda: _flash_limits(name),
    )
