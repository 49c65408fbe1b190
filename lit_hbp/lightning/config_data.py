"""The data a config names, read outside a fit as the data module's set-up reads it: the sample lengths (and, for
images and videos, the samples) the level search and the cost tools price (``python -m lit_hbp.autoselect
--config``, ``bench/ckpt_memory.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from lit_hbp.data.sources import Source
from lit_hbp.data.store import SampleStore
from lit_hbp.data.tokenize import id_bound, tokenize_source
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.datamodule import data_seed
from lit_hbp.lightning.loader import StoreSamples, media_inputs
from lit_hbp.lightning.renderers import load_renderers
from lit_hbp.packing.vision_load import VisionLoad


def config_lengths(config: dict) -> tuple[np.ndarray, int, VisionLoad | None]:
    """Sample lengths of the config's data sources, the tokenizer's vocabulary size and, for a
    vision-language checkpoint's data with images or videos, what they give its tower (``VisionLoad``)."""
    return config_samples(config)[:3]


def _data_section(config: dict, *keys: str) -> dict:
    """The config's ``data`` section with its tokenizer (and ``keys``), the demo data built where it names it."""
    data = config.get("data") or {}
    missing = [f"data.{k}" for k in ("tokenizer", *keys) if not data.get(k)]
    if missing:
        raise ConfigError(f"the config has no {' or '.join(missing)}: give {'them' if len(missing) > 1 else 'it'}")
    if data.get("demo_dir"):
        from lit_hbp.demo import ensure_kind

        ensure_kind(data["demo_dir"], data.get("demo", "text"))
    return data


def config_samples(config: dict) -> tuple[np.ndarray, int, VisionLoad | None, Any]:
    """``config_lengths`` and, for data with images or videos, the samples themselves as a measured level
    search packs them into its probes (``StoreSamples``, their images read by the
    checkpoint's processor); None for text."""
    from lit_hbp.data.media import vision_load

    data = _data_section(config, "sources")
    tok, processor, vlm_config = load_renderers(
        data["tokenizer"], data.get("chat_template"), data.get("processor_kwargs")
    )
    sources = [Source.of(s, f"data.sources[{i}]") for i, s in enumerate(data["sources"])]
    train_on, cache = data.get("train_on", "assistant"), data.get("cache_dir")
    num_proc = data.get("num_proc")
    tokenized = [
        tokenize_source(s, tok, train_on, cache, label=f"data.sources[{i}]", num_proc=num_proc, processor=processor)
        for i, s in enumerate(sources)
    ]
    store = SampleStore.build(tokenized, max_len=None, seed=data_seed(data.get("seed"), config.get("seed_everything")))
    if not store.has_media or vlm_config is None:
        return store.lengths, id_bound(tok), None, None
    samples = StoreSamples(store, media_inputs(store, processor, vlm_config))
    return store.lengths, id_bound(tok), vision_load(store.media_pixels(), vlm_config), samples
