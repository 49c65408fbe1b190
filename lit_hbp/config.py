"""A training YAML read outside LightningCLI: its data lengths and its model, for the tools that
price or probe a run before it starts (level auto-selection, benchmarks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing.vision_load import VisionLoad


def read_config(path: str | Path) -> dict:
    """A training YAML with its ${...} interpolations resolved."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def config_lengths(config: dict) -> tuple[np.ndarray, int, VisionLoad | None]:
    """Sample lengths of the config's data sources, the tokenizer's vocabulary size and, for a
    vision-language checkpoint's data with images or videos, what they give its tower (``VisionLoad``)."""
    return config_samples(config)[:3]


def config_samples(config: dict) -> tuple[np.ndarray, int, VisionLoad | None, Any]:
    """``config_lengths`` and, for data with images or videos, the samples themselves as a measured level
    search packs them into its probes (``lit_hbp.data.datamodule.StoreSamples``, their images read by the
    checkpoint's processor); None for text."""
    from lit_hbp.data.datamodule import StoreSamples, load_renderers, media_inputs
    from lit_hbp.data.media import vision_load
    from lit_hbp.data.sources import Source
    from lit_hbp.data.store import SampleStore
    from lit_hbp.data.tokenize import tokenize_source

    data = config.get("data") or {}
    if data.get("demo_dir"):
        from lit_hbp.demo_vlm import ensure_kind

        ensure_kind(data["demo_dir"], data.get("demo", "text"))
    tok, processor, vlm_config = load_renderers(data["tokenizer"], data.get("chat_template"))
    sources = [Source.of(s, f"data.sources[{i}]") for i, s in enumerate(data["sources"])]
    train_on, cache = data.get("train_on", "assistant"), data.get("cache_dir")
    num_proc = data.get("num_proc")
    tokenized = [
        tokenize_source(s, tok, train_on, cache, label=f"data.sources[{i}]", num_proc=num_proc, processor=processor)
        for i, s in enumerate(sources)
    ]
    store = SampleStore.build(tokenized, max_len=None, seed=data.get("seed", 0))
    if not store.has_media or vlm_config is None:
        return store.lengths, len(tok), None, None
    samples = StoreSamples(store, media_inputs(store, processor, vlm_config))
    return store.lengths, len(tok), vision_load(store.media_pixels(), vlm_config), samples


def model_config(config: dict, vocab: int | None) -> dict | str:
    model = (config.get("model") or {}).get("model")
    if model is None:
        raise ValueError("the config has no model.model entry (a checkpoint path or a config mapping)")
    if isinstance(model, dict) and vocab is not None:
        model = {**model, "vocab_size": vocab}
    return model


def spec_of(model: dict | str) -> ModelSpec:
    """The shape of the config's model: its mapping, or its checkpoint folder's config.json; a folder
    that is not on this machine (pricing a cluster's run on a laptop) names the way round it."""
    if isinstance(model, dict):
        return ModelSpec.from_config(model)
    if not Path(model).exists():
        from lit_hbp.model_spec import MODELS

        raise ValueError(
            f"model.model {model} is not on this machine: give the model's shape with --model, a preset "
            f"({', '.join(sorted(MODELS))}) or a config.json"
        )
    return ModelSpec.from_config(Path(model))
