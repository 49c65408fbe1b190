"""Issue 14's console and run-folder rows: the final step checkpointed, a resume that says where it
continues, a progress bar in optimizer steps, a per-level epoch summary, no log folder left by a run
that failed before its first step, and HBPThroughputMonitor in a plain Lightning project."""

import contextlib
import csv
import glob
import io
import logging
import re
import types
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import SHORTER, TINY_LLAMA, chat_datamodule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lit_hbp.callbacks import (
    DiscardEmptyRunDir,
    FinalCheckpoint,
    HBPProgressBar,
    HBPThroughputMonitor,
    LevelSummary,
)
from lit_hbp.cli.app import main
from lit_hbp.lightning.module import HBPLitModule

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 5  # with a checkpoint every 2 steps: 2, 4, and the final 5 only from FinalCheckpoint


class Record(L.Callback):
    """Every trained micro-batch: where it comes from and what it holds."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(
            dict(epoch=batch.epoch, micro=batch.micro_index, level=batch.level, step=trainer.global_step,
                 tokens=batch.n_tokens / batch.sp, samples=batch.sample_index.numel() / batch.sp)
        )  # fmt: skip


class BarProbe(L.Callback):
    """What the training bar shows at each epoch start and after each batch (runs after the bar)."""

    def __init__(self):
        self.shown = []

    def _read(self, trainer, when):
        bar = trainer.progress_bar_callback.train_progress_bar
        self.shown.append((when, bar.n, bar.total, bar.desc.rstrip(": ")))

    def on_train_start(self, trainer, pl_module):
        self._read(trainer, "train start")

    def on_train_epoch_start(self, trainer, pl_module):
        self._read(trainer, "epoch start")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._read(trainer, "batch end")


@contextlib.contextmanager
def console():
    """Everything a run writes to the console: Lightning's log records and stdout (the bar's prints)."""
    records, out = [], io.StringIO()
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    text = types.SimpleNamespace()
    try:
        with contextlib.redirect_stdout(out):
            yield text
    finally:
        logger.removeHandler(handler)
        text.log, text.stdout = "\n".join(records), out.getvalue()


def hbp_fit(root: Path, demo: Path, max_steps: int, callbacks: list, ckpt_path=None, **trainer_kw):
    """A short HBP fit of the tiny model on the demo chats (levels 256 and 1024, accumulate 2)."""
    L.seed_everything(0)
    dm = chat_datamodule(demo, str(demo / "tokenizer"), root / "cache")
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
    record = Record()
    trainer_kw.setdefault("logger", False)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[*callbacks, record],
        **trainer_kw,
    )
    with console() as out:
        trainer.fit(module, dm, ckpt_path=ckpt_path)
    return types.SimpleNamespace(trainer=trainer, dm=dm, rows=record.rows, out=out)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, small_demo):
    """5 optimizer steps, a checkpoint every 2 with save_last, the console callbacks and a logger."""
    root = tmp_path_factory.mktemp("first")
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_last=True, save_top_k=-1,
                           filename="{step}")  # fmt: skip
    probe, summary = BarProbe(), LevelSummary()
    callbacks = [HBPProgressBar(), probe, summary, FinalCheckpoint(), HBPThroughputMonitor(), ckpt]
    run = hbp_fit(root, small_demo, MAX_STEPS, callbacks, logger=CSVLogger(root / "logs"), log_every_n_steps=1)
    run.root, run.bar, run.summary = root, probe.shown, summary
    return run


@pytest.fixture(scope="module")
def resumed_run(first_run, small_demo):
    """The first run resumed from its step-4 checkpoint (mid-epoch) up to step 6."""
    probe = BarProbe()
    ckpt = first_run.root / "ckpt" / "step=4.ckpt"
    run = hbp_fit(first_run.root / "resumed", small_demo, 6, [HBPProgressBar(), probe], ckpt_path=ckpt,
                  enable_checkpointing=False)  # fmt: skip
    run.bar = probe.shown
    return run


# ---- 1. the end of fit leaves a checkpoint of the final step ------------------------------------


def test_last_checkpoint_holds_the_final_step_and_a_resume_trains_nothing_more(first_run, small_demo, tmp_path):
    ckpt_dir = first_run.root / "ckpt"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    last = torch.load(ckpt_dir / "last.ckpt", weights_only=False)
    assert last["global_step"] == MAX_STEPS  # Lightning alone leaves step 4 there
    assert torch.load(ckpt_dir / "step=4.ckpt", weights_only=False)["global_step"] == 4

    again = hbp_fit(tmp_path / "same", small_demo, MAX_STEPS, [], ckpt_path=ckpt_dir / "last.ckpt",
                    enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    assert again.rows == [] and again.trainer.global_step == MAX_STEPS

    # Saved right after the final step, not after Lightning closed the epoch: a longer run resumed
    # from it trains the micro-batches an uninterrupted run trains next (10.. of epoch 0), not epoch 1.
    longer = hbp_fit(tmp_path / "longer", small_demo, MAX_STEPS + 2, [], ckpt_path=ckpt_dir / "last.ckpt",
                     enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    assert [(r["epoch"], r["micro"]) for r in longer.rows] == [(0, 10), (0, 11), (0, 12), (0, 13)]
    assert [r["micro"] for r in first_run.rows] == list(range(10))


class PlainModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def plain_loader(n=64, batch_size=8):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def plain_fit(tmp_path, callbacks, **kw):
    kw = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=tmp_path, callbacks=callbacks) | kw  # fmt: skip
    val = kw.pop("val_dataloaders", None)
    trainer = L.Trainer(**kw)
    trainer.fit(PlainModel(), plain_loader(), val)
    return trainer


class Scored(PlainModel):
    """``val_loss`` 1.0, 0.5, 0.2 by epoch; ``m`` its step's number, logged on step and epoch (``on``)."""

    def __init__(self, on: dict):
        super().__init__()
        self.on = on

    def training_step(self, batch, batch_idx):
        self.log("m", float(self.global_step + 1), **self.on)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", [1.0, 0.5, 0.2][self.current_epoch])


