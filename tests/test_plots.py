"""Figures of a plan and its simulation: written, readable, and carrying the expected artists; and
PackingMetrics(figures=True) logging them to TensorBoard during a tiny fit."""

import glob
import json

import lightning as L
import numpy as np
import pytest
import torch
from conftest import TINY_LLAMA
from matplotlib.container import BarContainer
from matplotlib.image import imread

from lit_hbp.callbacks import PackingMetrics
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import HARDWARE
from lit_hbp.lightning.datamodule import HBPDataModule
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing import Level, plan_hbp, plan_single_level
from lit_hbp.simulate import simulate
from lit_hbp.simulate.plots import (
    PART_LABELS,
    TIMELINE_PARTS,
    _fmt_fill,
    _fmt_gpu_time,
    cp_balance_figure,
    default_start,
    length_histogram_figure,
    save_figures,
    timeline_figure,
)

WORLD = 8
TINY = ModelSpec("tiny", layers=2, hidden=256, heads=4, kv_heads=4, intermediate=512, vocab=1000)


@pytest.fixture(scope="module")
def lengths():
    rng = np.random.default_rng(0)
    short = rng.lognormal(5.5, 1.0, 1500).clip(2, 1024).astype(np.int64)
    long = rng.integers(1500, 8192, 60)
    return rng.permutation(np.r_[short, long])


@pytest.fixture(scope="module")
def sims(lengths):
    cost = CostModel(TINY, HARDWARE["h100"], WORLD)
    hbp = plan_hbp(lengths, [Level(1024, 1), Level(8192, 4)], WORLD, seed=0)
    naive = plan_single_level(lengths, Level(8192, 4), WORLD, packer="isf")
    return [simulate(naive, cost, "naive ISF"), simulate(hbp, cost, "HBP")]


def bar_series(ax) -> dict[str, BarContainer]:
    return {c.get_label(): c for c in ax.containers if isinstance(c, BarContainer)}


def test_save_figures_writes_readable_pngs(tmp_path, sims):
    paths = save_figures(tmp_path / "out" / "sim.png", sims, sims[1].plan)
    assert paths == [tmp_path / "out" / "sim.png", tmp_path / "out" / "sim_lengths.png"]
    for path in paths:
        img = imread(path)
        assert img.shape[0] >= 400 and img.shape[1] >= 600, (path, img.shape)
        assert img[..., :3].var() > 1e-3, f"{path} is blank"


def test_timeline_has_a_bar_series_per_part_and_a_row_per_rank(sims):
    fig = timeline_figure(sims, n_micro=4)
    axes = [ax for ax in fig.axes if ax.containers]
    assert len(axes) == len(sims)
    for ax, sim in zip(axes, sims):
        series = bar_series(ax)
        assert list(series) == [PART_LABELS[p] for p in TIMELINE_PARTS]
        for bars in series.values():
            rows = {round(p.get_y() + p.get_height() / 2) for p in bars.patches}
            assert rows == set(range(WORLD))
            assert len(bars.patches) == 4 * WORLD  # every rank at each of the 4 micro-steps
        assert sim.name in ax.get_title()
        assert _fmt_gpu_time(sim.gpu_hours) in ax.get_title()
        assert ax.get_xlabel() == "simulated time (ms)"  # the tiny model runs micro-steps in milliseconds
    # Every rank's parts plus idle end where its micro-step ends (the slowest group's total).
    for ax, sim in zip(axes, sims):
        start = default_start(sim, 4)
        ends = np.array([p.get_x() + p.get_width() for p in bar_series(ax)[PART_LABELS["idle"]].patches])
        ends = ends.reshape(4, WORLD)
        np.testing.assert_allclose(ends, ends[:, :1].repeat(WORLD, axis=1))
        elapsed = np.cumsum(sim.micro_seconds[start : start + 4])
        np.testing.assert_allclose(ends[:, 0] / ends[-1, 0], elapsed / elapsed[-1])


