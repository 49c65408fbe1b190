"""What a newcomer sees in the first hour: ``lit-hbp preview --help`` shows its own usage and options
and the data module's, nothing it does not use; a plain run prints no warning the user cannot act on
(torch's LeafSpec deprecation about Lightning's code, Lightning's litlogger advertisement) and no FLOPs
it never counted; every other warning still shows."""

import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import console_script

from lit_hbp.callbacks.summary import HBPModelSummary
from lit_hbp.cli.app import main, quiet_what_a_user_cannot_act_on

ROOT = Path(__file__).resolve().parents[1]


def test_preview_help_shows_its_own_usage_and_what_preview_uses(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lit-hbp"])
    with pytest.raises(SystemExit) as stop:
        main(["preview", "--help"])
    assert stop.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "usage: lit-hbp preview --config CONFIG [--data.KEY VALUE ...] [--n N] [--json]"
    head = "\n".join(lines[:40])
    assert "--n N" in head and "--json" in head and "--config" in head, head
    text = "\n".join(lines)
    assert "--trainer" not in text and "--model" not in text and "--optimizer" not in text  # read, not used
    assert "--data.sources" in text and "--data.levels" in text and len(lines) < 200, len(lines)


@pytest.mark.slow
def test_a_plain_run_prints_no_warning_nobody_can_act_on_nor_uncounted_flops(tmp_path, small_demo):
    """``lit-hbp fit`` of the tiny config, as a person runs it: the model summary is there, without a
    FLOPs column of zeros; no LeafSpec deprecation, no litlogger advertisement, no Python warning."""
    run = subprocess.run(
        [console_script("lit-hbp"), "fit", "--config", str(ROOT / "configs/tiny_cpu.yaml"),
         "--data.demo_dir", str(small_demo), "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
         "--data.cache_dir", str(tmp_path / "cache")],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "Total params" in out and "LlamaForCausalLM" in out, out[-3000:]
    for unwanted in ("FLOPs", "Flops", "LeafSpec", "litlogger", "Warning:", "warnings.warn"):
        assert unwanted not in out, (unwanted, out[-3000:])


def test_the_filters_are_that_precise():
    """The LeafSpec filter matches its message, category and Lightning's module only; the same words from
    elsewhere, and any other warning, still show; the advertisement filter drops that line alone."""
    quiet_what_a_user_cannot_act_on()
    message = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)` instead."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet_what_a_user_cannot_act_on()
        warnings.warn_explicit(message, FutureWarning, "_pytree.py", 21, module="lightning.pytorch.utilities._pytree")
        warnings.warn_explicit(message, FutureWarning, "mine.py", 1, module="my_project.trees")
        warnings.warn_explicit(
            "something else", FutureWarning, "_pytree.py", 22, module="lightning.pytorch.utilities._pytree"
        )
    assert [(str(w.message)[:20], w.filename) for w in seen] == [
        (message[:20], "mine.py"),
        ("something else", "_pytree.py"),
    ]
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    ad = logging.LogRecord(rank_zero.name, logging.INFO, "x", 1, "💡 Tip: try installing [litlogger](...)", (), None)
    other = logging.LogRecord(rank_zero.name, logging.INFO, "x", 1, "GPU available: False, used: False", (), None)
    assert not rank_zero.filter(ad) and rank_zero.filter(other)


class Counted(L.LightningModule):
    """A module Lightning can count FLOPs of when it has an example input."""

    def __init__(self, example: bool):
        super().__init__()
        self.layer = torch.nn.Linear(32, 16)
        if example:
            self.example_input_array = torch.zeros(4, 32)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        return self(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def words(text: str) -> set[str]:
    """The words of a summary, without the table's rules (their length follows the columns)."""
    return {w for w in re.split(r"[\s|│┃]+", text) if w and not set(w) <= set("-━─┏┓┗┛┡┩└┘┳╇┴┻╋┼┬")}


@pytest.mark.parametrize("rich", [False, True])
@pytest.mark.parametrize("example", [False, True])
def test_the_summary_shows_flops_only_when_lightning_counted_them(rich, example, tmp_path, capsys, caplog):
    """Against Lightning's own summary of the same module in a fit: with FLOPs counted (a Linear 32 -> 16
    on 4 rows: 4 x 32 x 16 x 2 = 4.1 K), the same words; without, the same words less FLOPs."""
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    printed = []
    for summary in ((RichModelSummary if rich else ModelSummary)(), HBPModelSummary(rich=rich)):
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            max_steps=1, callbacks=[summary], default_root_dir=tmp_path)  # fmt: skip
        capsys.readouterr()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lightning.pytorch.callbacks.model_summary"):
            trainer.fit(Counted(example), torch.utils.data.DataLoader(torch.zeros(8, 32), batch_size=4))
        printed.append(capsys.readouterr().out + "\n".join(r.getMessage() for r in caplog.records))
    lightning, lit_hbp = printed
    assert "Linear" in lit_hbp and "Trainable" in lit_hbp
    if example:
        assert "4.1 K" in lightning and words(lit_hbp) == words(lightning)
    else:
        assert ("Total FLOPs: 0" if rich else "Total Flops") in lightning
        assert words(lit_hbp) == words(lightning) - {"FLOPs", "FLOPs:", "Flops"}
