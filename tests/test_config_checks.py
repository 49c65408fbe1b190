"""Issue 14, "no silent surprises", the config rows: a model-config typo, positions the model does not
cover, command-line lists merged into the config's, the resolved config printed, world-size and SP
errors before anything spawns, and short parser errors."""

import argparse
import logging
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from conftest import TINY_LLAMA, quiet_trainer

from lit_hbp.cli.app import main
from lit_hbp.cli.checks import check_logging_callbacks
from lit_hbp.cli.launch import world_size_of
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.lightning.plan_checks import accumulation_at, check_accumulation_windows, check_validation_interval
from lit_hbp.model.checks import check_model_config, check_positions, valid_config_keys
from lit_hbp.packing import Level

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/tiny_cpu.yaml")
TINY_SP = str(ROOT / "configs/tiny_cpu_sp.yaml")


def cli_error(capsys, args: list[str]) -> list[str]:
    """The stderr lines of a CLI run that must stop with exit status 2 before anything is built (so
    ``fit`` runs nothing either)."""
    with pytest.raises(SystemExit) as stop:
        main(args, run=args[0] == "fit")
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    assert "Traceback" not in "\n".join(lines)
    return lines[first:]  # (what comes before: warnings, "Seed set to 0")


# ------------------------------------------------------------------- 1. model config typos


def test_a_model_config_typo_names_the_key_and_the_nearest_valid_one(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key 'num_hiden_layers' \(did you mean 'num_hidden_layers'\?\)"):
        check_model_config({"model_type": "llama", "num_hiden_layers": 4})
    with pytest.raises(ValueError, match=r"unknown model_type 'lama' \(did you mean 'llama'\?\)"):
        check_model_config({"model_type": "lama"})
    # Keys real config.json files carry for other tools, with no near miss of a missing key: kept, and said.
    with pytest.warns(UserWarning, match=r"does not use 'max_length' \(a generation setting\)"):
        check_model_config({"model_type": "qwen2", "max_length": 4096})
    with pytest.warns(UserWarning, match=r"GPT2Config does not use 'rope_theta'"):
        check_model_config({"model_type": "gpt2", "n_layer": 2, "rope_theta": 1e6})
    real = {"auto_map": {"AutoConfig": "x.Config"}, "quantization_config": {"quant_method": "fp8"}}
    with pytest.warns(UserWarning, match=r"'auto_map', 'quantization_config'"):
        check_model_config({"model_type": "llama", **real})
    # gemma2's config.json has hidden_act beside hidden_activation: not a typo, the real key is there.
    with pytest.warns(UserWarning, match="hidden_act"):
        check_model_config({"model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu"})
    # Plain Python: building the module's model refuses it.
    typo = {**{k: v for k, v in TINY_LLAMA.items() if k != "num_attention_heads"}, "num_atention_heads": 4}
    module = HBPLitModule(model=typo, vocab_size=300)
    with pytest.raises(ValueError, match=r"'num_atention_heads' \(did you mean 'num_attention_heads'\?\)"):
        module.configure_model()


def test_the_cli_refuses_a_model_config_typo_before_building_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = cli_error(capsys, ["--config", TINY, "--model.model.num_hiden_layers", "2"])
    assert "unknown key 'num_hiden_layers' (did you mean 'num_hidden_layers'?)" in err[0], err
    assert len(err) <= 3, err


def test_the_attention_lit_hbp_sets_is_refused_in_a_model_mapping_and_a_ddp_argument_typo_on_one_device(
    tmp_path, capsys, monkeypatch
):
    """``attn_implementation`` in a mapping was dropped without a word (prepare_model sets lit-hbp's); a DDP
    argument that no DDP wrapper takes on one device would pass there and stop the same config on two GPUs."""
    from lit_hbp.lightning.strategy import HBPDDPStrategy

    monkeypatch.chdir(tmp_path)
    err = cli_error(capsys, ["--config", TINY, "--model.model.attn_implementation", "eager"])
    assert "attn_implementation: 'eager' is lit-hbp's to set" in err[0] and "set model.attn_backend" in err[0], err
    with pytest.raises(ValueError, match="_attn_implementation: 'sdpa' is lit-hbp's to set"):
        check_model_config({"model_type": "llama", "_attn_implementation": "sdpa"})
    with pytest.raises(ValueError, match=r"'find_unused_paramters' is not an argument of torch's Distributed"
                       r"DataParallel \(did you mean 'find_unused_parameters'\?\)"):  # fmt: skip
        HBPDDPStrategy(find_unused_paramters=True)
    assert HBPDDPStrategy(find_unused_parameters=True)._ddp_kwargs == {"find_unused_parameters": True}


@pytest.mark.parametrize(
    "env, said",
    [
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}, "but torchrun started 2 (--nnodes x --nproc_per_node)"),
        ({"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train"}, "but SLURM started 2 (--nodes x --ntasks-per-node)"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "0"}, "but its launcher started 2 (the WORLD_SIZE it set)"),
    ],
    ids=["torchrun", "slurm", "deepspeed_or_mpirun"],
)
def test_a_launcher_that_started_another_count_of_processes_is_refused(tmp_path, capsys, monkeypatch, env, said):
    """``torchrun --nproc_per_node 2`` (or srun with 2 tasks) of a config with ``devices: 1`` trained two separate
    copies of the run, each planned for world 1, into one run folder, exit 0 (Lightning checks only several
    devices against the launcher): refused before anything is built. A launch that matches runs as before."""
    monkeypatch.chdir(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    err = cli_error(capsys, ["fit", "--config", TINY])
    assert err[0] == f"error: the config trains on 1 process (trainer.devices x trainer.num_nodes), {said}: launch " \
        "as many as it trains on, or set trainer.devices (docs/cluster.md)", err  # fmt: skip
    monkeypatch.setenv(*next((k, "1") for k in ("WORLD_SIZE", "SLURM_NTASKS") if k in env))
    from lit_hbp.cli.launch import check_launcher

    check_launcher({"devices": 1})


def test_a_slurm_layout_other_than_the_configs_is_refused_in_one_line(monkeypatch):
    """SLURM's 2 tasks on 2 nodes for a config of 2 devices on 1 node: the counts agree, and Lightning stopped on a
    traceback about --ntasks-per-node after the data was read; refused first, naming the key. Its layout runs."""
    from lit_hbp.cli.launch import check_launcher

    for key, value in dict(
        SLURM_NTASKS="2", SLURM_JOB_NAME="train", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="1"
    ).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"trainer.devices is 2 a node, but SLURM starts 1 \(--ntasks-per-node\)"):
        check_launcher({"devices": 2, "num_nodes": 1})
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2(x2)")  # SLURM's form for a count repeated over nodes
    with pytest.raises(ConfigError, match=r"trainer.num_nodes is 1, but SLURM gave 2 nodes \(--nodes\)"):
        check_launcher({"devices": 2, "num_nodes": 1})
    monkeypatch.setenv("SLURM_NTASKS", "4")
    check_launcher({"devices": 2, "num_nodes": 2})


