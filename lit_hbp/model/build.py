"""Building a Hugging Face causal LM for lit-hbp, and the parts of it lit-hbp works with: built from a
checkpoint folder or a config mapping with the varlen attention (``build_causal_lm``; a family that
does not run its attention through transformers' AttentionInterface is refused), its decoder and its
checkpointable layers, the configs its modules read, a checkpoint's family checked before the data is read
as ``prepare_model`` will check it (``check_model_before_data``), ZeRO-3 loading, and what a run adds to the
model before it trains: Liger's kernels, a frozen vision tower, LoRA adapters. How the built model then trains on
packs: ``lit_hbp.model.causal_lm``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lit_hbp.errors import ConfigError
from lit_hbp.model import attention, calls
from lit_hbp.model.checks import base_model_name, check_model_config, local_checkpoint, model_config
from lit_hbp.model.family_checks import refuse_unseen
from lit_hbp.model.mixers import ZERO3_REFUSAL, mode_refusal, refusal, sp_refusal, stateful_mixers
from lit_hbp.model.packed_call import unwrapped
from lit_hbp.model.vision import encoder_parameters, is_multimodal, language_linears, vision_tower
from lit_hbp.packing.levels import as_level
from lit_hbp.parallel.topology import model_heads, resolve_layout

LIGER_FLOOR = "liger-kernel>=0.6.2"  # the first release whose fused linear cross-entropy takes accum_dtype


LORA_NAMES = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout"}
# peft.LoraConfig fields lit-hbp cannot train as peft would, each with why (``check_lora``).
LORA_REFUSED = {
    "alora_invocation_tokens": "activated LoRA finds each call's invocation in PeftModel.forward, which a packed call "
    "does not run: it would train as plain LoRA",
    "layer_replication": "peft copies decoder layers after lit-hbp prepared them: the copies would let a pack's "
    "documents attend to each other",
    "inference_mode": "it freezes the adapters, so nothing would train",
    "runtime_config": "it sets inference-time offloading, not training",
    "megatron_config": "lit-hbp trains Hugging Face layers, not Megatron's",
    "megatron_core": "lit-hbp trains Hugging Face layers, not Megatron's",
    "loftq_config": "LoftQ quantizes the base weights, which lit-hbp trains unquantized",
    "use_qalora": "QA-LoRA needs a quantized base model, which lit-hbp does not train",
    "eva_config": "EVA initialises from activations of your data (peft's initialize_lora_eva_weights), which the run "
    "does not compute",
    "corda_config": "CorDA initialises from activations of your data (peft's preprocess_corda), which the run does "
    "not compute",
    "lora_ga_config": "LoRA-GA initialises from gradients of your data, which the run does not compute",
    "velora_config": "not tested exact through packed calls",
    "monteclora_config": "not tested exact through packed calls",
    "arrow_config": "Arrow routes between several adapters, and the run trains one",
    "kasa_config": "not tested exact through packed calls",
    "use_bdlora": "not tested exact through packed calls",
}
LORA_INITS_REFUSED = ("eva", "corda", "loftq", "lora_ga")  # init_lora_weights that need the data or a quantized base


SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
SAVED_DTYPE = "hf_saved_dtype"  # the built model's attribute, and the checkpoint's key, for its base's saved dtype


def saved_dtype(net: Any) -> str | None:
    """The dtype the model's base was saved in, by name (``"bfloat16"``): its folder's config.json ``dtype``
    (``torch_dtype`` in older folders), a config mapping's ``dtype``; None where it said none, and for a model
    ``build_causal_lm`` did not build. The export writes that dtype unless told another."""
    return getattr(net, SAVED_DTYPE, None)


def _dtype_name(dtype: Any) -> str | None:
    return str(dtype).removeprefix("torch.") if isinstance(dtype, (torch.dtype, str)) else None


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
    from transformers import AutoConfig

    if isinstance(model, dict):
        check_model_config(model)  # a typo'd key would otherwise be ignored and the default trained
        cfg = dict(model)
        model_type = cfg.pop("model_type")
        if vocab_size is not None:
            if cfg.get("vocab_size", vocab_size) < vocab_size:
                raise ConfigError(
                    f"model.model.vocab_size: {cfg['vocab_size']} rows embed fewer than the tokenizer's {vocab_size} "
                    f"tokens: set it to {vocab_size} or more, or leave it out (the tokenizer's size is taken)"
                )
            cfg.setdefault("vocab_size", vocab_size)  # more rows than tokens (a vocabulary padded to 64) as asked
        if tokenizer is not None:
            cfg = {**special_token_ids(tokenizer), **cfg}
        config = AutoConfig.for_model(model_type, **cfg)
        config.use_cache = False
        auto, attn = _auto_class(model_type)
        saved = config.dtype  # the mapping's, what an export writes: the model trains in the run's precision, as a
        with _refusing_other_attention(model_type):  # folder's does (from_config's default is the config's dtype)
            net = auto.from_config(config, dtype=torch.get_default_dtype(), **attn)
    else:
        folder = local_checkpoint(model)
        saved_config = AutoConfig.from_pretrained(folder, local_files_only=True)
        auto, attn = _auto_class(saved_config.model_type)
        with _refusing_other_attention(str(model)):
            net = auto.from_pretrained(folder, dtype=torch.get_default_dtype(), local_files_only=True, **attn)
        saved = saved_config.dtype  # from_pretrained set the config's to the loaded one
        net.config.use_cache = False
        net.config._name_or_path = base_model_name(model)  # what an adapter export names as its base
        if vocab_size is not None and vocab_size > net.get_input_embeddings().num_embeddings:
            raise ValueError(
                f"the tokenizer has {vocab_size} tokens but {model} embeds only "
                f"{net.get_input_embeddings().num_embeddings}: use the checkpoint's tokenizer"
            )
    setattr(net, SAVED_DTYPE, _dtype_name(saved))
    return net


def _auto_class(model_type: str):
    """(the Auto class that loads a checkpoint of ``model_type``, its attention argument): a causal LM
    with lit-hbp's attention (refused at load when the family cannot take it); a vision-language model
    as an image-text-to-text model with its own attention, whose language model ``prepare_model`` checks."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForImageTextToText, {}
    return AutoModelForCausalLM, {"attn_implementation": attention.ATTN_NAME}


