"""Checks of a model before anything is built from it: typos in a config mapping (``check_model_config``),
positions the model does not cover (``check_positions``), a checkpoint path that is no checkpoint
(``check_model_source``). Pure functions of a config (a mapping, a Hugging Face config object, a level
list; whether the model takes positions at all is asked of the built model, or of the config built on the meta
device), so that the command line (``lit_hbp.cli.checks``, before processes spawn) and plain Python
(``build_causal_lm``, ``HBPLitModule.configure_model``) run the same code.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import itertools
import json
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_hbp.errors import ConfigError, did_you_mean

# Keys ``PreTrainedConfig.__post_init__`` (transformers 5) consumes without a field of the same name:
# backward-compatible spellings that config.json files still carry.
CONSUMED_KEYS = frozenset(
    {
        "model_type",
        "torch_dtype",
        "name_or_path",
        "_name_or_path",
        "_commit_hash",
        "output_attentions",
        "attn_implementation",
        "experts_implementation",
        "per_layer_config",
        "num_labels",
    }
)
# How close (difflib ratio) an unknown model key must be to a missing valid one to be called its typo:
# num_hiden_layers / num_hidden_layers is 0.97; gemma2's real hidden_act / hidden_size only 0.76.
TYPO_CUTOFF = 0.85
# Keys lit-hbp reads from any family's config itself, and refuses with its own message where the family
# cannot honour them (``router_loss.check_router_loss``).
LIT_HBP_KEYS = frozenset({"output_router_logits"})
# Legacy RoPE keys, folded into ``rope_parameters`` by configs that have it (set silently otherwise).
ROPE_KEYS = frozenset({"rope_scaling", "rope_theta", "partial_rotary_factor"})


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ConfigError(
            f"unknown model_type {model_type!r}{did_you_mean(model_type, CONFIG_MAPPING.keys())}: "
            "transformers has no config class of that name"
        )
    return CONFIG_MAPPING[model_type]


@functools.cache
def valid_config_keys(model_type: str) -> frozenset[str]:
    """Every key a ``model_type`` config mapping may hold: the ``__init__`` parameters and dataclass
    fields of its config class and of every base (PreTrainedConfig included), its settable properties,
    its ``attribute_map`` aliases, the attributes a default instance sets, and the keys transformers
    consumes for backward compatibility."""
    cls = _config_class(model_type)
    keys = set(CONSUMED_KEYS | LIT_HBP_KEYS)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            try:
                params = inspect.signature(init).parameters.values()
            except (TypeError, ValueError):
                params = ()
            keys |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        keys |= {n for n, v in vars(klass).items() if isinstance(v, property) and v.fset is not None}
        keys |= set(getattr(klass, "attribute_map", None) or {})
    if dataclasses.is_dataclass(cls):
        keys |= {f.name for f in dataclasses.fields(cls)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = cls()
    keys |= set(vars(default))
    if hasattr(default, "rope_parameters"):
        keys |= ROPE_KEYS
    return frozenset(keys - {"self"})


def _generation_keys() -> frozenset[str]:
    """Generation settings transformers drops from a model config (they live in GenerationConfig)."""
    try:
        from transformers import GenerationConfig

        return frozenset(GenerationConfig._get_default_generation_params())
    except (ImportError, AttributeError):
        return frozenset()


def check_model_config(model: Mapping[str, Any]) -> None:
    """Refuse a model config mapping with a key its config class does not know. transformers would
    store or drop such a key silently and build the default (a typo'd ``num_hiden_layers`` trains 32
    layers); the error names each unknown key and the nearest valid one."""
    model_type = model.get("model_type")
    if model_type is None:
        raise ConfigError("a model config mapping needs a 'model_type' (e.g. 'llama', 'qwen2', 'mistral')")
    for key in ("attn_implementation", "_attn_implementation"):
        if key in model:
            raise ConfigError(
                f"model config ({model_type}): {key}: {model[key]!r} is lit-hbp's to set: packed calls run its varlen "
                "attention, with the kernel model.attn_backend names (auto, eager, sdpa, flex, torch_varlen, "
                "flash_attn, ...), and other calls the family's sdpa or eager; remove it and set model.attn_backend"
            )
    valid = valid_config_keys(str(model_type))
    unknown = [k for k in model if k not in valid]
    if not unknown:
        return
    public = [k for k in valid if not k.startswith("_")]
    generation = _generation_keys()
    typos, ignored = [], []
    for key in unknown:
        # A near miss (a letter or two) of a valid key: what the user meant is not what trains.
        near = difflib.get_close_matches(key, sorted(public), n=1, cutoff=TYPO_CUTOFF)
        near = near[0] if near else None
        if near is not None:
            typos.append(f"unknown key {key!r} (did you mean {near!r}?)")
        elif key in generation:
            ignored.append(f"{key!r} (a generation setting)")
        else:
            ignored.append(repr(key))
    name = _config_class(str(model_type)).__name__
    if typos:
        raise ConfigError(
            f"model config ({model_type}): {'; '.join(typos)}. transformers does not use such keys ({name} keeps "
            "its defaults): fix or remove them"
        )
    # Keys a real config.json carries for other tools (auto_map, quantization_config, task_specific_params,
    # ...) and no near miss of a missing key: kept, but said, since the model does not read them.
    warnings.warn(
        f"model config ({model_type}): {name} does not use {', '.join(ignored)}; they are kept but change nothing",
        stacklevel=2,
    )


def _rope_sets(config: Any) -> list[Mapping]:
    """The config's RoPE parameter sets: one, or one per layer type (full / sliding attention)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, Mapping) and rope and all(isinstance(v, Mapping) for v in rope.values()):
        return list(rope.values())
    return [rope] if isinstance(rope, Mapping) else []


