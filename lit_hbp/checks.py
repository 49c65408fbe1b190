"""Checks that turn a training setup's silent surprises into errors (or a logged statement) before the
expensive part starts: typos in a model config mapping, positions the model does not cover, a world
the levels cannot tile, and the compact resolved config printed at the start of a run.

Pure functions of a config (a mapping, a Hugging Face config object, a level list) so that the CLI
(``lit_hbp.cli``, before processes spawn) and plain Python (``build_causal_lm``,
``HBPLitModule.configure_model``) run the same code.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib
import inspect
import math
import typing
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from lit_hbp.errors import ConfigError

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
# cannot honour them (``causal_lm.check_router_loss``).
LIT_HBP_KEYS = frozenset({"output_router_logits"})
# Legacy RoPE keys, folded into ``rope_parameters`` by configs that have it (set silently otherwise).
ROPE_KEYS = frozenset({"rope_scaling", "rope_theta", "partial_rotary_factor"})
# (field names, field defaults) of the dataclasses a list option's entries may be.
EntryDefaults = list[tuple[frozenset[str], dict[str, Any]]]


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate nearest to ``word`` (difflib), or None when none is near: the "did you mean"."""
    found = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest candidate, to append to an error; "" when none is near."""
    near = closest(word, (c for c in candidates if c != word))
    return f" (did you mean {near!r}?)" if near else ""


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


def position_range(config: Any) -> tuple[int | None, int | None, str]:
    """(max_position_embeddings, the longest position the model covers with its RoPE scaling, how it is
    scaled). A scaling with a ``factor`` extends ``original_max_position_embeddings`` (or
    max_position_embeddings when absent) by that factor; (None, None, "") when the config has no
    max_position_embeddings (ALiBi and other relative-only models)."""
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, bool) or not isinstance(max_pos, int):
        return None, None, ""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, Mapping) and rope and all(isinstance(v, Mapping) for v in rope.values()):
        sets = list(rope.values())  # one per layer type (full / sliding attention)
    else:
        sets = [rope] if isinstance(rope, Mapping) else []
    limit, how = max_pos, ""
    for params in sets:
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


def check_positions(config: Any, levels: Sequence[Any] | None) -> str | None:
    """A document as long as the largest level's pack_len uses positions up to pack_len - 1 (positions
    restart per document): refuse levels past the model's max_position_embeddings unless its RoPE
    scaling covers them, in which case the extension is returned (for the caller to log)."""
    if not levels:
        return None
    longest = max(int(getattr(lv, "pack_len", lv)) for lv in levels)
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
    note = check_positions(module.model.config, levels)
    if note:
        rank_zero_info(note)


def _device_count(devices: Any, accelerator: Any) -> int | None:
    """Devices per node as Lightning will count them, or None when only the started run knows."""
    kind = accelerator.lower() if isinstance(accelerator, str) else None
    if isinstance(devices, bool) or devices is None:
        return None
    if isinstance(devices, (list, tuple)):
        return len(devices) or None
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return 1 if kind == "cpu" else _all_devices(kind)
        if "," in text:  # device indices
            return len([x for x in text.split(",") if x.strip()]) or None
        try:
            devices = int(text)
        except ValueError:
            return None
    if isinstance(devices, int):
        if devices > 0:
            return devices
        if devices == -1 and kind != "cpu":
            return _all_devices(kind)
    return None


def _all_devices(kind: str | None) -> int | None:
    if kind not in ("gpu", "cuda", "auto"):
        return None
    from lightning.fabric.accelerators.cuda import num_cuda_devices

    n = num_cuda_devices()  # NVML where it can: does not initialize CUDA in this process
    if n > 0:
        return n
    return 1 if kind == "auto" else None


def world_size_of(trainer: Mapping[str, Any]) -> int | None:
    """trainer.devices x trainer.num_nodes from a trainer config section, or None when it cannot be
    known before the run starts (e.g. ``devices: auto`` on an accelerator this process cannot count)."""
    n = _device_count(trainer.get("devices", "auto"), trainer.get("accelerator", "auto"))
    nodes = trainer.get("num_nodes", 1)
    if n is None or isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        return None
    return n * nodes


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


def check_sp_setup(levels: Sequence[Any], world_size: int, model: Any) -> None:
    """The levels against the world (every sp divides it) and, when they use sequence parallelism and
    the model's shape is known, against its attention heads and layers: HBPStrategy's own checks at
    setup, run from the config alone."""
    from lit_hbp.packing.levels import as_level, validate_levels

    levels = validate_levels([as_level(x, f"data.levels[{i}]") for i, x in enumerate(levels)], world_size)
    if all(lv.sp == 1 for lv in levels):
        return
    config = model_config(model)
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(heads, int) or not isinstance(layers, int):
        return
    from lit_hbp.parallel.kind import validate_sp_setup

    validate_sp_setup(levels, world_size, heads, getattr(config, "num_key_value_heads", None) or heads, layers)


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


def local_checkpoint(model: str | Path) -> str:
    """``model`` as a local folder: itself, or its snapshot in the Hugging Face cache."""
    if Path(model).expanduser().exists():
        return str(Path(model).expanduser())
    return hub_snapshot(str(model)) or str(model)


def check_model_source(model: Any, key: str = "model.model") -> None:
    """A ``model`` given as a path must be a checkpoint folder (a config.json inside) or a model in the
    Hugging Face cache: said at once, naming the nearest folders, not after the data is tokenized
    (hub downloads are off in training jobs)."""
    if isinstance(model, Mapping) or model is None:
        return
    path = Path(local_checkpoint(model))
    if (path / "config.json").is_file():
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


def check_curriculum(levels: Sequence[Any], callbacks: Any) -> None:
    """An ``HBPCurriculum`` among the trainer's callbacks whose ``short_levels`` name a pack length the
    levels do not have (``--data.levels`` given without it) is refused now, naming both."""
    from lit_hbp.packing.levels import as_level

    try:
        lengths = sorted(as_level(x, f"data.levels[{i}]").pack_len for i, x in enumerate(levels))
    except (ValueError, TypeError):
        return  # the levels' own error comes where they are checked
    for i, entry in enumerate(callbacks if isinstance(callbacks, list) else []):
        if not isinstance(entry, Mapping) or not str(entry.get("class_path", "")).endswith("HBPCurriculum"):
            continue
        short = (entry.get("init_args") or {}).get("short_levels")
        for x in short if isinstance(short, list) else []:
            try:
                length = as_level(x).pack_len
            except (ValueError, TypeError):
                continue
            if length not in lengths:
                raise ConfigError(
                    f"trainer.callbacks[{i}] (HBPCurriculum) short_levels: {x!r} is not the pack_len of a level of "
                    f"data.levels ({lengths}): name levels the data has, or leave short_levels out (every level "
                    "without sp but the largest)"
                )


def check_run_config(config: Mapping[str, Any]) -> None:
    """What a LightningCLI config (the subcommand's section, as plain data) shows wrong before any
    process spawns: the model (its folder, or the mapping's keys), the levels against the world size
    and the model's heads."""
    data = config.get("data") or {}
    if data.get("demo_dir") and data.get("demo") == "vision":  # the demo's checkpoint folder is the model
        from lit_hbp.demo_vlm import ensure_kind

        ensure_kind(data["demo_dir"], "vision")
    model = (config.get("model") or {}).get("model")
    check_model_source(model)
    if isinstance(model, Mapping):
        check_model_config(model)
    levels = (config.get("data") or {}).get("levels")
    if not isinstance(levels, list) or not levels:  # a LevelSelector: chosen at setup
        return
    check_curriculum(levels, (config.get("trainer") or {}).get("callbacks"))
    world = world_size_of(config.get("trainer") or {})
    if world is not None:
        check_sp_setup(levels, world, model)


# ---- the resolved config, compact ------------------------------------------------------------------


@functools.cache
def class_arguments(class_path: str) -> dict[str, Any]:
    """The init arguments jsonargparse accepts for a class (``**kwargs`` resolved the way it resolves
    them) with their defaults as a config dump writes them; {} when the class cannot be resolved."""
    from jsonargparse import ArgumentParser

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, fail_untyped=False)
        dumped = parser.dump(parser.get_defaults(), skip_validation=True, skip_none=False)
    except (ImportError, AttributeError, TypeError, ValueError, argparse.ArgumentError):
        return {}
    return yaml.safe_load(dumped) or {}


def dataclass_defaults(typehint: Any) -> EntryDefaults:
    """(field names, field defaults) of every dataclass a type hint names (``list[Source | dict]``:
    Source's)."""
    out = []
    if dataclasses.is_dataclass(typehint) and isinstance(typehint, type):
        fields = dataclasses.fields(typehint)
        defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        out.append((frozenset(f.name for f in fields), defaults))
    for arg in typing.get_args(typehint):
        out += dataclass_defaults(arg)
    return out


def _compact_value(value: Any, entry_defaults: EntryDefaults) -> Any:
    if isinstance(value, list):
        return [_compact_value(v, entry_defaults) for v in value]
    if not isinstance(value, dict):
        return value
    if "class_path" in value:
        init = value.get("init_args") or {}
        defaults = class_arguments(value["class_path"])
        init = {k: v for k, v in init.items() if k not in defaults or defaults[k] != v}
        return {"class_path": value["class_path"], **({"init_args": init} if init else {})}
    for names, defaults in entry_defaults:  # a dataclass entry: the fields it sets to other than their default
        if set(value) <= names:
            return {k: v for k, v in value.items() if k not in defaults or defaults[k] != v}
    return value


def compact_config(
    config: Mapping[str, Any],
    defaults: Mapping[str, Any],
    entry_defaults: Mapping[str, EntryDefaults] | None = None,
) -> dict[str, Any]:
    """``config`` without what equals ``defaults`` (nested by section), class specs without their
    default init_args, and dataclass entries (``entry_defaults``: per dotted key) without default
    fields: what a run actually sets, short enough to read at the start of its log."""
    entry_defaults = entry_defaults or {}

    def walk(cfg: Mapping[str, Any], dflt: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out = {}
        for key, value in cfg.items():
            dotted = f"{prefix}{key}"
            default = dflt.get(key, dataclasses.MISSING) if isinstance(dflt, Mapping) else dataclasses.MISSING
            if isinstance(value, Mapping) and "class_path" not in value and isinstance(default, Mapping):
                sub = walk(value, default, f"{dotted}.")
                if sub:
                    out[key] = sub
            elif value != default:
                out[key] = _compact_value(value, entry_defaults.get(dotted, []))
        return out

    return walk(config, defaults, "")


class _CompactDumper(yaml.SafeDumper):
    """Block YAML whose short leaf collections (no nested ones) are written on one line."""


def _represent_compact(dumper: yaml.SafeDumper, data: dict | list) -> yaml.Node:
    items = data.values() if isinstance(data, dict) else data
    flow = bool(data) and not any(isinstance(v, (dict, list)) for v in items) and len(repr(data)) <= 72
    if isinstance(data, dict):
        return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=flow)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_CompactDumper.add_representer(dict, _represent_compact)
_CompactDumper.add_representer(list, _represent_compact)


def compact_yaml(data: Mapping[str, Any]) -> str:
    """``data`` as block YAML in its own key order, short leaf lists and mappings inline."""
    return yaml.dump(dict(data), Dumper=_CompactDumper, sort_keys=False, width=120).rstrip()
