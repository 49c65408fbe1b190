"""Varlen (packed) causal attention, registered in transformers' ``AttentionInterface``.

A model that ``lit_hbp.prepare_model`` prepared runs ``varlen_attention`` only inside a packed call
(``lit_hbp.model.packed_call``): the call's ``cu_seq_lens_q`` / ``max_length_q`` (and a context-parallel
shard, ``hbp_cp_shard``, and the level's SP group, ``hbp_sp``) arrive as forward keywords and travel
with it, through checkpointed layers' recomputation too (for a family whose layers drop the keywords,
StableLM, they come from the model's packed call on this thread, ``lit_hbp.model.calls``); nothing of a pack
is kept in this module. Outside a pack the model runs the attention it had before. No mask function
is registered under the name, so transformers builds no mask and runs no packed-sequence detection
(which would read a device value back every forward). When the call carries an SP group, the level's
SP kind wraps the kernel (Ulysses: all-to-all to head shards, attention over the whole pack,
all-to-all back). A call without the boundaries, an explicit mask or a keyword this function does not
implement raises instead of being ignored: ignoring one trains a different model.

The kernel comes from ``lit_hbp.model.attention.backends``: per device, the dtype the kernel runs in
(the autocast dtype under autocast) and the features the layer needs (sliding window, soft-capping,
sinks, dropout), the fastest backend that can run it, or the one the model was prepared with
(``prepare_model(model, attn_backend=...)``: a setting of the model, not of the process). Each
model's choices, and why each faster backend was not taken, are logged the first time that model
makes such a call, and ``choices(model)`` lists them.

The kernel call is the ``torch.library`` custom op ``hbp::varlen_attention_v4``: a compiled decoder layer
sees one opaque op with a fake implementation (the output's shape and dtype) and stays one graph on
every backend, the per-document CPU loops included; backend choice, logging, imports and host reads
happen inside the op, at run time, never while tracing. The op keeps the kernel's LSE where the backend
has a backward kernel (``backends.LseKernels``), and its backward, ``hbp::varlen_attention_v3_backward``,
runs that kernel; otherwise (Flex, dropout) it recomputes the forward and differentiates it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch._C import DispatchKey
from transformers import AttentionInterface

from lit_hbp.data.batch import CPShard
from lit_hbp.model import calls
from lit_hbp.model.attention.backends import REGISTRY, AttnArgs, decide, lse_dtype, lse_why_not
from lit_hbp.model.calls import ATTN_NAME
from lit_hbp.model.packed_call import PREPARED, record_by_owner, record_of

# Keywords transformers passes that carry nothing this function needs: cu_seq_lens_k/max_length_k
# equal the q ones for self-attention, position_ids were used for the rotary embedding.
IGNORED = frozenset(
    {"position_ids", "cu_seq_lens_k", "max_length_k", "use_cache", "cache_position", "output_router_logits"}
    | {"shift_labels", "num_items_in_batch"}  # the loss's keywords, which transformers hands every layer too
    | {"hbp_cp_shard", "hbp_sp"}  # read by varlen_attention itself
    | {"seq_idx"}  # DataCollatorWithFlattening's document index: the boundaries say the same
)
CHECKED = frozenset({"output_attentions", "is_causal"})


def _unsupported(module, attention_mask, kwargs: dict) -> None:
    """Raise for what would be silently ignored: an explicit mask, weights asked back, a non-causal
    call, or any keyword with a value that is not implemented here."""
    where = type(module).__name__
    if getattr(module, "is_causal", True) is False:
        raise NotImplementedError(f"{where} is not causal (is_causal=False); {ATTN_NAME} attends causally")
    if attention_mask is not None:
        raise NotImplementedError(
            f"{where} passes its own attention mask to {ATTN_NAME}, which attends causally inside each document "
            "and would ignore it"
        )
    if kwargs.get("output_attentions"):
        raise NotImplementedError(f"{where} asks for attention weights, which {ATTN_NAME} does not compute")
    if kwargs.get("is_causal") is False:
        raise NotImplementedError(f"{where} asks for non-causal attention; {ATTN_NAME} is causal")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in IGNORED | CHECKED)
    if unknown:
        raise NotImplementedError(
            f"{where} passes the attention keyword(s) {unknown} that {ATTN_NAME} does not implement; training "
            "would silently differ from the model's own attention"
        )


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
    name = backend_for(q.device.type, q.dtype, args.needs, backend, owner)
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
    """The chosen backend's forward-with-LSE / backward pair for such a call (``backends.LseKernels``),
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


