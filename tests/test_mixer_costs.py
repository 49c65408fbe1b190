"""A hybrid's stateful mixers priced as the packed call runs them on a Ulysses level: the busiest rank's
documents, 1/sp of every document's heads, or every document on every rank (``mixer_share``; what the ranks
really ran is checked against it in tests/test_mixers.py's sp 2 test)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from plan_walk import epoch_seconds

from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import Hardware
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing.mixer_share import mixer_tokens, padded_tokens

NODE = Hardware("test", 1e15, 80e9, intra_node_bw=400e9, inter_node_bw=50e9, gpus_per_node=8, link_latency_s=0.0)
SPEC = ModelSpec("tiny", 4, 256, 8, 4, 512, 1000)
# 1 layer attends, 2 hold a mixer, 1 is an MLP block (Nemotron-H's kinds)
HYBRID = replace(SPEC, attention_layers=1, mixer_layers=2, mixer_params=3.0 * 256 * 256)


def test_a_mixer_run_whole_on_every_rank_costs_what_one_rank_holding_the_pack_costs():
    """A model whose every matmul is a mixer that runs the whole pack on each of 2 ranks (no LM head): its
    dense time is one rank's with the whole pack, checkpointed layers' recompute included; at the rank's own
    tokens nothing is added; a model without mixers ignores the argument."""
    every = replace(SPEC, vocab=0, attention_layers=0, mixer_layers=4, mixer_params=SPEC.layer_params)
    cost = CostModel(every, NODE, world=2)
    for ckpt in range(5):
        assert cost.dense_seconds(500.0, ckpt, mixer_tokens=1000.0) == pytest.approx(cost.dense_seconds(1000.0, ckpt))
        assert cost.dense_seconds(500.0, ckpt, mixer_tokens=500.0) == pytest.approx(cost.dense_seconds(500.0, ckpt))
    plain = CostModel(SPEC, NODE, world=2)
    assert plain.dense_seconds(500.0, 2, mixer_tokens=1000.0) == plain.dense_seconds(500.0, 2)


def test_an_mlp_block_of_a_hybrid_gathers_nothing_on_a_ulysses_level():
    """The mixers' gathers are counted per layer holding one (``ModelSpec.mixing``): Nemotron-H's MLP blocks
    neither attend nor gather; the attending layer's all-to-alls as before."""
    from lit_hbp.cost.costmodel import mixer_comm_bytes
    from lit_hbp.parallel.ulysses import Ulysses

    tokens, sp = 1000.0, 2
    a2a = Ulysses().comm_bytes_per_layer(HYBRID, tokens, sp) / NODE.intra_node_bw / NODE.eff_link
    gather = mixer_comm_bytes(HYBRID, tokens, sp) / NODE.intra_node_bw / NODE.eff_link
    want = 2 * 1 * a2a + 2 * 2 * gather  # forward and backward: 1 attending layer, 2 mixers, the MLP block nothing
    assert CostModel(HYBRID, NODE, 2).comm_parts(tokens, sp, 0)["ulysses_comm"] == pytest.approx(want)


def test_what_a_split_mixer_sums_over_the_ranks_is_priced_where_it_splits():
    """By hand, 1000 tokens a rank at sp 2 (the pack 2000): the gather and the reduce-scatter move half the pack's
    width in bf16 each, 2 x 2000 x 256 x 2 / 2 bytes; a mixer split by heads whose shares sum 36 values a token
    (a Mamba1 scan's x_proj) all-reduces half of them in float32 too, 2 x 2000 x 36 x 4 / 2; not where it does
    not split (heads 3, or none)."""
    from lit_hbp.cost.costmodel import mixer_comm_bytes

    plain = 2 * 2000 * 256 * 2 / 2
    spanning = 2 * 2000 * 36 * 4 / 2
    assert mixer_comm_bytes(replace(HYBRID, mixer_heads=2, mixer_spanning=36), 1000.0, 2) == plain + spanning
    for heads in (3, None):
        assert mixer_comm_bytes(replace(HYBRID, mixer_heads=heads, mixer_spanning=36), 1000.0, 2) == plain
    assert mixer_comm_bytes(replace(HYBRID, mixer_heads=2), 1000.0, 2) == plain


