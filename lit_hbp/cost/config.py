"""A training YAML read outside LightningCLI: its model, for the tools that price or probe a run before
it starts (level auto-selection, the memory report, benchmarks). Its data's lengths and samples, which
the data module's set-up computes: ``lit_hbp.lightning.config_data.config_samples``."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from lit_hbp.errors import ConfigError
from lit_hbp.model_spec import ModelSpec, load_model_spec


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (GPUs, lengths, steps), refused in one line otherwise."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """An argparse type: a number >= 0 (a memory margin)."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def check_levels(levels: list, world: int, layers: int) -> None:
    """Refuse levels set-up refuses: pack lengths increasing, each sp dividing the world (``validate_levels``),
    no more checkpointed layers than the model has."""
    from lit_hbp.packing import validate_levels

    validate_levels(levels, world)
    for i, lv in enumerate(levels):
        if lv.ckpt_layers > layers:
            raise ValueError(
                f"level {i} ({lv.pack_len} tokens) checkpoints {lv.ckpt_layers} layers; the model has {layers}"
            )


def read_config(path: str | Path) -> dict:
    """A training YAML with its ${...} interpolations resolved (``check_yaml_text`` first)."""
    from omegaconf import OmegaConf

    check_yaml_text(Path(path).read_text(), str(path))
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def check_yaml_text(text: str, where: str, key: str = "") -> None:
    """What YAML 1.1 (PyYAML, jsonargparse and OmegaConf read it) would take silently, refused by its key in ``text``
    (a config file ``where``, or a command-line value: ``where`` empty, ``key`` its option):
    - an unquoted ``4096:1`` is the base-60 number 245761: a level written PACK_LEN:SP would train other pack lengths;
      ``0:00:00.5`` the number 0.5 (a ``train_time_interval`` then stopped on a 20-line report of every type tried);
    - a key given twice in one mapping keeps the last: a second ``sources:`` pasted below the first, or a second
      ``trainer:`` section, drops the first without a word."""
    import yaml

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return  # its own error comes where it is loaded
    queue = [(root, key)]
    while queue:
        node, at = queue.pop(0)
        line = f"{where}, line {node.start_mark.line + 1}: " if where and node is not None else ""
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for k, _ in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else None
                if name is not None and name != "<<" and name in seen:
                    raise ConfigError(
                        f"{where + ': ' if where else ''}{f'{at}.{name}'.lstrip('.')} is given twice (lines "
                        f"{seen[name] + 1} and {k.start_mark.line + 1}): YAML would keep the last and drop the "
                        "first without a word; write it once (a list option holds all its items in one list)"
                    )
                seen.setdefault(name, k.start_mark.line)
            queue += [(v, f"{at}.{k.value}".lstrip(".")) for k, v in node.value]
        elif isinstance(node, yaml.SequenceNode):
            queue += [(v, f"{at}[{i}]") for i, v in enumerate(node.value)]
        elif isinstance(node, yaml.ScalarNode) and node.tag.endswith((":int", ":float")) and not node.style:
            if ":" not in node.value:
                continue
            hint = " or write a mapping, e.g. {pack_len: ..., sp: ...}" if "levels" in at else ""
            raise ConfigError(
                f"{line}{at or 'the value'}: {node.value} reads as the base-60 number {yaml.safe_load(node.value)} "
                f"in YAML: quote it ('{node.value}'){hint}"
            )


def config_world(config: dict) -> tuple[int, int] | None:
    """(processes, processes per node) a training config runs on: its ``trainer.devices`` x ``trainer.num_nodes``;
    None when it names no count (``auto``, a device list: the machine decides)."""
    trainer = config.get("trainer") or {}
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1 or not isinstance(nodes, int):
        return None
    return devices * max(nodes, 1), devices


def model_config(config: dict, vocab: int | None) -> dict | str:
    model = (config.get("model") or {}).get("model")
    if model is None:
        raise ValueError("the config has no model.model entry (a checkpoint path or a config mapping)")
    if isinstance(model, dict) and vocab is not None:  # as the fit builds it: the mapping's own if not fewer
        model = {**model, "vocab_size": max(vocab, model.get("vocab_size") or vocab)}
    return model


def config_vocab(config: dict) -> int | None:
    """The vocabulary a fit gives the config's model where its size depends on it (a model mapping without
    ``vocab_size``: the embedding then has the tokenizer's rows, the data module's ``vocab_size`` linked to the
    module), read as the level search reads it: ``id_bound`` of ``data.tokenizer`` (a local folder or the Hugging
    Face cache, as ``lightning.renderers.load_tokenizer`` loads it; a demo built first, as the data module builds it);
    None where the model names its own (a mapping's ``vocab_size``, a checkpoint's)."""
    model = (config.get("model") or {}).get("model")
    if not isinstance(model, dict) or model.get("vocab_size") is not None:
        return None
    data = config.get("data") or {}
    if not data.get("tokenizer"):
        raise ConfigError(
            "model.model names no vocab_size and data.tokenizer is not given: the embedding has the tokenizer's "
            "rows; give data.tokenizer, or model.model.vocab_size"
        )
    from transformers import AutoTokenizer

    from lit_hbp.data.tokenize import id_bound
    from lit_hbp.model.checks import local_checkpoint

    if data.get("demo_dir"):
        from lit_hbp.demo import ensure_kind

        ensure_kind(data["demo_dir"], data.get("demo", "text"))
    try:  # as the data module loads it: a local folder or the Hugging Face cache, no download
        tokenizer = AutoTokenizer.from_pretrained(local_checkpoint(str(data["tokenizer"])), local_files_only=True)
    except OSError:
        raise ConfigError(
            f"data.tokenizer: {data['tokenizer']!r} is neither a local folder nor a tokenizer in the Hugging Face cache"
        ) from None
    return id_bound(tokenizer)


def spec_of(model: dict | str) -> ModelSpec:
    """The shape of the config's model: its mapping, or its checkpoint folder's config.json (counted on the model
    built on the meta device: ``configured_spec``); a folder that is not on this machine
    (pricing a cluster's run on a laptop) names the way round it."""
    from lit_hbp.model.causal_lm import configured_spec

    if isinstance(model, dict):
        return configured_spec(model) or ModelSpec.from_config(model)
    if not Path(model).exists():
        from lit_hbp.model_spec import MODELS

        raise ValueError(
            f"model.model {model} is not on this machine: give the model's shape with --model, a preset "
            f"({', '.join(sorted(MODELS))}) or a config.json (the cost tools; a measured search trains the model "
            "itself: put its folder here)"
        )
    return configured_spec(model) or ModelSpec.from_config(Path(model))


def load_spec(spec: str) -> ModelSpec:
    """A tool's ``--model``: ``load_model_spec``'s (a preset, a config.json or checkpoint folder, a training YAML's
    model), counted on its model built on the meta device (``configured_spec``), as a run prices it."""
    from lit_hbp.model.causal_lm import configured_spec
    from lit_hbp.model.checks import read_config_json
    from lit_hbp.model_spec import MODELS

    base = load_model_spec(spec)
    if spec.lower() in MODELS:
        return base
    path = Path(spec)
    if path.suffix in (".yaml", ".yml"):
        model = model_config(read_config(path), None)
    else:
        model = str(path) if path.is_dir() else read_config_json(path)
    built = configured_spec(model)
    return base if built is None else replace(built, name=base.name)