@pytest.mark.parametrize(
    "monitor, on, stop",
    [
        ("val_loss", {}, dict(max_steps=16, max_epochs=5)),  # ends with epoch 1: its validation ranks it
        ("m", dict(on_step=True, on_epoch=True), dict(max_steps=3)),  # the epoch's mean ranks, not the step's value
        ("m", dict(on_step=False, on_epoch=True), dict(max_steps=3)),  # logged for the epoch only
    ],
    ids=["fresh_validation", "epoch_mean", "epoch_only"],
)
def test_final_checkpoint_leaves_the_ranking_to_lightning(tmp_path, monitor, on, stop):
    """A ModelCheckpoint that ranks at the epoch's end ranks a run's final step as plain Lightning does (the best
    file and score equal), with FinalCheckpoint beside it; its last.ckpt holds the final step."""
    kept = {}
    for final in (False, True):
        ckpt = ModelCheckpoint(dirpath=tmp_path / str(final), monitor=monitor, mode="min", save_last=True)
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path, callbacks=[ckpt, *([FinalCheckpoint()] if final else [])],
                            num_sanity_val_steps=0, **stop)  # fmt: skip
        trainer.fit(Scored(on), plain_loader(), plain_loader(16))
        kept[final] = (Path(ckpt.best_model_path).name, float(ckpt.best_model_score), dict(ckpt.best_k_models))
        assert ckpt.save_last is True
        assert torch.load(tmp_path / str(final) / "last.ckpt", weights_only=False)["global_step"] == stop["max_steps"]
    assert kept[True][:2] == kept[False][:2]
    assert {Path(k).name: float(v) for k, v in kept[True][2].items()} == {
        Path(k).name: float(v) for k, v in kept[False][2].items()
    }


def test_final_step_with_the_default_checkpoint_and_with_save_last_link(tmp_path):
    # The default checkpoint callback saves at validation only (validation every 3 batches): step 3.
    plain_fit(tmp_path / "default", [FinalCheckpoint()], max_steps=5, val_check_interval=3,
              check_val_every_n_epoch=None, val_dataloaders=plain_loader(16))  # fmt: skip
    (saved,) = glob.glob(f"{tmp_path}/default/**/*.ckpt", recursive=True)
    assert Path(saved).name == "epoch=0-step=5.ckpt"
    assert torch.load(saved, weights_only=False)["global_step"] == 5

    # save_last="link" links last.ckpt to the latest scheduled checkpoint (step 4): the final step
    # is written as a file, and the step-4 checkpoint is not overwritten through the link.
    link = ModelCheckpoint(dirpath=tmp_path / "link", every_n_train_steps=2, save_last="link", save_top_k=-1,
                           filename="{step}")  # fmt: skip
    plain_fit(tmp_path, [link, FinalCheckpoint()], max_steps=5)
    last = tmp_path / "link" / "last.ckpt"
    assert not last.is_symlink() and torch.load(last, weights_only=False)["global_step"] == 5
    assert torch.load(tmp_path / "link" / "step=4.ckpt", weights_only=False)["global_step"] == 4


