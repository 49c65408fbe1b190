"""The cluster simulator: vectorized pricing against a loop over ranks, the HBP speed-up on a
paper-shaped mix, and the command line with its pictures."""

import numpy as np
import pytest
from plan_walk import epoch_seconds

from lit_hbp.autoselect.search import analytic_levels
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import HARDWARE
from lit_hbp.model_spec import MODELS, ModelSpec
from lit_hbp.packing import Level, plan_hbp
from lit_hbp.simulate import compare, compare_auto, fill_checkpointing, simulate
from lit_hbp.simulate.__main__ import main as simulate_main

TINY = ModelSpec("tiny", 4, 256, 8, 4, 512, 1000)


@pytest.mark.parametrize("images", [False, True])
def test_simulation_equals_a_loop_over_micro_steps_and_groups(images):
    """With ``images``, 30% of the samples carry extra work (an image's encoding, in squared-length
    units), priced as the vision tower's part of their group's micro-step."""
    rng = np.random.default_rng(0)
    lengths = np.r_[rng.integers(10, 500, 3000), rng.integers(500, 4000, 40)]
    extra = np.where(rng.random(lengths.size) < 0.3, rng.uniform(0, 2e5, lengths.size), 0.0) if images else None
    plan = plan_hbp(lengths, [Level(512, 1, 1, 2), Level(4096, 4, 3)], 8, accumulate=2, extra_work=extra)
    cost = CostModel(TINY, HARDWARE["h100"], 8)
    sim = simulate(plan, cost, "hbp", extra_work=extra)
    work = extra if images else np.zeros(lengths.size)

    def group_seconds(lv, members) -> float:
        tokens, sum_sq = lengths[members].sum() / lv.sp, float((lengths[members].astype(float) ** 2).sum())
        return cost.micro_step(tokens, sum_sq, lv.sp, lv.ckpt_layers, vision_work=work[members].sum())["total"]

    total = epoch_seconds(plan, cost, group_seconds)
    assert sim.seconds == pytest.approx(total, rel=1e-9)
    assert sim.gpu_hours == pytest.approx(total * 8 / 3600)
    shares = sim.breakdown()
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(v >= 0 for v in shares.values())
    assert (shares["vision"] > 0) is images


def test_simulate_refuses_levels_that_do_not_fit_and_inputs_it_cannot_use(tmp_path, capsys):
    """A given level the cost model says does not fit is refused with the memory tool's line (it was priced as if it
    fit); no GPUs, more checkpointed layers than the model has, and the search's flags beside --no-auto likewise."""
    path = tmp_path / "mix.npy"
    np.save(path, np.random.default_rng(0).integers(100, 30000, 500))
    base = [str(path), "--model", "llama3.1-8b", "--gpus", "8", "--no-auto"]
    assert simulate_main([*base, "--levels", "4096:1:0", "32768:1:0"]) == 2
    err = capsys.readouterr().err
    assert "level 1 (32768 tokens, sp 1, ckpt 0) will not fit:" in err and "checkpoint more layers" in err
    assert simulate_main([*base, "--levels", "4096:1:99", "32768:8:32"]) == 2
    assert "level 0 (4096 tokens) checkpoints 99 layers; the model has 32" in capsys.readouterr().err
    for flags, refused in [
        (["--gpus", "0"], "--gpus: must be a whole number >= 1, got 0"),
        (["--max-len", "8192"], "--max-len and --margin-gib steer (d)"),
    ]:
        with pytest.raises(SystemExit) as stop:
            simulate_main([*base, *flags])
        assert stop.value.code == 2 and refused in capsys.readouterr().err


