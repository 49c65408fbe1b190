"""A Hugging Face causal LM as lit-hbp trains it: built with the varlen attention, its decoder,
its output head exactly as the family's own forward applies it, its router loss, its FLOPs; and
the two functions a Lightning module of one's own calls to train any such model on packs:

    from lit_hbp import prepare_model, packed_loss
    model = prepare_model(hf_model)   # varlen attention, per-level checkpointing; returns the model
    out = packed_loss(model, batch)   # out.loss (normalized, to backward), out.ce_sum, out.n_targets

``HBPLitModule`` trains through the same two functions.

lit-hbp runs the decoder itself and computes the loss from the hidden states (chunked, supervised
positions only), so whatever the family's ``ForCausalLM.forward`` does after the decoder must be
reproduced here: logit scaling (Cohere multiplies by ``logit_scale``, Granite divides by
``logits_scaling``), final soft-capping (Gemma 2/3), the router's load-balancing loss of
mixture-of-experts models. What is not known here is caught by the self-check at the start of fit
(``lit_hbp.selfcheck``), which compares against the family's own forward.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lit_hbp import attention
from lit_hbp.checks import check_model_config, local_checkpoint
from lit_hbp.data.batch import PackedBatch
from lit_hbp.loss import chunked_cross_entropy, fused_linear_cross_entropy, token_scale, token_weights
from lit_hbp.model_spec import ModelSpec
from lit_hbp.offload import OFFLOADER, HostOffload, checkpoint_function, host_offload
from lit_hbp.parallel import context as sp_context
from lit_hbp.tiling import TILES, install_tiling, mlp_of

EXPERT_COUNT = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")


SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_token_ids(tokenizer) -> dict[str, int]:
    """The tokenizer's BOS, EOS and padding ids (those it has): what a model config must say so that
    generation stops and pads where the training data did."""
    ids = {name: getattr(tokenizer, name, None) for name in SPECIAL_TOKEN_IDS}
    return {k: int(v) for k, v in ids.items() if isinstance(v, int)}


def build_causal_lm(model: str | dict, vocab_size: int | None = None, tokenizer=None):
    """A causal LM from a local checkpoint folder, or randomly initialized from a config mapping
    (``{"model_type": "llama", "hidden_size": ...}``), whose BOS/EOS/padding ids, unless the mapping
    sets them, are the ``tokenizer``'s (a family's defaults name other tokens of another vocabulary).
    Uses the varlen attention and no KV cache. A family that does not run its attention through
    transformers' AttentionInterface is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(model, dict):
        check_model_config(model)  # a typo'd key would otherwise be ignored and the default trained
        cfg = dict(model)
        model_type = cfg.pop("model_type")
        if vocab_size is not None:
            cfg["vocab_size"] = vocab_size
        if tokenizer is not None:
            cfg = {**special_token_ids(tokenizer), **cfg}
        config = AutoConfig.for_model(model_type, **cfg)
        config.use_cache = False
        with _refusing_other_attention(model_type):
            net = AutoModelForCausalLM.from_config(config, attn_implementation=attention.ATTN_NAME)
    else:
        with _refusing_other_attention(str(model)):
            net = AutoModelForCausalLM.from_pretrained(
                local_checkpoint(model),
                attn_implementation=attention.ATTN_NAME,
                dtype=torch.get_default_dtype(),
                local_files_only=True,
            )
        net.config.use_cache = False
        if vocab_size is not None and vocab_size > net.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"the tokenizer has {vocab_size} tokens but {model} embeds only "
                f"{net.get_input_embeddings().num_embeddings}: use the checkpoint's tokenizer"
            )
    return net


@contextlib.contextmanager
def _refusing_other_attention(what: str):
    """transformers raises KeyError(attn name) for a model that does not dispatch through the
    AttentionInterface: say so, and what would work."""
    try:
        yield
    except KeyError as e:
        if e.args and e.args[0] == attention.ATTN_NAME:
            raise ValueError(
                f"{what}: this model does not run its attention through transformers' AttentionInterface, so "
                f"lit-hbp cannot give it packed (varlen) attention and refuses to train it rather than let the "
                "documents of a pack attend to each other. Families that work: llama, qwen2/3, mistral, gemma, "
                "phi3, olmo2, mixtral, ... (docs/families.md)"
            ) from None
        raise


LAYERS = "_hbp_layers"  # what prepare_model keeps on the model: its decoder layers, for checkpointing
MLPS = "_hbp_mlps"  # and each layer's tileable MLP (None where it has none), read once: not per micro-batch