@dataclass(frozen=True, eq=False)  # identity hash: dynamo (torch 2.11) hashes it while tracing, before its fields exist
class Attend:
    """One layer's attention call over the pack being trained, as the SP kinds receive it
    (``lit_hbp.parallel.kind.Attend``): ``attend(q, k, v, sinks)`` runs the kernel over the pack's
    documents; ``forward``/``backward`` run it over query ranges against key prefixes of their own
    (context parallelism: range [a, b) of a document sees keys [0, b), causal bottom-right) as two
    calls outside autograd, the backward from the forward's saved output and LSE. ``shard``: the
    micro-batch's context-parallel geometry, which came with the call."""

    cu: torch.Tensor
    max_len: int
    scaling: float | None
    window: int | None
    softcap: float | None
    dropout: float
    shard: CPShard | None = None  # this rank's context-parallel geometry (cp > 1)
    backend: str = "auto"  # the model's backend setting
    owner: int = 0  # the model (its ``Prepared.owner``), for ``choices``

    def _scale(self, q: torch.Tensor) -> float:
        return float(self.scaling) if self.scaling is not None else q.shape[-1] ** -0.5

    def __call__(self, q, k, v, sinks) -> torch.Tensor:
        scale, softcap = self._scale(q), self.softcap or None
        if not torch.compiler.is_compiling():  # eager: the kernel itself, no recomputation in the backward
            args = AttnArgs(self.cu, int(self.max_len), scale, self.window, softcap, sinks, self.dropout)
            return _attend(q, k, v, args, self.backend, self.owner)
        out = _varlen_op(
            q, k, v, self.cu, sinks, self.max_len, scale, self.window, softcap, self.dropout, self.backend, self.owner
        )[0]
        return out.transpose(1, 2)

    def ranges(self, q, sinks, cu_q, cu_k, max_q: int, max_k: int) -> AttnArgs:
        """The call's arguments for query ranges ``cu_q`` against key prefixes ``cu_k``."""
        softcap = self.softcap or None
        args = AttnArgs(cu_q, int(max_q), self._scale(q), self.window, softcap, sinks, self.dropout, cu_k, int(max_k))
        return _on_device(args, q)

    def forward(self, q, k, v, sinks, seed: int, **geometry) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out, lse) over the ranges ``geometry`` (``cu_q, cu_k, max_q, max_k``), without autograd;
        lse is None when the backend has no backward kernel for the call (``backward`` then
        recomputes the forward, its dropout replayed from ``seed``)."""
        args = self.ranges(q, sinks, **geometry)
        kernels = lse_kernels(q.device.type, q.dtype, args.needs, self.backend, self.owner)
        with torch.no_grad():
            if kernels is not None:
                return kernels.forward(q, k, v, args)
            with replay_rng(q.device, seed, active=bool(args.dropout)):
                return _attend(q, k, v, args, self.backend, self.owner), None

    def backward(self, grad, q, k, v, sinks, out, lse, seed: int, **geometry):
        """(dq, dk, dv, dsinks or None) of ``forward``'s output for the upstream gradient ``grad``."""
        args = self.ranges(q, sinks, **geometry)
        if lse is not None:
            kernels = lse_kernels(q.device.type, q.dtype, args.needs, self.backend, self.owner)
            return kernels.backward(grad, q, k, v, out, lse, args)
        with torch.enable_grad(), replay_rng(q.device, seed, active=bool(args.dropout)):
            leaves = [x.detach().requires_grad_() if x is not None else None for x in (q, k, v, sinks)]
            wrt = [x for x in leaves if x is not None]
            out = _attend(*leaves[:3], AttnArgs(**{**args.__dict__, "sinks": leaves[3]}), self.backend, self.owner)
            grads = torch.autograd.grad(out, wrt, grad, allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, wrt)]
        return (*grads[:3], grads[3] if sinks is not None else None)


# Compiled graphs are cached on disk keyed by the ops they call, not by those ops' schemas or kernels
# (torch's AOTAutograd cache): the names carry the contract's version, so a graph cached by an older
# lit-hbp is never run against these ops.
OP = "hbp::varlen_attention_v4"


def _op_args(q, cu, sinks, max_len: int, scale: float, window, softcap, dropout: float) -> AttnArgs:
    return _on_device(AttnArgs(cu, int(max_len), scale, window, softcap, sinks, dropout), q)


def _op_lse_kernels(q, args: AttnArgs, backend: str, owner: int):
    """The backend's LSE pair for the op's call, or None (its backward then recomputes the forward,
    and the op's LSE is empty). Decided from the backend setting, device, dtype and features alone,
    so the fake and the kernel agree."""
    return lse_kernels(q.device.type, q.dtype, args.needs, backend, owner)


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
    seed = torch.randint(2**62, (), dtype=torch.int64) if dropout else torch.zeros((), dtype=torch.int64)
    kernels = _op_lse_kernels(q, args, backend, owner)
    with torch.no_grad():
        if kernels is not None:
            out, lse = kernels.forward(q, k, v, args)
            lse = lse.to(lse_dtype(q.dtype)).reshape(q.shape[1:3]).contiguous()
        else:
            run = (max_len, scale, window, softcap, dropout, backend, owner)
            out, lse = _run_op(q, k, v, cu, sinks, seed, *run), q.new_empty(0)
    out = out.transpose(1, 2).contiguous()
    if any(out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in (q, k, v)):
        out = out.clone()  # a custom op's output never aliases an input
    return out, lse.to(lse_dtype(q.dtype)), seed