@pytest.mark.slow
def test_hbp_speedup_over_naive_isf_on_a_paper_shaped_mix(paper_shaped_mix):
    cost = CostModel(MODELS["llama3.1-8b"], HARDWARE["h100"], 32)
    levels = fill_checkpointing([Level(16384, 1), Level(131072, 8)], cost, paper_shaped_mix)
    sims = compare(paper_shaped_mix, cost, levels)
    naive, hierarchical, hbp = (sims[0].seconds / s.seconds for s in sims)
    assert naive == 1.0
    assert 1.2 <= hbp <= 1.7, hbp  # the paper: 1.40x
    assert 1.0 < hierarchical < hbp  # the paper: hierarchical packing alone 1.16-1.2x
    selection = analytic_levels(cost, paper_shaped_mix)
    naive_auto, auto_sim = compare_auto(paper_shaped_mix, cost, selection)
    assert list(naive_auto.plan.levels) == selection.levels[-1:]  # naive ISF at the search's own largest level
    assert naive_auto.seconds / auto_sim.seconds >= hbp * 0.95
    # HBP removes the idle time of unbalanced attention and most SP traffic.
    assert sims[2].breakdown()["idle"] < 0.02 < sims[0].breakdown()["idle"]
    comm = [sum(s.breakdown()[k] for k in ("ulysses_comm", "cp_comm")) for s in (sims[2], sims[0])]
    assert comm[0] < comm[1]
    assert selection.levels[-1].pack_len == 131072


