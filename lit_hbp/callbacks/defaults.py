"""The callbacks every CLI run gets, added to those its config lists (``lit_hbp.cli.app``)."""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
from lightning.pytorch.callbacks import ProgressBar

from lit_hbp.callbacks.checkpoint import FinalCheckpoint
from lit_hbp.callbacks.interrupt import InterruptCheckpoint
from lit_hbp.callbacks.lost_rank import LostRankReport
from lit_hbp.callbacks.progress import HBPProgressBar, LevelSummary
from lit_hbp.callbacks.rundir import DiscardEmptyRunDir


def with_default_callbacks(
    callbacks: L.Callback | Sequence[L.Callback] | None, enable_progress_bar: bool | None = True
) -> list[L.Callback]:
    """``callbacks`` plus those of lit-hbp's console and run hygiene the list has none of:
    FinalCheckpoint, InterruptCheckpoint, LostRankReport, LevelSummary, DiscardEmptyRunDir, and
    HBPProgressBar
    unless the list has a progress bar or ``enable_progress_bar`` is False (Lightning refuses a bar
    then)."""
    out = [callbacks] if isinstance(callbacks, L.Callback) else list(callbacks or [])
    wanted: list[L.Callback] = [
        FinalCheckpoint(),
        InterruptCheckpoint(),
        LostRankReport(),
        LevelSummary(),
        DiscardEmptyRunDir(),
    ]
    if enable_progress_bar is not False:
        wanted.append(HBPProgressBar())
    for callback in wanted:
        kind = ProgressBar if isinstance(callback, ProgressBar) else type(callback)
        if not any(isinstance(c, kind) for c in out):
            out.append(callback)
    return out
