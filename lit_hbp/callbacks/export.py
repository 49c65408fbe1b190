"""HBPExport: write a Hugging Face ``save_pretrained`` folder when fit ends."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

from lit_hbp.callbacks.interrupt import InterruptCheckpoint
from lit_hbp.errors import ConfigError, did_you_mean


def run_folders(trainer: L.Trainer) -> list[Path]:
    """The folders a run writes into: each ModelCheckpoint's (resolved as it resolves one it was not given)
    and the loggers'."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    logs = [Path(lg.log_dir) for lg in trainer.loggers if getattr(lg, "log_dir", None)]
    default = Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints"
    saves = [Path(c.dirpath) if c.dirpath else default for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    return [p.resolve() for p in (*saves, *logs)]


class HBPExport(L.Callback):
    """At the end of fit, save a checkpoint (every rank takes part, as ZeRO needs) and turn it into a
    ``save_pretrained`` folder in ``dirpath`` with ``lit_hbp.export`` (rank zero): config, safetensors weights in
    ``dtype`` (default: the one the base model was saved in, float32 where it said none), the run's tokenizer; LoRA
    runs write the adapter, or the merged model with ``merge_lora``. The intermediate checkpoint is removed
    afterwards. A run stopped by Ctrl-C (``InterruptCheckpoint``) is not exported: the log says how to export its
    checkpoint."""

    def __init__(self, dirpath: str, dtype: str | None = None, merge_lora: bool = False):
        from lit_hbp.export import DTYPES

        if dtype is not None and dtype not in DTYPES:
            raise ConfigError(f"HBPExport dtype: {dtype!r}{did_you_mean(dtype, DTYPES)} is not one of {sorted(DTYPES)}")
        self.dirpath, self.dtype, self.merge_lora = Path(dirpath), dtype, merge_lora

    @property
    def _staging(self) -> Path:
        """Where the run's last checkpoint is saved for the export, and removed from after it."""
        return self.dirpath.with_name(self.dirpath.name + ".checkpoint")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from lit_hbp.export import check_adapter_servable, check_export_folder
        from lit_hbp.lightning.module import HBPLitModule

        if not isinstance(pl_module, HBPLitModule):
            raise TypeError(
                f"HBPExport exports the model of an HBPLitModule run, not of a {type(pl_module).__name__}: save your "
                "own module's Hugging Face model with model.save_pretrained(folder) (and the tokenizer beside it)"
            )
        if stage == "fit":  # refused before training, not after it
            check_export_folder(self.dirpath, "HBPExport dirpath")
            if self._staging.exists():
                raise ConfigError(
                    f"HBPExport dirpath {self.dirpath}: {self._staging} exists, where the export saves the run's "
                    "last checkpoint before converting it (and removes it after): move it away or give another dirpath"
                )
            for written in run_folders(trainer):
                if self.dirpath.resolve() in (written, *written.parents):
                    raise ConfigError(
                        f"HBPExport dirpath {self.dirpath} holds {written}, where this run writes its checkpoints or "
                        "logs (the export would find them there when fit ends): give a folder of its own"
                    )
            if self.merge_lora and not pl_module.hparams.get("lora"):
                raise ConfigError("HBPExport merge_lora: true, but the run trains no LoRA adapters: drop it")
            check_adapter_servable(dict(pl_module.hparams), self.merge_lora)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lit_hbp.export import export_checkpoint

        interrupted = [c.checkpoint for c in trainer.callbacks if isinstance(c, InterruptCheckpoint) and c.checkpoint]
        if interrupted:  # a run stopped by Ctrl-C is not the model asked for: it is resumed, not served
            rank_zero_info(
                f"HBPExport: nothing written to {self.dirpath}: training was interrupted; to export that step "
                f"anyway: python -m lit_hbp.export {interrupted[0]} {self.dirpath}"
            )
            return
        staging = self._staging
        trainer.save_checkpoint(staging)
        trainer.strategy.barrier("hbp_export_saved")
        if trainer.is_global_zero:
            export_checkpoint(staging, self.dirpath, self.dtype, self.merge_lora, option="HBPExport dirpath")
            if staging.is_dir():
                shutil.rmtree(staging)
            else:
                staging.unlink()
        trainer.strategy.barrier("hbp_export_written")