def test_simulate_command_prints_the_table_and_writes_pictures(tmp_path, capsys, paper_shaped_mix):
    import matplotlib.image

    path = tmp_path / "mix.npy"
    np.save(path, paper_shaped_mix[:20000])
    png = tmp_path / "timeline.png"
    code = simulate_main(
        [
            str(path),
            "--model",
            "llama3.1-8b",
            "--gpus",
            "32",
            "--gpu",
            "h100",
            "--levels",
            "16384:1",
            "131072:8",
            "--no-auto",
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    for row in ("naive ISF", "hierarchical, no balance", "HBP", "HBP over naive ISF"):
        assert row in out
    for f in (png, tmp_path / "timeline_lengths.png"):
        image = matplotlib.image.imread(f)
        assert image.shape[0] > 300 and image.shape[1] > 500 and image.std() > 0.01
    assert simulate_main([str(path), "--model", "nope"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_simulate_refuses_a_plot_path_it_cannot_write_before_simulating_and_names_the_files_it_wrote(
    tmp_path, capsys, monkeypatch
):
    """``--plot t.xyz`` (a suffix matplotlib writes nothing for), a folder, or a path under a file ended in
    savefig's traceback after the whole simulation; each is now refused first (exit 2, one line naming --plot, no
    simulation run). ``--plot NAME`` without a suffix printed ``wrote NAME`` while matplotlib wrote NAME.png:
    the printed paths are now the files on disk, and the only ones."""
    import lit_hbp.simulate.__main__ as command

    path = tmp_path / "l.npy"
    np.save(path, np.arange(1, 4000))
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    run = [str(path), "--gpus", "8", "--levels", "4096:1", "8192:8", "--no-auto", "--plot"]
    monkeypatch.setattr(command, "compare", lambda *a, **k: pytest.fail("simulated before refusing --plot"))
    for plot, said in {
        "t.xyz": "t.xyz: matplotlib writes no .xyz pictures: end it in one of ",
        "adir": "adir is a folder: give a picture file's name",
        "afile/t.png": "afile is a file, so no picture can be written under it",
    }.items():
        with pytest.raises(SystemExit) as stop:
            simulate_main([*run, str(tmp_path / plot)])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and err.startswith("python -m lit_hbp.simulate: error: --plot: ") and said in err
    monkeypatch.undo()
    before = set(tmp_path.iterdir())
    assert simulate_main([*run, str(tmp_path / "noext")]) == 0
    wrote = [line.removeprefix("wrote ") for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert set(map(str, set(tmp_path.iterdir()) - before)) == set(wrote) and len(wrote) == 2
    assert wrote == [str(tmp_path / "noext.png"), str(tmp_path / "noext_lengths.png")]


@pytest.mark.slow
def test_the_vlm_balance_bench_runs_and_hbp_with_the_vision_work_leads(capsys, monkeypatch):
    """bench/vlm_balance.py on a smaller mix: HBP with the vision work in its balance is the fastest
    plan on 32 GPUs, ahead of attention-only HBP and naive packing (the same work priced in each)."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    monkeypatch.syspath_prepend(bench)
    import vlm_balance

    monkeypatch.setattr(sys, "argv", ["vlm_balance.py", "--samples", "4000", "--world", "32"])
    assert vlm_balance.main() == 0
    rows = {line[:28].strip(): float(line.split()[-1].rstrip("x")) for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["naive ISF at 128K"] == 1.0
    assert rows["HBP with the vision work"] >= rows["HBP, attention only"] > 1.2, rows


def test_simulate_applies_a_checkpoints_positions_as_the_fit_does(tmp_path, capsys):
    """A --model folder (as ``save_pretrained`` writes it) brings its positions: a given level past them is refused
    with the fit's own words (``check_positions``, the gate before a fit), and (d) chooses no level past them.
    A Phi-3-mini-128k-shaped longrope model: an SP level past its 4,096 original positions is refused, and (d)'s
    levels past them are sp 1 where the same model with a static rotary embedding takes sp > 1."""
    from transformers import AutoConfig

    path = tmp_path / "mix.npy"
    rng = np.random.default_rng(0)
    np.save(path, np.r_[rng.integers(200, 4000, 3000), rng.integers(4000, 30000, 300), rng.integers(30000, 60000, 30)])
    llama = tmp_path / "llama"
    AutoConfig.for_model("llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         max_position_embeddings=8192).save_pretrained(llama)  # fmt: skip
    base = [str(path), "--gpus", "8"]
    assert simulate_main([*base, "--model", str(llama), "--no-auto", "--levels", "4096:1", "16384:2"]) == 2
    assert "the largest level's pack_len 16384 exceeds the model's max_position_embeddings 8192" in (
        capsys.readouterr().err
    )
    assert simulate_main([*base, "--model", str(llama), "--levels", "2048:1", "8192:1"]) == 0
    out = capsys.readouterr().out
    (auto,) = [line for line in out.splitlines() if line.startswith("auto-selected levels (d), ")]
    chosen = [int(level.split()[0]) for level in auto.split(", ", 1)[1].rstrip(":").split(", ")]
    assert max(chosen) == 8192, auto  # the samples past 8,192 tokens are over the model's positions
    # a training YAML whose model mapping names no positions: the family's default, as the fit builds it (2,048)
    run = tmp_path / "run.yaml"
    shape = "hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, num_attention_heads: 4, vocab_size: 99"
    run.write_text(f"model:\n  model: {{model_type: llama, {shape}}}\n")
    assert simulate_main([*base, "--model", str(run), "--no-auto", "--levels", "1024:1", "8192:1"]) == 2
    assert "pack_len 8192 exceeds the model's max_position_embeddings 2048" in capsys.readouterr().err

    rope = {"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48}
    phi3 = {}
    for name, scaling in (("longrope", rope), ("static", None)):
        phi3[name] = tmp_path / name
        config = AutoConfig.for_model("phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                                      num_attention_heads=32, max_position_embeddings=131072, vocab_size=32064,
                                      original_max_position_embeddings=4096, rope_scaling=scaling)  # fmt: skip
        config.save_pretrained(phi3[name])
    assert simulate_main([*base, "--model", str(phi3["longrope"]), "--no-auto", "--levels", "4096:1", "65536:8"]) == 2
    assert "the level of pack_len 65536 at sp 8 passes 4096" in capsys.readouterr().err
    sps = {}
    for name, folder in phi3.items():
        assert simulate_main([*base, "--model", str(folder), "--levels", "4096:1", "65536:1"]) == 0
        (auto,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("auto-selected levels")]
        sps[name] = {
            int(lv.split()[0]): int(lv.split()[1][2:].split("=")[0])
            for lv in auto.split(", ", 1)[1].rstrip(":").split(", ")  # "65536 sp8=8x1 ckpt20": at sp 8
        }
    assert all(sp == 1 for length, sp in sps["longrope"].items() if length > 4096), sps
    assert any(sp > 1 for sp in sps["static"].values()), sps


def test_simulate_prices_a_training_yamls_own_run_with_the_flags_over_it(tmp_path, capsys):
    """``--model`` a training YAML: its LoRA, Liger, strategy and precision were dropped (a full-weights ZeRO-2 run
    priced, whatever the YAML trains: other levels than the level search chose for the same config); now the
    YAML's own run is priced, and a flag given sets its setting over it."""
    path = tmp_path / "l.npy"
    np.save(path, np.random.default_rng(0).integers(100, 4000, 500))
    shape = "hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, num_attention_heads: 4, vocab_size: 99"
    run = tmp_path / "run.yaml"
    run.write_text(
        "trainer:\n  precision: bf16-mixed\n  strategy: hbp_stage_1\nmodel:\n  lora: {rank: 16}\n  liger: true\n"
        f"  model: {{model_type: llama, {shape}, max_position_embeddings: 8192}}\n"
    )
    base = [str(path), "--model", str(run), "--gpus", "8", "--no-auto", "--levels", "4096:1"]
    for flags, said in (([], "ZeRO-1, Liger, LoRA, bf16;"), (["--zero-stage", "2"], "ZeRO-2, Liger, LoRA, bf16;")):
        assert simulate_main([*base, *flags]) == 0
        assert f"(simulated with the cost model), {said}" in capsys.readouterr().out, flags
    # A run without DeepSpeed, and a lever asking for it: priced as the level search prices the same config and flag.
    from lit_hbp.autoselect import RunSetting
    from lit_hbp.cost.config import read_config
    from lit_hbp.cost.hardware import HARDWARE
    from lit_hbp.cost.run_settings import describe

    ddp = tmp_path / "ddp.yaml"
    ddp.write_text(run.read_text().replace("hbp_stage_1", "ddp"))
    for flags, stage in (([], None), (["--zero-stage", "2"], 2)):
        assert simulate_main([str(path), "--model", str(ddp), *base[3:], *flags]) == 0
        searched = RunSetting.from_config(read_config(ddp), None, 8).with_flags(zero_stage=stage)
        said = describe(searched.settings(HARDWARE["h100"]))
        assert f"(simulated with the cost model), {said};" in capsys.readouterr().out, flags
    assert said == "ZeRO-2, Liger, LoRA, bf16"  # DeepSpeed's bf16 weights, not autocast over fp32 ones


def test_simulate_plans_a_training_yamls_own_world_levels_accumulation_packer_and_seed(tmp_path, capsys):
    """``--model`` a training YAML: its devices x num_nodes, data.levels, accumulate_grad_batches, data.packer and
    data.seed were replaced by the flags' defaults (32 GPUs, 16K:1 128K:8, 1, bfd, 0) without a word, so the YAML's
    own run was never the one priced. Now the YAML's run is planned as if each were given as a flag; a flag given
    wins; a selector's levels or ``devices: auto`` need the flag."""
    path = tmp_path / "l.npy"
    np.save(path, np.random.default_rng(0).integers(100, 6000, 400))
    shape = "hidden_size: 256, intermediate_size: 512, num_hidden_layers: 4, num_attention_heads: 4, vocab_size: 99"
    head = "seed_everything: 3\ntrainer:\n  devices: 2\n  num_nodes: 2\n  accumulate_grad_batches: 3\n"
    head += "  precision: bf16-mixed\n  strategy: hbp_stage_2\n"
    model = f"model:\n  model: {{model_type: llama, {shape}, max_position_embeddings: 8192}}\n"
    levels = "  levels:\n    - {pack_len: 2048, sp: 1}\n    - 8K:2:3\n"
    run = tmp_path / "run.yaml"
    run.write_text(head + "data:\n  packer: ffd\n  seed: 7\n" + levels + model)
    flags = ["--gpus", "4", "--accumulate", "3", "--packer", "ffd", "--seed", "7", "--levels", "2048:1:0", "8192:2:3"]
    outputs = []
    for given in ([], flags):
        assert simulate_main([str(path), "--model", str(run), "--no-auto", *given]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert "on 4 x " in outputs[0] and "accumulate 3, packer ffd, seed 7; levels 2048 sp1 ckpt0, 8192 sp2" in outputs[0]
    assert simulate_main([str(path), "--model", str(run), "--no-auto", "--seed", "1", "--gpus", "8"]) == 0
    assert "on 8 x " in (out := capsys.readouterr().out) and "packer ffd, seed 1;" in out  # the flags win
    run.write_text(head + "data:\n  seed: null\n" + levels + model)
    assert simulate_main([str(path), "--model", str(run), "--no-auto"]) == 0
    assert "packer bfd, seed 3;" in capsys.readouterr().out  # data.seed null: seed_everything's, as the fit plans
    run.write_text(head + "data:\n  levels: {class_path: lit_hbp.autoselect.AnalyticSelector}\n" + model)
    assert simulate_main([str(path), "--model", str(run), "--no-auto"]) == 2
    said = "data.levels is a selector, which chooses the fit's levels as (d) does: give --levels"
    assert said in capsys.readouterr().err
    run.write_text(head.replace("devices: 2", "devices: auto") + "data:\n" + levels + model)
    assert simulate_main([str(path), "--model", str(run), "--no-auto"]) == 2
    assert "trainer.devices x num_nodes names no count of GPUs to price: give --gpus" in capsys.readouterr().err


def test_simulate_and_autoselect_price_a_yamls_nodes_of_its_devices(tmp_path, capsys):
    """A YAML of 4 nodes of 4 GPUs: simulate priced and laid its levels out on the preset's nodes of 8 (Ulysses 8 across
    two of the run's nodes), and autoselect did too once ``--gpus`` was given, even the config's own 16: each chose
    other levels than the fit's nodes allow. Both now price nodes of ``trainer.devices`` and write the same block."""
    from lit_hbp.autoselect.__main__ import main as autoselect_main

    path = tmp_path / "l.npy"
    rng = np.random.default_rng(0)
    np.save(path, np.concatenate([rng.integers(50, 8000, 4000), [131072, 100000, 60000, 40000]]))
    run = tmp_path / "run.yaml"
    run.write_text(
        "trainer:\n  devices: 4\n  num_nodes: 4\n  precision: bf16-mixed\n  strategy: hbp_stage_2\n"
        "data:\n  levels: ['16384:1:32', '131072:8:32']\n"
        "model:\n  model: {model_type: llama, hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: 32, "
        "num_attention_heads: 32, num_key_value_heads: 8, vocab_size: 128256, max_position_embeddings: 131072}\n"
    )
    blocks = []
    assert simulate_main([str(path), "--model", str(run)]) == 0
    out = capsys.readouterr().out
    assert "131072 sp8=4x2 ckpt32" in out  # the given level: Ulysses within a node of 4, CP across two
    blocks.append("levels:" + out.split("\nauto-selected levels (d), ")[1].split("\nlevels:", 1)[1].split("\n\n")[0])
    for gpus in ([], ["--gpus", "16"]):
        assert autoselect_main(["--config", str(run), "--analytic", "--lengths", str(path), *gpus]) == 0
        blocks.append("levels:" + capsys.readouterr().out.split("\nlevels:", 1)[1].split("\n\n")[0])
    assert blocks[0] == blocks[1] == blocks[2], blocks
    assert "ulysses: 8" not in blocks[0]


@pytest.mark.parametrize("tool", ["simulate", "autoselect"])
def test_a_switch_a_yaml_turned_on_is_refused_in_the_yamls_words(tmp_path, capsys, tool):
    """Liger (or the optimizer's offload) a YAML turned on, at a ZeRO stage that refuses it, was named as the flag
    (``--liger``), with the fix "without --liger": a flag the user never gave, and no flag turns it off. Named as
    the YAML names it; the flag given names itself; the stage's own fix stays a flag (it overrides the YAML)."""
    from lit_hbp.autoselect.__main__ import main as autoselect_main

    path = tmp_path / "l.npy"
    np.save(path, np.random.default_rng(0).integers(100, 4000, 200))
    shape = "hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2, num_attention_heads: 4, vocab_size: 99"
    run = tmp_path / "run.yaml"
    run.write_text(
        "trainer:\n  precision: bf16-mixed\n  strategy: hbp_stage_3\nmodel:\n  liger: true\n"
        f"  model: {{model_type: llama, {shape}, max_position_embeddings: 8192}}\n"
    )
    if tool == "simulate":
        argv, main = [str(path), "--model", str(run), "--gpus", "8", "--no-auto", "--levels", "4096:1"], simulate_main
    else:
        argv, main = ["--config", str(run), "--lengths", str(path), "--gpus", "8"], autoselect_main
    said = (([], "model.liger: true", "model.liger: false"), (["--liger"], "--liger", "without --liger"))
    for flags, name, off in said:
        assert main([*argv, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"error: {name} needs ZeRO stage 0-2, not 3 (Liger's fused linear cross-entropy reads the LM head's weight "
            f"whole, which ZeRO-3 partitions): use --zero-stage 2 or {off}"
        ), flags
    assert main([*argv, "--zero-stage", "2"]) == 0  # the fix named
