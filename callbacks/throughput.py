"""Lightning's ThroughputMonitor, told how to count samples and tokens of packed micro-batches."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ThroughputMonitor


def samples_in_batch(batch: dict) -> int:
    return int(batch["sample_index"].numel())


def tokens_in_batch(batch: dict) -> int:
    return int(batch["n_tokens"])


class HBPThroughputMonitor(ThroughputMonitor):
    """Logs samples/s and tokens/s where tokens are real sample tokens, never padding.

    A level's last step may hold empty completion packs (a dummy forward so collectives match).
    Such a micro-batch adds no sample and no token; its time still counts, in the next update.
    """

    def __init__(self, **kwargs: Any):
        super().__init__(batch_size_fn=samples_in_batch, length_fn=tokens_in_batch, **kwargs)

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, *args: Any) -> None:
        if tokens_in_batch(batch) > 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)