def test_a_checkpoint_every_n_steps_that_keeps_them_all_holds_the_final_step(tmp_path):
    """``ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)`` without a monitor keeps every step it saves: the
    final step 5 (max_steps) was in no checkpoint, the run's last 1 step lost, and ``--ckpt_path auto`` resumed at
    step 4. It gets its own file, as a scheduled save at that step would write it."""
    every = ModelCheckpoint(dirpath=tmp_path / "every", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    plain_fit(tmp_path, [every, FinalCheckpoint()], max_steps=5)
    assert sorted(p.name for p in (tmp_path / "every").iterdir()) == ["step=2.ckpt", "step=4.ckpt", "step=5.ckpt"]
    assert torch.load(tmp_path / "every" / "step=5.ckpt", weights_only=False)["global_step"] == 5


def test_the_default_checkpoint_is_not_rewritten_after_lightning_closes_the_epoch(tmp_path):
    """Without validation the default checkpoint callback saves at epoch ends. max_steps 5 stops inside
    the 8-batch epoch: the final-step checkpoint must stay the mid-epoch one, so a resume with a larger
    max_steps continues the epoch instead of starting the next (Lightning restarts at the next epoch when
    the checkpoint's epoch counts as processed)."""
    plain_fit(tmp_path, [FinalCheckpoint()], max_steps=5)
    (saved,) = glob.glob(f"{tmp_path}/**/*.ckpt", recursive=True)
    state = torch.load(saved, weights_only=False)
    epoch = state["loops"]["fit_loop"]["epoch_progress"]["current"]
    assert state["global_step"] == 5 and epoch["processed"] == 0, epoch
    # processed == 0: Lightning resumes inside epoch 0 (1 would make it start epoch 1).


@pytest.mark.parametrize("save_last", [None, True])
def test_a_fast_dev_run_saves_what_lightning_alone_saves(tmp_path, save_last):
    """Lightning suppresses checkpointing in a fast_dev_run (but for its own save_last at the end of fit);
    FinalCheckpoint adds nothing to it: a debug run's checkpoint would be what ``--ckpt_path auto`` resumes a
    real run from. Reference: Lightning alone, the same checkpoint callback (the default one, or save_last)."""

    def saved(folder: Path, final: bool) -> list[str]:
        own = [ModelCheckpoint(dirpath=folder / "ckpt", save_last=True)] if save_last else []
        plain_fit(folder, [*own, *([FinalCheckpoint()] if final else [])], fast_dev_run=3)
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.ckpt"))

    assert saved(tmp_path / "lit_hbp", final=True) == saved(tmp_path / "lightning", final=False)


class StepLosses(HBPLitModule):
    """Each micro-batch's cross-entropy sum and supervised tokens, by the optimizer step it trains in."""

    def training_step(self, batch, batch_idx):
        loss, ce_sum, n = self(batch)
        self._meter.add_loss(ce_sum, n)
        self.seen.append((self.global_step + 1, float(ce_sum), n))
        return loss


class OwnBatchStart(StepLosses):
    """A subclass's own ``on_train_batch_start``, without ``super()``'s (the module's micro-step clock)."""

    def on_train_batch_start(self, batch, batch_idx):
        pass


class StopAtStep(L.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.should_stop = True


@pytest.mark.parametrize(
    "module_class, stop, log_every, every, saved",
    [
        (StepLosses, None, 1, 1, {1: [1], 2: [2], 3: [3], 4: [4]}),
        (OwnBatchStart, None, 1, 1, {1: [1], 2: [2], 3: [3], 4: [4]}),  # logged at every step all the same
        # a stop min_steps holds: Lightning logs every step after it
        (StepLosses, StopAtStep(1), 50, 1, {1: [1], 2: [2], 3: [3], 4: [4]}),
        # saves between the steps the loggers write (3, 6): ranked by the steps since the last written one, this one
        # included; they were ranked by the last written window (step 4 by steps 1-3) or not at all (step 2)
        (StepLosses, None, 3, 2, {2: [1, 2], 4: [4], 6: [4, 5, 6], 8: [7, 8]}),
    ],
    ids=["every_step", "own_batch_start", "stop_held_by_min_steps", "saves_between_logged_steps"],
)
def test_a_checkpoint_monitoring_train_loss_is_ranked_by_its_own_steps_loss(
    tmp_path, small_demo, module_class, stop, log_every, every, saved
):
    """``ModelCheckpoint(monitor="train/loss")`` saves in the callbacks' ``on_train_batch_end``, which ran before the
    module logged the step's loss: every save was ranked by the step before's. Reference: the token mean of the
    micro-batches' cross-entropy (accumulate 2) of the steps since the last one the loggers wrote (each step alone
    where every step is written, as a plain module logging in ``training_step`` is ranked)."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train/loss", every_n_train_steps=every, save_top_k=-1,
                           filename="{step}")  # fmt: skip
    L.seed_everything(0)
    dm = chat_datamodule(small_demo, str(small_demo / "tokenizer"), tmp_path / "cache")
    module = module_class(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
    module.seen = []
    last = max(saved)
    trainer = L.Trainer(accelerator="cpu", max_steps=last, min_steps=last, accumulate_grad_batches=2, logger=False,
                        use_distributed_sampler=False, enable_model_summary=False, enable_progress_bar=False,
                        log_every_n_steps=log_every, default_root_dir=tmp_path,
                        callbacks=[ckpt, *([stop] if stop else [])])  # fmt: skip
    trainer.fit(module, dm)
    want = {}
    for step, window in saved.items():
        ce, n = (sum(x) for x in zip(*[(c, k) for s, c, k in module.seen if s in window]))
        want[f"step={step}.ckpt"] = ce / n
    got = {Path(path).name: float(score) for path, score in ckpt.best_k_models.items()}
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-5) for k in want), (got, want)


def test_a_run_that_never_logs_keeps_no_time_per_micro_step(tmp_path, small_demo):
    """``barebones`` (``log_every_n_steps`` 0) logs nothing, yet the meter kept a time span (two CUDA events on a
    GPU) per micro-step for the whole run, never read."""
    L.seed_everything(0)
    dm = chat_datamodule(small_demo, str(small_demo / "tokenizer"), tmp_path / "cache")
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=6, barebones=True, use_distributed_sampler=False,
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(module, dm)
    assert trainer.global_step == 6 and module._meter._spans == []


# ---- 2. a resume says where it continues --------------------------------------------------------


def test_resume_prints_step_epoch_micro_batch_and_plan(resumed_run):
    n_micro = resumed_run.dm.plan_for_epoch(0).n_micro_steps
    expected = (
        f"resuming at optimizer step 4, epoch 0, micro-batch 8 of {n_micro} of the epoch's plan "
        "(levels 256:1, 1024:1; world 1, accumulate 2, seed 0 + epoch 0, packer "
    )
    assert expected in resumed_run.out.log, resumed_run.out.log
    assert "the 8 micro-batches before it are not trained again" in resumed_run.out.log
    assert [(r["epoch"], r["micro"]) for r in resumed_run.rows] == [(0, 8), (0, 9), (0, 10), (0, 11)]
    # A checkpoint of an epoch's end says that the next epoch starts from its beginning.
    loader, dm = resumed_run.trainer.train_dataloader, resumed_run.dm
    message = loader.resume_message({"epoch": 0, "micro_step": n_micro}, dm.plan_key())
    assert message.startswith(f"resuming at optimizer step 6: epoch 0 was trained to its end ({n_micro} micro-batches")


# ---- 3. the bar counts optimizer steps ----------------------------------------------------------


def test_progress_bar_counts_optimizer_steps_over_max_steps(first_run, resumed_run):
    # accumulate 2: the bar moves every second micro-batch, up to max_steps; no "/-2" epoch total.
    steps = [(n, total, desc) for when, n, total, desc in first_run.bar if when == "batch end"]
    assert steps == [(k, MAX_STEPS, "Epoch 0") for k in (0, 1, 1, 2, 2, 3, 3, 4, 4, 5)]
    # After a resume from step 4 it starts at 4, and counts to the new max_steps.
    assert resumed_run.bar[0] == ("train start", 4, 6, "Epoch 0")
    assert [(n, total, desc) for when, n, total, desc in resumed_run.bar[1:]] == [
        (4, 6, "Epoch 0"), (5, 6, "Epoch 0"), (5, 6, "Epoch 0"), (6, 6, "Epoch 0")
    ]  # fmt: skip


def test_progress_bar_over_epochs_in_a_plain_project(tmp_path):
    probe = BarProbe()
    plain_fit(tmp_path, [HBPProgressBar(), probe], max_epochs=2, accumulate_grad_batches=2, enable_progress_bar=True)
    # 8 batches an epoch, accumulate 2: 4 steps an epoch, 8 planned; the epoch over the last index.
    ends = [(n, total, desc) for when, n, total, desc in probe.shown if when == "batch end"]
    assert ends[7] == (4, 8, "Epoch 0/1") and ends[-1] == (8, 8, "Epoch 1/1")
    assert ("epoch start", 4, 8, "Epoch 1/1") in probe.shown


def test_progress_bar_in_a_log_file_renders_only_the_runs_steps(tmp_path, capsys):
    """In a log file (not a terminal) every render of the bar is a line: Lightning's epoch start rendered two
    more with the epoch's micro-batches as the total (``Epoch 1: 0/8``) and a negative rate. Reference: the
    run's own counts (3 epochs of 8 batches, accumulate 2: 12 steps, 4 an epoch)."""
    plain_fit(tmp_path, [HBPProgressBar()], max_epochs=3, accumulate_grad_batches=2, enable_progress_bar=True)
    renders = [r.strip() for r in re.split(r"[\r\n]+", capsys.readouterr().out) if r.startswith("Epoch")]
    shown = [re.match(r"Epoch (\d)/2: +\d+%\|.*\| (\d+)/12 steps \[[^-]*\]$", r) for r in renders]
    assert all(shown), renders
    steps_by_epoch = [[int(m[2]) for m in shown if int(m[1]) == e] for e in range(3)]
    assert [s[0] for s in steps_by_epoch] == [0, 4, 8] and [s[-1] for s in steps_by_epoch] == [4, 8, 12]
    assert all(s == sorted(s) for s in steps_by_epoch), renders


def test_progress_bar_total_is_the_steps_the_run_trains_when_epochs_end_it_before_max_steps(tmp_path):
    """``max_steps: 1000`` beside ``max_epochs: 1`` of 3 steps: the bar ended at 3/1000 (its time left wrong); the
    run trains 3, which its LR schedule spans too."""
    probe = BarProbe()
    trainer = plain_fit(tmp_path, [HBPProgressBar(), probe], max_steps=1000, max_epochs=1, limit_train_batches=6,
                        accumulate_grad_batches=2, enable_progress_bar=True)  # fmt: skip
    assert trainer.global_step == 3
    assert probe.shown[-1] == ("batch end", 3, 3, "Epoch 0/0")


# ---- 4. the per-level summary of each epoch ------------------------------------------------------


def test_epoch_summary_per_level(first_run):
    (summary,) = first_run.summary.history
    rows = first_run.rows
    plan = first_run.dm.plan_for_epoch(0)
    by_level = {r["level"]: r for r in summary["levels"]}
    assert set(by_level) == {0, 1} and (by_level[0]["pack_len"], by_level[1]["pack_len"]) == (256, 1024)
    for level, got in by_level.items():
        mine = [r for r in rows if r["level"] == level]
        assert got["micro_batches"] == len(mine)
        assert got["steps"] == len(mine) // 2
        assert got["tokens"] == round(sum(r["tokens"] for r in mine))
        assert got["samples"] == round(sum(r["samples"] for r in mine))
        assert (got["seconds"] > 0) == bool(mine)
    assert summary["plan_steps"] == plan.n_steps
    dropped = first_run.dm.store.report["dropped"]  # the demo chats longer than 1024 tokens
    assert dropped and summary["left_out"]["dropped"] == (len(dropped), len(set(dropped)))
    text = first_run.out.stdout
    tokens = sum(r["tokens"] for r in rows)
    assert f"epoch 0 summary: {MAX_STEPS} of the plan's {plan.n_steps} optimizer steps, 10 micro-batches" in text
    assert f"{round(tokens)} tokens in" in text
    assert f"dropped {len(dropped)} sample(s) ({len(set(dropped))} distinct records)" in text
    assert text.count("epoch 0 summary") == 1


# ---- 5. a run that fails before its first step leaves no log folder ------------------------------


def test_failed_cli_run_leaves_no_log_folder(tmp_path, small_demo, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
            "--trainer.enable_progress_bar", "false"]  # fmt: skip
    # The demo's long samples exceed the largest level: HBPDataModule.setup raises, after the
    # TensorBoard logger made runs/tiny_cpu/version_0.
    with pytest.raises(SystemExit) as stop:  # a data error: short message, exit status 2
        main(args + ["--data.over_length", "error"])
    assert stop.value.code == 2
    assert not (tmp_path / "runs" / "tiny_cpu").exists()


class FailAt(L.Callback):
    def __init__(self, hook, step=0):
        self.step = step
        setattr(self, hook, self._fail)

    def _fail(self, trainer, *args, **kwargs):
        if trainer.global_step >= self.step:
            raise RuntimeError("boom")


def test_failed_run_folders_go_only_when_nothing_was_trained(tmp_path):
    def fit(name, callbacks):
        loggers = [TensorBoardLogger(tmp_path / name, name="tb"), CSVLogger(tmp_path / name, name="csv")]
        with pytest.raises(RuntimeError, match="boom"):  # the run's own error, not a logger's
            plain_fit(tmp_path, [DiscardEmptyRunDir(), *callbacks], max_steps=4, logger=loggers)
        return sorted(str(p.relative_to(tmp_path / name)) for p in (tmp_path / name).rglob("*") if p.is_dir())

    # Fails after the loggers made their version folders and the config/hparams could be written.
    assert fit("setup", [FailAt("on_train_start")]) == []
    # Fails after two optimizer steps: the metrics are worth keeping.
    assert fit("trained", [FailAt("on_train_batch_start", step=2)]) == ["csv", "csv/version_0", "tb", "tb/version_0"]
    # A file the run did not write itself keeps the folder.
    keep = tmp_path / "keep"
    user_file = FailAt("on_train_start")
    user_file.setup = lambda trainer, *a, **k: Path(trainer.loggers[0].log_dir, "notes.txt").write_text("mine")
    assert fit("keep", [user_file]) == ["tb", "tb/version_0"]
    assert (keep / "tb" / "version_0" / "notes.txt").read_text() == "mine"
    # A logger with a fixed version logs every run into one folder: an earlier run's events stay.
    fixed = lambda: TensorBoardLogger(tmp_path / "fixed", name="tb", version="main")  # noqa: E731
    plain_fit(tmp_path, [], max_steps=2, logger=fixed())
    earlier = sorted((tmp_path / "fixed" / "tb" / "main").glob("events.out.tfevents.*"))
    assert earlier
    with pytest.raises(RuntimeError, match="boom"):
        plain_fit(tmp_path, [DiscardEmptyRunDir(), FailAt("on_train_start")], max_steps=2, logger=fixed())
    assert all(p.exists() for p in earlier)


def test_cli_adds_the_console_callbacks(tmp_path, small_demo, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo)]
    names = [type(c).__name__ for c in main(args, run=False).trainer.callbacks]
    for name in ("FinalCheckpoint", "LevelSummary", "DiscardEmptyRunDir", "HBPProgressBar"):
        assert names.count(name) == 1, names
    names = [
        type(c).__name__ for c in main(args + ["--trainer.enable_progress_bar", "false"], run=False).trainer.callbacks
    ]
    assert "HBPProgressBar" not in names and "FinalCheckpoint" in names


# ---- 6. HBPThroughputMonitor in a plain Lightning project ----------------------------------------


def test_throughput_monitor_in_a_plain_project(tmp_path):
    with pytest.raises(TypeError, match=r"PackedBatch micro-batches.*this batch is a list.*batch_size_fn"):
        plain_fit(tmp_path, [HBPThroughputMonitor()], max_steps=2)

    monitor = HBPThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0], length_fn=lambda b: b[0].numel())
    plain_fit(tmp_path, [monitor], max_steps=6, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    (metrics,) = glob.glob(f"{tmp_path}/**/metrics.csv", recursive=True)
    rows = [r for r in csv.DictReader(open(metrics)) if r.get("train/samples")]
    assert [float(r["train/samples"]) for r in rows] == [8.0 * k for k in range(1, 7)]
    assert [float(r["train/lengths"]) for r in rows] == [32.0 * k for k in range(1, 7)]
    assert all(float(r["train/device/items_per_sec"]) > 0 for r in rows[1:])


def test_throughput_monitor_counts_packed_batches(first_run):
    (metrics,) = glob.glob(f"{first_run.root}/logs/**/metrics.csv", recursive=True)
    rows = [r for r in csv.DictReader(open(metrics)) if r.get("train/samples")]
    assert len(rows) == MAX_STEPS
    assert float(rows[-1]["train/samples"]) == pytest.approx(sum(r["samples"] for r in first_run.rows))
    assert float(rows[-1]["train/lengths"]) == pytest.approx(sum(r["tokens"] for r in first_run.rows))


def test_a_resumed_runs_throughput_counts_go_on_from_the_checkpoints(first_run, small_demo, tmp_path):
    """``train/batches``, ``train/samples`` and ``train/lengths`` are running counts: resumed from the step-4
    checkpoint they started again from 0 (the "tokens seen" curve fell back in the same run folder); the resumed
    run's step 5 logs what the uninterrupted run's step 5 logged."""
    step_4 = first_run.root / "ckpt" / "step=4.ckpt"
    hbp_fit(tmp_path, small_demo, MAX_STEPS, [HBPThroughputMonitor()], ckpt_path=step_4,
            logger=CSVLogger(tmp_path / "logs"), log_every_n_steps=1, enable_checkpointing=False)  # fmt: skip
    keys = ("train/batches", "train/samples", "train/lengths")

    def logged(root):
        (metrics,) = glob.glob(f"{root}/logs/**/metrics.csv", recursive=True)
        return {int(r["step"]): [float(r[k]) for k in keys] for r in csv.DictReader(open(metrics)) if r.get(keys[0])}

    resumed, uninterrupted = logged(tmp_path), logged(first_run.root)
    assert list(resumed) == [MAX_STEPS - 1]  # the logger's step: global_step - 1
    assert resumed[MAX_STEPS - 1] == uninterrupted[MAX_STEPS - 1]


# ---- 6. a checkpoint folder fine-tuned through the CLI, validated, resumed into its own run folder ---------


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of every event file in ``run_dir``: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(run_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


@pytest.mark.slow
def test_cli_fine_tunes_a_folder_and_resumes_into_the_same_run_folder(
    tmp_path, small_demo, demo_pretrained, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
            "--model.model", demo_pretrained, "--trainer.val_check_interval", "8",
            "--model.min_lr_ratio", "1.0", "--model.warmup_steps", "0",  # a constant rate, whatever max_steps
            "--trainer.enable_progress_bar", "false", *SHORTER]  # fmt: skip
    main(args + ["--trainer.max_steps", "4"])
    run_dir = tmp_path / "runs" / "tiny_cpu" / "version_0"
    last = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 4
    config = (run_dir / "config.yaml").read_text()
    # A resume refused once set up (another plan: other levels) left the refused config as the run's config.yaml.
    with pytest.raises(SystemExit):
        main(args + ["--trainer.max_steps", "8", "--ckpt_path", str(last), "--data.levels", "[1024, 2048, 5120]"])
    cli = main(args + ["--trainer.max_steps", "8", "--ckpt_path", str(last)])
    assert (run_dir / "config.yaml").read_text() == config  # the run's own; the resume's beside it
    assert "max_steps: 8" in (run_dir / "config.resumed.yaml").read_text()
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["version_0"]  # no version_1
    assert cli.trainer.logger.version == 0  # the progress bar's v_num=0 (a string would show "on_0")
    logged = tensorboard_scalars(run_dir)
    assert max(logged["train/loss"]) >= 6 and min(logged["train/loss"]) < 4  # both runs' curves, one folder
    assert sorted(logged["val/loss"]) == [3, 7]  # validations after steps 4 and 8 (TensorBoard: step - 1)
    resumed = torch.load(last, weights_only=False)
    assert resumed["global_step"] == 8
    # The resumed run equals one that was never interrupted.
    (tmp_path / "straight").mkdir()
    monkeypatch.chdir(tmp_path / "straight")
    main(args + ["--trainer.max_steps", "8"])
    straight = torch.load(tmp_path / "straight/runs/tiny_cpu/version_0/checkpoints/last.ckpt", weights_only=False)
    for name, value in straight["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][name]), name
