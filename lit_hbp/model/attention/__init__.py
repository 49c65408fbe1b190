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

The kernel comes from ``lit_hbp.model.attention.backends``, chosen in ``dispatch``: per device, the dtype
the kernel runs in (the autocast dtype under autocast) and the features the layer needs (sliding window, soft-capping,
sinks, dropout), the fastest backend that can run it, or the one the model was prepared with
(``prepare_model(model, attn_backend=...)``: a setting of the model, not of the process). Each
model's choices, and why each faster backend was not taken, are logged the first time that model
makes such a call, and ``choices(model)`` lists them.

Compiled, the kernel call is the ``torch.library`` custom op ``hbp::varlen_attention_v4`` (``op``): a
compiled decoder layer sees one opaque op with a fake implementation (the output's shape and dtype) and
stays one graph on every backend, the per-document CPU loops included; backend choice, logging, imports
and host reads happen inside the op, at run time, never while tracing. The op keeps the kernel's LSE
where the backend has a backward kernel (``kernel.LseKernels``), and its backward op,
``hbp::varlen_attention_v4_backward``, runs that kernel; otherwise (Flex, dropout) it recomputes the
forward and differentiates it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from lit_hbp.data.batch import CPShard
from lit_hbp.model import calls
from lit_hbp.model.attention.backends import REGISTRY
from lit_hbp.model.attention.dispatch import (
    _attend,
    _on_device,
    backend_for,
    check_backend,
    choices,
    compute_dtype,
    lse_kernels,
    replay_rng,
)
from lit_hbp.model.attention.kernel import AttnArgs, call_needs
from lit_hbp.model.attention.op import _varlen_op
from lit_hbp.model.calls import ATTN_NAME
from lit_hbp.model.packed_call import PREPARED
from lit_hbp.model.position_limits import chunked_layer, scaled_layer

__all__ = [
    "ATTN_NAME",
    "REGISTRY",
    "Attend",
    "backend_for",
    "check_backend",
    "choices",
    "compute_dtype",
    "varlen_attention",
]


# Keywords transformers passes that carry nothing this function needs: cu_seq_lens_k/max_length_k
# equal the q ones for self-attention, position_ids were used for the rotary embedding.
IGNORED = frozenset(
    {"position_ids", "cu_seq_lens_k", "max_length_k", "use_cache", "cache_position", "output_router_logits"}
    | {"output_hidden_states"}  # the model records each layer's output itself: nothing for the attention to do
    | {"shift_labels", "num_items_in_batch", "ignore_index"}  # the loss's keywords, handed to every layer too
    | {"hbp_cp_shard", "hbp_sp"}  # read by varlen_attention itself
    | {"seq_idx"}  # DataCollatorWithFlattening's document index: the boundaries say the same
    # a vision-language model's token types and video timing, read for its positions before the layers; LLaVA-
    # OneVision-1.5 hands its language model every keyword it got (transformers' attention functions drop them)
    | {"mm_token_type_ids", "second_per_grid_ts"}
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
    asked = kwargs.get("output_attentions")  # else the config's, which transformers reads without passing it on
    if asked if asked is not None else getattr(getattr(module, "config", None), "output_attentions", False):
        raise NotImplementedError(f"{where} asks for attention weights, which {ATTN_NAME} does not compute")
    if kwargs.get("is_causal") is False:
        raise NotImplementedError(f"{where} asks for non-causal attention; {ATTN_NAME} is causal")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in IGNORED | CHECKED)
    if unknown:
        raise NotImplementedError(
            f"{where} passes the attention keyword(s) {unknown} that {ATTN_NAME} does not implement; training "
            "would silently differ from the model's own attention"
        )


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
        kernels = lse_kernels(q.device.type, q.dtype, call_needs(q, args), self.backend, self.owner)
        with torch.no_grad():
            if kernels is not None:
                return kernels.forward(q, k, v, args)
            with replay_rng(q.device, seed, active=bool(args.dropout)):
                return _attend(q, k, v, args, self.backend, self.owner), None

    def backward(self, grad, q, k, v, sinks, out, lse, seed: int, **geometry):
        """(dq, dk, dv, dsinks or None) of ``forward``'s output for the upstream gradient ``grad``."""
        args = self.ranges(q, sinks, **geometry)
        if lse is not None:
            kernels = lse_kernels(q.device.type, q.dtype, call_needs(q, args), self.backend, self.owner)
            return kernels.backward(grad, q, k, v, out, lse, args)
        with torch.enable_grad(), replay_rng(q.device, seed, active=bool(args.dropout)):
            leaves = [x.detach().requires_grad_() if x is not None else None for x in (q, k, v, sinks)]
            wrt = [x for x in leaves if x is not None]
            out = _attend(*leaves[:3], AttnArgs(**{**args.__dict__, "sinks": leaves[3]}), self.backend, self.owner)
            grads = torch.autograd.grad(out, wrt, grad, allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, wrt)]
        return (*grads[:3], grads[3] if sinks is not None else None)


def _own_positions(module, record, query, cu, max_len):
    """What a layer that takes positions from the call's row gets in a packed call so that each document has its
    own (``lit_hbp.model.position_limits``): a chunked layer the pack's boundaries cut into chunks, a layer that
    scales its queries by row position the ratio to its document's scale."""
    call = calls.current(record)
    if call is None:
        return query, cu, max_len
    chunks, scale = call.pack.get("hbp_chunks"), call.pack.get("hbp_query_scale")
    if chunks is not None and chunked_layer(module):
        cu, max_len = chunks
    if scale is not None and scaled_layer(module):
        query = (query * scale.to(query.device).view(1, 1, -1, 1)).to(query.dtype)
    return query, cu, max_len


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
    if cu_seq_lens_q is None and record is None:
        raise ValueError(
            f"{type(module).__name__} ran {ATTN_NAME} attention in a model lit_hbp.prepare_model did not prepare "
            f"(built with attn_implementation={ATTN_NAME!r}?): it attends only within a pack's document boundaries, "
            "and this call has none. Build the model with its own attention (sdpa, eager) and call "
            "lit_hbp.prepare_model(model): its packed calls then run this attention, every other call its own"
        )
    if cu_seq_lens_q is None:
        raise ValueError(
            f"{type(module).__name__} ran {ATTN_NAME} attention without the pack's document boundaries "
            "(cu_seq_lens_q), so its documents would attend to each other: this family's layers do not pass the "
            "attention keywords on, and lit-hbp cannot train it packed (docs/families.md)"
        )
    if record is not None and record.position_limits:  # layers that take positions from the row (Llama 4)
        query, cu_seq_lens_q, max_length_q = _own_positions(module, record, query, cu_seq_lens_q, max_length_q)
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