@pytest.mark.parametrize("heads", [None, 2, 3])
def test_the_simulator_prices_each_sp_groups_mixers_at_what_its_busiest_rank_runs(heads):
    """Brute force over the plan's micro-batches: each SP group's documents (its packs together, as one row)
    give the busiest rank's mixer tokens (a rank of its own too: its documents' batches' padding); heads 2 split
    at sp 2, 3 do not (nor None); the packs of one long
    document, run whole on both ranks where the mixer does not split, make a non-splitting hybrid slower."""
    from lit_hbp.packing import Level, plan_hbp
    from lit_hbp.simulate import simulate

    rng = np.random.default_rng(2)
    lengths = np.r_[rng.integers(10, 500, 1500), rng.integers(2000, 4096, 40)]
    plan = plan_hbp(lengths, [Level(512, 1, 1, 2), Level(4096, 2, 2, ulysses=2)], 8, accumulate=2)
    cost = CostModel(replace(HYBRID, mixer_heads=heads), NODE, 8)
    sim = simulate(plan, cost, "hbp")

    def group_seconds(lv, members) -> float:
        docs = lengths[members]
        mixer = mixer_tokens(docs.tolist(), lv.sp, heads)  # at sp 1 too: the batches' padding
        sum_sq = float((docs.astype(float) ** 2).sum())
        return cost.micro_step(docs.sum() / lv.sp, sum_sq, lv.sp, lv.ckpt_layers, mixer_tokens=mixer)["total"]

    assert sim.seconds == pytest.approx(epoch_seconds(plan, cost, group_seconds), rel=1e-9)
    split = simulate(plan, CostModel(replace(HYBRID, mixer_heads=2), NODE, 8), "hbp")
    assert sim.seconds > split.seconds if heads != 2 else sim.seconds == split.seconds


def test_a_mixer_runs_its_batches_padding_and_that_is_what_it_costs():
    """By hand: documents of 70, 37, 9, 9, 8, 6 and 5 tokens run as [70], [37] and five rows of 9 (45 tokens
    for 37: within a quarter), 152 tokens. At sp 2 the ranks share them evenly (70 | 37 + 9 + 9 + 8 + 6 + 5 =
    74, at most 1.1 x 72): the busiest runs 37 and five rows of 9, 82; documents of one length pad nothing."""
    lengths = [9, 70, 5, 9, 37, 8, 6]
    assert padded_tokens(lengths) == 152
    assert mixer_tokens(lengths, 1, None) == 152.0
    assert mixer_tokens(lengths, 2, 2) == mixer_tokens(lengths, 2, None) == 82.0
    assert mixer_tokens([64] * 5, 1, None) == 320.0
    cost = CostModel(HYBRID, NODE, 8)
    assert cost.micro_step(144.0, 1e4, 1, 0, mixer_tokens=152.0)["total"] > cost.micro_step(144.0, 1e4, 1, 0)["total"]


def test_the_analytic_search_prices_a_hybrids_mixers_over_the_same_synthetic_packs():
    """The analytic profiler's micro-step at sp 2 is the cost model's with the mean busiest-rank mixer tokens
    of the packs ``pack_stats`` draws; a pack of one document each costs a non-splitting hybrid every
    document on both ranks and a splitting one half of it."""
    from lit_hbp.autoselect.profiler import AnalyticProfiler
    from lit_hbp.cost.sample_packs import pack_stats, synthetic_pack

    lengths, pack_len = np.full(100, 4096), 4096
    for heads, want in ((None, 4096.0), (2, 2048.0)):
        cost = CostModel(replace(HYBRID, mixer_heads=heads), NODE, 8)
        tokens, sum_sq, _ = pack_stats(lengths, pack_len, seed=0)
        step = cost.micro_step(tokens / 2, sum_sq, 2, 1, mixer_tokens=want)["total"]
        assert AnalyticProfiler(cost, lengths).measure(pack_len, 2, 1).seconds == pytest.approx(step)
    mixed = np.random.default_rng(4).integers(100, 3000, 5000)
    cost = CostModel(HYBRID, NODE, 8)
    rng = np.random.default_rng(0)
    want = np.mean([mixer_tokens(synthetic_pack(mixed, pack_len, rng).tolist(), 4, None) for _ in range(64)])
    tokens, sum_sq, _ = pack_stats(mixed, pack_len, seed=0)
    step = cost.micro_step(tokens / 4, sum_sq, 4, 0, mixer_tokens=want)["total"]
    assert AnalyticProfiler(cost, mixed).measure(pack_len, 4, 0).seconds == pytest.approx(step)


