"""Short levels that fill the device: a level's micro-step carries B packs side by side
(``packs_per_rank``), each document still alone; the self-check passes and the run trains at B 4; the
level search fills each level toward the longest level's tokens per rank where memory allows.
Exactness at B > 1: at sp 1 here against each sample alone, at Ulysses sp 2 on 2 processes here (the loss and
every gradient of one four-pack micro-batch) and through training in ``tests/test_sp.py`` (its sp 2 level
holds two packs)."""

import copy

import numpy as np
import pytest
import torch
from conftest import TINY_LLAMA, quiet_trainer, separate_loss

from lit_hbp.autoselect.search import analytic_levels, fill_token_budget
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import GIB, HARDWARE
from lit_hbp.data.collate import collate_packs
from lit_hbp.lightning.datamodule import HBPDataModule
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.model_spec import MODELS
from lit_hbp.packing.levels import Level


def four_pack_data(small_demo, toy_tokenizer, tmp_path) -> HBPDataModule:
    return HBPDataModule(
        sources=[{"path": str(small_demo / "short.jsonl")}],
        tokenizer=toy_tokenizer,
        levels=[{"pack_len": 128, "packs_per_rank": 4}, {"pack_len": 512}],
        cache_dir=str(tmp_path / "cache"),
        over_length="drop",
    )


def test_a_level_of_four_packs_per_rank_passes_the_self_check_and_trains(small_demo, toy_tokenizer, tmp_path):
    import lightning as L

    dm = four_pack_data(small_demo, toy_tokenizer, tmp_path)
    seen = []

    class Rows(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append((batch.level, batch.n_tokens, int(batch.cu_seqlens.numel()) - 1))

    dm.setup("fit")
    levels = [step.level for step in dm.plan_for_epoch(0).steps]
    steps = levels.index(0) + 3  # into the four-pack level
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3)  # self-check on
    trainer = quiet_trainer(devices=1, max_steps=steps, callbacks=[Rows()])
    trainer.fit(module, dm)
    assert trainer.global_step == steps
    four = [n for level, n, _ in seen if level == 0]
    assert four and max(four) > 128, seen  # a level-0 row holds several 128-token packs ...
    assert all(n <= 4 * 128 for n in four)  # ... and at most four
    plan = dm.plan_for_epoch(0)
    assert all(len(step.micro[0][0]) == 4 for step in plan.steps if step.level == 0)


def test_a_micro_batch_of_four_packs_trains_like_each_document_alone(small_demo, toy_tokenizer, tmp_path):
    """The loss and every parameter's gradient of a plan's four-pack micro-batch through ``packed_loss``
    against each of its samples alone through the unprepared model with eager attention."""
    dm = four_pack_data(small_demo, toy_tokenizer, tmp_path)
    dm.setup("fit")
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, loss="sum")
    module.configure_model()
    reference = copy.deepcopy(module.model)
    reference.set_attn_implementation("eager")
    plan = dm.plan_for_epoch(0)
    tokens = dm.store.lengths
    mb = next(m for m in plan.micro_batches(0) if m.level == 0 and sum(tokens[p].sum() for p in m.packs) > 2 * 128)
    batch = collate_packs(mb.packs, dm.store.tokens, loss_norm=1.0)
    assert len(mb.packs) == 4
    loss = module(batch).ce_sum
    module(batch).loss.backward()
    ids = np.concatenate(mb.packs)
    want = separate_loss(reference, {int(i): dm.store.tokens(int(i)) for i in ids})
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(module.model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def four_packs(vocab: int = 128, pack_len: int = 64) -> tuple[dict, list[np.ndarray]]:
    """Four packs of two or three documents of 5-24 tokens, about 70% of their tokens supervised."""
    rng = np.random.default_rng(0)
    samples, packs = {}, []
    for _ in range(4):
        lengths = [int(n) for n in rng.integers(5, 25, 3)]
        lengths = lengths if sum(lengths) <= pack_len else lengths[:2]
        ids = []
        for n in lengths:
            ids.append(len(samples))
            samples[len(samples)] = (rng.integers(3, vocab, n), rng.random(n) < 0.7)
        packs.append(np.array(ids))
    return samples, packs


def four_packs_at_ulysses_sp2(loss: str) -> dict:
    """On each of two ranks: its Ulysses sp 2 shard of a four-pack micro-batch through HBPLitModule (the run's
    packed call), the gradients averaged over the world as DDP and DeepSpeed average them; the CE summed over
    the ranks. ``ave_token`` with the plan's normalizer (the step's targets over the world)."""
    import torch.distributed as dist

    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPGroups
    from lit_hbp.parallel.kind import resolve_sp_kind

    world, rank = dist.get_world_size(), dist.get_rank()
    samples, packs = four_packs()
    torch.manual_seed(0)
    module = HBPLitModule(model={**TINY_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2}, vocab_size=128,
                          loss=loss, self_check=False)  # fmt: skip
    module.configure_model()
    initial = {k: v.clone() for k, v in module.model.state_dict().items()}
    whole = collate_packs(packs, samples.__getitem__, sp=2)
    whole = whole.replace(loss_norm=whole.n_targets / world if loss == "ave_token" else None)
    kind = resolve_sp_kind("ulysses")
    ctx = SPGroups([2], world, rank)[2]
    out = module(kind.shard(whole, 2, ctx.rank).replace(sp_group=SPCall.of(ctx, kind)))
    out.loss.backward()
    ce = out.ce_sum.detach().reshape(())
    dist.all_reduce(ce)
    grads = {}
    for name, p in module.model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad
        dist.all_reduce(g)
        grads[name] = g / world
    return dict(initial=initial, ce=ce, grads=grads, targets=whole.n_targets, packs=len(packs))


@pytest.mark.parametrize("loss", ["sum", "ave_token"])
def test_four_packs_at_ulysses_sp_2_train_like_each_document_alone(shared_pool2, loss):
    """B = 4 at sp 2 on two processes: the summed CE and every parameter's gradient against each document
    alone through the unprepared model with eager attention, in this process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    results = shared_pool2.run(four_packs_at_ulysses_sp2, loss)
    got = results[0]
    assert got["packs"] == 4
    cfg = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    cfg.update(num_attention_heads=4, num_key_value_heads=2)
    reference = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", vocab_size=128, **cfg), attn_implementation="eager"
    )
    reference.load_state_dict(got["initial"])
    samples, _ = four_packs()
    want = separate_loss(reference, samples)
    (want / (got["targets"] if loss == "ave_token" else 1.0)).backward()
    torch.testing.assert_close(got["ce"], want.detach(), rtol=1e-5, atol=1e-5)
    for r in results:
        torch.testing.assert_close(r["ce"], got["ce"])
    for name, q in reference.named_parameters():
        for r in results:
            torch.testing.assert_close(
                r["grads"][name], q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


def cost_8b(capacity_gib: float | None = None) -> CostModel:
    hardware = HARDWARE["h100"]
    if capacity_gib is not None:
        from dataclasses import replace

        hardware = replace(hardware, memory_bytes=capacity_gib * GIB)
    return CostModel(MODELS["llama3.1-8b"], hardware, 8)


@pytest.mark.parametrize("capacity_gib", [None, 60.0, 40.0])
def test_the_level_search_fills_short_levels_to_the_longest_levels_tokens_within_memory(capacity_gib):
    """For each level below the longest: B is a power of two, B x pack_len / sp is within the longest
    level's tokens per rank, the level at B fits the device (the cost model's memory), and twice B would
    exceed the budget or the memory. Less memory, fewer packs."""
    rng = np.random.default_rng(0)
    lengths = np.r_[rng.integers(200, 4000, 5000), rng.integers(20_000, 60_000, 50)]
    cost = cost_8b(capacity_gib)
    levels = analytic_levels(cost, lengths, candidates=[2048, 4096, 65536]).levels
    budget = max(lv.pack_len * lv.packs_per_rank / lv.sp for lv in levels)
    assert levels[-1].packs_per_rank == 1
    for lv in levels:
        b = lv.packs_per_rank
        assert b & (b - 1) == 0 and b * lv.pack_len / lv.sp <= budget
        args = (lv.pack_len, lv.sp, lv.ckpt_layers)
        assert cost.memory_bytes(*args, b, lv.offload, lv.mlp_tiles, lv.layout[1]) <= cost.hardware.memory_bytes
        doubled = 2 * b * lv.pack_len / lv.sp > budget
        assert doubled or not cost.fits(*args, 2 * b, lv.offload, lv.mlp_tiles, lv.layout[1]), lv
    if capacity_gib is None:
        assert levels[0].packs_per_rank > 1, levels  # an 80 GB GPU: the short level fills up
    if capacity_gib == 40.0:
        assert all(lv.packs_per_rank == 1 for lv in levels), levels  # the weights leave no room for more


def test_filling_keeps_a_given_b_and_a_level_that_fills_nothing():
    cost = cost_8b()
    given = [Level(4096, 1, 0, packs_per_rank=2), Level(32768, 1, 8)]
    assert [lv.packs_per_rank for lv in fill_token_budget(given, cost, cost.hardware.memory_bytes)] == [2, 1]
    tight = fill_token_budget([Level(4096, 1, 0), Level(32768, 1, 8)], cost, cost.static_bytes() + 1)
    assert [lv.packs_per_rank for lv in tight] == [1, 1]  # no memory beyond the weights: one pack
