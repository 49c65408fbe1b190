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

Refused instead of trained wrong: a pack's token ids (``PackedBatch.input_ids``, which carry the
pack's segment count, ``PACK_MARK``) called with neither boundaries nor positions, or with an attention
mask and no boundaries (transformers reads a masked row as one sequence); an attention mask
with zeros, or a KV cache, in a packed call; the model's own loss (``labels=``) on a pack whose labels
are lit-hbp's pre-shifted ones, whose documents' first labels are not the ignore index (the loss's shift would
train one document's last token on the next one's first), or under sequence parallelism; a model whose
forward drops a pack's positions before a decoder that takes them; torch's own activation checkpointing of a
decoder layer, which recomputes it after the call returned (``lit_hbp.model.checkpoint_wrappers``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
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

from lit_hbp.data.batch import DOCS_MARK, PACK_MARK, SP_MARK, PackedBatch
from lit_hbp.data.media_batch import TOKEN_KEYS
from lit_hbp.model import calls
from lit_hbp.model.checkpoint_wrappers import refuse_checkpoint_wrappers
from lit_hbp.model.compile_scope import replay_free_checkpoints, sizes_apart
from lit_hbp.model.mixers import refuse_own_forwards, whole_rows
from lit_hbp.model.offload import host_offload, offloaded_checkpoint
from lit_hbp.model.position_limits import check_position_limits
from lit_hbp.model.rope import rope_scope
from lit_hbp.model.tiling import install_tiling
from lit_hbp.model.vision import attends_both_ways, has_batch_norms, refuse_batch_statistics, refuse_bidirectional
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


def boundaries_from_positions(position_ids: torch.Tensor) -> dict | None:
    """``cu_seq_lens_q`` / ``max_length_q`` of a one-row pack whose positions restart (a step other
    than +1 starts a document, as transformers' ``find_packed_sequence_indices`` reads them), or None
    for one sequence. Reads the starts back from the device once."""
    if position_ids.dim() == 3 and position_ids.shape[0] == 4:  # multimodal RoPE: row 0 is the text row
        position_ids = position_ids[0]
    if position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] < 2:
        return None
    p = position_ids[0]
    starts = (torch.nonzero(torch.diff(p) != 1).flatten() + 1).tolist()
    if not starts:
        return None
    cu = [0, *starts, int(p.numel())]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=p.device)
    return dict(cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t, max_length_q=max(b - a for a, b in zip(cu, cu[1:])))


def _packed_keywords(kwargs: dict, args: tuple = ()) -> dict | None:
    """The boundary keywords of a call, given or read from restarting positions; None for a plain call (a
    batch of several rows whose positions restart as transformers broadcasts them: each row attends as one)."""
    if kwargs.get("cu_seq_lens_q") is not None:
        return {k: kwargs[k] for k in ("cu_seq_lens_q", "max_length_q") if k in kwargs}
    if kwargs.get("attention_mask") is not None or _cache_of(kwargs) is not None:
        return None  # a padded batch or a decoding step: transformers' own masks and cache
    pos = kwargs.get("position_ids")
    rows = kwargs.get("input_ids")
    rows = rows if rows is not None else kwargs.get("inputs_embeds")  # a VLM's language model: input_ids=None
    rows = rows if rows is not None else next((a for a in args[:1] if isinstance(a, torch.Tensor)), None)
    if isinstance(rows, torch.Tensor) and rows.dim() >= 2 and rows.shape[0] > 1:
        return None
    return boundaries_from_positions(pos) if isinstance(pos, torch.Tensor) else None


def _cache_of(kwargs: dict):
    return kwargs.get("past_key_values", kwargs.get("cache"))


def _check_packed_call(where: str, kwargs: dict) -> None:
    """What a packed call cannot honour: a KV cache, an attention mask other than all ones (one that pads
    inside the pack, a 4-D or per-layer mask of the caller's own: the boundaries decide what attends)."""
    cache = _cache_of(kwargs)
    if cache is not None and (not hasattr(cache, "get_seq_length") or cache.get_seq_length() > 0):
        raise ValueError(
            f"{where}: a packed call (document boundaries) with a KV cache of earlier tokens: a pack's documents "
            "start from nothing; call it without past_key_values"
        )
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise ValueError(
            f"{where}: a packed call with an attention_mask that has zeros: the boundaries (cu_seq_lens_q) say where "
            "documents end, and a mask cannot pad inside a pack; drop the attention_mask"
        )
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
        shape = f"a {mask.dim()}-D tensor" if isinstance(mask, torch.Tensor) else f"a {type(mask).__name__}"
        raise ValueError(
            f"{where}: a packed call with an attention_mask of its own ({shape}): lit-hbp's attention takes each "
            "document causally from the boundaries (cu_seq_lens_q) and would ignore it; drop the attention_mask"
        )


