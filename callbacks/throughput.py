"""Lightning's ThroughputMonitor, told how to count samples and tokens of packed micro-batches."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ThroughputMonitor


def samples_in_batch(batch: dict) -> float:
    """This rank's share: every rank of an SP group sees the group's whole list of samples."""
    return batch["sample_index"].numel() / batch.get("sp", 1)


def tokens_in_batch(batch: dict) -> float:
    """This rank's share of the pack's real tokens (not its padding)."""
    return batch["n_tokens"] / batch.get("sp", 1)


class HBPThroughputMonitor(ThroughputMonitor):
    """Logs samples/s and tokens/s where tokens are real sample tokens, never padding; an SP group's
    ranks each count their 1/sp share, so the world totals are right.

    A level's last step may hold empty completion packs (a dummy forward so collectives match).
    Such a micro-batch adds no sample and no token; its time still counts, in the next update.
    """

    def __init__(self, **kwargs: Any):
        super().__init__(batch_size_fn=samples_in_batch, length_fn=tokens_in_batch, **kwargs)

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, *args: Any) -> None:
        if tokens_in_batch(batch) > 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, *args)
