"""What a vision-language run's tower encodes, per sample: the planner's and the level search's view of
a data set's images and videos (numpy only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VisionLoad:
    """What a vision-language run's tower encodes, per sample: ``patches`` (image patches, video frames'
    included) and ``work`` (its forward in the planner's units: squared lengths, ``media.vision_work``).
    The level search prices a level's vision time from ``work`` and its memory from the most patches a
    token of a pack can carry (``patches_per_token``)."""

    patches: np.ndarray
    work: np.ndarray

    def patches_per_token(self, lengths) -> float:
        """The most patches per token of any sample: a pack of L tokens holds at most L times it."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return float(np.max(np.asarray(self.patches, np.float64) / np.maximum(lengths, 1), initial=0.0))
