"""A Hugging Face causal LM as lit-hbp trains it (built by ``lit_hbp.model.build``): its output head
exactly as the family's own forward applies it, its router loss, its FLOPs; and the two functions a
Lightning module of one's own calls to train any such model on packs:

    from lit_hbp import prepare_model, packed_loss
    model = prepare_model(hf_model)   # varlen attention, per-level checkpointing; returns the model
    out = packed_loss(model, batch)   # out.loss (normalized, to backward), out.ce_sum, out.n_targets

``HBPLitModule`` trains through the same two functions.

lit-hbp runs the decoder itself and computes the loss from the hidden states (chunked, supervised
positions only), so whatever the family's ``ForCausalLM.forward`` does after the decoder must be
reproduced here: logit scaling (Cohere multiplies by ``logit_scale``, Granite divides by
``logits_scaling``), final soft-capping (Gemma 2/3), the router's load-balancing loss of
mixture-of-experts models. What is not known here is caught by the self-check at the start of fit
(``lit_hbp.model.selfcheck``), which compares against the family's own forward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import warnings
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_hbp.data.batch import PackedBatch
from lit_hbp.model import attention, calls
from lit_hbp.model.build import (
    _refusing_other_attention,
    base_of,
    build_on_meta,
    check_liger,
    checkpoint_layers,
    decoder_of,
    family_of,
    model_configs,
    tower_configs,
)
from lit_hbp.model.call_hooks import install_call_hooks
from lit_hbp.model.checkpoint_wrappers import refuse_checkpoint_wrappers
from lit_hbp.model.checks import model_config, rescaling_limit
from lit_hbp.model.compile_scope import kernel_routing
from lit_hbp.model.family_checks import refuse_unseen
from lit_hbp.model.head import check_output_head, output_head
from lit_hbp.model.loss import (
    NORMALIZERS,
    check_loss_function,
    chunked_cross_entropy,
    fused_linear_cross_entropy,
    token_scale,
    token_weights,
)
from lit_hbp.model.mixer_heads import spanning_values, split_heads
from lit_hbp.model.mixers import (
    install_per_document,
    refuse_stateful_mixers,
    stateful_mixers,
    uninstall_per_document,
)
from lit_hbp.model.offload import OFFLOADER, HostOffload
from lit_hbp.model.packed_call import (
    PREPARED,
    Prepared,
    pack_inputs,
    pack_scope,
    record_of,
)
from lit_hbp.model.param_counts import language_params, layer_matrices, matmul_params, norm_values
from lit_hbp.model.position_limits import position_limits
from lit_hbp.model.router_loss import check_router_loss, experts_of_model, router_aux_loss
from lit_hbp.model.sharded_units import refuse_whole_model_shards
from lit_hbp.model.sp_media import split_encoder_outputs
from lit_hbp.model.tiling import install_tiling, mlp_of, uninstall_tiling
from lit_hbp.model.vision import (
    check_encoder_outputs,
    check_record_placeholders,
    encoder_outputs,
    is_multimodal,
    refuse_batch_statistics,
    refuse_bidirectional,
    vision_tower,
    without_unread_text_row,
)
from lit_hbp.model_spec import ModelSpec


def prepare_model(model: torch.nn.Module, attn_backend: str | None = None) -> torch.nn.Module:
    """Make a Hugging Face causal LM (or its peft wrapper) train on lit-hbp's packs; returns it.

    Only packed calls change: those that carry a pack's document boundaries (``packed_loss``, or
    ``model(**pack_inputs(batch))``) run lit-hbp's varlen attention (every document attends only to
    itself, a level's sequence parallelism inside it) with the level's checkpointing, offload and MLP
    tiles, for the duration of the call (``lit_hbp.model.packed_call``). Every other call (padded batches
    with a mask, ordinary ``labels=``, the KV cache, ``generate()``) computes what the model computed
    before in the same mode. A model wholly in eval mode is put in train mode (``from_pretrained`` returns it so,
    which would train without dropout and without checkpointing: call ``.eval()`` to generate as before, where its
    config has dropout); one with any module in train mode keeps every module's mode
    (a frozen part put in eval stays so). A call of a pack's token ids without its
    boundaries, and ``labels=`` of a pack (pre-shifted: its loss would shift them again) are refused.
    A family whose own code does what a packed call cannot see is refused before anything is done to it
    (``lit_hbp.model.family_checks``: attention outside transformers' AttentionInterface, a window in the mask
    alone, positions its decoder numbers itself, weights between decoder and output layer). Token mixers that
    carry state along the sequence (Mamba, the gated delta rule, a short convolution, ...:
    ``lit_hbp.model.mixers``) run document by document in packed calls; a model holding one lit-hbp cannot run
    so is refused before anything is done to it.
    ``attn_backend``: the kernel of its packed calls (``auto``:
    the fastest that runs each kind of call; ``lit_hbp.model.attention.backends``), the model's own: another
    model keeps its own; None (the default) keeps a prepared model's, ``auto`` for one not yet prepared.
    ``unprepare_model`` (or ``with prepared(model):``) undoes it."""
    net = base_of(model)
    if not hasattr(net, "set_attn_implementation") or not hasattr(net, "config"):
        raise TypeError(f"prepare_model takes a Hugging Face causal LM (a PreTrainedModel), got {type(net).__name__}")
    if attn_backend is not None:
        attention.check_backend(attn_backend)
    refuse_checkpoint_wrappers(net)  # torch's own around decoder layers: it would recompute outside packed calls
    record = record_of(net)
    if record is not None:
        if attn_backend not in (None, record.backend):  # what its calls ran (attention.choices) is said again
            record.backend = attn_backend
            record.ran.clear()
            record.tower_said.clear()
        return train_unless_set(model)
    decoder = decoder_of(net)
    family = family_of(net)
    mixers = refuse_stateful_mixers(decoder, family)
    refuse_unseen(net, decoder, family, {m.path for m in mixers}, not is_multimodal(net))
    check_router_loss(net)
    check_z_loss(net)
    check_loss_function(net)
    runner = net.model if is_multimodal(net) else decoder
    check_output_head(net, runner)
    configs = model_configs(decoder)  # a vision-language model's vision tower keeps its own attention
    for config in configs:
        calls.install(type(config))
        if getattr(config, "use_bidirectional_attention", None) is True:
            raise ValueError(
                f"{type(net).__name__}: its config sets use_bidirectional_attention=True, so its tokens attend to "
                "later ones, which lit-hbp's causal attention per document does not compute: a pack would train wrong; "
                "set use_bidirectional_attention: false, or train another family (docs/families.md)"
            )
    own = {id(c): c._attn_implementation_internal for c in configs}
    with _refusing_other_attention(type(net).__name__):
        decoder.set_attn_implementation(attention.ATTN_NAME)
        if decoder.config._attn_implementation != attention.ATTN_NAME:
            raise KeyError(attention.ATTN_NAME)  # transformers only warned: the same refusal
    fallback = "sdpa" if getattr(decoder, "_supports_sdpa", False) else "eager"
    for config in configs:  # outside a pack: the attention it had (built with lit-hbp's: sdpa or eager)
        name = own[id(config)]
        config._attn_implementation_internal = fallback if name in (None, attention.ATTN_NAME) else name
    layers = checkpoint_layers(decoder)
    record = Prepared(
        net=net,
        decoder=decoder,
        runner=runner,
        configs=[(c, c._attn_implementation_internal) for c in configs],
        layers=layers,
        blocks=[] if vision_tower(net) is None else checkpoint_layers(vision_tower(net)),
        tower_configs=tower_configs(net, configs),
        mlps=[mlp_of(layer) for layer in layers],
        attends=[[m for m in layer.modules() if hasattr(m, "config")] for layer in layers],
        mixers=[decoder.get_submodule(m.path) for m in mixers],
        backend=attn_backend or "auto",
        rope_limit=rescaling_limit(decoder.config),
        position_limits=position_limits(decoder.config, decoder),
        routes_kernels=kernel_routing(layers),
    )
    for mlp in record.mlps:
        if mlp is not None:
            install_tiling(mlp, record.tiles_of)
    for mixer in record.mixers:
        install_per_document(mixer, functools.partial(calls.current, record))
    for module in {id(m): m for m in (net, decoder, record.runner, *(m for ms in record.attends for m in ms))}.values():
        module.__dict__[PREPARED] = record  # plain attributes: not in the state dict
    net.__dict__.setdefault(OFFLOADER, HostOffload())
    install_call_hooks(record)
    record.was_eval = not any(module.training for module in model.modules())
    return train_unless_set(model)


def train_unless_set(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in train mode when every module of it is in eval (as ``from_pretrained`` returns it); else each
    module's mode as its project set it (``model.train()`` would turn a frozen part's dropout back on)."""
    if not any(module.training for module in model.modules()):
        model.train()
    return model


def unprepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``prepare_model``: the model's own attention, loss, MLP forwards and checkpointing as they
    were, nothing of lit-hbp left on it (a project handing the model to code that expects it untouched), and the
    eval mode it was in where ``prepare_model`` put it in train mode (unless a module's mode was set since)."""
    net = base_of(model)
    record = record_of(net)
    if record is None:
        return model
    if record.active:
        raise RuntimeError("unprepare_model while a packed call of the same model runs")
    for handle in record.hooks:
        handle.remove()
    for config, name in record.configs:
        if config._attn_implementation_internal in (None, attention.ATTN_NAME):  # one the project set since: kept
            config._attn_implementation_internal = name
    for mlp in (m for m in record.mlps if m is not None):
        uninstall_tiling(mlp)
    for mixer in record.mixers:
        uninstall_per_document(mixer)
    net.__dict__.pop(OFFLOADER, None)
    for module in (net, record.decoder, record.runner, *(m for ms in record.attends for m in ms)):
        module.__dict__.pop(PREPARED, None)
    if record.was_eval and all(module.training for module in model.modules()):  # the train mode prepare_model set
        model.eval()
    return model


@contextlib.contextmanager
def prepared(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``with prepared(model):`` the model trains on packs inside, and is handed back as it was
    (attention, loss, each module's train/eval mode) when the block ends."""
    modes = [(module, module.training) for module in model.modules()]
    was_prepared = record_of(model) is not None
    prepare_model(model)
    try:
        yield model
    finally:
        if not was_prepared:
            unprepare_model(model)
        for module, training in modes:
            module.training = training


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers ``prepare_model`` found (checkpointed from the first)."""
    record = record_of(model)
    if record is None:
        raise ValueError(_not_prepared(model))
    return record.layers


def _not_prepared(model: torch.nn.Module) -> str:
    inner = getattr(model, "module", None)  # torch's DistributedDataParallel, Fabric's module wrapper
    if isinstance(inner, torch.nn.Module) and record_of(inner) is not None:
        return (
            f"{type(model).__name__} wraps a prepared model: packed_loss runs the model's decoder itself, outside the "
            "wrapper's forward, where DistributedDataParallel averages no gradient (packed_loss of its .module would "
            "train each rank on its own gradients): call packed_loss in a LightningModule's training_step (Lightning "
            "wraps that module, HBPStrategy / HBPDDPStrategy), or call the wrapper with **lit_hbp.pack_inputs(batch) "
            "and take the loss of its logits"
        )
    return (
        f"{type(base_of(model)).__name__} is not prepared for packs: its attention would let the documents of a "
        "pack attend to each other and cannot run a level's sequence parallelism: call "
        "lit_hbp.prepare_model(model) first"
    )


class PackedLoss(NamedTuple):
    """``packed_loss``'s result: ``loss`` (normalized, what to backward), ``ce_sum`` (the summed
    cross-entropy of this rank's shard, detached) and ``n_targets`` (its supervised tokens)."""

    loss: torch.Tensor
    ce_sum: torch.Tensor
    n_targets: int

    def mean_ce(self, batch: PackedBatch) -> torch.Tensor:
        """The token-mean cross-entropy of the whole pack of ``batch`` (this rank's shard and, under
        sequence parallelism, the other shards of its SP group: one all-reduce over the group), what to
        log; a device tensor, nothing read back."""
        stats = torch.stack([self.ce_sum.detach().float(), self.ce_sum.new_tensor(float(self.n_targets))])
        if batch.sp_group is not None:
            torch.distributed.all_reduce(stats, group=batch.sp_group.ctx.group)
        return stats[0] / stats[1].clamp(min=1.0)


def warn_liger_unfused(head, plain_head: bool, scale) -> None:
    """Said where ``liger=True`` cannot fuse the LM head with the cross-entropy (the chunked loss runs, same
    values; Liger's other kernels stay): shown once per reason by Python's warning filter."""
    why = []
    if not plain_head:
        why.append(f"the LM head is wrapped ({type(head.linear).__name__}: a LoRA adapter or a modules_to_save copy)")
    if not isinstance(scale, float):
        why.append("the token weights differ per token (loss sample_mean, or weights given)")
    if plain_head and head.scale != 1.0 and head.linear.bias is not None:
        why.append("the head has both a logit scale and a bias")
    warnings.warn(
        f"liger=True: Liger's fused linear cross-entropy is not used, since {' and '.join(why)}: the chunked "
        "cross-entropy computes the loss (the same values; Liger's other kernels still run)",
        stacklevel=3,
    )


def packed_loss(
    model: torch.nn.Module,
    batch: PackedBatch,
    loss: str | None = None,
    *,
    weights: float | torch.Tensor | None = None,
    ce_chunk_size: int = 1024,
    liger: bool = False,
    router_loss: bool = True,
    recompute: bool = True,
) -> PackedLoss:
    """The loss of a packed micro-batch (``batch``, this rank's shard under SP) through a model that
    ``prepare_model`` prepared, exactly as each of its documents alone would give it.

    It applies the batch's ``ckpt_layers``, ``offload`` and ``mlp_tiles``, checks the level's SP group
    is the active one, passes the document boundaries and per-document positions to the model's decoder,
    and runs the chunked cross-entropy over the supervised positions only (the labels are pre-shifted:
    position t predicts t + 1), weighted by the normalizer ``loss`` (``ave_token`` (default) |
    ``token_mean`` | ``sample_mean`` | ``sum``, ``lit_hbp.model.loss``) or by ``weights`` (not both). The
    family's router loss is added when its config asks for it (and ``router_loss``). ``liger``: Liger's fused linear
    cross-entropy on a CUDA GPU; ``recompute=False`` keeps each chunk's logits for the backward."""
    if not isinstance(batch, PackedBatch):
        raise TypeError(
            f"packed_loss takes a PackedBatch (HBPDataModule's micro-batches, or lit_hbp.pack_samples over your own "
            f"samples), got {type(batch).__name__}"
        )
    if loss is not None and weights is not None:
        raise ValueError(
            f"packed_loss takes a normalizer (loss={loss!r}) or weights, not both: weights replace the normalizer"
        )
    loss = "ave_token" if loss is None else loss
    if loss not in NORMALIZERS:
        raise ValueError(f"packed_loss's loss must be one of {NORMALIZERS}, got {loss!r}")
    number = isinstance(weights, numbers.Real) and not isinstance(weights, bool)
    if not (weights is None or torch.is_tensor(weights) or (number and math.isfinite(weights))):
        got = f"a {type(weights).__name__}" if not number else repr(weights)
        raise ValueError(f"packed_loss's weights: a finite number or a tensor of one per position, got {got}")
    if isinstance(weights, torch.Tensor):
        weights = weights[0] if weights.dim() == 2 and weights.shape[0] == 1 else weights  # labels' [1, T]
        if tuple(weights.shape) != (batch.input_ids.shape[1],):
            raise ValueError(
                f"packed_loss's weights: one per position of the pack (this rank's shard: {batch.input_ids.shape[1]}), "
                f"as [T] or the labels' [1, T], got shape {tuple(weights.shape)}"
            )
    if not isinstance(ce_chunk_size, numbers.Integral) or isinstance(ce_chunk_size, bool) or ce_chunk_size < 1:
        raise ValueError(
            f"packed_loss's ce_chunk_size (a loss chunk's tokens) must be an int >= 1, got {ce_chunk_size!r}"
        )
    ce_chunk_size = int(ce_chunk_size)  # numpy's integers too
    batch.check_untouched()
    net = base_of(model)
    record = record_of(net)
    if record is None:
        raise ValueError(_not_prepared(model))
    check_loss_function(net)  # also one replaced after prepare_model
    refuse_whole_model_shards(net, record.runner, net.get_output_embeddings())
    inputs = pack_inputs(batch)  # checks the level's SP group came with the batch
    if (axes := without_unread_text_row(net, inputs["position_ids"])) is not None:  # HunYuan-VL's axes alone
        inputs["position_ids"] = axes
    aux = router_loss and getattr(net.config.get_text_config(), "output_router_logits", False)
    if aux:
        check_router_loss(net)  # also a flag set after prepare_model: its router loss known, or refused here
    level = (batch.ckpt_layers, bool(batch.offload), batch.mlp_tiles)  # checked by pack_scope
    with pack_scope(net, *level, inputs, tower_names(record) if batch.mm else None, batch.bounds):
        if batch.mm and is_multimodal(net):  # images encoded apart, by the vision tower's own attention (split
            inputs = _encoded(record, batch, inputs)  # over the SP group), its blocks checkpointed as the level says
        # (a text model's token_type_ids, its segment embedding, go to the decoder with the ids)
        kw = {"output_router_logits": True} if aux else {}
        out = _decoder_call(model, record)(**inputs, **kw, **_as_dict(record.runner))
    hidden = out.last_hidden_state
    head = output_head(net)  # the model's own forward's scale and cap, not a compile or peft wrapper's
    scale = weights if weights is not None else token_scale(batch, loss)
    labels = batch.labels[0]
    plain_head = type(head.linear) is torch.nn.Linear  # not wrapped by an adapter
    fusable = plain_head and isinstance(scale, float) and (head.scale == 1.0 or head.linear.bias is None)
    if liger:
        check_liger()
        if not fusable:
            warn_liger_unfused(head, plain_head, scale)
    if liger and fusable:
        total, ce_sum, n = fused_linear_cross_entropy(hidden[0], head, labels, scale, batch.target_index)
    else:
        w = scale if scale is not None else token_weights(batch, loss)[0]
        total, ce_sum, n = chunked_cross_entropy(
            hidden[0], head.logits, labels, w, batch.target_index, ce_chunk_size, recompute
        )
    if aux:
        total = total + router_aux_loss(net, out.router_logits, batch)
    return PackedLoss(total, ce_sum, n)


def tower_names(prepared: Prepared) -> dict:
    """The attention a vision tower's configs name in a packed call of the model (config id -> transformers'
    implementation): the varlen flash one sharing the kernel the model's packed calls choose on its device
    and compute dtype (``backends.tower_attention``), so a tower encodes a pack's images in one call per
    layer; empty (its own attention) elsewhere, on a CPU, in fp32 and for a text-only model."""
    if not prepared.tower_configs:
        return {}
    weight = next(prepared.net.parameters())
    on = weight.device.type
    dtype = torch.get_autocast_dtype(on) if torch.is_autocast_enabled(on) else weight.dtype
    name = attention.backends.tower_attention(prepared.backend, on, dtype)
    if (on, dtype) not in prepared.tower_said:
        prepared.tower_said.add((on, dtype))
        rank_zero_info(f"vision tower attention in packed calls: {name or 'its own'} for {dtype} on {on}")
    return {} if name is None else {id(c): name for c in prepared.tower_configs}


def _encoded(record: Prepared, batch: PackedBatch, inputs: dict) -> dict:
    """The call's keywords with the pack's images and videos encoded (``mm_encoder_outputs``) in place of
    their pixels: each rank its share of them under SP (``split_encoder_outputs``). Inside the packed
    call (its tower blocks checkpoint as its level says), every config naming its own attention."""
    refuse_bidirectional(record.net, batch.mm)
    refuse_batch_statistics(record.net, batch.mm)
    check_encoder_outputs(record.runner)
    with calls.entered(calls.current(record), route=False):
        if int(batch.sp) > 1:
            part = batch.positions_in_pack().to(batch.input_ids.device)
            encoded = split_encoder_outputs(
                record.runner, batch.mm, batch.input_ids, part, int(batch.cu_seqlens[-1]), inputs["hbp_sp"]
            )
        else:
            encoded = encoder_outputs(record.runner, batch.mm)
            check_record_placeholders(record.runner.config, batch.media_items, batch.media_ids, batch.bounds, encoded)
    kept = {k: v for k, v in inputs.items() if k not in ("pixel_values", "pixel_values_videos")}
    return {**kept, "mm_encoder_outputs": encoded}


def _as_dict(runner: torch.nn.Module) -> dict:
    """``return_dict=True`` where the decoder's forward takes it: its outputs by name whatever the config's
    ``return_dict`` says (the model's own forward reads them by name too)."""
    return {"return_dict": True} if _takes_return_dict(type(runner)) else {}


@functools.cache
def _takes_return_dict(cls: type) -> bool:
    takes = inspect.signature(cls.forward).parameters
    return "return_dict" in takes or any(p.kind is p.VAR_KEYWORD for p in takes.values())


def _decoder_call(model: torch.nn.Module, record: Prepared):
    """The decoder as ``packed_loss`` runs it: compiled as the model was (``torch.compile(model)``:
    through the same compile settings; ``model.compile()``: its settings where torch keeps them
    reachable, else torch's defaults), since the decoder is called without the model's own forward."""
    decoder = record.runner
    ctx = getattr(model, "dynamo_ctx", None)  # torch.compile(model): an OptimizedModule
    if ctx is None and getattr(record.net, "_compiled_call_impl", None) is not None:  # model.compile()
        ctx = _compile_context(record.net._compiled_call_impl)
    if ctx is None:
        return decoder
    if record.compiled is None or record.compiled[0] is not ctx:
        record.compiled = (ctx, ctx(decoder) if callable(ctx) else torch.compile(decoder))
    return record.compiled[1]


def _compile_context(compiled) -> object:
    """The compile context ``torch.compile`` wrapped ``compiled`` with (its settings), found among the
    wrapper's closure cells; True when torch keeps it elsewhere (the decoder then gets the defaults)."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    for cell in getattr(compiled, "__closure__", None) or ():
        contents = cell.cell_contents
        if isinstance(contents, _TorchDynamoContext):
            return contents
    return True


def check_z_loss(net: torch.nn.Module) -> None:
    """A model whose own loss adds a z-loss of its logits (Bamba's ``z_loss_coefficient``: the mean square
    log-sum-exp over every position) is refused here (``prepare_model``): ``packed_loss`` computes the
    supervised tokens' cross-entropy only, so it would train without it."""
    config = net.config.get_text_config()
    coefficient = getattr(net, "z_loss_coefficient", getattr(config, "z_loss_coefficient", 0))  # the forward's own
    if coefficient:
        raise ValueError(
            f"{net.config.model_type}: z_loss_coefficient {coefficient} adds a z-loss of every position's logits to "
            "the model's own loss, which packed_loss does not compute: set z_loss_coefficient: 0"
        )


def configured_spec(model: Any) -> ModelSpec | None:
    """A model's shape (``model``: a checkpoint folder or config mapping) counted as ``model_spec`` counts a
    prepared model's, on the model built from its config on the meta device: its layers' matrices as they are
    (a mixture of experts' routed experts at top-k of all, an MLP of two matrices or three), a hybrid's mixers
    (found as ``prepare_model`` finds them), so the level search prices what the run trains. None for one that
    cannot be built here (the config's formula prices it: ``ModelSpec.from_config``). Its ``source`` is ``model``,
    on which a run's LoRA is counted (``param_counts.lora_settings``)."""
    config = model_config(model)
    if config is None:
        return None
    net = build_on_meta(config)
    if net is None:
        return None
    decoder = decoder_of(net)
    mixers = [decoder.get_submodule(m.path) for m in stateful_mixers(decoder)]
    return replace(model_spec(net, checkpoint_layers(decoder), mixers), source=model)


def model_spec(net: torch.nn.Module, layers: list[torch.nn.Module], mixers: list | None = None) -> ModelSpec:
    """The model's shape for FLOP counting, with the matmul parameters a token really passes through
    in a decoder layer counted from the layers' weights: every matrix once, routed experts at
    top-k / experts (shared experts and the router in full), a layer used twice (shared, looped) twice. Its
    parameters (``ModelSpec.counted_params``, ``total_layer_params``) count each tensor once, as
    ``net.parameters()`` does. A hybrid's stateful ``mixers`` (default: those ``prepare_model`` found) priced
    by what they hold. Raises ValueError when the config does not say the shape; a vision-language model's
    carries its tower's (``ModelSpec.vision``)."""
    config = net.config.get_text_config()  # a vision-language model's: its language model's
    vision = getattr(net.config, "vision_config", None)
    spec = ModelSpec.from_config({**config.to_dict(), **({"vision_config": vision.to_dict()} if vision else {})})
    tower = 0.0 if spec.vision is None else spec.vision.params(spec.hidden)  # priced apart: ``static_parts``
    spec = replace(spec, counted_params=language_params(net, tower))
    if not layers:
        return spec
    experts, top_k = experts_of_model(net)  # DBRX's from its ffn_config, as its router loss takes them
    active = total = 0.0
    held: set[int] = set()  # a tensor of a layer shared, looped or nested in another: its matrices counted once
    for layer in layers:
        for name, p in layer_matrices(layer):
            shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the full shape here
            if len(shape) < 2 or name.endswith("bias"):  # GPT-OSS's experts' biases: one row per expert
                continue
            n = float(torch.Size(shape).numel())
            total += 0.0 if id(p) in held else n
            held.add(id(p))
            fused = len(shape) == 3 and shape[0] == experts  # one matrix per expert (JetMoE's input_linear)
            routed = experts and top_k and ("experts" in name.split(".") or fused) and "shared" not in name
            active += n * top_k / experts if routed else n
    norms = sum(norm_values(layer, spec) for layer in layers) / len(layers)
    spec = replace(
        spec, active_layer_params=active / len(layers), total_layer_params=total / spec.layers, norm_values=norms
    )
    if mixers is None:
        record = record_of(net)
        mixers = [] if record is None else record.mixers
    if mixers:  # a hybrid: its attention where its layers hold one, its mixers
        heads = {split_heads(m) for m in mixers}
        spec = replace(
            spec,
            attention_layers=attending_layers(layers, mixers),
            mixer_layers=len(mixers),
            mixer_params=sum(map(matmul_params, mixers)) / len(mixers),
            mixer_heads=heads.pop() if len(heads) == 1 else None,
            mixer_spanning=max(map(spanning_values, mixers)),
        )
    return spec


def attending_layers(layers: list[torch.nn.Module], mixers: list[torch.nn.Module]) -> int:
    """How many of ``layers`` hold an attention module (a class named ``...Attention`` that is not one of the
    stateful ``mixers``, MiniMax's lightning attention or Kimi's delta attention)."""
    stateful = {id(m) for m in mixers}
    return sum(
        any(type(m).__name__.endswith("Attention") and id(m) not in stateful for m in layer.modules())
        for layer in layers
    )