def build_on_meta(config: Any) -> torch.nn.Module | None:
    """The model a Hugging Face ``config`` describes, built on the meta device (no weights, no memory) as the run
    will build it, or None where it cannot be built here (left to where it is built: its own error there)."""
    auto, _ = _auto_class(config.model_type)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        try:
            net = auto.from_config(config)
            decoder_of(net)
        except Exception:  # noqa: BLE001
            return None
    return net


def check_model_before_data(
    model: Any, levels: Any = None, key: str = "model.model", zero_stage: int | None = None, freeze: bool = False
) -> None:
    """A ``model`` argument (checkpoint folder or config mapping) holding a token mixer that carries state
    across documents (``lit_hbp.model.mixers``) and that lit-hbp cannot run document by document, or one that
    it can, at a level of ``levels`` (a config's list) whose SP layout cannot give it documents whole (context
    parallelism: ``SPKind.mixer_problem``) or under DeepSpeed ZeRO stage 3 (``zero_stage``), or a family whose
    own code does what a packed call cannot see (``lit_hbp.model.family_checks``), is refused before the data is
    read: the model is built from its config on the meta device (no weights, no memory) and looked at as
    ``prepare_model`` will look at the real one. A config that cannot be built here is left to where it is
    built. ``freeze``: ``model.freeze_vision`` asked, refused for a model without a vision tower."""
    config = model_config(model)
    net = None if config is None else build_on_meta(config)
    if net is None:
        return
    if freeze and vision_tower(net) is None:
        raise ConfigError(f"model.freeze_vision: {type(net).__name__} has no vision tower (a text-only model)")
    decoder = decoder_of(net)
    mixers = stateful_mixers(decoder)
    refused = [m for m in mixers if not m.per_document]
    if refused:
        raise ConfigError(f"{key}: {refusal(config.model_type, refused)}")
    if (problem := mode_refusal(config.model_type, mixers, decoder.config)) is not None:
        raise ConfigError(f"{key}: {problem}")
    try:
        refuse_unseen(net, decoder, config.model_type, {m.path for m in mixers}, not is_multimodal(net))
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    if mixers and zero_stage == 3:
        raise ConfigError(f"trainer.strategy (ZeRO stage 3): {config.model_type} holds {ZERO3_REFUSAL}")
    if mixers and isinstance(levels, (list, tuple)):
        for i, entry in enumerate(levels):
            try:
                lv = resolve_layout(as_level(entry, f"data.levels[{i}]"), *model_heads(config))
            except (ValueError, TypeError, AttributeError):
                continue  # the level's own error comes where the levels are checked
            where = f"data.levels[{i}] (pack_len {lv.pack_len}, sp {lv.sp})"
            problem = sp_refusal(config.model_type, mixers, lv, where)
            if problem is not None:
                raise ConfigError(problem)