def rescaling_limit(config: Any) -> tuple[str, int] | None:
    """(rope type, length) of a rotary embedding whose frequencies transformers chooses from a call's longest
    position (``dynamic_rope_update``: ``dynamic`` rescales past ``max_position_embeddings``, ``longrope`` takes
    its long factors past ``original_max_position_embeddings``), the smallest such length; None for static
    rope types (default, linear, yarn, llama3, ...). A pack is one call: past that length its longest document
    would choose for the others."""
    max_pos = getattr(config, "max_position_embeddings", None)
    found = []
    for params in _rope_sets(config):
        kind = str(params.get("rope_type") or params.get("type") or "default")
        if "dynamic" in kind and isinstance(max_pos, int):
            found.append((kind, max_pos))
        elif kind == "longrope":
            original = (
                params.get("original_max_position_embeddings")
                or getattr(config, "original_max_position_embeddings", None)
                or max_pos
            )
            if isinstance(original, int):
                found.append((kind, original))
    return min(found, key=lambda x: x[1]) if found else None


def position_range(config: Any) -> tuple[int | None, int | None, str]:
    """(max_position_embeddings, the longest position the model covers with its RoPE scaling, how it is
    scaled). A scaling with a ``factor`` extends ``original_max_position_embeddings`` (or
    max_position_embeddings when absent) by that factor; (None, None, "") when the config has no
    max_position_embeddings (ALiBi and other relative-only models)."""
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, bool) or not isinstance(max_pos, int):
        return None, None, ""
    limit, how = max_pos, ""
    for params in _rope_sets(config):
        kind = params.get("rope_type") or params.get("type") or "default"
        factor = params.get("factor")
        if kind == "default" or isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 1:
            continue
        original = (
            params.get("original_max_position_embeddings")
            or getattr(config, "original_max_position_embeddings", None)
            or max_pos
        )
        extended = int(original * factor)
        if extended > limit:
            limit, how = extended, f"{kind} RoPE scaling (factor {factor:g} over {original} positions)"
    return max_pos, limit, how


# What numbers a model's tokens: a rotary embedding's module (transformers names every one ``...RotaryEmbedding``)
# or its frequencies, a table or buffer of positions (GPT-2's ``wpe``, OPT's ``embed_positions``, cached sin/cos).
POSITION_MODULES = re.compile(r"Rotary|RoPE|Rope|Position")
POSITION_TENSORS = re.compile(r"inv_freq|rotary|rope|position|pos_emb|wpe|_cached")


