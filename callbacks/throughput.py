"""Lightning's ThroughputMonitor, told how to count samples and tokens of packed micro-batches."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ThroughputMonitor


def samples_in_batch(batch: dict) -> int:
    return int(batch["sample_index"].numel())


def tokens_in_batch(batch: dict) -> int:
    return int(batch["n_tokens"])


class HBPThroughputMonitor(ThroughputMonitor):
    """Logs samples/s and tokens/s (``train/items_per_sec`` counts real tokens, not padding)."""

    def __init__(self, **kwargs: Any):
        super().__init__(batch_size_fn=samples_in_batch, length_fn=tokens_in_batch, **kwargs)