def base_of(net: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model itself (under peft: the model the adapters wrap)."""
    return net.get_base_model() if hasattr(net, "get_base_model") else net


def prepare_model(model: torch.nn.Module) -> torch.nn.Module:
    """Make a Hugging Face causal LM (or its peft wrapper) train on lit-hbp's packs; returns it.

    Its attention becomes ``hbp_varlen`` (transformers' ``set_attn_implementation``): every document of a
    pack attends only to itself, and a level's sequence parallelism runs inside it. Its decoder layers
    get non-reentrant activation checkpointing, off until ``packed_loss`` applies a batch's
    ``ckpt_layers``; the KV cache is off; the model is put in train mode (``from_pretrained`` returns it
    in eval mode, which would train without dropout and without checkpointing). Its own loss refuses
    the pre-shifted labels it would shift again. A family whose attention does not go through
    transformers' AttentionInterface is refused: its documents would attend to each other."""
    net = base_of(model)
    if not hasattr(net, "set_attn_implementation") or not hasattr(net, "config"):
        raise TypeError(f"prepare_model takes a Hugging Face causal LM (a PreTrainedModel), got {type(net).__name__}")
    if net.config._attn_implementation != attention.ATTN_NAME:
        with _refusing_other_attention(type(net).__name__):
            net.set_attn_implementation(attention.ATTN_NAME)
        if net.config._attn_implementation != attention.ATTN_NAME:
            raise KeyError(attention.ATTN_NAME)  # transformers only warned: the same refusal
    net.config.use_cache = False
    model.train()
    layers = checkpoint_layers(net)
    for layer in layers:
        layer._gradient_checkpointing_func = checkpoint_function(None)
        layer.gradient_checkpointing = False
    mlps = [mlp_of(layer) for layer in layers]
    for mlp in mlps:
        if mlp is not None:
            install_tiling(mlp)
    net.__dict__[LAYERS] = layers  # plain attributes: not submodules, not in the state dict
    net.__dict__[MLPS] = mlps
    net.__dict__.setdefault(OFFLOADER, HostOffload())
    if not getattr(net.loss_function, "refuses_unshifted", False):
        net.loss_function = _pre_shifted(net.loss_function)
    return model


def _pre_shifted(loss_function):
    """The model's own loss (``model(..., labels=...)``), refusing the labels it would shift: a
    PackedBatch's labels are already shifted (``labels[t]`` is the target of position t), and
    transformers' causal-LM loss shifts ``labels`` again unless ``shift_labels`` is given."""

    def loss(*args, shift_labels=None, **kwargs):
        if shift_labels is None:
            raise ValueError(
                "the labels of lit-hbp's batches are already shifted (labels[t] is the target of position t) and "
                "transformers' loss would shift them again: compute the loss with lit_hbp.packed_loss(model, batch), "
                "or pass shift_labels=batch.labels to the model"
            )
        return loss_function(*args, shift_labels=shift_labels, **kwargs)

    loss.refuses_unshifted = True
    return loss


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers ``prepare_model`` found (checkpointed from the first)."""
    layers = base_of(model).__dict__.get(LAYERS)
    if layers is None:
        raise ValueError(_not_prepared(model))
    return layers


def set_checkpointing(model: torch.nn.Module, ckpt_layers: int, offload: bool = False) -> None:
    """Checkpoint the first ``ckpt_layers`` decoder layers of a prepared model, run the rest normally;
    with ``offload`` the checkpointed layers keep their inputs in host memory (``lit_hbp.offload``)."""
    layers = decoder_layers(model)
    if ckpt_layers > len(layers):
        raise ValueError(f"ckpt_layers {ckpt_layers} exceeds the model's {len(layers)} decoder layers")
    if offload and ckpt_layers == 0:
        raise ValueError("offload keeps the checkpointed layers' inputs on the host: it needs ckpt_layers > 0")
    func = checkpoint_function(host_offload(model) if offload else None)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < ckpt_layers
        layer._gradient_checkpointing_func = func


def set_mlp_tiles(model: torch.nn.Module, tiles: int) -> None:
    """Run every decoder layer's MLP of a prepared model in ``tiles`` tiles of the sequence
    (``lit_hbp.tiling``; 1: the family's MLP as it is). A model whose layers have no token-wise MLP
    (MoE blocks) is refused for tiles > 1."""
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"mlp_tiles must be a positive int, got {tiles!r}")
    layers = decoder_layers(model)
    for i, (layer, mlp) in enumerate(zip(layers, base_of(model).__dict__[MLPS])):
        if mlp is None:
            if tiles == 1:
                continue
            raise ValueError(
                f"mlp_tiles {tiles}: decoder layer {i} ({type(layer).__name__}) has no token-wise MLP lit-hbp can tile "
                f"({type(getattr(layer, 'mlp', None)).__name__}: mixture-of-experts blocks route tokens and feed the "
                "router loss, some families' MLPs take more than the hidden states); use mlp_tiles 1 for this model"
            )
        install_tiling(mlp)  # again if something (Liger) bound another forward since prepare_model
        mlp.__dict__[TILES] = tiles


def _not_prepared(model: torch.nn.Module) -> str:
    config = getattr(base_of(model), "config", None)
    attn = getattr(config, "_attn_implementation", None)
    return (
        f"{type(base_of(model)).__name__} runs {attn!r} attention, which would let the documents of a pack attend to "
        "each other and cannot run a level's sequence parallelism: call lit_hbp.prepare_model(model) first"
    )


class PackedLoss(NamedTuple):
    """``packed_loss``'s result: ``loss`` (normalized, what to backward), ``ce_sum`` (the summed
    cross-entropy of this rank's shard, detached) and ``n_targets`` (its supervised tokens)."""

    loss: torch.Tensor
    ce_sum: torch.Tensor
    n_targets: int


def packed_loss(
    model: torch.nn.Module,
    batch: PackedBatch,
    loss: str = "ave_token",
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
    ``token_mean`` | ``sample_mean`` | ``sum``, ``lit_hbp.loss``) or by ``weights``. The family's router
    loss is added when its config asks for it (and ``router_loss``). ``liger``: Liger's fused linear
    cross-entropy on a CUDA GPU; ``recompute=False`` keeps each chunk's logits for the backward."""
    if not isinstance(batch, PackedBatch):
        raise TypeError(
            f"packed_loss takes a PackedBatch (HBPDataModule's micro-batches, or lit_hbp.pack_samples over your own "
            f"samples), got {type(batch).__name__}"
        )
    net = base_of(model)
    if getattr(net.config, "_attn_implementation", None) != attention.ATTN_NAME or LAYERS not in net.__dict__:
        raise ValueError(_not_prepared(model))
    ctx = sp_context.active()
    if int(batch.sp) != (ctx.size if ctx is not None else 1):
        raise ValueError(
            f"this micro-batch (level {batch.level}) is a shard for sequence parallelism {batch.sp} but the active SP "
            f"group has {ctx.size if ctx is not None else 1} rank(s): levels with sp > 1 train under "
            "lit_hbp.HBPStrategy, which activates each level's group"
        )
    set_checkpointing(model, int(batch.ckpt_layers), bool(batch.offload))
    set_mlp_tiles(model, int(batch.mlp_tiles))
    cu = batch.cu_seqlens
    attention.set_pack(cu, batch.max_seqlen, batch.input_ids.shape[1] * int(batch.sp))
    sp_context.set_shard(batch.cp_shard)
    aux = router_loss and getattr(net.config, "output_router_logits", False)
    out = decoder_of(model)(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=batch.max_seqlen,
        max_length_k=batch.max_seqlen,
        use_cache=False,
        **({"output_router_logits": True} if aux else {}),
    )
    hidden = out.last_hidden_state
    head = output_head(model)
    scale = weights if weights is not None else token_scale(batch, loss)
    labels = batch.labels[0]
    plain_head = type(head.linear) is torch.nn.Linear  # not wrapped by an adapter
    fusable = plain_head and isinstance(scale, float) and (head.scale == 1.0 or head.linear.bias is None)
    if liger and fusable:
        total, ce_sum, n = fused_linear_cross_entropy(hidden[0], head, labels, scale, batch.target_index)
    else:
        w = scale if scale is not None else token_weights(batch, loss)[0]
        total, ce_sum, n = chunked_cross_entropy(
            hidden[0], head.logits, labels, w, batch.target_index, ce_chunk_size, recompute
        )
    if aux:
        real = (batch.positions_in_pack() < batch.n_tokens)[None]  # not the padding segment
        total = total + router_aux_loss(net, out.router_logits, real)
    return PackedLoss(total, ce_sum, n)


def decoder_of(net: torch.nn.Module) -> torch.nn.Module:
    """The module that maps token ids to the final hidden states (final norm included)."""
    dec = net.get_decoder()
    if dec is net:
        dec = getattr(net, "model", None)
    if dec is None or dec is net:
        raise ValueError(f"{type(net).__name__}: cannot find its decoder (get_decoder() returns the model itself)")
    return dec


def checkpoint_layers(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers that support activation checkpointing, in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in net.modules() if isinstance(m, GradientCheckpointingLayer)]


@dataclass(frozen=True)
class OutputHead:
    """logits = softcap(scale * linear(hidden)), as the family's forward computes them."""

    linear: torch.nn.Module
    scale: float = 1.0
    softcap: float | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.linear(hidden).float()
        if self.scale != 1.0:
            out = out * self.scale
        if self.softcap:
            out = self.softcap * torch.tanh(out / self.softcap)
        return out


def output_head(net: torch.nn.Module) -> OutputHead:
    config = net.config
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None):  # Granite
        scale /= float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None) or None
    return OutputHead(net.get_output_embeddings(), scale, softcap)


def _first(config, names):
    return next((getattr(config, n) for n in names if getattr(config, n, None)), None)


def router_aux_loss(net: torch.nn.Module, router_logits, real: torch.Tensor) -> torch.Tensor:
    """The load-balancing loss the family's forward adds when ``output_router_logits`` is set
    (its own ``load_balancing_loss_func``), over this micro-batch's real tokens (``real``: [1, T] mask)."""
    config = net.config
    fn = sys.modules[type(net).__module__].load_balancing_loss_func
    aux = fn(router_logits, _first(config, EXPERT_COUNT), _first(config, EXPERTS_PER_TOKEN), real)
    return config.router_aux_loss_coef * aux


def check_router_loss(net: torch.nn.Module) -> None:
    """A config asking for the router loss trains with it, or is refused here."""
    if not getattr(net.config, "output_router_logits", False):
        return
    module = sys.modules[type(net).__module__]
    if not hasattr(module, "load_balancing_loss_func") or not _first(net.config, EXPERT_COUNT):
        raise ValueError(
            f"{net.config.model_type}: output_router_logits is set but lit-hbp does not know this family's router "
            "loss (no load_balancing_loss_func in its modeling module); set output_router_logits: false"
        )


def model_spec(net: torch.nn.Module, layers: list[torch.nn.Module]) -> ModelSpec:
    """The model's shape for FLOP counting, with the matmul parameters a token really passes through
    in a decoder layer counted from the layers' weights: every matrix once, routed experts at
    top-k / experts (shared experts and the router in full). Raises ValueError when the config
    does not say the shape."""
    spec = ModelSpec.from_config(net.config.to_dict())
    if not layers:
        return spec
    experts = _first(net.config, EXPERT_COUNT)
    top_k = _first(net.config, EXPERTS_PER_TOKEN)
    active = total = 0.0
    for layer in layers:
        for name, p in layer.named_parameters():
            shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the full shape here
            if len(shape) < 2:
                continue
            n = float(torch.Size(shape).numel())
            total += n
            routed = experts and top_k and "experts" in name.split(".") and "shared" not in name
            active += n * top_k / experts if routed else n
    return replace(spec, active_layer_params=active / len(layers), total_layer_params=total / len(layers))


LIGER_FLOOR = "liger-kernel>=0.6.2"  # the first release whose fused linear cross-entropy takes accum_dtype


def apply_liger(net) -> None:
    """Liger's RMSNorm, RoPE and SwiGLU kernels on ``net``, the Hugging Face model itself (not a peft
    wrapper), where Liger has them for its family (the cross-entropy is the module's own fused one,
    so Liger's loss patches stay off). Refuses a Liger whose fused linear cross-entropy cannot
    accumulate the LM head's gradient in fp32 (``accum_dtype``)."""
    if not torch.cuda.is_available():
        raise ValueError("liger=True needs a CUDA GPU: Liger's kernels are Triton kernels")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ValueError("liger=True needs liger-kernel: pip install 'lit-hbp[gpu]'")
    import inspect

    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    if "accum_dtype" not in inspect.signature(liger_fused_linear_cross_entropy).parameters:
        raise ValueError(
            "liger=True: this liger-kernel's fused linear cross-entropy has no accum_dtype, so the LM head's "
            f"gradient would accumulate in bf16; pip install '{LIGER_FLOOR}'"
        )

    model_type = net.config.model_type
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        rank_zero_warn(f"liger-kernel has no kernels for {model_type!r}: only the fused cross-entropy is used")
        return
    _apply_liger_kernel_to_instance(model=net, cross_entropy=False, fused_linear_cross_entropy=False)


LORA_NAMES = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout"}


def apply_lora(net, lora: dict):
    """Wrap ``net`` with peft LoRA adapters: only the adapters (and ``modules_to_save``) train.
    ``lora`` takes rank, alpha, dropout, target_modules (default "all-linear"), modules_to_save, and
    any other ``peft.LoraConfig`` field by its own name."""
    import inspect

    from peft import LoraConfig, get_peft_model

    fields = set(inspect.signature(LoraConfig).parameters)
    kw = {LORA_NAMES.get(k, k): v for k, v in lora.items()}
    unknown = sorted(k for k in kw if k not in fields)
    if unknown:
        raise ValueError(
            f"lora: unknown setting(s) {unknown}; use rank, alpha, dropout, target_modules, modules_to_save "
            "or a peft.LoraConfig field"
        )
    kw.setdefault("target_modules", "all-linear")
    return get_peft_model(net, LoraConfig(task_type="CAUSAL_LM", **kw))
