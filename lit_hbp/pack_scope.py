"""A packed call of a prepared model, and nothing of it after the call.

``prepare_model`` leaves a Hugging Face model as it was for every call but a packed one: its own
attention (sdpa, eager, flash ...) with transformers' masks, its KV cache and ``generate()``, its
ordinary ``labels=`` loss, its own gradient checkpointing. A packed call is one that carries the
pack's document boundaries (``cu_seq_lens_q``): ``packed_loss`` passes them to the decoder, and a
project's own code passes them with ``model(**pack_inputs(batch))``. For exactly the duration of
such a call (``pack_scope``) the model's configs name lit-hbp's varlen attention, its decoder layers
are checkpointed as the batch's level says (inputs on the host with ``offload``) and its MLPs run in
the level's tiles; when the call ends, everything is as it was. A checkpointed layer recomputes in
the backward, after the call returned: its checkpoint function re-enters the attention and the tiles
for that recomputation, and the call's keywords (boundaries, CP shard) come back with the saved
inputs. So a pack lives as long as its call and its autograd graph, never in a global that a later
call could read.

A call of a packed micro-batch's token ids without the boundaries would run the pack as one
document: ``PackedBatch`` marks its ``input_ids`` (``PACK_MARK``, the pack's segment count) and the
decoder refuses such a call. Under ``torch.compile`` the checkpoint is traced as the family's own
(its recomputation is part of the compiled backward, which reads no config).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.checkpoint import checkpoint

from lit_hbp import attention
from lit_hbp.data.batch import PACK_MARK, PackedBatch
from lit_hbp.offload import HostOffload, host_offload, offloaded_checkpoint
from lit_hbp.parallel import context as sp_context
from lit_hbp.tiling import TILES, install_tiling

PREPARED = "_hbp_prepared"  # the Prepared record, on the model and on its decoder (a plain attribute)
PACK_KEYS = ("cu_seq_lens_q", "max_length_q", "hbp_cp_shard")  # what attention needs of a packed call


@dataclass(eq=False)
class Prepared:
    """What ``prepare_model`` did to a model, to apply per packed call and to undo (``unprepare_model``)."""

    decoder: torch.nn.Module
    configs: list  # every config its modules read, with the attention implementation it had
    layers: list[torch.nn.Module]  # decoder layers that can checkpoint, in order
    mlps: list[torch.nn.Module | None]  # each layer's tileable MLP (None where it has none)
    attends: list[list[torch.nn.Module]]  # each layer's modules that may call the attention function
    loss_function: object  # the model's own loss, before the pre-shifted-labels guard
    hooks: list = field(default_factory=list)  # the decoder's hook handles
    calls: list = field(default_factory=list)  # scopes the decoder's hooks entered: empty between calls
    said_own_ckpt: bool = False


def record_of(model: torch.nn.Module) -> Prepared | None:
    net = model.get_base_model() if hasattr(model, "get_base_model") else model
    return net.__dict__.get(PREPARED)


def _checkpointed(prepared: Prepared, layer: int, tiles: int, offload: HostOffload | None, pack, fn, *args):
    """Layer ``layer``'s checkpoint inside a packed call: its recomputation, which runs in the backward
    after the call returned, runs with the call's attention, tiles and pack again."""
    if torch.compiler.is_compiling():  # the compiled backward recomputes without Python
        run = fn
    else:

        def run(*inputs):
            with _attending(prepared, [layer], tiles, pack):
                return fn(*inputs)

    if offload is None:
        return checkpoint(run, *args, use_reentrant=False)
    return offloaded_checkpoint(offload, run, *args)


@contextlib.contextmanager
def _attending(prepared: Prepared, layers: list[int], tiles: int, pack: dict | None) -> Iterator[None]:
    """lit-hbp's attention on every config the model reads, and for ``layers``: their MLPs in ``tiles``
    and the call's ``pack`` (boundaries, CP shard) on their attention modules, for a family whose layers
    do not pass the attention keywords on; everything as it was after."""
    names = [config._attn_implementation_internal for config, _ in prepared.configs]
    mlps = [prepared.mlps[i] for i in layers if prepared.mlps[i] is not None]
    tiles_before = [mlp.__dict__.get(TILES) for mlp in mlps]
    attends = [m for i in layers for m in prepared.attends[i]]
    try:
        for config, _ in prepared.configs:
            config._attn_implementation_internal = attention.ATTN_NAME
        for mlp in mlps:
            install_tiling(mlp)  # again if something (Liger) bound another forward since prepare_model
            mlp.__dict__[TILES] = tiles
        if pack is not None:
            for m in attends:
                m.__dict__[attention.CALL_PACK] = pack
        yield
    finally:
        for (config, _), name in zip(prepared.configs, names):
            config._attn_implementation_internal = name
        for mlp, before in zip(mlps, tiles_before):
            if before is None:
                mlp.__dict__.pop(TILES, None)
            else:
                mlp.__dict__[TILES] = before
        for m in attends:
            m.__dict__.pop(attention.CALL_PACK, None)


