"""Every precision plugin hands the module a PackedBatch whose counts are exact.

Lightning's training loop passes each batch through ``precision_plugin.convert_input``, which casts
every floating tensor of a dataclass to the training dtype; bf16 has 8 significant bits, so a
per-sample count of 265 would arrive as 264 and skew the ``sample_mean`` weights.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import quiet_trainer
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, HalfPrecision, MixedPrecision, Precision
from packaging.requirements import Requirement

from lit_hbp.data.batch import PackedBatch
from lit_hbp.data.collate import collate_packs
from lit_hbp.lightning.deepspeed_config import overflow_note
from lit_hbp.lightning.strategy import HBPStrategy
from lit_hbp.model.loss import token_weights
from lit_hbp.parallel.groups import SPGroups

TARGETS = (265, 1023, 4097)  # none of them is a bf16 (or, for 4097, an fp16) number

PLUGINS = {
    "plain-32-true": lambda: Precision(),
    "plain-bf16-mixed": lambda: MixedPrecision("bf16-mixed", "cpu"),
    "plain-16-mixed": lambda: MixedPrecision("16-mixed", "cpu"),
    "plain-bf16-true": lambda: HalfPrecision("bf16-true"),
    "plain-16-true": lambda: HalfPrecision("16-true"),
    **{
        f"deepspeed-{p}": (lambda p=p: DeepSpeedPrecision(p))
        for p in ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
    },
}


def odd_batch() -> PackedBatch:
    """Three samples whose supervised-token counts are TARGETS, plus a padding segment."""
    lengths = [n + 1 for n in TARGETS]  # every token supervised; the last one of a sample has no label
    samples = {i: (np.arange(n) % 50 + 1, np.ones(n, bool)) for i, n in enumerate(lengths)}
    return collate_packs([np.arange(len(TARGETS))], lambda i: samples[i], loss_norm=123.0)


def assert_same(got: PackedBatch, want: PackedBatch) -> None:
    for field in dataclasses.fields(PackedBatch):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), field.name
        else:
            assert type(a) is type(b) and a == b, field.name


def test_the_counts_are_not_representable_in_bf16():
    """The test has teeth: a floating count would not survive the cast."""
    assert torch.tensor(TARGETS, dtype=torch.float32).bfloat16().float().tolist() != list(TARGETS)
    batch = odd_batch()
    assert sorted(set(batch.sample_targets[0].tolist())) == [0, *TARGETS]  # 0: the padding
    tensors = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    assert not any(t.is_floating_point() for t in tensors if isinstance(t, torch.Tensor))  # nothing to cast


@pytest.mark.parametrize("plugin", PLUGINS)
def test_convert_input_leaves_every_field_exact(plugin):
    batch = odd_batch()
    assert_same(PLUGINS[plugin]().convert_input(batch), batch)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_hbp_strategy_path_leaves_every_field_exact(precision):
    """The training loop's order: the precision plugin's convert_input, then the strategy's batch_to_device."""
    strategy = HBPStrategy(precision_plugin=DeepSpeedPrecision(precision))
    strategy.sp_groups = SPGroups([1], world_size=1, rank=0)
    batch = odd_batch()
    moved = strategy.batch_to_device(strategy.precision_plugin.convert_input(batch), torch.device("cpu"))
    assert_same(moved, batch)


@pytest.mark.parametrize("plugin", ["deepspeed-bf16-mixed", "deepspeed-bf16-true", "plain-bf16-true"])
def test_sample_mean_weights_after_bf16_conversion_equal_the_fp32_reference(plugin):
    batch = odd_batch()
    weights = token_weights(PLUGINS[plugin]().convert_input(batch), "sample_mean")
    labels = batch.labels[0]
    per_position = np.repeat(TARGETS, [n + 1 for n in TARGETS])  # a sample's count at each of its positions
    counts = torch.tensor([*per_position.tolist(), *[1] * (labels.numel() - per_position.size)])  # padding: 1
    reference = torch.where(labels != -100, 1.0 / (len(TARGETS) * counts.float()), 0.0)
    assert weights.dtype == torch.float32 and torch.equal(weights[0], reference)
    # Each sample's weights sum to 1 / samples: the sample mean.
    for k in range(len(TARGETS)):
        assert weights[0][batch.cu_seqlens[k] : batch.cu_seqlens[k + 1]].double().sum().item() == pytest.approx(1 / 3)