def test_a_ddp_communication_hook_on_one_cpu_device_is_refused_not_dropped(tmp_path, sp_data, toy_tokenizer):
    """On one device HBPDDPStrategy wraps nothing, and Lightning registers a DDP hook on CUDA only: an fp16
    compression hook (which rounds every gradient) was dropped without a word; on one CUDA device DDP runs it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.lightning.strategy import HBPDDPStrategy

    dm = HBPDataModule(sources=[{"path": str(sp_data)}], tokenizer=toy_tokenizer, levels=[256], cache_dir=str(tmp_path))
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size)
    trainer = quiet_trainer(strategy=HBPDDPStrategy(ddp_comm_hook=fp16_compress_hook), max_steps=1)
    with pytest.raises(ConfigError, match=r"ddp_comm_hook runs on CUDA devices only .* not on cpu: remove it"):
        trainer.fit(module, dm)


def test_a_static_graph_with_accumulation_on_several_processes_is_refused(monkeypatch):
    """``HBPDDPStrategy(static_graph=True)`` with ``accumulate_grad_batches`` 2 on two processes stopped in the first
    backward with torch's ``expect_autograd_hooks_ INTERNAL ASSERT FAILED`` (reducer.cpp), asking to report a bug to
    PyTorch: Lightning accumulates in ``no_sync``, which DDP's static graph does not take. Refused by name; with
    accumulate 1 it reaches DDP's wrapper as before."""
    import types

    from lit_hbp.lightning.strategy import HBPDDPStrategy

    wrapped = []
    monkeypatch.setattr("lightning.pytorch.strategies.ddp.DDPStrategy.configure_ddp", lambda self: wrapped.append(1))
    for accumulate in (2, 1):
        strategy = HBPDDPStrategy(static_graph=True)
        monkeypatch.setattr(type(strategy), "world_size", 2)
        trainer = types.SimpleNamespace(accumulate_grad_batches=accumulate)
        monkeypatch.setattr(type(strategy), "lightning_module", types.SimpleNamespace(trainer=trainer))
        if accumulate > 1:
            with pytest.raises(ConfigError, match=r"static_graph=True with accumulate_grad_batches 2: torch's DDP"):
                strategy.configure_ddp()
        else:
            strategy.configure_ddp()
    assert wrapped == [1]