def test_a_hybrid_on_a_ulysses_level_holds_the_gathered_pack_and_a_non_splitting_mixers_whole_run(monkeypatch):
    """Each mixer layer run without checkpointing keeps the pack's gathered hidden states beyond its rank's
    share (bf16, the whole width); one that does not split by heads keeps, at worst (one document), the whole
    pack's saved set; with every layer checkpointed, the one being recomputed; nothing without mixers. On top,
    at every sp, the worst padding of the batches its documents run in (a third of the tokens it runs, a
    quarter of a batch's): the mixer's set on the padding and its copy of the pack's input rows."""
    import lit_hbp.cost.costmodel as costmodel

    pack_len, sp, b = 8192, 2, 2
    split, whole = CostModel(replace(HYBRID, mixer_heads=2), NODE, 8), CostModel(HYBRID, NODE, 8)
    overhead = split.activation_overhead
    gathered = (pack_len - pack_len / sp) * b * HYBRID.hidden * overhead
    monkeypatch.setattr(costmodel, "PAD_SLACK", 0.0)  # no batch padded
    assert split.memory_parts(pack_len, sp, 0)["mixers"] == pytest.approx(HYBRID.mixing * gathered)
    assert split.memory_parts(pack_len, sp, 4)["mixers"] == pytest.approx(gathered)  # the recomputed layer
    assert split.memory_parts(pack_len, sp, 2)["mixers"] == pytest.approx(HYBRID.mixing * 2 / 4 * gathered)
    assert split.memory_parts(pack_len, 1, 0)["mixers"] == 0
    more = whole.memory_parts(pack_len, sp, 0)["mixers"] - split.memory_parts(pack_len, sp, 0)["mixers"]
    assert more > 0 and whole.memory_bytes(pack_len, sp, 0) - split.memory_bytes(pack_len, sp, 0) == pytest.approx(more)
    mixer_set = more / HYBRID.mixing / (pack_len - pack_len / sp)  # a token's set in a mixer layer, overhead in
    unpadded = {m: m.mixer_saved_bytes(pack_len, sp) for m in (split, whole)}

    monkeypatch.setattr(costmodel, "PAD_SLACK", 0.25)
    rows = pack_len * b * HYBRID.hidden * overhead / 3  # the padding's copy of the gathered pack's input rows
    padded = {split: rows + pack_len / sp * mixer_set / 3, whole: rows + pack_len * mixer_set / 3}  # the runs' third
    for m, want in padded.items():
        assert m.mixer_saved_bytes(pack_len, sp) - unpadded[m] == pytest.approx(want)
    at_sp1 = HYBRID.mixing * (rows + pack_len * mixer_set / 3)
    assert split.memory_parts(pack_len, 1, 0)["mixers"] == pytest.approx(at_sp1)
    assert CostModel(SPEC, NODE, 8).memory_parts(pack_len, sp, 0)["mixers"] == 0


def test_the_tools_price_a_hybrid_as_its_model_built_on_the_meta_device(tmp_path):
    """A config's formula prices every layer as attention and a gated MLP; for a hybrid the level search and
    the tools count the layers' matrices by kind on the model built from the config on the meta device
    (``configured_spec``, equal to a prepared model's spec in tests/test_mixers.py), from a mapping or a
    folder; a dense model's too (its formula's count where the formula is right)."""
    import json

    from families import small_config

    from lit_hbp.cost.config import spec_of
    from lit_hbp.model.causal_lm import configured_spec

    config = small_config("nemotron_h")  # Mamba2, attention and MoE blocks: no layer holds two
    built = configured_spec(config)
    assert built is not None and spec_of(config) == built
    assert built.active_layer_params is not None  # its Mamba2, attention and MoE blocks' matrices, counted
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert spec_of(str(tmp_path)).layer_params == built.layer_params
    llama = small_config("llama")
    assert spec_of(llama) == configured_spec(llama) and spec_of(llama).params == ModelSpec.from_config(llama).params


def test_a_tools_model_option_prices_a_hybrid_as_its_model_built_on_the_meta_device(tmp_path, capsys):
    """``--model`` of the simulator, the level search and the memory report (``cost.config.load_spec``): a hybrid's
    config.json, checkpoint folder or training YAML is counted on its meta-built model, named as given; a preset
    keeps ``load_model_spec``'s, a dense model's count is its formula's. The simulator runs on it."""
    import json

    import yaml
    from families import small_config

    from lit_hbp.cost.config import load_spec
    from lit_hbp.model.causal_lm import configured_spec
    from lit_hbp.model_spec import MODELS, load_model_spec
    from lit_hbp.simulate.__main__ import main as simulate_main

    config = small_config("nemotron_h")
    built = configured_spec(config)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text(json.dumps(config))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"model": {"model": config}}))
    for given in (tmp_path / "folder", tmp_path / "folder" / "config.json", tmp_path / "run.yaml"):
        spec = load_spec(str(given))
        assert spec == replace(built, name=load_model_spec(str(given)).name), given
    assert load_spec("llama3.1-8b") == MODELS["llama3.1-8b"]
    (tmp_path / "llama.json").write_text(json.dumps(small_config("llama")))
    assert load_spec(str(tmp_path / "llama.json")).params == load_model_spec(str(tmp_path / "llama.json")).params
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in np.random.default_rng(0).integers(10, 200, 400)))
    args = [str(lengths), "--model", str(tmp_path / "folder"), "--gpus", "2", "--levels", "256:1", "--no-auto"]
    assert simulate_main(args) == 0, capsys.readouterr().err
