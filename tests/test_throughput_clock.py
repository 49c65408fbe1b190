"""HBPThroughputMonitor's rates against a clock the test drives: every training micro-batch takes 1 s, every
validation batch 100 s. The training rate logged at each logging step is the window's tokens over its micro-batches'
seconds whatever validation ran inside the window, and a validation batch's FLOPs are its own forward's."""

import time

import lightning as L
import pytest
from conftest import TINY_LLAMA, chat_datamodule, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers.logger import Logger

from lit_hbp.callbacks import HBPThroughputMonitor
from lit_hbp.lightning.module import HBPLitModule


class Clock:
    """time.perf_counter for the run: it moves only when ``Tick`` moves it."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Tick(L.Callback):
    """A training micro-batch 1 s (inside it: after its backward), a validation batch 100 s (first among the
    callbacks at its end: the module's own hooks run after the callbacks'). Records each micro-batch's real tokens
    and each validation batch's FLOPs as the module set them."""

    def __init__(self, clock: Clock):
        self.clock, self.tokens, self.val_flops, self.val_forward = clock, [], [], []

    def on_after_backward(self, trainer, pl_module):
        self.clock.now += 1.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.tokens.append(batch.n_tokens / int(batch.sp))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking:
            return
        self.clock.now += 100.0
        spec = pl_module._spec  # forward only: a third of the fully trained FLOPs (the backward runs two forwards)
        head = batch.target_index.shape[0]
        self.val_forward.append((spec.train_flops(batch.n_tokens, batch.doc_sq, 0) + spec.train_flops(0, 0, head)) / 3)
        self.val_flops.append(pl_module.flops_per_batch)


class Rows(Logger):
    def __init__(self):
        super().__init__()
        self.rows = []

    name = "rows"
    version = 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append(dict(metrics))


def test_training_rates_pass_over_validation_and_validation_flops_are_its_own(
    tmp_path, toy_tokenizer, small_demo, monkeypatch
):
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    tick, rows = Tick(clock), Rows()
    dm = chat_datamodule(small_demo, toy_tokenizer, tmp_path / "cache", val_fraction=0.05)
    module = HBPLitModule(model=TINY_LLAMA, self_check=False)
    trainer = quiet_trainer(
        max_steps=12, log_every_n_steps=4, val_check_interval=7, limit_val_batches=4, num_sanity_val_steps=0,
        callbacks=[tick, HBPThroughputMonitor()], logger=rows,
    )  # fmt: skip
    trainer.fit(module, dm)

    logged = [r for r in rows.rows if "train/lengths" in r]
    assert len(logged) == 3 and any("validate/device/flops_per_sec" in r for r in rows.rows)
    ends = [tick_index(tick.tokens, r["train/lengths"]) for r in logged]
    for later, start, end in zip(logged[1:], ends, ends[1:]):  # the rate over the last logging interval
        want = sum(tick.tokens[start:end]) / (end - start)  # tokens over their micro-batches' seconds
        assert later["train/device/items_per_sec"] == pytest.approx(want, rel=1e-9), (later, want)
    assert tick.val_flops == pytest.approx(tick.val_forward) and all(f > 0 for f in tick.val_flops)


def tick_index(tokens: list, total: float) -> int:
    """How many micro-batches the monitor had counted when it logged ``total`` tokens."""
    return next(i for i in range(len(tokens) + 1) if sum(tokens[:i]) == pytest.approx(total))


class SlowSave(ModelCheckpoint):
    """A checkpoint whose every save takes 1000 s of the test's clock (a large model's, written to slow storage)."""

    def __init__(self, clock: Clock, **kwargs):
        super().__init__(**kwargs)
        self.clock, self.saves = clock, 0

    def _save_checkpoint(self, trainer, filepath):
        self.clock.now += 1000.0
        self.saves += 1
        super()._save_checkpoint(trainer, filepath)


def test_a_checkpoint_saved_at_a_step_is_not_the_levels_training_time(tmp_path, toy_tokenizer, small_demo, monkeypatch):
    """``time/level*_micro_step_s`` is a micro-batch's time (1 s here), and tokens per second its tokens over it: a
    checkpoint saved at the step (1000 s here) ran in the callbacks' ``on_train_batch_end``, before the module's own
    hook, which stopped the clock after it."""
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    tick, rows = Tick(clock), Rows()
    save = SlowSave(clock, dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    dm = chat_datamodule(small_demo, toy_tokenizer, tmp_path / "cache", val_fraction=0.0)
    trainer = quiet_trainer(
        max_steps=4, log_every_n_steps=1, callbacks=[tick, save], logger=rows, enable_checkpointing=True
    )
    trainer.fit(HBPLitModule(model=TINY_LLAMA, self_check=False), dm)
    assert save.saves == 4
    times = {k: v for r in rows.rows for k, v in r.items() if k.startswith("time/")}
    steps = [v for r in rows.rows for k, v in r.items() if k.endswith("_micro_step_s")]
    assert len(steps) == 4 and all(v == pytest.approx(1.0) for v in steps), rows.rows
    rates = [v for r in rows.rows for k, v in r.items() if k.endswith("_tokens_per_s_per_device")]
    assert rates == pytest.approx(tick.tokens), times


class Levels(L.Callback):
    """Each optimizer step's levels (its micro-batches')."""

    def __init__(self):
        self.steps: list[set[int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.steps.append(set())
        self.steps[-1].add(int(batch.level))


def test_a_windows_values_are_written_for_that_window_only(tmp_path, toy_tokenizer, small_demo):
    """Lightning writes, at each log step, every value logged since the epoch began, logged again or not: a step
    without the 1K level wrote the 1K level's time of an earlier step, as its own. Each written row holds the times of
    the levels its step trained (``train/loss`` and ``train/grad_norm`` are forgotten alike: a window without
    supervised tokens writes none)."""
    levels, rows = Levels(), Rows()
    dm = chat_datamodule(small_demo, toy_tokenizer, tmp_path / "cache", val_fraction=0.0)
    trainer = quiet_trainer(max_steps=12, log_every_n_steps=1, callbacks=[levels], logger=rows)
    trainer.fit(HBPLitModule(model=TINY_LLAMA, self_check=False), dm)
    written = [r for r in rows.rows if "train/level" in r]
    assert len(written) == len(levels.steps) == 12
    assert len({frozenset(s) for s in levels.steps}) > 1, levels.steps  # the steps train different levels
    for row, step in zip(written, levels.steps, strict=True):
        timed = {int(k[len("time/level") :].split("_")[0]) for k in row if k.startswith("time/level")}
        assert timed == step, (row, step)
