"""The callbacks in plain Lightning projects, and with the offline W&B logger."""

import csv
import glob
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import quiet_trainer
from lightning.pytorch.loggers import CSVLogger

from lit_hbp.callbacks import HBPCurriculum, PackingMetrics
from lit_hbp.cli.app import main
from lit_hbp.packing import Level, plan_hbp

ROOT = Path(__file__).resolve().parents[1]


class PlainData(L.LightningDataModule):
    """A non-HBP data module: ordinary tensors, plus the plan of how it would pack its samples."""

    def __init__(self):
        super().__init__()
        lengths = np.random.default_rng(0).integers(10, 600, 400)
        self.plan = plan_hbp(lengths, [Level(512), Level(1024, 2)], world_size=2, seed=0)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        return torch.utils.data.DataLoader(data, batch_size=8)


class PlainModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_packing_metrics_in_a_plain_lightning_project(tmp_path):
    dm = PlainData()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=5,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[PackingMetrics()],
    )
    model = PlainModel()
    given, log = [], model.log

    def recording_log(name, value, **kw):
        if name == "packing/level":
            given.append(value)
        return log(name, value, **kw)

    model.log = recording_log
    trainer.fit(model, dm)
    # A host tensor, never a Python number: Lightning would copy a number to the device every micro-step.
    assert given and all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in given)
    (metrics_file,) = glob.glob(f"{tmp_path}/**/metrics.csv", recursive=True)
    rows = list(csv.DictReader(open(metrics_file)))
    logged = {k: float(v) for row in rows for k, v in row.items() if v}
    expected = dm.plan.metrics()
    for key in ("abr", "dbr", "pr", "cr", "ave_t", "fill", "n_steps"):
        assert logged[f"packing/{key}"] == pytest.approx(expected[key], rel=1e-6), key
    levels = [float(r["packing/level"]) for r in rows if r.get("packing/level")]
    assert levels == [float(x) for x in dm.plan.step_level[: len(levels)]]


class DictData(L.LightningDataModule):
    """An ordinary padded data module: dicts of input_ids and attention_mask."""

    def train_dataloader(self):
        rows = [{"input_ids": torch.randint(0, 50, (12,)), "attention_mask": torch.ones(12, dtype=torch.long)}] * 16
        return torch.utils.data.DataLoader(rows, batch_size=4)


class DictModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50)

    def training_step(self, batch, batch_idx):
        x = batch["input_ids"]
        return torch.nn.functional.cross_entropy(self.out(self.emb(x))[:, :-1].reshape(-1, 50), x[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_every_callback_works_in_a_plain_project_or_says_what_it_needs(tmp_path):
    """The table of callbacks in docs/lightning.md, checked: in a project with its own module and padded dict
    batches, the console and run hygiene work; the others stop at once with the one line they need."""
    from lit_hbp.callbacks import (
        DiscardEmptyRunDir,
        FinalCheckpoint,
        HBPExport,
        HBPProgressBar,
        HBPThroughputMonitor,
        InterruptCheckpoint,
        LevelSummary,
    )

    counted = HBPThroughputMonitor(
        batch_size_fn=lambda b: len(b["input_ids"]), length_fn=lambda b: b["input_ids"].numel()
    )
    works = [HBPProgressBar(), FinalCheckpoint(), InterruptCheckpoint(), DiscardEmptyRunDir(), counted]
    for callback in works:
        bar = isinstance(callback, HBPProgressBar)
        trainer = quiet_trainer(max_steps=2, callbacks=[callback], enable_progress_bar=bar, default_root_dir=tmp_path)
        trainer.fit(DictModel(), DictData())
        assert trainer.global_step == 2, type(callback).__name__
    needs = [
        (HBPCurriculum(5), "needs a data module with set_curriculum(warmup_steps, short_levels), such as HBPDataMod"),
        (PackingMetrics(), "needs a data module with a `plan` attribute"),
        (LevelSummary(), "counts the levels of lit_hbp PackedBatch micro-batches (from HBPDataModule)"),
        (
            HBPThroughputMonitor(),
            'HBPThroughputMonitor(batch_size_fn=lambda b: len(b["input_ids"]), length_fn=lambda b: b["attention_mask"]',
        ),
        (HBPExport(str(tmp_path / "hf")), "HBPExport exports the model of an HBPLitModule run, not of a DictModel"),
    ]  # fmt: skip
    for callback, message in needs:
        trainer = quiet_trainer(max_steps=1, callbacks=[callback])
        with pytest.raises(TypeError) as e:
            trainer.fit(DictModel(), DictData())
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_callbacks_refuse_data_modules_they_cannot_work_with():
    class NoPlan(L.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1)))

    for callback, message in (
        (HBPCurriculum(5), "needs a data module with set_curriculum"),
        (PackingMetrics(), "needs a data module with a `plan`"),
    ):
        trainer = quiet_trainer(max_steps=1, callbacks=[callback], use_distributed_sampler=True)
        with pytest.raises(TypeError, match=message):
            trainer.fit(PlainModel(), NoPlan())


@pytest.mark.slow
def test_tiny_config_logs_to_wandb_offline(tmp_path, small_demo, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "demo_data").symlink_to(small_demo)
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs/tiny_cpu.yaml"),
            "--config",
            str(ROOT / "configs/wandb_offline.yaml"),
            "--trainer.max_steps",
            "3",
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    import wandb

    # Lightning leaves the run open in-process. `finish` only tells wandb's service process that the run
    # ended (it returns before the service closes the run's log); `teardown` waits for that process to exit,
    # as the atexit hook does when `train.py` ends.
    wandb.finish()
    wandb.teardown()
    (run,) = glob.glob(str(tmp_path / "runs/wandb/offline-run-*"))
    (log,) = glob.glob(f"{run}/*.wandb")
    # Offline, the run's history and config live in its binary log until `wandb sync`.
    records = Path(log).read_bytes()
    for key in (b"train/loss", b"packing/abr", b"curriculum/warmup", b"ave_token"):
        assert key in records, key
    assert glob.glob(str(tmp_path / "runs/tiny_cpu/version_0/events.out.tfevents.*")), "TensorBoard logs beside W&B"
