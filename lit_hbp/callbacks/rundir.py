"""DiscardEmptyRunDir: a run that fails before its first optimizer step leaves no log folder.

Where the folder comes from: Lightning creates each logger's experiment before any ``setup`` hook
(``trainer._call_setup_hook`` reads ``logger.experiment``), so TensorBoardLogger makes
``<save_dir>/<name>/version_N`` with an empty events file and CSVLogger its ``version_N``; then
LightningCLI's SaveConfigCallback writes ``config.yaml`` there and HBPDataModule its
``data_report.json``. A config error raised from there on left a ``version_N`` that holds nothing a
re-run would not write again, and shifted every later run's version number.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

# What a run writes into its log folder before it trains: the config (SaveConfigCallback), the
# hyper-parameters, the data module's report (a function of the data and the config, printed in
# summary on the console and rewritten by the next run), and the loggers' files, which before the
# first optimizer step hold no training metric.
REWRITTEN_BY_A_RERUN = ("config.yaml", "hparams.yaml", "data_report.json", "events.out.tfevents.*", "metrics.csv")


class DiscardEmptyRunDir(L.Callback):
    """On a failure before the run's first optimizer step, remove (rank 0) the TensorBoard / CSV
    logger's ``version_N`` folder when it holds nothing but files a re-run writes again
    (``REWRITTEN_BY_A_RERUN``) and empty folders, then the logger's ``name`` folder if that is left
    empty. Anything else in it (a checkpoint, a profile, a file of the user's) keeps the folder, as
    does any failure after an optimizer step. The loggers are finalized first (as Lightning does
    next on a failure); the removed ones are taken off the trainer so nothing writes there again.

    The CLI adds this callback; in a plain Lightning project add it to ``Trainer(callbacks=...)``.
    """

    def __init__(self) -> None:
        self._start_step: int | None = None
        self._created_after = time.time()  # files older than this are an earlier run's: never removed
        self.removed: list[str] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_step = trainer.global_step

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        trained = self._start_step is not None and trainer.global_step > self._start_step
        if trained or not trainer.is_global_zero:
            return
        discarded, removed = [], []
        for logger in trainer.loggers:
            if not isinstance(logger, (TensorBoardLogger, CSVLogger)):
                continue
            log_dir = Path(logger.log_dir)
            if not log_dir.is_dir() or not disposable(log_dir, self._created_after):
                continue
            logger.finalize("failed")
            shutil.rmtree(log_dir)
            discarded.append(logger)
            removed.append(str(log_dir))
            _remove_empty_parents(log_dir, Path(logger.save_dir))
        self.removed += removed
        if discarded:
            trainer.loggers = [lg for lg in trainer.loggers if lg not in discarded]
            rank_zero_info(
                f"the run failed before its first optimizer step: removed its log folder(s) {', '.join(removed)} "
                f"(they held only {', '.join(REWRITTEN_BY_A_RERUN)}, which a re-run writes again)"
            )


def disposable(folder: Path, created_after: float = 0.0) -> bool:
    """True when ``folder`` holds only files named like ``REWRITTEN_BY_A_RERUN``, all written since
    ``created_after`` (a folder an earlier run logged into, e.g. a logger with a fixed ``version``,
    keeps that run's events), and empty folders."""
    for root, _, files in os.walk(folder):
        for name in files:
            if not any(fnmatch.fnmatch(name, pattern) for pattern in REWRITTEN_BY_A_RERUN):
                return False
            if os.path.getmtime(os.path.join(root, name)) < created_after:
                return False
    return True


def _remove_empty_parents(folder: Path, stop: Path) -> None:
    """Remove the now empty folders above ``folder`` up to (not including) ``stop``."""
    stop = stop.resolve()
    parent = folder.resolve().parent
    while parent != stop and stop in parent.parents and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent
