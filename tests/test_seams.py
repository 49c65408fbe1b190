"""The seams a new engineer extends: the SP kind a level names, the typed micro-batch, the level
selector. Each is checked against what the rest of the library does with it."""

import copy
import dataclasses
import pickle

import numpy as np
import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer

from lit_hbp.autoselect import AnalyticSelector, RunSetting, Selection, sp_candidates
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import HARDWARE
from lit_hbp.data.batch import PackedBatch
from lit_hbp.data.collate import collate_packs
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing import Level
from lit_hbp.packing.levels import LevelSelector, as_level
from lit_hbp.parallel.kind import SPKind, resolve_sp_kind, validate_sp_setup
from lit_hbp.parallel.ulysses import Ulysses

GATHER = "sp_kinds.GatherAll"  # tests/sp_kinds.py: a kind defined outside the library


def samples(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {i: (rng.integers(5, 300, m), rng.random(m) < 0.7) for i, m in enumerate(rng.integers(3, 40, n))}


# ----------------------------------------------------------------------------------- SP kinds


def test_levels_name_their_kind_and_unknown_kinds_are_refused():
    assert Level(64, 2).sp_kind == "ulysses" and isinstance(resolve_sp_kind("ulysses"), Ulysses)
    assert as_level({"pack_len": 64, "sp": 2, "sp_kind": GATHER}).sp_kind == GATHER
    assert type(resolve_sp_kind(GATHER)).__name__ == "GatherAll" and isinstance(resolve_sp_kind(GATHER), SPKind)
    with pytest.raises(ValueError, match=r"unknown sp_kind 'ring'.*\['cp', 'ulysses'\]"):
        resolve_sp_kind("ring")
    with pytest.raises(ValueError, match="cannot import 'nowhere.to'"):
        resolve_sp_kind("nowhere.to.Ring")
    with pytest.raises(ValueError, match=r"unknown sp_kind 'torch.nn.Linear'"):
        resolve_sp_kind("torch.nn.Linear")  # importable, but not an SPKind
    with pytest.raises(TypeError, match="sp_kind must be a non-empty string"):
        Level(64, 2, sp_kind="")
    # A level of sp 1 runs no SP kind, but a misspelled one is refused there too (a config's levels gain sp later)
    from lit_hbp import HBPDataModule

    with pytest.raises(ValueError, match=r"data.levels\[1\]: unknown sp_kind 'ulyses' \(did you mean 'ulysses'\?\)"):
        HBPDataModule(sources=["d.jsonl"], tokenizer="t", levels=[64, {"pack_len": 128, "sp": 1, "sp_kind": "ulyses"}])


def test_the_strategy_checks_and_the_level_search_ask_the_levels_kind():
    # 6 heads cannot be split over 4 ranks by Ulysses; the all-gather kind needs no head split.
    with pytest.raises(ValueError, match="level 0 .*6 attention heads cannot be split over 4 Ulysses ranks"):
        validate_sp_setup([Level(64, 4, ulysses=4)], 4, 6, 6, 2)
    assert validate_sp_setup([Level(64, 4, sp_kind=GATHER)], 4, 6, 6, 2) == [1]
    # Ulysses alone stops at 2 for 6 heads; the built-in kinds go on with context parallelism.
    assert sp_candidates(8, 6, 6, every_layout=False) == [(1, 1), (2, 1), (4, 2), (8, 4)]
    assert (4, 4) in sp_candidates(8, 6, 6) and (4, 1) not in sp_candidates(8, 6, 6)
    assert sp_candidates(8, 6, 6, GATHER) == [(1, 1), (2, 1), (4, 1), (8, 1)]


def test_the_cost_model_prices_each_kinds_own_traffic():
    spec = ModelSpec.from_config({**TINY_LLAMA, "vocab_size": 300})
    ulysses = CostModel(spec, HARDWARE["h100"], 8)
    gather = dataclasses.replace(ulysses, sp_kind=GATHER)
    tokens, sp = 4096.0, 4
    # Independent arithmetic: Ulysses sends (sp-1)/sp of q, k, v (kv replicated up to sp) and the
    # output; the all-gather kind sends its q, k, v shard to each of the sp - 1 peers. bf16.
    kv = max(spec.kv_heads, sp)
    ulysses_bytes = tokens * 2 * (2 * spec.heads + 2 * kv) * spec.dim * (sp - 1) / sp
    gather_bytes = tokens * 2 * (spec.heads + 2 * spec.kv_heads) * spec.dim * (sp - 1)
    assert resolve_sp_kind("ulysses").comm_bytes_per_layer(spec, tokens, sp) == pytest.approx(ulysses_bytes)
    ratio = gather.sp_comm_seconds(tokens, sp, 0) / ulysses.sp_comm_seconds(tokens, sp, 0)
    assert ratio > 1 and gather.sp_comm_seconds(tokens, 1, 0) == 0
    # Latency terms are the same for both kinds: the bandwidth part scales with the bytes.
    hw = HARDWARE["h100"]
    bandwidth = lambda b: (2 * spec.layers) * b / hw.intra_node_bw / hw.eff_link  # noqa: E731 (sp 4 < 8 GPUs/node)
    diff = gather.sp_comm_seconds(tokens, sp, 0) - ulysses.sp_comm_seconds(tokens, sp, 0)
    assert diff == pytest.approx(bandwidth(gather_bytes) - bandwidth(ulysses_bytes))


def test_the_data_module_shards_with_the_levels_kind_and_the_batch_carries_it():
    from lit_hbp.lightning.datamodule import MicroBatchDataset
    from lit_hbp.packing.plan import MicroBatch

    class Store:
        data = samples(6)

        def tokens(self, i):
            return self.data[i]

    levels = (Level(32), Level(256, 2, 1, sp_kind=GATHER))
    mb = MicroBatch(step=3, micro=1, level=1, packs=[np.arange(6)], loss_norm=50.0)
    whole = collate_packs([np.arange(6)], Store().tokens, sp=2, loss_norm=50.0)
    for rank in (2, 3):  # second SP group of a world of 4: SP ranks 0 and 1
        batch = MicroBatchDataset(Store(), levels, rank, pad_id=0)[(0, 7, mb)]
        assert batch.sp_kind == GATHER and batch.sp == 2 and batch.sp_rank == rank - 2
        assert (batch.level, batch.ckpt_layers, batch.loss_norm, batch.micro_index) == (1, 1, 50.0, 7)
        half = whole.input_ids.shape[1] // 2
        assert torch.equal(batch.input_ids, whole.input_ids[:, (rank - 2) * half : (rank - 1) * half])


def test_the_strategy_hands_the_batch_over_with_its_kind_and_group():
    """batch_to_device gives the micro-batch its level's group and kind (which its packed calls carry),
    one SPCall per level, and activates nothing: the next batch of another level gets its own."""
    from lit_hbp.lightning.strategy import HBPStrategy
    from lit_hbp.parallel.groups import SPContext, SPGroups

    strategy = HBPStrategy.__new__(HBPStrategy)  # only batch_to_device's own work is exercised
    strategy._sp_calls = {}
    groups = SPGroups([], 1, 0)
    fake = SPContext(None, 2, 1, (0, 1))
    groups.contexts[(2, 1)] = fake
    strategy.sp_groups = groups
    batch = Ulysses().shard(collate_packs([np.arange(4)], samples(4).__getitem__, sp=2, sp_kind=GATHER), 2, 1)
    moved = handed_over(strategy, batch)
    assert moved.sp_group.ctx is fake
    assert type(moved.sp_group.kind).__module__ + "." + type(moved.sp_group.kind).__name__ == GATHER
    assert handed_over(strategy, batch).sp_group is moved.sp_group
    whole = collate_packs([np.arange(4)], samples(4).__getitem__)
    assert handed_over(strategy, whole).sp_group is None


def handed_over(strategy, batch: PackedBatch) -> PackedBatch:
    """What HBPStrategy.batch_to_device hands over for ``batch`` (the device move is Lightning's)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    real = DeepSpeedStrategy.batch_to_device
    DeepSpeedStrategy.batch_to_device = lambda self, b, device=None, dataloader_idx=0: b
    try:
        return type(strategy).batch_to_device(strategy, batch)
    finally:
        DeepSpeedStrategy.batch_to_device = real


# --------------------------------------------------------------------------------- PackedBatch


def test_packed_batch_moves_pins_copies_and_pickles_as_one_value():
    batch = collate_packs([np.arange(5)], samples(5).__getitem__, level=2, ckpt_layers=1, loss_norm=9.0)
    tensors = [f.name for f in dataclasses.fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)]
    assert set(PackedBatch.TOKEN_FIELDS) < set(tensors)
    moved = batch.to("meta")
    assert all(getattr(moved, name).device.type == "meta" for name in tensors)
    assert (moved.level, moved.ckpt_layers, moved.loss_norm, moved.n_tokens) == (2, 1, 9.0, batch.n_tokens)
    assert batch.input_ids.device.type == "cpu", "to() returns a new batch"
    back = pickle.loads(pickle.dumps(batch))  # what a DataLoader worker sends
    assert all(torch.equal(getattr(back, n), getattr(batch, n)) for n in tensors) and back.level == 2
    clone = copy.deepcopy(batch)
    clone.input_ids[0, 0] += 1
    assert not torch.equal(clone.input_ids, batch.input_ids)
    # Lightning moves a dataclass batch field by field (the path of Trainer.batch_to_device).
    from lightning.fabric.utilities.apply_func import move_data_to_device

    assert move_data_to_device(batch, torch.device("meta")).labels.device.type == "meta"
    assert batch.pack_len == batch.shard_len == batch.input_ids.shape[1]
    half = Ulysses().shard(collate_packs([np.arange(5)], samples(5).__getitem__, sp=2), 2, 0)
    assert half.pack_len == 2 * half.shard_len


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned memory)")
def test_packed_batch_pins_its_tensors():
    batch = collate_packs([np.arange(5)], samples(5).__getitem__).pin_memory()
    assert batch.input_ids.is_pinned() and batch.cu_seqlens.is_pinned()


def test_the_ave_token_loss_refuses_an_unplanned_batch():
    from lit_hbp.model.loss import token_scale

    batch = collate_packs([np.arange(5)], samples(5).__getitem__)
    assert batch.loss_norm is None
    with pytest.raises(ValueError, match="no loss_norm"):
        token_scale(batch, "ave_token")
    assert token_scale(batch, "token_mean") == 1 / batch.n_targets


# ------------------------------------------------------------------------------ level selector


class FixedSelector(LevelSelector):
    """A user's own selector: whatever rule they like, given the lengths and the trainer."""

    def __init__(self):
        self.seen = None

    def levels_for(self, lengths, trainer):
        self.seen = (len(lengths), int(np.max(lengths)), trainer.world_size)
        return (Level(256), Level(int(2 ** np.ceil(np.log2(np.max(lengths))))))


def test_a_data_module_takes_any_level_selector(small_demo, toy_tokenizer, tmp_path):

    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.lightning.module import HBPLitModule

    selector = FixedSelector()
    dm = HBPDataModule(
        sources=[{"path": str(small_demo / "short.jsonl")}],
        tokenizer=toy_tokenizer,
        levels=selector,
        cache_dir=str(tmp_path / "cache"),
    )
    assert dm.levels is None and dm.selector is selector
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(HBPLitModule(model={**TINY_LLAMA, "max_position_embeddings": 16384}, vocab_size=dm.vocab_size), dm)
    n, longest, world = selector.seen
    assert n == dm.store.lengths.size and longest == dm.store.lengths.max() and world == 1
    assert dm.levels[0] == Level(256) and dm.levels[-1].pack_len >= longest
    with pytest.raises(ValueError, match="a LevelSelector .*got 'auto'"):
        HBPDataModule(sources=[{"path": "x.jsonl"}], tokenizer=toy_tokenizer, levels="auto")


class TimedSelector(LevelSelector):
    """Chooses as a measured search may, by its timings: here two levels at the first search, one after."""

    def __init__(self, searches: list):
        self.searches = searches  # shared by the runs: how many searches ran

    def levels_for(self, lengths, trainer):
        self.searches.append(len(lengths))
        longest = int(2 ** np.ceil(np.log2(np.max(lengths))))
        return (Level(256), Level(longest)) if len(self.searches) == 1 else (Level(longest),)


@pytest.mark.parametrize("deepspeed", [False, True], ids=["single", "hbp_zero2"])
def test_a_resumed_fit_plans_with_the_levels_its_selector_chose_for_the_checkpoint(
    small_demo, toy_tokenizer, tmp_path, deepspeed
):
    """A measured search on resume chose other levels (its timings differ) and the resume was refused: "the plan of
    its epoch 0 was made with other settings". The checkpoint keeps the chosen levels and a resumed fit plans with
    them (DeepSpeed restores after its strategy set up: its levels are laid out again). Reference: the uninterrupted
    run's weights at the same step, equal to the bit."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.lightning.strategy import HBPStrategy

    searches, model = [], {**TINY_LLAMA, "max_position_embeddings": 16384}

    def run(max_steps, ckpt_path=None, callbacks=()):
        L.seed_everything(0)
        dm = HBPDataModule(sources=[{"path": str(small_demo / "short.jsonl")}], tokenizer=toy_tokenizer,
                           levels=TimedSelector(searches), cache_dir=str(tmp_path / "cache"))  # fmt: skip
        module = HBPLitModule(model=model, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
        strategy = {"strategy": HBPStrategy(stage=2)} if deepspeed else {}
        trainer = quiet_trainer(max_steps=max_steps, callbacks=list(callbacks), enable_checkpointing=bool(callbacks),
                                default_root_dir=tmp_path, **strategy)  # fmt: skip
        trainer.fit(module, dm, ckpt_path=ckpt_path)
        assert not deepspeed or [lv.pack_len for lv in trainer.strategy.levels] == [lv.pack_len for lv in dm.levels]
        return dm, module

    saves = ModelCheckpoint(tmp_path / "ckpt", "{step}", every_n_train_steps=2, save_top_k=-1)
    first, whole = run(4, callbacks=[saves])
    resumed, again = run(4, ckpt_path=tmp_path / "ckpt" / "step=2.ckpt")
    assert len(searches) == 2 and len(first.levels) == 2 and resumed.levels == first.levels
    for (name, a), b in zip(whole.model.named_parameters(), again.model.parameters()):
        assert torch.equal(a, b), name


def test_the_analytic_selector_is_algorithm_1_on_the_cost_model():
    from lit_hbp.autoselect import AnalyticProfiler, select_levels

    spec = ModelSpec.from_config({**TINY_LLAMA, "vocab_size": 300})
    lengths = np.random.default_rng(0).integers(50, 3000, 500)
    run = RunSetting(spec=spec, world=4)
    selection = AnalyticSelector(gpu="a100", candidates=[1024, 4096], margin_gib=1).select(lengths, run)
    cost = CostModel(spec, HARDWARE["a100"], 4)
    reference = select_levels(
        AnalyticProfiler(cost, lengths), lengths, spec, 4, candidates=[1024, 4096], margin=2**30, cost=cost
    )
    assert isinstance(selection, Selection) and selection.levels == reference.levels
    assert [c.measurement for c in selection.candidates] == [c.measurement for c in reference.candidates]
    with pytest.raises(ValueError, match="AnalyticSelector gpu: unknown 'b200'"):
        AnalyticSelector(gpu="b200")


def test_measured_probes_shard_and_tag_with_the_selectors_kind():
    from lit_hbp.autoselect import MeasuredProfiler
    from lit_hbp.autoselect.measured import synthetic_batch

    lengths = np.random.default_rng(0).integers(20, 200, 100)
    batch = synthetic_batch(lengths, 512, 2, 1, 300, 0, np.random.default_rng(1), GATHER)
    whole = synthetic_batch(lengths, 512, 1, 0, 300, 0, np.random.default_rng(1))
    assert batch.sp_kind == GATHER and batch.sp_rank == 1 and batch.n_tokens == whole.n_tokens
    half = whole.input_ids.shape[1] // 2
    assert torch.equal(batch.input_ids, whole.input_ids[:, half:])
    assert MeasuredProfiler(lambda: None, lengths, 2**30, sp_kind=GATHER).sp_kind == GATHER


def test_the_simulator_prices_each_levels_own_kind():
    """A level's ``sp_kind`` is what the run shards its packs with: the simulator (and so ``lit_hbp.simulate`` and
    the timeline) priced every level as Ulysses. A plan of one sp-4 level of the all-gather kind costs what the
    cost model of that kind says for each of its groups."""
    import numpy as np

    from lit_hbp.packing import Level, plan_hbp
    from lit_hbp.simulate.simulator import simulate

    spec = ModelSpec.from_config({**TINY_LLAMA, "vocab_size": 300})
    ulysses = CostModel(spec, HARDWARE["h100"], 8)
    lengths = np.random.default_rng(0).integers(100, 4000, 200)
    plans = {kind: plan_hbp(lengths, [Level(4096, 4, sp_kind=kind)], 8, 1) for kind in ("ulysses", GATHER)}
    ours, theirs = simulate(plans[GATHER], ulysses), simulate(plans["ulysses"], ulysses)
    assert ours.parts["ulysses_comm"].sum() > theirs.parts["ulysses_comm"].sum()
    assert ours.seconds == pytest.approx(simulate(plans[GATHER], dataclasses.replace(ulysses, sp_kind=GATHER)).seconds)