def takes_positions(model: Any) -> bool:
    """Whether a model numbers its tokens, decided on the built model (``model``, or a model config built on the
    meta device): a rotary embedding, an embedding table beside the token ids', or a weight or buffer named for
    positions. A hybrid whose attention takes none (NoPE: Nemotron-H, Jamba, Zamba, Granite 4.0-H with
    ``position_embedding_type`` None, which still carries ``rope_parameters``) has none, so no document is too long
    for its ``max_position_embeddings``. Only a model with a stateful token mixer is asked (a transformer's
    positions may sit in a buffer named otherwise: CTRL's ``pos_encoding``); what cannot be built or read, and
    every other model, counts as taking positions."""
    import torch

    from lit_hbp.model.mixers import stateful_mixers

    if not isinstance(model, torch.nn.Module):
        model = _built_on_meta(model)
        if model is None:
            return True
    if not stateful_mixers(model):
        return True
    try:
        tokens = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        tokens = None
    inside_tokens = set() if tokens is None else {id(m) for m in tokens.modules()}
    for module in model.modules():
        if POSITION_MODULES.search(type(module).__name__):
            return True
        if isinstance(module, torch.nn.Embedding) and id(module) not in inside_tokens:
            return True
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    return any(POSITION_TENSORS.search(name) for name, _ in named)


