"""A packed call of a prepared model, and nothing of it outside the call.

``prepare_model`` leaves a Hugging Face model as it was for every call but a packed one: its own
attention (sdpa, eager, flash ...) with transformers' masks, its KV cache and ``generate()``, its
ordinary ``labels=`` loss, its own gradient checkpointing. A packed call is recognised by what it
carries: the pack's document boundaries (``cu_seq_lens_q``: ``packed_loss``, ``model(**pack_inputs(batch))``,
Hugging Face's ``DataCollatorWithFlattening`` with its flash keywords), or, without them, positions
that restart inside one row (the same collator without them; any copy, slice or ``inputs_embeds`` of
a pack called with its positions): the boundaries are then read from the positions, as transformers'
own packed-sequence detection reads them.

For exactly the duration of such a call (``pack_scope``) the call is this thread's ``PackCall``
(``lit_hbp.model.calls``): the model's configs name lit-hbp's varlen attention on this thread only, its
decoder layers are checkpointed as the batch's level says (inputs on the host with ``offload``), a
vision-language model's tower blocks all of them when the level checkpoints any (a block keeps per
image patch what a decoder layer keeps per token), and its MLPs run in the level's tiles. A
checkpointed layer recomputes in the backward, after the call returned, maybe on another thread: the
checkpoint function enters the same call around the recomputation. So a
pack lives as long as its call and its autograd graph; another thread's calls, another model built
from the same config and later calls see nothing of it. The one thing a call sets on the model are the
layers' checkpointing flags, while any packed call of the model runs (counted over threads): a plain
call of the model on another thread meanwhile finds the call-aware checkpoint function, which runs it
as the model's own flags say.

A packed call makes no cache (``use_cache`` off for it: a cache made of a pack would carry one
document's state into the next, and a pack cannot be continued as one row), and a model whose forward
drops the boundaries before its decoder (Mamba's, Mamba2's, FalconMamba's) has them handed over by its hook.

How a call is recognised as packed, and what such a call refuses: ``lit_hbp.model.call_hooks``. Torch's own
activation checkpointing of a decoder layer, which would recompute it after the call returned, is refused
(``lit_hbp.model.checkpoint_wrappers``).
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.checkpoint import checkpoint

from lit_hbp.data.batch import DOCS_MARK, PackedBatch
from lit_hbp.data.media_batch import TOKEN_KEYS
from lit_hbp.model import calls
from lit_hbp.model.checkpoint_wrappers import refuse_checkpoint_wrappers
from lit_hbp.model.compile_scope import replay_free_checkpoints, sizes_apart
from lit_hbp.model.mixers import holds_adapters, refuse_own_forwards, refuse_uncalled_adapters, whole_rows
from lit_hbp.model.offload import host_offload, offloaded_checkpoint
from lit_hbp.model.position_limits import check_position_limits
from lit_hbp.model.rope import rope_scope
from lit_hbp.model.tiling import install_tiling
from lit_hbp.parallel.context import sp_call

PREPARED = "_hbp_prepared"  # the Prepared record, on the model, its decoder, its attention modules and MLPs
PACK_KEYS = ("cu_seq_lens_q", "max_length_q", "hbp_cp_shard", "hbp_sp")  # what attention needs of a packed call
_owners = itertools.count(1)
_by_owner: weakref.WeakValueDictionary[int, Prepared] = weakref.WeakValueDictionary()


@dataclass(eq=False)
class Prepared:
    """What ``prepare_model`` did to a model: to apply per packed call and to undo (``unprepare_model``)."""

    net: torch.nn.Module  # the Hugging Face model itself
    decoder: torch.nn.Module  # its (language) decoder: hidden states of the token sequence
    runner: torch.nn.Module  # what packed_loss calls: the decoder, or a vision-language model's inner model
    configs: list  # every config its modules read, with the attention implementation it has outside a pack
    layers: list[torch.nn.Module]  # decoder layers that can checkpoint, in order
    blocks: list[torch.nn.Module]  # the vision tower's blocks that can checkpoint (none: a text-only model)
    tower_configs: list  # configs only the vision tower reads (their packed-call attention: causal_lm.tower_names)
    mlps: list[torch.nn.Module | None]  # each layer's tileable MLP (None where it has none)
    attends: list[list[torch.nn.Module]]  # each layer's modules that may call the attention function
    mixers: list[torch.nn.Module] = field(default_factory=list)  # stateful token mixers run document by document
    backend: str = "auto"  # the attention backend of its packed calls (``lit_hbp.model.attention.backends``)
    owner: int = field(default_factory=lambda: next(_owners))  # names its calls in ``attention.choices``
    hooks: list = field(default_factory=list)
    own: list | None = None  # layers' and blocks' own (checkpointing flag, function, dict flag) while packed calls run
    active: int = 0  # packed calls of the model running now, on any thread
    said_own_ckpt: bool = False
    was_eval: bool = False  # every module in eval mode before prepare_model put it in train mode (unprepare: back)
    tower_said: set = field(default_factory=set)  # (device, dtype) the tower's attention in packed calls was logged for
    compiled: tuple | None = None  # (compile context, the decoder compiled with it) for a compiled model
    lock: threading.Lock = field(default_factory=threading.Lock)
    # what its packed calls ran: (device, dtype, features) -> [backend, why, backward] (``attention.choices``)
    ran: dict = field(default_factory=dict)
    # one object for every layer, so compiled layers share their graphs: the MLPs' ``tiles_of`` and the
    # layers' checkpoint function while packed calls run
    tiles_of: Any = None
    checkpoint: Any = None
    # (rope type, length) of a rotary embedding that rescales by the call's longest position (``rescaling_limit``,
    # ``rope.rope_scope``)
    rope_limit: tuple[str, int] | None = None
    # lengths past which its attention takes positions from the call's row (``position_limits``)
    position_limits: tuple = ()
    # its layers route functions through ``kernels`` per model, setting a context variable in their forward
    # (``compile_scope.kernel_routing``): compiled checkpoints then need ``compile_scope.replay_free_checkpoints``
    routes_kernels: bool = False

    def __post_init__(self) -> None:
        _by_owner[self.owner] = self
        if self.tiles_of is None:
            self.tiles_of = partial(current_tiles, self)
        if self.checkpoint is None:
            self.checkpoint = partial(_checkpoint, self)

    def __getstate__(self) -> dict:
        """Pickled between calls: no lock, no call in flight, no compiled code (a loaded copy has its own)."""
        skip = ("lock", "own", "active", "owner", "compiled", "ran", "tower_said")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict) -> None:
        """A prepared model loaded in another process: its packed calls need the config's routing there too."""
        fresh = dict(lock=threading.Lock(), own=None, active=0, owner=next(_owners), compiled=None, ran={})
        self.__dict__.update(state, **fresh, tower_said=set())
        _by_owner[self.owner] = self
        for config in [c for c, _ in self.configs] + self.tower_configs:
            calls.install(type(config))