def install_call_hooks(prepared: Prepared) -> None:
    """The model's hooks: the decoder runs a call that carries a pack in a ``pack_scope`` (unless
    ``packed_loss`` opened one), and refuses a pack's token ids without boundaries or positions; the
    model refuses its own loss on a pack it would compute wrong, and hands a packed call's boundaries to its
    decoder where its forward does not (``_model_pack``)."""
    prepared.hooks = [
        prepared.decoder.register_forward_pre_hook(_enter_call, with_kwargs=True),
        prepared.decoder.register_forward_hook(_leave_call, with_kwargs=True, always_call=True),
        prepared.net.register_forward_pre_hook(_check_model_call, with_kwargs=True),
        prepared.net.register_forward_hook(_leave_model_call, with_kwargs=True, always_call=True),
    ]


def _takes(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module``'s forward has a parameter ``name`` (not only ``**kwargs``)."""
    return name in _parameters(type(module).forward)[0]


@functools.cache
def _parameters(forward) -> tuple[frozenset[str], bool]:
    """A forward's named parameters, and whether it takes ``**kwargs``."""
    params = inspect.signature(forward).parameters.values()
    return frozenset(p.name for p in params), any(p.kind is p.VAR_KEYWORD for p in params)


def _model_pack(prepared: Prepared, positions: Any = None) -> dict | None:
    """The boundaries of the packed call of the whole model this thread is running, if any: what its decoder
    gets when the model's forward drops them (Mamba's, Mamba2's and FalconMamba's pass their backbone neither
    positions nor boundaries), or, given the ``positions`` the model was called with, what they were read as
    (read from the device once a call, not again by the decoder)."""
    pending = getattr(calls._local, "model_packs", None)
    if not pending or pending[-1] is None or pending[-1][0] is not prepared:
        return None
    _, packed, called_with = pending[-1]
    return packed if positions is None or positions is called_with else None


@torch.compiler.disable  # host bookkeeping on real tensors, also inside a whole-model compile
def _enter_call(decoder: torch.nn.Module, args: tuple, kwargs: dict):
    prepared: Prepared = decoder.__dict__[PREPARED]
    entered = getattr(calls._local, "hooked", None)
    if entered is None:
        entered = calls._local.hooked = []
    entered.append(None)  # what the forward hook closes, also when this hook raises
    if calls.current(prepared) is not None:  # packed_loss's scope, or a recomputation inside it
        return None
    positions = kwargs.get("position_ids")
    packed = _model_pack(prepared, positions) if isinstance(positions, torch.Tensor) else None
    packed = packed or _packed_keywords(kwargs, args)
    if packed is None and (packed := _model_pack(prepared)) is not None:
        if _takes(decoder, "position_ids"):
            raise ValueError(
                f"{type(prepared.net).__name__} was called on a pack (restarting positions or document boundaries) "
                f"but its forward passed {type(decoder).__name__} neither, which would number the pack as one "
                "sequence: compute the loss with lit_hbp.packed_loss(model, batch)"
            )
    ids = kwargs.get("input_ids", args[0] if args else None)
    sp = ids.__dict__.get(SP_MARK, 1) if isinstance(ids, torch.Tensor) else 1  # a rank's shard of the pack
    if sp > 1 and kwargs.get("hbp_sp") is None and kwargs.get("hbp_cp_shard") is None:  # restarting or not
        raise ValueError(
            f"{type(decoder).__name__} was called on one rank's shard of a pack of sequence parallelism {sp} without "
            "its SP group, so the shard would attend only to itself: call the model with **lit_hbp.pack_inputs(batch)"
        )
    if packed is None:
        segments = ids.__dict__.get(PACK_MARK, 0) if isinstance(ids, torch.Tensor) else 0
        masked = kwargs.get("attention_mask") is not None  # transformers then attends over the row as one
        if segments > 1 and (kwargs.get("position_ids") is None or masked):
            without = "with an attention_mask but without their document boundaries"
            without = without if masked else "without their document boundaries or positions"
            raise ValueError(
                f"{type(decoder).__name__} was called on a packed micro-batch of {segments} segments {without}, so "
                "they would attend to each other: compute the loss with "
                "lit_hbp.packed_loss(model, batch), or call the model with **lit_hbp.pack_inputs(batch)"
            )
        return None
    _check_packed_call(type(decoder).__name__, kwargs)
    pack = {**kwargs, **packed}
    names, open_ended = _parameters(type(decoder).forward)
    kwargs = {**kwargs, **{k: v for k, v in packed.items() if open_ended or k in names}}
    kwargs.pop("attention_mask", None)
    if "use_cache" in names:  # a pack's documents cannot be continued as one row: no cache is made of it
        kwargs["use_cache"] = False
    scope = pack_scope(decoder, pack=pack)
    scope.__enter__()
    entered[-1] = scope
    return args, kwargs


@torch.compiler.disable  # host bookkeeping on real tensors, also inside a whole-model compile
def _leave_call(decoder: torch.nn.Module, args: tuple, kwargs: dict, output):
    scope = calls._local.hooked.pop()
    if scope is not None:
        scope.__exit__(None, None, None)
    return None


@torch.compiler.disable  # host bookkeeping on real tensors, also inside a whole-model compile
def _check_model_call(net: torch.nn.Module, args: tuple, kwargs: dict):
    """A packed call of the model as a whole: images or a prefix where its family attends both ways among
    them (``lit_hbp.model.vision.attends_both_ways``) are refused, and so is its own loss where it would be wrong;
    its boundaries are kept for its decoder's call (``_model_pack``) and no cache is made of it."""
    pending = getattr(calls._local, "model_packs", None)
    if pending is None:
        pending = calls._local.model_packs = []
    pending.append(None)  # what _leave_model_call takes off, also when this hook raises
    if attends_both_ways(net) is not None:
        if kwargs.get("hbp_sp") is not None or _packed_keywords(kwargs, args) is not None:
            refuse_bidirectional(net, kwargs)
    if has_batch_norms(net) and (kwargs.get("hbp_sp") is not None or _packed_keywords(kwargs, args) is not None):
        refuse_batch_statistics(net, kwargs)  # asked only of a model that has one: no read for any other
    _check_own_loss(net, args, kwargs)
    prepared = net.__dict__[PREPARED]
    if calls.current(prepared) is not None:
        return None
    packed = _packed_keywords(kwargs, args)
    if packed is None:
        return None
    pending[-1] = (prepared, packed, kwargs.get("position_ids"))
    if _takes(net, "use_cache"):
        return args, {**kwargs, "use_cache": False}
    return None


@torch.compiler.disable  # host bookkeeping on real tensors, also inside a whole-model compile
def _leave_model_call(net: torch.nn.Module, args: tuple, kwargs: dict, output):
    calls._local.model_packs.pop()
    return None


def _check_own_loss(net: torch.nn.Module, args: tuple, kwargs: dict):
    """The model's own loss (``labels=``) in a packed call: transformers shifts the labels by one over
    the whole row, which is each document's loss when the labels are ordinary (the token itself) and
    every document's first label is the ignore index (-100, or the call's ``ignore_index``), as
    ``DataCollatorWithFlattening`` makes them. lit-hbp's
    pre-shifted labels, other first labels, and any such loss under sequence parallelism (each rank would
    average its shard alone) are refused. One read-back from the device per call with labels."""
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor):
        return None
    sp = kwargs.get("hbp_sp")
    packed = _packed_keywords(kwargs, args) if sp is None else {}
    if packed is None:
        return None
    if sp is not None:
        raise ValueError(
            f"the model's own loss under sequence parallelism {sp.ctx.size} would average each rank's shard of the "
            "pack separately, not per token over the pack: compute it with lit_hbp.packed_loss(model, batch)"
        )
    if kwargs.get("shift_labels") is not None:
        return None  # the targets of each position, as given
    ids = kwargs.get("input_ids", args[0] if args else None)
    ignore = kwargs.get("ignore_index", -100)  # transformers' loss takes it as a keyword of the call
    cu = packed.get("cu_seq_lens_q")
    starts = cu[1:-1].long() if cu is not None else labels.new_zeros(0)
    row = labels[0]
    checks = [(row.index_select(0, starts.to(row.device)) == ignore).all()]
    if isinstance(ids, torch.Tensor) and ids.shape == labels.shape:
        ids = ids[0]
        checks.append(((row == ids) | (row == ignore)).all())
        checks.append(((row[:-1] == ids[1:]) | (row[:-1] == ignore)).all() & (row[-1] == ignore))
    verdict = torch.stack(checks).tolist()
    first_ok, ordinary, pre_shifted = (*verdict, True, False)[:3]
    if pre_shifted and not ordinary:
        raise ValueError(
            "labels= of this packed call are pre-shifted (labels[t] is the target of position t, as lit-hbp's "
            "batches have them) and transformers' loss would shift them again: pass shift_labels=batch.labels too "
            "(the targets as they are), or compute the loss with lit_hbp.packed_loss(model, batch)"
        )
    if not first_ok:
        raise ValueError(
            f"labels= of this packed call: a document's first label is not the ignore index {ignore}, so transformers' "
            "loss, which shifts the labels over the whole row, would train the previous document's last token to "
            f"predict it; set the first label of every document to {ignore} (DataCollatorWithFlattening does), or "
            "pass shift_labels"
        )
    return None