def test_every_key_of_every_causal_lm_default_config_is_valid():
    """The property the typo check must keep: nothing a family's own config writes is refused."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    checked = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
                try:
                    config = AutoConfig.for_model(family)
                except Exception:  # a family whose default config transformers itself cannot build
                    continue
                keys = config.to_dict()
                check_model_config({**keys, "model_type": family})
                checked.append(family)
        finally:
            logging.disable(logging.NOTSET)
    for family in ("llama", "qwen2", "mistral", "gpt_neox", "gpt2", "gemma3_text", "mixtral", "phi3"):
        assert family in checked
    assert len(checked) > 100
    # The spellings of hub config.json files that transformers 5 folds into newer fields or aliases.
    check_model_config(
        {
            "model_type": "llama",
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
            "torch_dtype": "bfloat16",
            "architectures": ["LlamaForCausalLM"],
            "transformers_version": "4.43.0",
        }
    )
    check_model_config({"model_type": "gpt2", "num_hidden_layers": 2, "n_layer": 2})  # attribute_map alias
    assert {"num_hidden_layers", "rope_theta", "use_parallel_residual"} <= valid_config_keys("gpt_neox")


# ------------------------------------------------------------------- 2. positions the model does not cover


def llama(**kw):
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", **kw)


LEVELS = [Level(2048), Level(32768, 1, 0)]


def test_levels_past_max_position_embeddings_are_an_error_naming_both_numbers():
    with pytest.raises(ValueError) as e:
        check_positions(llama(max_position_embeddings=2048), LEVELS)
    message = str(e.value)
    assert "pack_len 32768" in message and "max_position_embeddings 2048" in message
    assert "Raise max_position_embeddings to 32768" in message and "rope_type: yarn, factor: 16" in message
    # Scaling that does not reach far enough says how far it reaches.
    linear = llama(max_position_embeddings=2048, rope_parameters={"rope_type": "linear", "factor": 4.0})
    with pytest.raises(ValueError, match=r"linear RoPE scaling \(factor 4 over 2048 positions\) reaches only 8192"):
        check_positions(linear, LEVELS)
    assert check_positions(llama(max_position_embeddings=32768), LEVELS) is None
    assert check_positions(llama(max_position_embeddings=2048), None) is None  # levels: auto, not chosen yet


def test_rope_scaling_that_covers_the_levels_is_stated():
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048}
    note = check_positions(llama(max_position_embeddings=2048, rope_parameters=yarn), LEVELS)
    assert note is not None and "32768" in note and "2048" in note and "yarn" in note


# Hybrids whose attention takes no positions (NoPE), and models that take them (RoPE, a position table).
NOPE = [("nemotron_h", {"layers_block_type": ["mamba", "attention"]}), ("jamba", {}), ("granitemoehybrid", {})]
POSITIONED = [("llama", {}), ("gpt2", {}), ("granitemoehybrid", {"position_embedding_type": "rope"}), ("bamba", {})]


@pytest.mark.parametrize(("family", "overrides"), NOPE + POSITIONED)
def test_a_model_takes_positions_exactly_when_its_logits_depend_on_them(family, overrides):
    """``takes_positions`` (asked of the built model, and of its config built on the meta device) against the
    unprepared model itself: a document's logits change when its second half's positions move 300 further
    (relative distances change; the all-ones mask keeps it one sequence), or they do not. Granite 4.0-H keeps
    rope_parameters in its config whatever its position_embedding_type says."""
    from test_mixers import tiny

    from lit_hbp.model.checks import takes_positions

    net = tiny(family, **overrides).eval()
    ids, mask = torch.arange(3, 40)[None], torch.ones(1, 37, dtype=torch.long)
    positions = torch.arange(37)[None]
    with torch.no_grad():
        first = net(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        moved = positions + 300 * (positions >= 18)
        later = net(input_ids=ids, attention_mask=mask, position_ids=moved, use_cache=False).logits
    depends = (first - later).abs().max().item() > 1e-4
    assert depends is ((family, overrides) in POSITIONED)
    assert takes_positions(net) is depends
    assert takes_positions(net.config) is depends


@pytest.mark.parametrize(("family", "overrides"), NOPE)
def test_a_hybrid_without_positions_trains_levels_past_max_position_embeddings(family, overrides, tmp_path):
    """A NoPE hybrid at max_position_embeddings 64 takes a level of 128 (the fit's check on the built model,
    the command line's and the simulator's on the config, the level search's limit, also on its saved folder: a
    Nemotron-H folder's config.json, read as plain JSON, held transformers' ``{"__float__": "Infinity"}`` and
    built nothing, so the search capped it at 64) and trains a 100-token document in it as that document alone
    through the unprepared model; a Llama at 64 is still refused."""
    from conftest import separate_loss
    from test_mixers import reference_of, tiny

    from lit_hbp import pack_samples, packed_loss, prepare_model
    from lit_hbp.autoselect.selector import position_limit

    net = tiny(family, max_position_embeddings=64, **overrides).eval()
    levels = [Level(64), Level(128)]
    assert check_positions(net.config, levels, net) is None
    assert check_positions(net.config, levels) is None
    assert position_limit(net.config) is None
    net.config.save_pretrained(tmp_path)
    assert position_limit(tmp_path) is None and position_limit(tmp_path / "config.json") is None
    from lit_hbp.cost.config import load_spec  # the cost tools' --model: its config.json priced as its folder

    assert load_spec(str(tmp_path / "config.json")) == load_spec(str(tmp_path))
    rng = np.random.default_rng(0)
    docs = [(rng.integers(3, net.config.vocab_size, n), np.ones(n, bool)) for n in (100, 20)]
    reference = reference_of(net)
    with torch.no_grad():
        want = float(separate_loss(reference, dict(enumerate(docs))))
        got = float(packed_loss(prepare_model(net).eval(), pack_samples(docs), "sum").ce_sum)
    assert abs(got - want) <= 1e-5 * abs(want)
    positioned = tiny("llama", max_position_embeddings=64)
    with pytest.raises(ValueError, match="pack_len 128 exceeds the model's max_position_embeddings 64"):
        check_positions(positioned.config, levels, positioned)
    assert position_limit(positioned.config) == 64


def test_levels_past_where_a_dynamic_or_longrope_rotary_embedding_rescales_are_refused():
    """transformers rescales dynamic and longrope rotary frequencies by a call's longest position: levels past
    that length would pack a long document's scaling onto its neighbours (the packed call refuses such a pack;
    tests/test_prepared_model.py); refused from the config, and the level search stops there. A longrope pack at
    sp 1 gives each document its own factors: only its SP levels past the length are refused (and the search
    keeps them at sp 1)."""
    from transformers import AutoConfig

    from lit_hbp.autoselect.selector import position_limit, whole_past

    dynamic = llama(max_position_embeddings=2048, rope_parameters={"rope_type": "dynamic", "factor": 16.0})
    with pytest.raises(ValueError, match=r"pack_len 32768 passes 2048, past which the model's rope_type 'dynamic'"):
        check_positions(dynamic, LEVELS)
    assert check_positions(dynamic, [Level(1024), Level(2048)]) is None
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [4.0] * 32}
    shape = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072, pad_token_id=0)
    phi3 = AutoConfig.for_model("phi3", original_max_position_embeddings=4096, rope_scaling=rope, **shape)
    assert check_positions(phi3, LEVELS) is None  # sp 1
    with pytest.raises(ValueError, match=r"pack_len 32768 at sp 2 passes 4096, past which the model's rope_type 'lo"):
        check_positions(phi3, [Level(2048), Level(32768, 2)])
    assert check_positions(phi3, [Level(4096, 2), Level(32768)]) is None
    assert position_limit(phi3.to_dict()) == 131072 and position_limit(dynamic.to_dict()) == 2048
    assert whole_past(phi3.to_dict()) == 4096 and whole_past(dynamic.to_dict()) is None  # longrope: sp 1 past it
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048}
    assert position_limit(llama(max_position_embeddings=2048, rope_parameters=yarn).to_dict()) == 32768


def test_the_module_checks_positions_against_the_data_modules_levels(tmp_path, small_demo, monkeypatch):
    """CLI and Python alike: the model is built at fit, against the levels the data module holds."""
    monkeypatch.chdir(tmp_path)
    cli = main(
        [
            "--config",
            TINY,
            "--data.demo_dir",
            str(small_demo),
            "--model.model.max_position_embeddings",
            "2048",
            "--trainer.logger",
            "false",
            "--trainer.enable_progress_bar",
            "false",
        ],
        run=False,
    )
    with pytest.raises(ValueError, match=r"pack_len 16384 exceeds the model's max_position_embeddings 2048"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)


# ------------------------------------------------------------------- 3. command-line lists replace


def test_a_command_line_list_replaces_the_configs_list(tmp_path, small_demo, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, b = f"{small_demo}/short.jsonl", f"{small_demo}/long.jsonl"
    args = ["--config", TINY, "--data.demo_dir", str(small_demo)]
    cli = main(
        args
        + [
            "--data.sources",
            f"[{{path: {a}}}, {{path: {b}}}]",
            "--data.levels",
            "[{pack_len: 1024}, {pack_len: 4096}, {pack_len: 16384}]",
        ],
        run=False,
    )
    assert [(s.path, s.repeat) for s in cli.datamodule.sources] == [(a, None), (b, None)]
    assert [lv.ckpt_layers for lv in cli.datamodule.levels] == [0, 0, 0]
    # Appending keeps the config's list (a third file: a source twice is refused, tests/test_data.py).
    extra = tmp_path / "more.jsonl"
    extra.write_text(Path(a).read_text())
    cli = main(args + ["--data.sources+", f"{{path: {extra}}}"], run=False)
    assert [s.repeat for s in cli.datamodule.sources] == [None, 2.0, None]
    # So does a second config file: its list replaces the first's.
    second = tmp_path / "second.yaml"
    second.write_text(yaml.safe_dump({"data": {"sources": [{"path": a}, {"path": b}]}}))
    cli = main(args + ["--config", str(second)], run=False)
    assert [(s.path, s.repeat) for s in cli.datamodule.sources] == [(a, None), (b, None)]


def test_a_command_line_callback_list_does_not_inherit_the_configs_arguments(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    callbacks = (
        "[{class_path: lit_hbp.callbacks.HBPCurriculum, init_args: {short_levels: [1024]}}, "
        "lit_hbp.callbacks.PackingMetrics, lit_hbp.callbacks.HBPThroughputMonitor, "
        "lightning.pytorch.callbacks.LearningRateMonitor, lightning.pytorch.callbacks.ModelCheckpoint]"
    )
    # Merged, the first entry took the config's warmup_steps: 10; replaced, it has none.
    err = cli_error(capsys, ["--config", TINY, "--trainer.callbacks", callbacks])
    assert err[0] == "error: trainer.callbacks: lit_hbp.callbacks.HBPCurriculum needs warmup_steps", err


def test_an_option_of_one_item_of_a_data_list_is_refused(tmp_path, small_demo, capsys, monkeypatch):
    """``--data.levels.pack_len 512``: jsonargparse set the last level's alone (a 1024 level became 512 and its
    samples too long, without a word), ``--data.sources.path`` swapped the last source keeping its ``repeat``, and
    the indexed forms were refused as unknown fields. Each names the whole-list form, status 2; Lightning's idiom
    for a class list (``--trainer.callbacks+=... --trainer.callbacks.monitor ...``: the one just added) stays."""
    monkeypatch.chdir(tmp_path)
    args = ["--config", TINY, "--data.demo_dir", str(small_demo)]
    for option, value in (
        ("--data.levels.pack_len", "512"),
        ("--data.levels.0.pack_len", "512"),
        ("--data.sources.path", f"{small_demo}/short.jsonl"),
        ("--data.sources.repeat", "2"),
        ("--data.val_sources.path", f"{small_demo}/short.jsonl"),
    ):
        whole = option.split(".")[0] + "." + option.split(".")[1]
        err = cli_error(capsys, [*args, option, value])
        assert err[0] == (
            f"error: {option}: a field of one item of the list {whole} is not an option (it would set the last "
            f"item's alone); give the whole list, e.g. {whole} '[{{...}}, {{...}}]' (--print_config shows it), or "
            "edit it in the config file"
        ), err
    cli = main([*args, "--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor=val/loss"], run=False)
    stops = [c for c in cli.trainer.callbacks if type(c).__name__ == "EarlyStopping"]
    assert [c.monitor for c in stops] == ["val/loss"]


def test_a_key_given_twice_in_a_yaml_mapping_is_refused(tmp_path, capsys, monkeypatch):
    """A second ``sources:`` pasted below the first, or a second ``trainer:`` section: YAML keeps the last and the
    first was dropped without a word (its source read nowhere). Refused with both lines, in a config file, on the
    command line and by the tools that read the YAML; once, it runs."""
    import yaml

    from lit_hbp.cost.config import read_config

    monkeypatch.chdir(tmp_path)
    text = "data:\n  sources: [a.jsonl]\n  levels: [{pack_len: 512}]\n  sources: [b.jsonl]\n"
    assert yaml.safe_load(text)["data"]["sources"] == ["b.jsonl"]  # what was read (the reference: PyYAML)
    extra = tmp_path / "twice.yaml"
    extra.write_text(text)
    want = (
        f"error: {extra}: data.sources is given twice (lines 2 and 4): YAML would keep the last and drop the first "
        "without a word; write it once (a list option holds all its items in one list)"
    )
    assert cli_error(capsys, ["fit", "--config", TINY, "--config", str(extra)])[0] == want
    extra.write_text("trainer:\n  max_steps: 3\ntrainer:\n  max_epochs: 1\n")
    err = cli_error(capsys, ["fit", "--config", TINY, "--config", str(extra)])
    assert err[0].startswith(f"error: {extra}: trainer is given twice (lines 1 and 3)"), err
    err = cli_error(capsys, ["fit", "--config", TINY, "--data.levels", "[{pack_len: 512, pack_len: 1024}]"])
    assert err[0].startswith("error: --data.levels[0].pack_len is given twice (lines 1 and 1)"), err
    with pytest.raises(ConfigError, match=r"trainer is given twice \(lines 1 and 3\)"):
        read_config(extra)


# ------------------------------------------------------------------- 4. the resolved config, once and compact


def test_the_resolved_config_is_printed_once_and_compact(tmp_path, small_demo, monkeypatch, capfd, caplog):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        main(["--config", TINY, "--data.demo_dir", str(small_demo), "--model.lr", "0.5"], run=False)
    # Lightning's rank-zero logger writes to stderr, or to the root logger's handlers where it has some.
    out = capfd.readouterr()
    printed = [m for m in [*caplog.messages, *(out.out + out.err).split("\n")] if "resolved config (" in m]
    assert len(printed) == 1
    text = "\n".join(caplog.messages) + out.out + out.err
    summary = text[text.index("resolved config") :].split("\n", 1)[1]
    summary = summary[: summary.index("\nGPU available")] if "\nGPU available" in summary else summary
    config = yaml.safe_load(summary)
    assert config["model"]["lr"] == 0.5 and config["model"]["model"]["num_hidden_layers"] == 4
    assert config["data"]["levels"][1] == {"pack_len": 4096, "ckpt_layers": 2}  # resolved, no default fields
    assert config["model"]["model"]["max_position_embeddings"] == 16384
    assert config["trainer"]["callbacks"][0] == {
        "class_path": "lit_hbp.callbacks.HBPCurriculum",
        "init_args": {"warmup_steps": 10, "short_levels": [1024, 4096]},
    }
    assert "ce_chunk_size" not in config["model"] and "log_graph" not in summary  # defaults left out
    assert len(summary.splitlines()) < 60


# ------------------------------------------------------------------- 5. world size and SP before spawning


def test_world_size_and_sp_errors_come_before_anything_spawns(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = cli_error(capsys, ["--config", TINY_SP, "--trainer.devices", "3"])
    assert err[0] == "error: world_size 3 is not divisible by sp 2 of level 1 (pack_len 8192)", err
    heads = ["--model.model.num_attention_heads", "3", "--model.model.num_key_value_heads", "3"]
    # 3 heads at sp 2 train by context parallelism unless the level asks for Ulysses 2.
    ulysses = ["--data.levels", "[{pack_len: 2048, sp: 1}, {pack_len: 8192, sp: 2, ulysses: 2}]"]
    err = cli_error(capsys, ["--config", TINY_SP, *heads, *ulysses, "--model.model.hidden_size", "96"])
    assert "level 1 (pack_len 8192, sp 2)" in err[0] and "3 attention heads cannot be split over 2 Ulysses" in err[0]
    err = cli_error(capsys, ["--config", TINY_SP, "--trainer.devices", "[0, 1, 2]", "--trainer.accelerator", "gpu"])
    assert "world_size 3 is not divisible by sp 2" in err[0], err


def test_world_size_from_the_trainer_config():
    assert world_size_of({"devices": 2, "num_nodes": 4}) == 8
    assert world_size_of({"devices": [0, 1, 2]}) == 3
    assert world_size_of({"devices": "0,1", "accelerator": "gpu"}) == 2
    assert world_size_of({"devices": "4"}) == 4
    assert world_size_of({"accelerator": "cpu", "devices": "auto", "num_nodes": 2}) == 2
    assert world_size_of({"accelerator": "cpu", "devices": -1}) is None  # Lightning refuses it itself


# ------------------------------------------------------------------- 6. short parser errors


def test_a_callback_argument_typo_is_a_short_error(tmp_path, capsys, monkeypatch):
    config = yaml.safe_load(Path(TINY).read_text())
    config["trainer"]["callbacks"][0]["init_args"] = {"warmup_stepz": 10}
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    err = cli_error(capsys, ["fit", "--config", str(typo)])
    assert err[0] == (
        "error: trainer.callbacks: lit_hbp.callbacks.HBPCurriculum has no argument 'warmup_stepz' "
        "(did you mean 'warmup_steps'?)"
    ), err
    assert len(err) <= 4, err
    # The full report stays one environment variable away.
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    with pytest.raises(argparse.ArgumentError, match="Does not validate against any of the Union subtypes"):
        main(["fit", "--config", str(typo)], run=False)


def test_an_unknown_option_names_the_nearest_valid_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = cli_error(capsys, ["fit", "--config", TINY, "--trainer.max_stepz", "3"])
    assert err[0] == "error: unrecognized arguments: --trainer.max_stepz 3 (did you mean 'trainer.max_steps'?)", err


def test_an_interpolation_the_command_line_broke_is_a_short_error(small_demo, tmp_path, monkeypatch, capsys):
    """tiny_cpu.yaml takes any number of levels from the command line (it interpolates none of them); a
    config of one's own that writes ${data.levels.2.pack_len} and gets two levels on the command line
    stops with a short error naming the key."""
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo)]
    two = ["--data.levels", "[{pack_len: 1024}, {pack_len: 4096}]"]
    cli = main([*args, *two], run=False)
    assert [lv.pack_len for lv in cli.datamodule.levels] == [1024, 4096]
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        (ROOT / "configs/tiny_cpu.yaml")
        .read_text()
        .replace("max_position_embeddings: 16384", "max_position_embeddings: ${data.levels.2.pack_len}")
    )
    with pytest.raises(SystemExit) as e:
        main(["--config", str(mine), "--data.demo_dir", str(small_demo), *two], run=False)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Interpolation key") and "data.levels[2].pack_len" in err
    assert "model.model.max_position_embeddings" in err and "Traceback" not in err


class OneWeight(L.LightningModule):
    """A plain LightningModule of one weight: Lightning's fit loop is the reference, not lit-hbp's module."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, _):
        return (self.w * batch).sum()

    def validation_step(self, batch, _):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "interval,every,limit,limit_val,batches",
    [(20, 1, 1.0, 1.0, 8), (8, 1, 1.0, 1.0, 8), (9, 1, 1.0, 1.0, 8), (9, None, 1.0, 1.0, 8), (9, 1, 1.0, 0, 8),
     (5, 1, 4, 1.0, 8), (4, 1, 4, 1.0, 8), (5, 1, 0.5, 1.0, 8), (4, 1, 0.5, 1.0, 8), (0.5, 1, 3, 1.0, 8)],
)  # fmt: skip
def test_a_validation_interval_is_refused_where_lightnings_fit_loop_stops(interval, every, limit, limit_val, batches):
    """``check_validation_interval`` against Lightning's own fit loop on a plain module and loader of ``batches``:
    refused (before the data, from the limit, or from the plan's length) exactly where Lightning stops."""
    settings = dict(val_check_interval=interval, check_val_every_n_epoch=every, limit_train_batches=limit,
                    limit_val_batches=limit_val, max_steps=1)  # fmt: skip
    common = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)  # fmt: skip
    loader = torch.utils.data.DataLoader(torch.ones(batches, 1), batch_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            L.Trainer(**common, **settings).fit(OneWeight(), loader, torch.utils.data.DataLoader(torch.ones(2, 1)))
            lightning_stops = False
        except ValueError as e:
            assert "val_check_interval" in str(e)
            lightning_stops = True
        trainer = L.Trainer(**common, **settings)
    refused = []
    for steps in (None, batches):  # before the data is read, then with the plan's length
        try:
            check_validation_interval(trainer, steps)
        except ConfigError as e:
            refused.append(str(e))
    assert bool(refused) == lightning_stops, refused
    if refused and isinstance(limit, int) and interval > limit:
        assert "limit_train_batches is" in refused[0]  # said before the data is read


class CountsStepWindows(OneWeight):
    """Records how many micro-batches each optimizer step of Lightning's own fit loop took."""

    def __init__(self):
        super().__init__()
        self.seen, self.windows = 0, []

    def training_step(self, batch, _):
        self.seen += 1
        return super().training_step(batch, _)

    def on_before_optimizer_step(self, optimizer):
        self.windows.append(self.seen)
        self.seen = 0


@pytest.mark.parametrize(
    "limit,accumulate,batches,max_steps",
    [(5, 2, 8, -1), (4, 2, 8, -1), (6, 4, 8, -1), (8, 4, 8, -1), (9, 2, 8, -1), (12, 4, 8, -1), (3, 1, 8, -1),
     (0.5, 2, 8, -1), (0.5, 4, 8, -1), (0.75, 4, 8, -1), (0.3, 2, 10, -1), (0.9, 2, 10, -1), (1.0, 2, 8, -1),
     (5, 2, 8, 2), (5, 2, 8, 3), (0.9, 2, 10, 4), (0.9, 2, 10, 5)],
)  # fmt: skip
def test_an_epoch_cut_inside_an_optimizer_step_is_refused_where_lightning_steps_on_part_of_one(
    limit, accumulate, batches, max_steps
):
    """Lightning's own fit loop on a plain module is the reference: where it steps the optimizer on fewer
    micro-batches than ``accumulate`` (the epoch cut by ``limit_train_batches``, before ``max_steps`` ends the
    run), the planned step's normalizer would be wrong, so the check refuses exactly there once the epoch's
    length is known, and before the data is read whenever an int limit is no multiple of the accumulation
    and the run reaches it (every cut among them)."""
    settings = dict(limit_train_batches=limit, accumulate_grad_batches=accumulate, max_epochs=1, accelerator="cpu",
                    devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, max_steps=max_steps)  # fmt: skip
    module = CountsStepWindows()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(**settings).fit(module, torch.utils.data.DataLoader(torch.ones(batches, 1), batch_size=1))
        trainer = L.Trainer(**settings)
    epoch = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    assert sum(module.windows) == (epoch if max_steps < 0 else min(epoch, max_steps * accumulate))
    lightning_cuts = any(n != accumulate for n in module.windows)

    def refused(*args) -> str:
        try:
            check_accumulation_windows(trainer, *args)
        except ConfigError as e:
            return str(e)
        return ""

    with_length = refused(batches, accumulate)
    assert bool(with_length) == lightning_cuts, (module.windows, with_length)
    early = refused()
    reached = max_steps < 0 or max_steps * accumulate > limit
    assert bool(early) == (isinstance(limit, int) and limit % accumulate != 0 and reached), early
    if lightning_cuts and isinstance(limit, int):
        assert early.startswith(f"trainer.limit_train_batches is {limit}, but an optimizer step accumulates")
    if with_length:
        assert f"give a multiple of {accumulate}" in with_length


def test_an_accumulation_schedule_needs_a_limit_that_each_of_its_accumulations_divides():
    """A GradientAccumulationScheduler's later accumulation counts too: 6 micro-batches are 3 steps of 2 but
    1.5 steps of 4."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(limit_train_batches=6, accelerator="cpu", devices=1, logger=False,
                            callbacks=[GradientAccumulationScheduler({0: 2, 1: 4})])  # fmt: skip
    with pytest.raises(ConfigError, match=r"accumulates 4 micro-batches \(its GradientAccumulationScheduler\): .* "
                       r"give a multiple of 4 \(4 or 8\)"):  # fmt: skip
        check_accumulation_windows(trainer)
    trainer.limit_train_batches = 8
    check_accumulation_windows(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one_epoch = L.Trainer(limit_train_batches=6, max_epochs=1, accelerator="cpu", devices=1, logger=False,
                              callbacks=[GradientAccumulationScheduler({0: 2, 1: 4})])  # fmt: skip
    check_accumulation_windows(one_epoch)  # the epoch that would accumulate 4 is never reached


def test_a_smoke_run_with_accumulation_is_not_refused_and_a_true_limit_is_one_batch():
    """``fast_dev_run`` (Lightning sets limit_train_batches and max_steps to its N) keeps nothing it trains: not
    refused. A limit of True is Lightning's one batch: a cut of a two-batch step, refused."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        smoke = L.Trainer(fast_dev_run=True, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False)
        one = L.Trainer(limit_train_batches=True, accumulate_grad_batches=2, accelerator="cpu", devices=1)
    check_accumulation_windows(smoke)
    check_accumulation_windows(smoke, 8, 2)
    with pytest.raises(ConfigError, match="trainer.limit_train_batches is 1, but an optimizer step accumulates 2"):
        check_accumulation_windows(one)


class CountsEpochWindows(CountsStepWindows):
    """Records the micro-batches of each optimizer step by epoch."""

    def __init__(self):
        super().__init__()
        self.by_epoch = {}

    def on_before_optimizer_step(self, optimizer):
        self.by_epoch.setdefault(self.trainer.current_epoch, []).append(self.seen)
        self.seen = 0


@pytest.mark.parametrize(
    "schedules",
    [[{0: 1, 2: 4}, {0: 2}], [{0: 2}, {0: 1, 2: 4}], [{1: 2}], [{0: 4}]],
    ids=["two", "two-swapped", "late", "one"],
)
def test_each_epochs_accumulation_is_the_one_lightnings_fit_loop_steps_with(schedules):
    """The accumulation the data module plans an epoch with (``accumulation_at``) is the one Lightning's own fit
    loop steps with in that epoch: with two GradientAccumulationSchedulers the last sets the trainer's last."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    def trainer():
        callbacks = [GradientAccumulationScheduler(dict(s)) for s in schedules]
        return L.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)  # fmt: skip

    module = CountsEpochWindows()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer().fit(module, torch.utils.data.DataLoader(torch.ones(8, 1), batch_size=1))
        planned = trainer()
    assert {e: set(w) for e, w in module.by_epoch.items()} == {e: {accumulation_at(planned, e)} for e in range(3)}


def test_a_transformer_whose_positions_sit_in_a_buffer_named_otherwise_keeps_its_limit():
    """CTRL numbers its tokens by a sinusoid buffer (``pos_encoding``) that its forward indexes by the position
    ids: the plain model fails on a document past ``n_positions``, so such levels stay refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_hbp.model.checks import takes_positions

    config = AutoConfig.for_model("ctrl", n_embd=32, n_layer=1, n_head=2, dff=64, n_positions=64, vocab_size=100)
    net = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(IndexError):
        net(input_ids=torch.arange(70)[None] % 100)
    assert takes_positions(net) and takes_positions(config)
    with pytest.raises(ValueError, match="max_position_embeddings 64"):
        check_positions(config, [Level(128, 1)])


def test_the_callbacks_refused_without_a_logger_are_those_lightnings_fit_refuses(tmp_path):
    """Every stock Lightning callback that builds without arguments, fitted and validated on Lightning's BoringModel
    without a logger (``logger=False``, ``[]``, ``barebones=True``): the ones whose fit Lightning refuses for want of
    a logger are exactly the ones ``check_logging_callbacks`` refuses (a validate never is), and a default logger
    refuses none."""
    from lightning.pytorch import callbacks
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    def lightning_refuses(cls: type, stage: str, **no_logger) -> bool:
        try:  # (checkpointing and the bar off, as barebones has them: a checkpoint callback or a bar is refused)
            trainer = L.Trainer(callbacks=[cls()], max_steps=1, limit_val_batches=1, enable_progress_bar=False,
                                enable_checkpointing=False, enable_model_summary=False, accelerator="cpu",
                                default_root_dir=str(tmp_path), **no_logger)  # fmt: skip
            getattr(trainer, stage)(BoringModel())
        except MisconfigurationException as e:
            return "logger" in str(e)
        except Exception:  # e.g. BatchSizeFinder's tuning finds no batch_size field: not about the logger
            return False
        return False

    def refused(name: str, **no_logger) -> bool:
        try:
            check_logging_callbacks({"callbacks": [{"class_path": f"lightning.pytorch.callbacks.{name}"}], **no_logger})
        except ConfigError:
            return True
        return False

    stock = []
    for name in callbacks.__all__:
        cls = getattr(callbacks, name)
        try:
            cls()
            stock.append(name)
        except (TypeError, NotImplementedError):
            continue
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            for no_logger in ({"logger": False}, {"logger": []}, {"barebones": True}):
                by_lightning = {n for n in stock if lightning_refuses(getattr(callbacks, n), "fit", **no_logger)}
                assert by_lightning == {n for n in stock if refused(n, **no_logger)}, no_logger
                assert by_lightning == {"LearningRateMonitor", "DeviceStatsMonitor"}  # (Lightning 2.6)
                assert not any(lightning_refuses(getattr(callbacks, n), "validate", **no_logger) for n in by_lightning)
            assert not any(refused(n, logger=None) for n in stock)
        finally:
            logging.disable(logging.NOTSET)


def test_a_level_yaml_reads_as_a_base_60_number_is_refused(tmp_path, capsys, monkeypatch):
    """``levels: [1024:1, 4096:1]``: YAML 1.1 (PyYAML, jsonargparse, OmegaConf) reads an unquoted ``4096:1`` as the
    base-60 number 245761, so the run planned levels of 61,441 and 245,761 tokens without a word (a curriculum naming
    1024 happened to stop it). Refused by key and line, in a config file or on the command line, and by the tools
    that read the YAML; quoted, the levels are what they say."""
    import yaml

    from lit_hbp.cost.config import read_config

    monkeypatch.chdir(tmp_path)
    assert yaml.safe_load("[4096:1]") == [245761]  # the reading refused (the independent reference: PyYAML)
    extra = tmp_path / "levels.yaml"
    extra.write_text("data:\n  levels:\n    - {pack_len: 512}\n    - 4096:1\n")
    err = cli_error(capsys, ["fit", "--config", TINY, "--config", str(extra)])
    assert err[0] == (
        f"error: {extra}, line 4: data.levels[1]: 4096:1 reads as the base-60 number 245761 in YAML: quote it "
        "('4096:1') or write a mapping, e.g. {pack_len: ..., sp: ...}"
    ), err
    err = cli_error(capsys, ["fit", "--config", TINY, "--data.levels", "[1024:1, '4096:1']"])
    assert err[0].startswith("error: --data.levels[0]: 1024:1 reads as the base-60 number 61441"), err
    with pytest.raises(ConfigError, match=r"line 4: data.levels\[1\]: 4096:1 reads as the base-60 number"):
        read_config(extra)
    assert yaml.safe_load("a: 0:00:00.5")["a"] == 0.5  # a time with a fraction: a base-60 float
    extra.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args: {train_time_interval: 0:00:00.5}\n"
    )
    err = cli_error(capsys, ["fit", "--config", TINY, "--config", str(extra)])
    assert err[0] == (
        f"error: {extra}, line 4: trainer.callbacks[0].init_args.train_time_interval: 0:00:00.5 reads as the base-60 "
        "number 0.5 in YAML: quote it ('0:00:00.5')"
    ), err
    extra.write_text("data:\n  levels: ['1024:1', '4096:1:2']\n")
    cli = main(["--config", TINY, "--config", str(extra)], run=False)
    assert [(lv.pack_len, lv.sp, lv.ckpt_layers) for lv in cli.datamodule.levels] == [(1024, 1, 0), (4096, 1, 2)]