@contextlib.contextmanager
def pack_scope(
    model: torch.nn.Module,
    ckpt_layers: int | None = None,
    offload: bool = False,
    tiles: int = 1,
    pack: dict | None = None,
) -> Iterator[None]:
    """The duration of one packed call of a prepared model (``pack``: its keywords, ``pack_inputs``):
    varlen attention, the first ``ckpt_layers``
    decoder layers checkpointed (None: as the project set them; a project's own
    ``gradient_checkpointing_enable()`` keeps every layer checkpointed), their inputs on the host with
    ``offload``, the MLPs in ``tiles``. Everything is restored when it ends, however it ends."""
    prepared = record_of(model)
    if prepared is None:
        raise ValueError("pack_scope: call lit_hbp.prepare_model(model) first")
    layers, mlps = prepared.layers, prepared.mlps
    if ckpt_layers is not None and ckpt_layers > len(layers):
        raise ValueError(f"ckpt_layers {ckpt_layers} exceeds the model's {len(layers)} decoder layers")
    if offload and not ckpt_layers:
        raise ValueError("offload keeps the checkpointed layers' inputs on the host: it needs ckpt_layers > 0")
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"mlp_tiles must be a positive int, got {tiles!r}")
    if tiles > 1:
        for i, (layer, mlp) in enumerate(zip(layers, mlps)):
            if mlp is None:
                raise ValueError(
                    f"mlp_tiles {tiles}: decoder layer {i} ({type(layer).__name__}) has no token-wise MLP lit-hbp can "
                    f"tile ({type(getattr(layer, 'mlp', None)).__name__}: mixture-of-experts blocks route tokens and "
                    "feed the router loss, some families' MLPs take more than the hidden states); use mlp_tiles 1 "
                    "for this model"
                )
    own = [(layer.gradient_checkpointing, layer.__dict__.get("_gradient_checkpointing_func")) for layer in layers]
    own_ckpt = any(flag for flag, _ in own)
    if own_ckpt and ckpt_layers is not None and ckpt_layers < len(layers) and not prepared.said_own_ckpt:
        prepared.said_own_ckpt = True
        rank_zero_info(
            f"the model's own gradient checkpointing is on (gradient_checkpointing_enable): packed calls checkpoint "
            f"the layers it checkpoints, not only the level's first {ckpt_layers}"
        )
    host = host_offload(model) if offload else None
    pack = None if pack is None else {k: pack[k] for k in PACK_KEYS if pack.get(k) is not None}
    with _attending(prepared, list(range(len(layers))), tiles, pack):
        try:
            for i, layer in enumerate(layers):
                if ckpt_layers is not None:
                    layer.gradient_checkpointing = own[i][0] or i < ckpt_layers
                layer._gradient_checkpointing_func = partial(_checkpointed, prepared, i, tiles, host, pack)
            yield
        finally:
            for layer, (flag, func) in zip(layers, own):
                layer.gradient_checkpointing = flag
                if func is None:
                    layer.__dict__.pop("_gradient_checkpointing_func", None)
                else:
                    layer._gradient_checkpointing_func = func


def pack_inputs(batch: PackedBatch) -> dict:
    """The keywords of a packed call of a prepared model on ``batch`` (this rank's shard): token ids,
    per-document positions, the pack's document boundaries and, with context parallelism, the shard's
    geometry. ``model(**pack_inputs(batch))`` gives each document's logits as it alone would; a
    frozen teacher or reference model called on a pack takes the same keywords."""
    ctx = sp_context.active()
    if int(batch.sp) != (ctx.size if ctx is not None else 1):
        raise ValueError(
            f"this micro-batch (level {batch.level}) is a shard for sequence parallelism {batch.sp} but the active SP "
            f"group has {ctx.size if ctx is not None else 1} rank(s): levels with sp > 1 train under "
            "lit_hbp.HBPStrategy, which activates each level's group"
        )
    cu = batch.cu_seqlens
    kw = dict(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=batch.max_seqlen,
        max_length_k=batch.max_seqlen,
    )
    if batch.cp_shard is not None:
        kw["hbp_cp_shard"] = batch.cp_shard
    return kw


def install_call_hooks(prepared: Prepared) -> None:
    """The decoder's hooks: a call with the pack's boundaries runs in a ``pack_scope`` (unless one is
    already open: ``packed_loss``'s), a call of a pack's token ids without them is refused."""
    decoder = prepared.decoder
    prepared.hooks = [
        decoder.register_forward_pre_hook(_enter_call, with_kwargs=True),
        decoder.register_forward_hook(_leave_call, with_kwargs=True, always_call=True),
    ]


def _enter_call(decoder: torch.nn.Module, args: tuple, kwargs: dict):
    prepared: Prepared = decoder.__dict__[PREPARED]
    if kwargs.get("cu_seq_lens_q") is not None:
        scope = None
        if prepared.configs[0][0]._attn_implementation_internal != attention.ATTN_NAME:
            scope = pack_scope(decoder, pack=kwargs)
            scope.__enter__()
        prepared.calls.append(scope)
        return None
    prepared.calls.append(None)
    ids = kwargs.get("input_ids", args[0] if args else None)
    segments = ids.__dict__.get(PACK_MARK, 0) if isinstance(ids, torch.Tensor) else 0
    if segments > 1:
        raise ValueError(
            f"{type(decoder).__name__} was called on a packed micro-batch of {segments} segments without their "
            "document boundaries, so they would attend to each other: compute the loss with "
            "lit_hbp.packed_loss(model, batch), or call the model with **lit_hbp.pack_inputs(batch)"
        )
    return None


def _leave_call(decoder: torch.nn.Module, args: tuple, kwargs: dict, output):
    scope = decoder.__dict__[PREPARED].calls.pop()
    if scope is not None:
        scope.__exit__(None, None, None)
    return None