@contextlib.contextmanager
def zero3_loading(strategy: Any) -> Iterator[None]:
    """Under a DeepSpeed strategy at ZeRO-3, ``from_pretrained`` inside this block loads the checkpoint
    into the partitioned parameters (DeepSpeed's config registered for transformers, as its own Trainer
    does); elsewhere it does nothing. ``HBPStrategy`` runs ``configure_model`` inside it: call it
    yourself around ``from_pretrained`` under Lightning's ``DeepSpeedStrategy``."""
    if not getattr(strategy, "zero_stage_3", False):
        yield
        return
    from transformers.integrations.deepspeed import (
        HfDeepSpeedConfig,
        is_deepspeed_zero3_enabled,
        unset_hf_deepspeed_config,
    )

    if is_deepspeed_zero3_enabled():  # already registered (HBPStrategy's, around HBPLitModule's)
        yield
        return
    registered = HfDeepSpeedConfig(strategy.config)  # noqa: F841  (kept alive: transformers holds a weakref)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


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


def family_of(net: torch.nn.Module) -> str:
    """The model's family as transformers names it (``config.model_type``), else its class name."""
    return getattr(getattr(net, "config", None), "model_type", None) or type(net).__name__


def base_of(net: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model itself (under peft: the model the adapters wrap; under
    ``torch.compile``: the compiled module)."""
    return unwrapped(net)


def tower_configs(net: torch.nn.Module, decoder_configs: list) -> list:
    """The configs a vision-language model's vision tower reads and its decoder does not (routed to the
    packed call's tower attention, ``packed_call.tower_names``); none for a text-only model."""
    tower = vision_tower(net)
    seen = {id(c) for c in decoder_configs}
    out = [] if tower is None else [c for c in model_configs(tower) if id(c) not in seen]
    for config in out:
        calls.install(type(config))
    return out


def model_configs(net: torch.nn.Module) -> list:
    """Every model config the model's modules read (the top one and sub-configs), once each."""
    from transformers import PretrainedConfig

    seen: dict[int, object] = {}
    for module in net.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            seen.setdefault(id(config), config)
    return list(seen.values())


def decoder_of(net: torch.nn.Module) -> torch.nn.Module:
    """The module that maps token ids to the final hidden states (final norm included)."""
    from transformers import PreTrainedModel

    dec = net.get_decoder()
    if dec is net or not isinstance(dec, PreTrainedModel):  # ModernBERT's ``decoder`` is its output projection
        dec = getattr(net, "model", None)
    if not isinstance(dec, PreTrainedModel) or dec is net:
        raise ValueError(f"{type(net).__name__}: cannot find its decoder (get_decoder() returns the model itself)")
    return dec


def checkpoint_layers(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The module's layers that support activation checkpointing, in order (a decoder's, a vision tower's)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in net.modules() if isinstance(m, GradientCheckpointingLayer)]


def check_liger_before_data(accelerator: Any) -> None:
    """``liger=True`` refused before the data is read where it will be refused at set-up: on the CPU
    (``trainer.accelerator``, or a machine with no CUDA device, counted without initializing CUDA) or without
    liger-kernel installed."""
    from lightning.fabric.accelerators.cuda import num_cuda_devices

    if accelerator == "cpu" or (accelerator in (None, "auto", "gpu", "cuda") and num_cuda_devices() == 0):
        where = "trainer.accelerator is cpu" if accelerator == "cpu" else "this machine has no CUDA device"
        raise ConfigError(f"model.liger: liger=True needs a CUDA GPU (Liger's kernels are Triton kernels), but {where}")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("model.liger: liger=True needs liger-kernel: pip install 'lit-hbp[gpu]'")


def check_liger() -> None:
    """Refuse ``liger=True`` where Liger cannot run: without a CUDA GPU or without liger-kernel."""
    if not torch.cuda.is_available():
        raise ValueError("liger=True needs a CUDA GPU: Liger's kernels are Triton kernels")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ValueError("liger=True needs liger-kernel: pip install 'lit-hbp[gpu]'")


def apply_liger(net) -> None:
    """Liger's RMSNorm, RoPE and SwiGLU kernels on ``net``, the Hugging Face model itself (not a peft
    wrapper), where Liger has them for its family (the cross-entropy is the module's own fused one,
    so Liger's loss patches stay off). Refuses a Liger whose fused linear cross-entropy cannot
    accumulate the LM head's gradient in fp32 (``accum_dtype``)."""
    check_liger()
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


def freeze_vision(net: torch.nn.Module) -> int:
    """Keep a vision-language model's image encoder as it is (its projector and language model train);
    returns how many parameters stopped training. A ValueError for a model without one."""
    tower = vision_tower(net)
    if tower is None:
        raise ValueError(f"freeze_vision: {type(net).__name__} has no vision tower (a text-only model)")
    params = encoder_parameters(tower)
    for p in params:
        p.requires_grad_(False)
    return len(params)


def check_lora(lora: dict, key: str = "lora") -> None:
    """Refuse a LoRA setting peft's ``LoraConfig`` has no field for, a value it would fail on after the data was
    read (or take for something else), and an empty mapping, which reads as no LoRA (``key``: where the settings
    were given)."""
    import inspect

    from peft import LoraConfig

    if not isinstance(lora, Mapping) or not lora:
        raise ConfigError(
            f"{key}: {lora!r} names no LoRA setting, and the full model would train: give at least the rank "
            "({rank: 16}), or leave it out (null) to fine-tune the whole model"
        )
    fields = set(inspect.signature(LoraConfig).parameters)
    value = {LORA_NAMES.get(k, k): v for k, v in lora.items()}
    rank, alpha, dropout = value.get("r", 8), value.get("lora_alpha", 8), value.get("lora_dropout", 0.0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{key}.rank must be a whole number >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < float("inf"):
        raise ConfigError(f"{key}.alpha must be a number > 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"{key}.dropout must be a probability in [0, 1), got {dropout!r}")
    if "task_type" in value:
        raise ConfigError(f"{key}.task_type: lit-hbp trains a causal language model (CAUSAL_LM, its own): leave it out")
    if isinstance(value.get("modules_to_save"), str):  # peft reads a string letter by letter
        raise ConfigError(f"{key}.modules_to_save: give a list of module names, e.g. [{value['modules_to_save']}]")
    for field, why in LORA_REFUSED.items():
        if field in value and (value[field] or field not in ("inference_mode", "use_qalora", "use_bdlora")):
            raise ConfigError(f"{key}.{field}: {value[field]!r} is refused: {why}; leave it out")
    init = value.get("init_lora_weights")
    if isinstance(init, str) and init in LORA_INITS_REFUSED:
        raise ConfigError(
            f"{key}.init_lora_weights: {init!r} is refused: it initialises from your data or quantizes the base "
            "weights, which the run does not do; use true, 'gaussian', 'pissa', 'olora' or 'orthogonal'"
        )
    unknown = sorted(k for k in (LORA_NAMES.get(k, k) for k in lora) if k not in fields)
    both = [(short, peft) for short, peft in LORA_NAMES.items() if short in lora and peft in lora]
    if both:  # one would be dropped by whichever came last
        short, peft = both[0]
        raise ConfigError(
            f"{key}: {short} ({lora[short]!r}) and {peft} ({lora[peft]!r}) are the same setting (peft's {peft}): "
            "give one"
        )
    if unknown:
        raise ConfigError(
            f"{key}: unknown setting(s) {unknown}; use rank, alpha, dropout, target_modules, modules_to_save "
            "or a peft.LoraConfig field"
        )


def lora_reads_whole(lora: Mapping | None) -> tuple[str, str] | None:
    """The LoRA setting (its field, and why) with which peft reads an adapted weight whole, which ZeRO-3 partitions;
    None without one (``check_lora_strategy``, and the level search's rule, ``run_settings.RULES``)."""
    if not lora:
        return None
    init = lora.get("init_lora_weights", True)
    for field, why in (
        ("use_dora", "DoRA reads each adapted weight whole (its norm)"),
        ("trainable_token_indices", "peft's trainable tokens read the embedding whole"),
        ("init_lora_weights", f"init_lora_weights {init!r} starts the adapters from the base weights"),
    ):
        given = lora.get(field)
        if field == "init_lora_weights":
            given = isinstance(init, str) and init.lower() != "gaussian"
        if given:
            return field, why
    return None


def check_lora_strategy(lora: Mapping | None, zero_stage: int | None) -> None:
    """What peft cannot build under ZeRO-3's ``zero.Init``, refused by name before the data is read: DoRA reads each
    adapted weight's shape and norm whole (its self-check failed with an IndexError blamed on the family); trainable
    tokens assert on the partitioned embedding; an init computed from the base weight (PiSSA, OLoRA, CorDA, MiCA,
    orthogonal) writes adapters that are partitioned already, so they keep nn.Linear's random start while PiSSA's base
    loses its part (``reinit_partitioned_lora`` restarts the plain inits)."""
    found = lora_reads_whole(lora) if zero_stage == 3 else None
    if found is not None:
        field, why = found
        raise ConfigError(
            f"model.lora.{field}: {why}, which DeepSpeed ZeRO stage 3 partitions: use ZeRO stage 0-2, or leave "
            f"{field} out"
        )


def reinit_partitioned_lora(wrapped) -> int:
    """Under ZeRO-3 peft creates each adapter inside ``zero.Init``, which partitions it as it is made, so peft's start
    (B = 0: the model starts as its base) wrote into an empty shard and the run began from base + a random B A
    (0.63 off the base model's logits). Each adapter's start is made again on the gathered tensors; returns how
    many layers were restarted (0 where nothing is partitioned)."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in wrapped.modules() if isinstance(m, LoraLayer)]
    partitioned = [m for m in layers if any(hasattr(p, "ds_id") for p in m.parameters(recurse=True))]
    if not partitioned:
        return 0
    import deepspeed

    for layer in partitioned:
        adapters = [p for n, p in layer.named_parameters() if "lora_" in n]
        with deepspeed.zero.GatheredParameters(adapters, modifier_rank=0):
            for name in layer.lora_A.keys() | layer.lora_embedding_A.keys():
                layer.reset_lora_parameters(name, layer_init(wrapped, name))
    return len(partitioned)


def layer_init(wrapped, adapter: str):
    """The adapter's ``init_lora_weights`` (True, False or 'gaussian' under ZeRO-3: ``check_lora_strategy``)."""
    return wrapped.peft_config[adapter].init_lora_weights


def apply_lora(net, lora: dict):
    """Wrap ``net`` with peft LoRA adapters: only the adapters (and ``modules_to_save``) train.
    ``lora`` takes rank, alpha, dropout, target_modules (default "all-linear"; on a vision-language
    model every linear layer of its language model), modules_to_save, and any other
    ``peft.LoraConfig`` field by its own name."""
    from peft import LoraConfig, get_peft_model

    check_lora(lora)
    kw = {LORA_NAMES.get(k, k): copy.deepcopy(v) for k, v in lora.items()}  # peft edits some in place
    if "target_modules" not in kw and is_multimodal(net):  # the language model's layers, not the vision tower's
        kw["target_modules"] = language_linears(net, decoder_of(net))
    kw.setdefault("target_modules", "all-linear")
    try:
        wrapped = get_peft_model(net, LoraConfig(task_type="CAUSAL_LM", **kw))
    except (ValueError, TypeError, AttributeError, ImportError) as e:  # peft's own refusal of the settings here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model.lora: peft refuses these settings on {type(net).__name__}: {first}") from None
    check_lora_matches(wrapped, kw)
    reinit_partitioned_lora(wrapped)
    return wrapped


def train_lora(net, lora: Mapping, zero_stage3: bool, from_mapping: bool):
    """``apply_lora`` for a training run (ZeRO-3 ``zero_stage3``, a base built from a config mapping
    ``from_mapping``): its settings checked against the strategy, and a LoRA bias no merged model can hold said
    (refused where no adapter export exists either)."""
    check_lora_strategy(lora, 3 if zero_stage3 else None)
    wrapped = apply_lora(net, dict(lora))
    unmergeable = unmergeable_lora_bias(wrapped)
    if unmergeable:
        said = (
            f"model.lora.lora_bias: true trains a bias beside {len(unmergeable)} adapted layer(s) without a bias of "
            f"their own ({unmergeable[0]}, ...), which a merged model cannot hold"
        )
        if from_mapping:
            raise ConfigError(f"{said}, and an adapter of a model built from a config mapping has no base folder to "
                              "load on: the run could not be exported; leave lora_bias out")  # fmt: skip
        rank_zero_warn(f"{said}: the run exports as an adapter only (python -m lit_hbp.export without --merge-lora)")
    return wrapped


def unmergeable_lora_bias(wrapped) -> list[str]:
    """The adapted layers whose LoRA bias (peft's ``lora_bias``) has no bias of the base layer to merge into: peft's
    ``merge_and_unload`` stops on them."""
    from peft.tuners.lora import LoraLayer

    if not any(getattr(c, "lora_bias", False) for c in getattr(wrapped, "peft_config", {}).values()):
        return []
    return [
        name
        for name, m in wrapped.named_modules()
        if isinstance(m, LoraLayer) and getattr(m.get_base_layer(), "bias", None) is None
    ]


def check_lora_matches(wrapped, kw: dict) -> None:
    """Refuse LoRA settings that matched nothing in the model and so change nothing: ``modules_to_save`` names
    that wrapped no module, a ``bias`` to train on a model without biases (peft says nothing of either)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    saved = [name for name, m in wrapped.named_modules() if isinstance(m, ModulesToSaveWrapper)]
    for wanted in kw.get("modules_to_save") or []:
        if not any(name == wanted or name.endswith(f".{wanted}") for name in saved):
            raise ConfigError(
                f"model.lora.modules_to_save: {wanted!r} is no module of {type(wrapped.get_base_model()).__name__}, "
                "so nothing more would train: give a module's name (e.g. lm_head, embed_tokens)"
            )
    adapted_names = [name for name, m in wrapped.named_modules() if isinstance(m, LoraLayer)]
    every = [name for name, _ in wrapped.get_base_model().named_modules()]
    listed = [(f, k, adapted_names) for f in ("target_modules",) if isinstance(kw.get(f), list) for k in kw[f]]
    listed += [(f, k, every) for f in ("exclude_modules",) if isinstance(kw.get(f), list) for k in kw[f]]
    for field, key, names in listed:  # peft's own match of a listed name: the module's name or its last parts
        if not any(name == key or name.endswith(f".{key}") for name in names):
            raise ConfigError(
                f"model.lora.{field}: {key!r} names no {'adapted ' if names is adapted_names else ''}module of "
                f"{type(wrapped.get_base_model()).__name__}, so it changes nothing: fix or remove it"
            )
    for field in ("rank_pattern", "alpha_pattern"):  # peft's match of a pattern key (peft.utils.other.get_pattern_key)
        for key in kw.get(field) or {}:
            if not any(re.match(rf"(.*\.)?({key})$", name) for name in adapted_names):
                raise ConfigError(
                    f"model.lora.{field}: {key!r} matches no module LoRA adapts, so it changes nothing: fix or "
                    "remove it"
                )
    bias = kw.get("bias", "none")
    adapted = [m.get_base_layer() for m in wrapped.modules() if isinstance(m, LoraLayer)]
    if bias != "none" and not any(name.endswith(".bias") for name, _ in wrapped.get_base_model().named_parameters()):
        raise ConfigError(
            f"model.lora.bias: {bias!r} trains the model's biases, and "
            f"{type(wrapped.get_base_model()).__name__} has none: leave it out"
        )
    if bias == "lora_only" and not any(getattr(m, "bias", None) is not None for m in adapted):
        raise ConfigError(
            "model.lora.bias: 'lora_only' trains the biases of the layers LoRA adapts, and none of "
            f"{type(wrapped.get_base_model()).__name__}'s adapted layers has one: leave it out"
        )


# What a generation config carries that no model folder's file decides: the version, the mark, what the config's
# run-time switches derive.
NOT_SAID = ("_from_model_config", "transformers_version", "use_cache", "output_attentions", "output_hidden_states")


def own_generation_config(generation: Any, config: Any) -> bool:
    """Whether ``generation`` says more than what transformers derives from ``config``: a folder's own
    generation_config.json, even one marked ``_from_model_config`` (Mistral's and Gemma 2's carry sampling
    defaults and more EOS ids beside that mark, and transformers uses them)."""
    from transformers import GenerationConfig

    def said(g) -> dict:  # a training run turns the cache off in the config; the export turns it on again
        return {k: v for k, v in g.to_diff_dict().items() if k not in NOT_SAID}

    return said(generation) != said(GenerationConfig.from_model_config(config))