@_varlen_op.register_fake
def _(q, k, v, cu, sinks, max_len, scale, window, softcap, dropout, backend, owner):
    args = AttnArgs(cu, max_len, scale, window, softcap, sinks, dropout)
    has_lse = _op_lse_kernels(q, args, backend, 0) is not None  # decided here, not run: nothing to record
    out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    lse = q.new_empty(q.shape[1:3] if has_lse else (0,), dtype=lse_dtype(q.dtype))
    return out, lse, torch.empty((), dtype=torch.int64)


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
        kernels = lse_kernels(q.device.type, q.dtype, args.needs, backend, owner)
        grads = kernels.backward(grad, q, k, v, out.transpose(1, 2), lse, args)
    else:
        run = (max_len, scale, window, softcap, dropout, backend, owner)
        grads = _recomputed_grads(grad, q, k, v, cu, sinks, seed, *run)
    dsinks = grads[3] if sinks is not None else q.new_empty(0)
    inputs = (grad, q, k, v, cu, sinks, out, lse, seed)
    return (*(_in_kernel_layout(g, x, inputs) for g, x in zip(grads[:3], (q, k, v))), dsinks.contiguous())


def kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped as ``x`` ([1, H, T, D]) laid out as the varlen kernels write their
    gradients: [1, T, H, D] in memory (their [T, H, D], the model's own q/k/v layout too)."""
    return x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2)


def _in_kernel_layout(g: torch.Tensor, like: torch.Tensor, inputs) -> torch.Tensor:
    """``g`` as the backward op returns it (its fake's strides): the kernel's own tensor where its layout
    is already that (the flash-attn kernels, torch's varlen, the CPU kernels on the model's layout), a
    copy only otherwise (a head dim padded for flash-attn 2, repeated K/V heads summed)."""
    b, h, t, d = like.shape
    strides = (t * h * d, d, h * d, 1)  # kernel_layout's
    same = g.shape == like.shape and all(a == s for a, s, n in zip(g.stride(), strides, g.shape) if n > 1)
    fresh = all(g.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for x in inputs if x is not None)
    if same and fresh and g.dtype == like.dtype and g.storage_offset() == 0:
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


def varlen_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
):
    """transformers attention function of a packed call: query [1, Hq, T, D], key/value [1, Hkv, T, D]
    (GQA not repeated) -> ([1, T, Hq, D], None), each document of ``cu_seq_lens_q`` attending to itself.
    When the call carries its level's SP group (``hbp_sp``) T is this rank's shard, and the level's SP
    kind (Ulysses: all-to-alls to 1/sp of the heads over the whole pack) runs it."""
    if query.shape[0] != 1:
        raise ValueError(f"{ATTN_NAME} takes one packed row per micro-batch, got batch size {query.shape[0]}")
    _unsupported(module, attention_mask, kwargs)
    record = getattr(module, "__dict__", {}).get(PREPARED)
    if cu_seq_lens_q is None and record is not None:
        call = calls.current(record)  # a family whose layers drop the keywords: the call's own
        if call is not None:
            cu_seq_lens_q, max_length_q = call.pack.get("cu_seq_lens_q"), call.pack.get("max_length_q")
            kwargs = {**call.pack, **kwargs}
    if cu_seq_lens_q is None:
        raise ValueError(
            f"{type(module).__name__} ran {ATTN_NAME} attention without the pack's document boundaries "
            "(cu_seq_lens_q), so its documents would attend to each other: this family's layers do not pass the "
            "attention keywords on, and lit-hbp cannot train it packed (docs/families.md). A model built with "
            f"attn_implementation={ATTN_NAME!r}: build it with its own attention and call lit_hbp.prepare_model"
        )
    sp = kwargs.get("hbp_sp")
    dtype = compute_dtype(query)
    query, key, value = (x.to(dtype) for x in (query, key, value))
    p = float(dropout) if module.training else 0.0
    backend, owner = (record.backend, record.owner) if record is not None else ("auto", 0)
    shard = kwargs.get("hbp_cp_shard")
    attend = Attend(cu_seq_lens_q, max_length_q, scaling, sliding_window, softcap, p, shard, backend, owner)
    if sp is not None:
        out = sp.kind.attend(query, key, value, s_aux, sp.ctx, attend)
    else:
        out = attend(query, key, value, s_aux)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, varlen_attention)
from lit_hbp.model.attention import tower  # noqa: E402,F401  (registers a vision tower's attention, calls.TOWER_NAME)