def test_default_window_starts_at_the_largest_level(sims):
    for sim in sims:
        start = default_start(sim, 6)
        level = sim.plan.step_level[start // sim.plan.accumulate]
        assert level == len(sim.plan.levels) - 1
    fig = timeline_figure(sims, n_micro=3, start=5)
    assert all("micro-steps 5-7 " in ax.get_title() for ax in fig.axes if ax.containers)


def test_histogram_legend_names_every_level_with_its_fill(sims):
    plan = sims[1].plan
    fig = length_histogram_figure(plan)
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    for i, lv in enumerate(plan.levels):
        info = plan.report["levels"][i]
        (line,) = [t for t in texts if t.startswith(f"level {i}:")]
        assert f"sp {lv.sp}" in line and f"{info['samples']:,} samples" in line
        assert f"fill {_fmt_fill(info['fill'])}" in line
    assert not any(t.startswith("not packed") for t in texts)
    assert fig.axes[-1].get_xscale() == "log"


def test_histogram_shows_unpacked_samples(lengths):
    lens = np.r_[lengths, [0, 0, 20000]]
    plan = plan_hbp(lens, [Level(1024, 1), Level(8192, 4)], WORLD, over_length="drop")
    texts = [t.get_text() for t in length_histogram_figure(plan).legends[0].get_texts()]
    assert "not packed: 1 dropped (longer than 8K), 2 zero-length (drawn at 1 token)" in texts


def test_fill_is_rounded_down():
    assert _fmt_fill(0.99996) == "99.99%"
    assert _fmt_fill(1.0) == "100.00%"


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    rng = np.random.default_rng(1)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    path = tmp_path_factory.mktemp("chats") / "d.jsonl"
    with path.open("w") as f:
        for _ in range(16):
            q, a = (" ".join(rng.choice(words, rng.integers(1, k))) for k in (30, 60))
            f.write(json.dumps({"prompt": q, "response": a}) + "\n")
    return path


def test_packing_metrics_logs_figures_to_tensorboard(tmp_path, chats, toy_tokenizer):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dm = HBPDataModule(
        sources=[{"path": str(chats)}], tokenizer=toy_tokenizer, levels=["128:1", "512:1"], cache_dir=str(tmp_path)
    )
    torch.manual_seed(0)
    module = HBPLitModule(
        model=TINY_LLAMA,
        vocab_size=dm.vocab_size,
        lr=1e-3,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[PackingMetrics(figures=True, hardware="a100")],
    )
    trainer.fit(module, dm)
    (events,) = glob.glob(f"{tmp_path}/tb/**/events.out.tfevents.*", recursive=True)
    acc = EventAccumulator(events, size_guidance={"images": 0})
    acc.Reload()
    images = acc.Tags()["images"]
    assert {"packing/length_histogram", "packing/timeline"} <= set(images), images
    for tag in ("packing/length_histogram", "packing/timeline"):
        (img,) = acc.Images(tag)
        assert img.width > 300 and img.height > 300 and img.step == 0
    assert "packing/abr" in acc.Tags()["scalars"]


def test_packing_metrics_rejects_unknown_hardware():
    with pytest.raises(ValueError, match="PackingMetrics hardware: unknown 'tpu'"):
        PackingMetrics(figures=True, hardware="tpu")


def test_cp_balance_figure_draws_each_ranks_area_of_both_splits(tmp_path):
    """Bars are each CP rank's causal area over the mean, summed by hand from its token positions:
    a contiguous split of one document rises to (2 cp - 1) / cp, the planner's stays at 1."""
    docs = {"one document": np.array([4096]), "mixed": np.array([300, 3000, 50, 746])}
    fig = cp_balance_figure(docs, cps=(2, 4))
    axes = fig.axes
    assert len(axes) == 4
    for ax, (title, cp) in zip(axes, [(t, cp) for t in docs for cp in (2, 4)]):
        assert ax.get_title() == f"{title}, cp {cp}"
        contiguous, balanced = [c for c in ax.containers if isinstance(c, BarContainer)]
        heights = np.array([b.get_height() for b in contiguous.patches])
        lengths = docs[title]
        positions = np.concatenate([np.arange(n) + 1 for n in lengths])  # keys each token sees
        area = positions.reshape(cp, -1).sum(axis=1).astype(float)
        np.testing.assert_allclose(heights, area / area.mean())
        assert max(b.get_height() for b in balanced.patches) < 1.05
    one = [b.get_height() for b in axes[1].containers[0].patches]
    assert one[-1] == pytest.approx((2 * 4 - 1) / 4, rel=1e-3)
    path = tmp_path / "cp.png"
    fig.savefig(path)
    assert imread(path).shape[0] > 100


def test_timeline_draws_cp_communication_beside_ulysses(lengths):
    """A level of sp 4 = Ulysses 2 x CP 2: its ranks' bars carry both collective families, each
    as wide as the simulator priced it, and the legend names both."""
    cost = CostModel(TINY, HARDWARE["h100"], WORLD)
    plan = plan_hbp(lengths, [Level(1024, 1), Level(8192, 4, ulysses=2, cp=2)], WORLD, seed=0)
    sim = simulate(plan, cost, "HBP with CP")
    start = default_start(sim, 2)
    fig = timeline_figure([sim], n_micro=2, start=start)
    (ax,) = [ax for ax in fig.axes if ax.containers]
    series = bar_series(ax)
    assert plan.step_level[start // plan.accumulate] == 1
    groups = np.searchsorted(sim.group_micro, start) + np.arange(WORLD) // 4  # micro-step `start`, rank order
    for part in ("ulysses_comm", "cp_comm"):
        widths = np.array([p.get_width() for p in series[PART_LABELS[part]].patches[:WORLD]])
        assert (widths > 0).all()
        np.testing.assert_allclose(widths / widths.sum(), sim.parts[part][groups] / sim.parts[part][groups].sum())
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert "SP communication (Ulysses all-to-all)" in texts and "CP all-gather/reduce-scatter" in texts
    (top,) = ax.child_axes  # the levels' labels
    assert any("sp 4=2x2" in label.get_text() for label in top.get_xticklabels())


def legend_inside(fig) -> list[str]:
    """The figure's legends (and its title) drawn outside it (their bounding box past the figure's), as
    text; [] when every one lies whole inside."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    outside = []
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends, "the figure has a legend"
    titles = [fig._suptitle] if fig._suptitle is not None else []  # matplotlib has no public getter
    for legend in legends + titles:
        ext = legend.get_window_extent(renderer)
        if ext.x0 < box.x0 - 0.5 or ext.y0 < box.y0 - 0.5 or ext.x1 > box.x1 + 0.5 or ext.y1 > box.y1 + 0.5:
            texts = [t.get_text() for t in legend.get_texts()] if hasattr(legend, "get_texts") else legend.get_text()
            outside.append(f"{texts}: {ext} outside {box}")
    return outside


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_timeline_shows_its_whole_legend(sims, n):
    """Rendered, every legend entry and the title lie inside the picture (a one-panel figure cut "dense
    compute", "attention" and the idle entry off on both sides, and its title's first line)."""
    fig = timeline_figure([sims[i % 2] for i in range(n)])
    assert legend_inside(fig) == []
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts == [PART_LABELS[p] for p in TIMELINE_PARTS]


def test_the_length_histogram_and_cp_balance_show_their_whole_legends(sims, lengths):
    assert legend_inside(length_histogram_figure(sims[1].plan, lengths)) == []
    docs = {"one long document": np.array([4096]), "a mix": np.array([2048, 1024, 512, 512])}
    assert legend_inside(cp_balance_figure(docs)) == []


def test_saved_timeline_pictures_hold_the_whole_legend(tmp_path, sims):
    """As written to disk (savefig, what simulate --plot writes): the legend's box in the saved image."""
    fig = timeline_figure(sims[:1])
    fig.savefig(tmp_path / "t.png")
    assert legend_inside(fig) == []
    assert imread(tmp_path / "t.png").shape[1] == round(fig.get_figwidth() * fig.dpi)