def _built_on_meta(config: Any):
    """The causal LM ``config`` (a Hugging Face config, or a mapping or namespace naming its ``model_type``)
    builds, on the meta device (no memory, no weights); None when it cannot be built here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    try:
        if not isinstance(config, PretrainedConfig):
            fields = dict(config if isinstance(config, Mapping) else vars(config))
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - any family or config this transformers cannot build: counted as positioned
        return None


def check_positions(config: Any, levels: Sequence[Any] | None, model: Any = None) -> str | None:
    """A document as long as the largest level's pack_len uses positions up to pack_len - 1 (positions
    restart per document): refuse levels past the model's max_position_embeddings unless its RoPE
    scaling covers them, in which case the extension is returned (for the caller to log), and levels past
    the length at which a dynamic rotary embedding rescales (``rescaling_limit``; a longrope one: levels past it
    at sp > 1). Nothing of it where the model takes no positions (``takes_positions``, asked of the built
    ``model``, or of ``config`` built on the meta device, only when a level would be refused or noted)."""
    if not levels:
        return None
    try:
        note = _position_check(config, levels)
    except ConfigError:
        if takes_positions(config if model is None else model):
            raise
        return None
    return note if note is None or takes_positions(config if model is None else model) else None


def _position_check(config: Any, levels: Sequence[Any]) -> str | None:
    """``check_positions`` read from the config alone (a model that takes positions)."""
    longest = max(int(getattr(lv, "pack_len", lv)) for lv in levels)
    rescaled = rescaling_limit(config)
    if rescaled is not None and rescaled[0] == "longrope":  # packs exactly at sp 1 (rope.per_document_longrope)
        split = [lv for lv in levels if getattr(lv, "sp", 1) > 1 and int(getattr(lv, "pack_len", lv)) > rescaled[1]]
        if split:
            raise ConfigError(
                f"the level of pack_len {split[0].pack_len} at sp {split[0].sp} passes {rescaled[1]}, past which the "
                "model's rope_type 'longrope' takes its long factors by a call's longest position: the ranks of "
                f"an SP group would each choose for their share of a document. Keep levels past {rescaled[1]} "
                "tokens at sp 1, where a longrope pack gives each document its own factors"
            )
    elif rescaled is not None and longest > rescaled[1]:
        kind, at = rescaled
        raise ConfigError(
            f"the largest level's pack_len {longest} passes {at}, past which the model's rope_type {kind!r} "
            "rescales its rotary frequencies by a call's longest position: a pack holding a document that long "
            "beside others would give them its scaling, unlike each alone. Keep every level at pack_len <= "
            f"{at}, or give the model a static rope_type (linear, yarn, llama3)"
        )
    max_pos, limit, how = position_range(config)
    if max_pos is None or longest <= max_pos:
        return None
    if limit is not None and limit >= longest:
        return (
            f"the largest level packs {longest} tokens, past max_position_embeddings {max_pos}: the model's {how} "
            f"extends its positions to {limit}"
        )
    factor = 2 ** math.ceil(math.log2(longest / max_pos))
    covered = f"; its {how} reaches only {limit}" if how else ""
    raise ConfigError(
        f"the largest level's pack_len {longest} exceeds the model's max_position_embeddings {max_pos}{covered}: "
        f"a document that long would use positions the model does not cover. Raise max_position_embeddings "
        f"to {longest} (a model trained from scratch), extend it with RoPE scaling (e.g. rope_parameters: "
        f"{{rope_type: yarn, factor: {factor}, original_max_position_embeddings: {max_pos}}}), or lower the "
        f"largest level's pack_len to {max(limit or 0, max_pos)}"
    )


def check_module_positions(module: Any) -> None:
    """``check_positions`` for an HBPLitModule whose model is built, against its trainer's data module's
    levels (chosen by then when a LevelSelector chooses them); nothing to check without them."""
    from lightning.pytorch.utilities import rank_zero_info

    trainer = getattr(module, "_trainer", None)
    levels = getattr(getattr(trainer, "datamodule", None), "levels", None)
    note = check_positions(module.model.config, levels, module.model)
    if note:
        rank_zero_info(note)


def read_config_json(path: Path) -> dict:
    """A config.json as transformers wrote it: its infinite and NaN values (Mamba2's ``time_step_limit``) are
    ``{"__float__": "Infinity"}`` there, which plain JSON reads as a mapping no config builds from."""
    return json.loads(Path(path).read_text(), object_pairs_hook=_special_floats)


def _special_floats(pairs: list) -> Any:
    """A JSON object as transformers' ``{"__float__": "Infinity"}`` means it (``read_config_json``)."""
    obj = dict(pairs)
    return float(obj["__float__"]) if set(obj) == {"__float__"} and isinstance(obj["__float__"], str) else obj


def model_config(model: Any):
    """The Hugging Face config a ``model`` argument describes (mapping or local checkpoint), or None."""
    from transformers import AutoConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if isinstance(model, Mapping):
            cfg = dict(model)
            return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        if isinstance(model, (str, Path)) and (Path(model) / "config.json").is_file():
            return AutoConfig.from_pretrained(model, local_files_only=True)
    return None


def hub_snapshot(repo_id: str) -> str | None:
    """The folder of ``repo_id``'s snapshot in the Hugging Face cache, or None (no network asked).
    Loading that folder, not the name, keeps transformers from asking the Hub about files the cache
    does not hold (an adapter config): without a network that costs retries of ~20 s."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        return snapshot_download(repo_id, local_files_only=True)
    except (ImportError, HFValidationError, LocalEntryNotFoundError, ValueError, OSError):
        return None


def base_model_name(model: str | Path) -> str:
    """How a run names the model it started from (what a LoRA adapter's ``base_model_name_or_path`` says): a local
    folder by its absolute path (a relative one means nothing from a server's working directory), else the Hub id
    as given (not this machine's cache folder of it)."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def local_checkpoint(model: str | Path) -> str:
    """``model`` as a local folder: itself, or its snapshot in the Hugging Face cache."""
    if Path(model).expanduser().exists():
        return str(Path(model).expanduser())
    return hub_snapshot(str(model)) or str(model)


def _json_file(path: Path) -> dict:
    """A JSON file's mapping; empty where it is unreadable (its own error comes where it is loaded)."""
    try:
        value = json.loads(path.read_text(), object_pairs_hook=_special_floats)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def check_model_source(model: Any, key: str = "model.model") -> None:
    """A ``model`` given as a path must be a checkpoint folder (a config.json inside) or a model in the
    Hugging Face cache: said at once, naming the nearest folders, not after the data is tokenized
    (hub downloads are off in training jobs)."""
    if isinstance(model, Mapping) or model is None:
        return
    path = Path(local_checkpoint(model))
    if (path / "adapter_config.json").is_file():  # transformers loads the adapter too: frozen, or dropped by lora
        raise ConfigError(
            f"{key}: {str(model)!r} holds a peft adapter (adapter_config.json), which lit-hbp would not train as "
            "given: merge it into its base model (PeftModel.merge_and_unload().save_pretrained(folder), or lit-hbp's "
            "export with --merge-lora) and give that folder"
        )
    if (path / "config.json").is_file():
        quantized = _json_file(path / "config.json").get("quantization_config")
        if quantized is not None:
            method = quantized.get("quant_method", "?") if isinstance(quantized, Mapping) else quantized
            raise ConfigError(
                f"{key}: {str(model)!r} is a quantized checkpoint (quantization_config, quant_method {method!r}): "
                "lit-hbp trains unquantized weights only; give the unquantized (bf16 or fp32) folder"
            )
        return
    path = Path(str(model)).expanduser()
    if path.is_dir():
        raise ConfigError(f"{key}: {str(model)!r} is a folder without a config.json: not a checkpoint folder")
    parent = path.parent if path.parent.is_dir() else None
    near = did_you_mean(path.name, (p.name for p in parent.iterdir() if p.is_dir())) if parent else ""
    raise ConfigError(
        f"{key}: {str(model)!r} is neither a checkpoint folder{near} nor a model in the Hugging Face cache "
        "(give the folder save_pretrained wrote, or a config mapping with model_type)"
    )