def record_by_owner(owner: int) -> Prepared | None:
    """The record of the prepared model numbered ``owner`` (what a packed call's custom op carries), or
    None once that model is gone."""
    return _by_owner.get(owner)


WRAPPER_ROUTED = ("POLY", "XLORA")  # peft adapters that PeftModel.forward routes (task_ids, X-LoRA's classifier)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside ``torch.compile``'s and peft's wrappers. A peft prompt-learning adapter
    (prompt, prefix, p-tuning) is refused: its virtual tokens are added in the wrapper's own forward, which a
    packed call of the model inside never runs (its prompt would neither act nor train)."""
    model = getattr(model, "_orig_mod", model)
    if not hasattr(model, "get_base_model"):
        return model
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        kind = getattr(config.peft_type, "value", config.peft_type)
        raise ValueError(
            f"{type(model).__name__}: peft's {kind} adds virtual tokens in the wrapper's own forward, which a packed "
            "call never runs: its prompt would not train; use LoRA or another adapter on the model's layers"
        )
    kind = getattr(getattr(config, "peft_type", None), "value", None)
    if kind in WRAPPER_ROUTED:
        raise ValueError(
            f"{type(model).__name__}: peft's {kind} routes each call by what the wrapper's own forward is given "
            "(task_ids, or a classifier pass), which a packed call never runs; use LoRA or another adapter on the "
            "model's layers"
        )
    if getattr(config, "alora_invocation_tokens", None):
        raise ValueError(
            f"{type(model).__name__}: activated LoRA (alora_invocation_tokens) finds each call's invocation in the "
            "wrapper's own forward, which a packed call never runs: it would train as plain LoRA; use plain LoRA"
        )
    return model.get_base_model()


def record_of(model: torch.nn.Module) -> Prepared | None:
    return unwrapped(model).__dict__.get(PREPARED)


def _layer_of(fn) -> Any:
    """The layer whose forward a checkpoint function runs (transformers passes it bound, as a partial's
    first argument or its method's owner)."""
    return fn.args[0] if getattr(fn, "args", None) else getattr(getattr(fn, "func", None), "__self__", None)


def _own_flags(prepared: Prepared, fn) -> tuple[bool, object]:
    """The (checkpointing flag, function) the project gave the layer or tower block that ``fn`` runs."""
    layer = _layer_of(fn)
    index = next((i for i, x in enumerate([*prepared.layers, *prepared.blocks]) if x is layer), None)
    if prepared.own is None or index is None:
        return False, None
    return prepared.own[index][:2]


def current_tiles(prepared: Prepared) -> int:
    """The MLP tiles of the model's packed call on this thread (1 outside one)."""
    call = calls.current(prepared)
    return call.tiles if call is not None else 1


def _checkpoint(prepared: Prepared, fn, *args):
    """A flagged layer's checkpoint function while packed calls of the model run (one for all layers:
    a layer's index read here would be a guard of compiled layers, one graph per layer). In this
    thread's packed call: checkpointed, offloaded as the call says, the recomputation entering the call
    again; the layer is flagged by this call's level, the project, or a deeper level another thread
    runs now (then it recomputes too: the same numbers). In a plain call on another thread: what the
    layer's own flags say."""
    call = calls.current(prepared)
    if call is None:
        own_flag, own_func = _own_flags(prepared, fn)
        return own_func(fn, *args) if own_flag and own_func is not None else fn(*args)
    block = any(_layer_of(fn) is b for b in prepared.blocks)  # a tower block: its own attention, its input kept

    def run(*inputs):  # decided as it runs: a layer whose graph breaks (router logits, a per-document convolution)
        # checkpoints eagerly from compiled code, and its recomputation in the backward runs outside the call
        if torch.compiler.is_compiling() and call.tiles == 1 and not block:
            return fn(*inputs)  # traced into the graph: its compiled backward recomputes without Python
        with calls.entered(call, route=not block):  # eager (tiled MLPs break the graph): it enters the call
            return fn(*inputs)

    if call.offload is None or block:
        return checkpoint(run, *args, use_reentrant=False)
    return offloaded_checkpoint(call.offload, run, *args)


@contextlib.contextmanager
def _layer_flags(prepared: Prepared, ckpt_layers: int | None) -> Iterator[None]:
    """While packed calls of the model run (counted over threads): every layer's and tower block's
    checkpoint function is the call-aware one, and the first ``ckpt_layers`` layers (the most any running
    call asks for), with every tower block when that is one or more, are flagged for checkpointing besides
    those the project flagged; the layers' and blocks' own after the last call."""
    every = [*prepared.layers, *prepared.blocks]
    with prepared.lock:
        if prepared.active == 0:
            prepared.own = [  # (flag, function, the flag in the layer's own dict: None where it is its class's)
                (
                    layer.gradient_checkpointing,
                    layer.__dict__.get("_gradient_checkpointing_func"),
                    layer.__dict__.get("gradient_checkpointing"),
                )
                for layer in every
            ]
            for layer in every:
                layer._gradient_checkpointing_func = prepared.checkpoint
        for layer in [*prepared.layers[: ckpt_layers or 0], *(prepared.blocks if ckpt_layers else [])]:
            layer.gradient_checkpointing = True
        prepared.active += 1
    try:
        yield
    finally:
        with prepared.lock:
            prepared.active -= 1
            if prepared.active == 0:
                for layer, (flag, func, own) in zip(every, prepared.own):
                    if own is None:  # the class's flag, as before: a flag left in the instance is a new guard
                        layer.__dict__.pop("gradient_checkpointing", None)
                    else:
                        layer.gradient_checkpointing = flag
                    if func is None:
                        layer.__dict__.pop("_gradient_checkpointing_func", None)
                    else:
                        layer._gradient_checkpointing_func = func
                prepared.own = None


@contextlib.contextmanager
def pack_scope(
    model: torch.nn.Module,
    ckpt_layers: int | None = None,
    offload: bool = False,
    tiles: int = 1,
    pack: dict | None = None,
    tower: dict | None = None,
    bounds: tuple[int, ...] | None = None,
) -> Iterator[None]:
    """The duration of one packed call of a prepared model (``pack``: its keywords, ``pack_inputs``):
    varlen attention, the first ``ckpt_layers`` decoder layers checkpointed (None: as the project set
    them; a project's own ``gradient_checkpointing_enable()`` keeps every layer checkpointed), their
    inputs on the host with ``offload``, the MLPs in ``tiles``, a vision tower's configs naming ``tower``'s
    attention while it encodes the call's images (``causal_lm.tower_names``; none: their own), the pack's
    document ``bounds`` on the host where the caller has them (``PackedBatch.bounds``: a stateful mixer then
    reads nothing back from the device); on this thread, for this call only. Graphs compiled during the call
    give each size a symbol of its own and, for layers routing kernels, trace their checkpoints whole (torch's
    settings, process-wide for the call's duration: ``compile_scope``)."""
    prepared = record_of(model)
    if prepared is None:
        raise ValueError("pack_scope: call lit_hbp.prepare_model(model) first")
    refuse_checkpoint_wrappers(prepared.net, prepared.layers)  # torch's own: it would recompute outside the call
    if any("forward" in m.__dict__ for m in prepared.mixers):  # kernelized after prepare_model: named, refused
        ids = {id(m) for m in prepared.mixers}
        refuse_own_forwards({name: m for name, m in prepared.decoder.named_modules() if id(m) in ids})
    if holds_adapters(prepared.mixers):  # LoRA put on a mixer's convolution after prepare_model: named, refused
        ids = {id(m) for m in prepared.mixers}
        refuse_uncalled_adapters({name: m for name, m in prepared.decoder.named_modules() if id(m) in ids})
    refuse_length_scaled_noise(prepared.net)
    layers, mlps = prepared.layers, prepared.mlps
    if ckpt_layers is not None:
        if isinstance(ckpt_layers, bool) or not isinstance(ckpt_layers, numbers.Integral) or ckpt_layers < 0:
            raise ValueError(f"ckpt_layers must be a whole number of decoder layers >= 0, got {ckpt_layers!r}")
        if ckpt_layers > len(layers):
            raise ValueError(f"ckpt_layers {ckpt_layers} exceeds the model's {len(layers)} decoder layers")
        ckpt_layers = int(ckpt_layers)
    if offload and not ckpt_layers:
        raise ValueError("offload keeps the checkpointed layers' inputs on the host: it needs ckpt_layers > 0")
    if isinstance(tiles, bool) or not isinstance(tiles, numbers.Integral) or tiles < 1:
        raise ValueError(f"mlp_tiles must be a positive int, got {tiles!r}")
    tiles = int(tiles)
    if tiles > 1:
        for i, (layer, mlp) in enumerate(zip(layers, mlps)):
            if mlp is None:
                own = getattr(layer, "mlp", None)
                why = (
                    f"its mlp is a {type(own).__name__}: mixture-of-experts blocks route tokens and feed the router "
                    "loss, some families' MLPs take more than the hidden states"
                    if own is not None
                    else "it names its feed-forward block otherwise than mlp"
                )
                raise ValueError(
                    f"mlp_tiles {tiles}: decoder layer {i} ({type(layer).__name__}) has no token-wise MLP lit-hbp can "
                    f"tile ({why}); use mlp_tiles 1 for this model"
                )
            install_tiling(mlp, prepared.tiles_of)  # again if an integration (Liger) rebound it
    if ckpt_layers is not None and ckpt_layers < len(layers) and not prepared.said_own_ckpt:
        if any(layer.gradient_checkpointing for layer in layers) and prepared.active == 0:
            prepared.said_own_ckpt = True
            rank_zero_info(
                f"the model's own gradient checkpointing is on (gradient_checkpointing_enable): packed calls "
                f"checkpoint the layers it checkpoints, not only the level's first {ckpt_layers}"
            )
    ids = (pack or {}).get("input_ids")
    documents = ids.__dict__.get(DOCS_MARK) if isinstance(ids, torch.Tensor) else None
    positions = (pack or {}).get("position_ids")
    pack = {} if pack is None else {k: pack[k] for k in PACK_KEYS if pack.get(k) is not None}
    rope = rope_scope(model, prepared.rope_limit, pack, documents)  # refused here, before the call
    pack.update(check_position_limits(prepared.position_limits, pack, bounds, documents, positions))
    offloader = host_offload(unwrapped(model)) if offload else None
    host = {"bounds": list(bounds)} if bounds is not None else {}
    call = calls.PackCall(prepared, pack, ckpt_layers, offloader, tiles, dict(tower or {}), host)
    rows = whole_rows(prepared.configs, ids, positions)  # xLSTM's eval chunks: the pack whole, for the call
    replay_free = replay_free_checkpoints(prepared.routes_kernels)
    with _layer_flags(prepared, ckpt_layers), calls.entered(call), sizes_apart(), replay_free, rope, rows:
        yield


def refuse_length_scaled_noise(net: torch.nn.Module) -> None:
    """transformers' NEFTune hook on the input embeddings (``neftune_noise_alpha``: its Trainer's, TRL's) draws noise
    scaled by 1 / sqrt(row length x width): in a packed call the pack's length, not each document's (a 5-token
    document among 112 tokens got 4.7 times less noise than alone), so it is refused while it would act."""
    try:
        embeddings = net.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a model without one to name: nothing hooked there
        return
    if embeddings is None or not embeddings._forward_hooks or not embeddings.training:
        return
    for hook in embeddings._forward_hooks.values():
        if getattr(hook, "__name__", None) == "neftune_post_forward_hook":
            raise ValueError(
                f"{type(embeddings).__name__} holds transformers' NEFTune hook (neftune_noise_alpha "
                f"{getattr(embeddings, 'neftune_noise_alpha', None)}), which scales its noise by the row's length: in "
                "a packed call the pack's, not each document's; train without NEFTune (remove the hook, or "
                "neftune_noise_alpha: None)"
            )


def pack_inputs(batch: PackedBatch) -> dict:
    """The keywords of a packed call on ``batch`` (this rank's shard): token ids, per-document
    positions, the pack's document boundaries, ``use_cache=False`` and, under sequence parallelism,
    the level's SP group (``hbp_sp``) and context-parallel geometry. ``model(**pack_inputs(batch))``
    gives each document's logits as it alone would: on a prepared model through lit-hbp's attention;
    on an unprepared one (a frozen teacher) at sp 1 through transformers' own packed path, which the
    cache turned off lets run (its masks from the positions, or flash-attention's boundaries)."""
    cu = batch.cu_seqlens
    positions = batch.position_ids
    media = dict(batch.mm or {})
    if media and int(batch.sp) > 1:  # the whole pack's media travels with each shard: its per-token rows are cut
        part = batch.positions_in_pack().to(batch.input_ids.device)
        media = {k: v[..., part] if k in TOKEN_KEYS or k == "position_ids" else v for k, v in media.items()}
    if "position_ids" in media:  # multimodal RoPE: [text row, 3 rows], as transformers' packed path reads them
        positions = torch.cat([positions[None], media.pop("position_ids")], dim=0)
    kw = dict(
        input_ids=batch.input_ids,
        position_ids=positions,
        **media,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=batch.max_seqlen,
        max_length_k=batch.max_seqlen,
        use_cache=False,
    )
    sp = sp_call(batch)
    if sp is not None:
        kw["hbp_sp"] = sp
    if batch.cp_shard is not None:
        kw["hbp_cp_shard"] = batch.cp_shard
    return kw