class Recorder(L.LightningModule):
    """Keeps the batch the training step receives."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))
        self.seen: list[PackedBatch] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch)
        return self.w * token_weights(batch, "sample_mean").sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_the_training_step_receives_the_collated_batch(precision):
    """Through Lightning's real training loop, not only the plugin call."""
    batch = odd_batch()
    model = Recorder()
    loader = torch.utils.data.DataLoader([batch], batch_size=None)
    quiet_trainer(accelerator="cpu", devices=1, precision=precision, max_steps=1).fit(model, loader)
    assert_same(model.seen[0], batch)


def test_deepspeed_floor_excludes_the_releases_that_cast_rope_buffers_to_bf16():
    """deepspeed 0.19.0/0.19.1 turn RoPE's inv_freq into bf16 on ``module.bfloat16()``."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    (spec,) = [r.specifier for r in map(Requirement, project["dependencies"]) if r.name == "deepspeed"]
    assert not spec.contains("0.19.0") and not spec.contains("0.19.1") and spec.contains("0.19.2")
    assert spec.contains(importlib.metadata.version("deepspeed"))


def test_the_strategy_turns_deepspeeds_synchronizing_throughput_timer_off_unless_asked():
    from deepspeed.utils.config import get_timers_config

    from lit_hbp.lightning.strategy import HBPStrategy

    timers = get_timers_config(HBPStrategy(stage=2).config)  # DeepSpeed's own reading of the config
    assert not timers.enabled and not timers.synchronized
    asked = {"zero_optimization": {"stage": 2}, "timers": {"throughput": {"enabled": True, "synchronized": True}}}
    assert get_timers_config(HBPStrategy(config=asked).config).enabled


@pytest.mark.parametrize(
    "config, check",
    [
        (None, False),  # bf16 has no loss scale: the check only reads a flag and the norm on the host
        ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True, "check_grad_overflow": True}}, True),
    ],
)
def test_the_strategy_turns_deepspeeds_bf16_overflow_check_off_unless_asked(config, check):
    from deepspeed.runtime.precision_config import get_bfloat16_config

    strategy = HBPStrategy(stage=2, config=config)
    strategy.precision_plugin = DeepSpeedPrecision("bf16-mixed")
    strategy._format_config()  # what setup does once the precision is known
    bf16 = get_bfloat16_config(strategy.config)  # DeepSpeed's own reading of the config
    assert bf16.enabled and bf16.check_grad_overflow is check
    # said at set-up whenever DeepSpeed's reading is off: its default (a plain DeepSpeedStrategy's) skips such steps
    note = overflow_note(strategy.config, strategy._overflow_check_asked)
    assert bool(note) is not bf16.check_grad_overflow
    assert not check and "non-finite gradients are applied, not skipped" in note or check and note == ""


@pytest.mark.parametrize(
    "kwargs, world, overlap",
    [
        ({"stage": 2}, 1, False),  # one process reduces nothing: no stream to overlap, only its sync
        ({"stage": 3}, 1, False),
        ({"stage": 2}, 2, True),  # Lightning's default where there is a reduction to overlap
        ({"stage": 2, "overlap_comm": True}, 1, True),  # asked
        ({"config": {"zero_optimization": {"stage": 2, "overlap_comm": True}}}, 1, True),  # asked in the config
        ({"config": {"zero_optimization": {"stage": 3}}}, 1, False),  # DeepSpeed's default for stage 3: on
    ],
)
def test_the_strategy_turns_zero_overlap_comm_off_on_a_single_process_unless_asked(kwargs, world, overlap):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from lit_hbp.lightning.strategy import HBPStrategy, without_idle_overlap

    strategy = HBPStrategy(**kwargs)
    config = without_idle_overlap(strategy.config, world, strategy._overlap_comm_asked)
    assert DeepSpeedZeroConfig(**config["zero_optimization"]).overlap_comm is overlap  # DeepSpeed's reading
    assert strategy.config["zero_optimization"] == HBPStrategy(**kwargs).config["zero_optimization"]  # not mutated


def test_a_config_file_strategy_leaves_overlap_comm_to_the_world_size():
    """LightningCLI (jsonargparse) instantiates the strategy with every argument, defaults included."""
    from jsonargparse import ArgumentParser

    from lit_hbp.lightning.strategy import HBPStrategy, without_idle_overlap

    entry = {
        "class_path": "lit_hbp.lightning.strategy.HBPStrategy",
        "init_args": {"stage": 2},
    }  # as a config file gives it
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=HBPStrategy)
    cfg = parser.parse_object({"strategy": entry})
    assert "overlap_comm" in cfg.strategy.init_args  # passed explicitly
    strategy = parser.instantiate_classes(cfg).strategy
    assert without_idle_overlap(strategy.config, 1, strategy._overlap_comm_asked)["zero_optimization"] == {
        **strategy.config["zero_optimization"],
        "overlap_comm": False,
    }
