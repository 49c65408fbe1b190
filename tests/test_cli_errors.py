"""Every mistake a user can make in a config or a data file ends a CLI run the same way: one short
paragraph naming the problem and where (file:line, config key), exit status 2, no traceback, and
nothing expensive done first; ``LIT_HBP_DEBUG=1`` brings the traceback back."""

import importlib.util
import json
import shlex
from pathlib import Path

import pytest
import yaml

from lit_hbp.cli.app import main
from lit_hbp.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


def write(path: Path, *lines: str) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def bad_inputs(tmp: Path, demo: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (command-line arguments, what the message must say)."""
    good = json.dumps(GOOD)
    malformed = write(tmp / "malformed.jsonl", good, '{"messages": [', good)
    no_messages = write(tmp / "fields.jsonl", good, good, json.dumps({"conversation": []}))
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    long_text = json.dumps({"text": "word " * 20000})
    too_long = write(tmp / "long.jsonl", good, long_text)
    broken = write(tmp / "broken.yaml", "trainer:", "  max_steps: 3", "   devices: 1")
    empty_folder = tmp / "tokenizer"
    empty_folder.mkdir()
    broken_tokenizer = tmp / "broken_tokenizer"
    broken_tokenizer.mkdir()
    (broken_tokenizer / "tokenizer_config.json").write_text("{not json")
    dangling = tmp / "demo_link"
    dangling.symlink_to(tmp / "moved_away")
    return {
        "a demo_dir link to nothing": (
            ["--data.demo_dir", str(dangling)],
            f"data.demo_dir: {dangling} is a link to {tmp / 'moved_away'}, which does not exist",
        ),
        "a demo_dir that is a file": (["--data.demo_dir", broken], f"data.demo_dir: {broken} is a file, not a folder"),
        "missing data file": (["--data.sources", f"[{{path: {tmp / 'chats.jsonl'}}}]"], "data source not found"),
        "a negative data seed": (  # numpy's traceback after the data was tokenized
            ["--data.seed", "-1"],
            "data.seed must be a non-negative integer (or null: the run's seed_everything), got -1",
        ),
        "no devices": (
            ["--trainer.devices", "0"],
            "trainer.devices: `Trainer(devices='0')` value is not a valid input",
        ),
        "another trainer's option name": (["--model.learning_rate", "0.1"], "(did you mean 'model.lr'?)"),
        "transformers' attention option": (
            ["--model.attn_implementation", "eager"],
            "(did you mean 'model.attn_backend'?)",
        ),
        "a config file that is no YAML": (["--config", broken], f"in {broken}, line 3, column 11"),
        "levels without the curriculum's": (
            ["--data.levels", "[1024, 8192]"],
            "trainer.callbacks[0] (HBPCurriculum) short_levels: 4096 is not the pack_len of a level of data.levels",
        ),
        "malformed JSON": (["--data.sources", f"[{{path: {malformed}}}]"], f"{malformed}:2: malformed JSON"),
        "record without messages": (
            ["--data.sources", f"[{{path: {no_messages}}}]"],
            f"{no_messages}:3: record has none of the fields 'messages'",
        ),
        "empty file": (["--data.sources", f"[{{path: {empty}}}]"], f"sources[0]: data source {empty} is empty"),
        "over-length": (
            ["--data.sources", f"[{{path: {too_long}}}]", "--data.over_length", "error"],
            f"longer than the largest level (16384 tokens): {too_long}:2",
        ),
        "misspelled source field": (
            ["--data.sources", f"[{{path: {demo / 'short.jsonl'}, repaet: 2}}]"],
            "sources[0]: unknown source field 'repaet' (did you mean 'repeat'?)",
        ),
        "misspelled model key": (
            ["--model.model", "{model_type: llama, num_hiden_layers: 2}"],
            "unknown key 'num_hiden_layers' (did you mean 'num_hidden_layers'?)",
        ),
        "missing model folder": (
            ["--model.model", str(tmp / "checkpoint")],
            f"model.model: '{tmp / 'checkpoint'}' is neither a checkpoint folder",
        ),
        "abbreviated option": (["--trainer.max_step", "3"], "(did you mean 'trainer.max_steps'?)"),
        "LightningCLI's optimizer": (
            ["--lr_scheduler", "torch.optim.lr_scheduler.ConstantLR"],
            "unrecognized arguments: --lr_scheduler torch.optim.lr_scheduler.ConstantLR: HBPLitModule configures its "
            "own AdamW with a linear warm-up and a cosine schedule; set model.lr",
        ),
        "a misspelled strategy": (
            ["--trainer.strategy", "hbp_dp"],
            "trainer.strategy: 'hbp_dp' is not a strategy Lightning knows (did you mean 'hbp_ddp'?)",
        ),
        "a strategy class given as a name": (
            ["--trainer.strategy", "lit_hbp.lightning.strategy.HBPDDPStrategy"],
            "a class is given as {class_path: lit_hbp.lightning.strategy.HBPDDPStrategy}",
        ),
        "clipping by value under DeepSpeed": (
            ["--trainer.strategy", "hbp", "--trainer.gradient_clip_algorithm", "value"],
            "trainer.gradient_clip_algorithm: 'value' with DeepSpeed (trainer.strategy), which clips by the global",
        ),
        "negative collate workers": (
            ["--data.num_workers", "-2"],
            "data.num_workers must be a whole number >= 0 (0: collate in the training process), got -2",
        ),
        "a ZeRO stage DeepSpeed has not": (
            ["--trainer.strategy.class_path", "lit_hbp.lightning.strategy.HBPStrategy"]
            + ["--trainer.strategy.stage", "5"],
            "trainer.strategy (HBPStrategy): stage is DeepSpeed's ZeRO stage, 0-3; got 5",
        ),
        "a precision plugin not installed": (
            ["--trainer.precision", "transformer-engine"],
            "trainer.precision: 'transformer-engine' needs NVIDIA's transformer-engine, which is not installed here",
        ),
        "Lightning's overfit loader": (
            ["--trainer.overfit_batches", "2"],
            "trainer.overfit_batches must be 0 (use limit_train_batches to train on a few batches), got 2",
        ),
        "a negative learning-rate floor": (
            ["--model.min_lr_ratio", "-1"],
            "model.min_lr_ratio (the cosine's floor, a share of lr) must be in [0, 1], got -1.0",
        ),
        "misspelled record format": (
            ["--data.sources", f"[{{path: {demo / 'short.jsonl'}, format: sharegtp}}]"],
            "format 'sharegtp' is not a record format (did you mean 'sharegpt'?); formats: auto, openai, sharegpt",
        ),
        "bad level count": (
            ["--data.levels", "[{pack_len: 4x}]", "--model.model.max_position_embeddings", "4096"],
            "data.levels[0]: pack_len must be a whole number (e.g. 4096, or 4K = 4096, 1M = 1048576), got '4x'",
        ),
        "a validation interval past limit_train_batches": (
            ["--trainer.check_val_every_n_epoch", "1", "--trainer.val_check_interval", "20"]
            + ["--trainer.limit_train_batches", "6"],
            "trainer.val_check_interval is 20 batches but trainer.limit_train_batches is 6",
        ),
        "an epoch cut inside an optimizer step": (
            ["--trainer.limit_train_batches", "5", "--trainer.max_steps", "3"],
            "trainer.limit_train_batches is 5, but an optimizer step accumulates 2 micro-batches "
            "(trainer.accumulate_grad_batches): the epoch would end inside a step",
        ),
        "a validation inside an optimizer step": (  # the config's ModelCheckpoint saves after each validation
            ["--trainer.val_check_interval", "7"],
            "ModelCheckpoint saves after each validation, which runs every 7 micro-batches "
            "(trainer.val_check_interval), but an optimizer step accumulates 2 micro-batches",
        ),
        "a validation inside an optimizer step, Lightning's default checkpoint": (  # the user named none
            ["--trainer.callbacks", "[]", "--trainer.val_check_interval", "7"],
            "Lightning's default ModelCheckpoint (trainer.enable_checkpointing adds it when none is given) saves after "
            "each validation, which runs every 7 micro-batches (trainer.val_check_interval), but an optimizer step "
            "accumulates 2 micro-batches (trainer.accumulate_grad_batches): a checkpoint saved inside a step cannot "
            "be resumed exactly. Give a val_check_interval that is a multiple of 2, or add a ModelCheckpoint with "
            "save_on_train_epoch_end: true, or trainer.enable_checkpointing: false",
        ),
        "liger on the CPU": (  # refused once the data was tokenized (50 s of the demo; hours of a corpus)
            ["--model.liger", "true"],
            "model.liger: liger=True needs a CUDA GPU (Liger's kernels are Triton kernels), but trainer.accelerator "
            "is cpu",
        ),
        "a frozen vision tower of a text model": (  # refused once the data was tokenized
            ["--model.freeze_vision", "true"],
            "model.freeze_vision: LlamaForCausalLM has no vision tower (a text-only model)",
        ),
        "a checkpoint by time inside an optimizer step": (
            [
                "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                "--trainer.callbacks.train_time_interval",
                "0:30:00",
            ],  # fmt: skip
            "ModelCheckpoint saves every train_time_interval 0:30:00, at whatever micro-batch it falls, but an "
            "optimizer step accumulates 2 micro-batches",
        ),
        "a validation interval past the epoch": (
            ["--trainer.check_val_every_n_epoch", "1", "--trainer.val_check_interval", "100000"],
            "trainer.val_check_interval is 100000 batches but this epoch's plan has",
        ),
        "a monitor a separator away from a logged metric": (
            ["--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping"]
            + ["--trainer.callbacks.monitor", "val_loss"],
            "(EarlyStopping): monitor 'val_loss' is logged by nothing; lit-hbp logs 'val/loss'",
        ),
        "a monitor with Lightning's epoch ending": (
            ["--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping"]
            + ["--trainer.callbacks.monitor", "train/loss_epoch"],
            "(EarlyStopping): monitor 'train/loss_epoch' is logged by nothing; lit-hbp logs 'train/loss'",
        ),
        "a validation metric monitored without validation data": (  # no checkpoint saved, without a word
            ["--data.val_fraction", "0"],
            "(ModelCheckpoint): monitor 'val/loss', but the run has no validation data (data.val_fraction 0, no "
            "data.val_sources): hold out records (data.val_fraction) or give data.val_sources, or monitor train/loss",
        ),
        "a validation metric monitored with no validation batches": (
            ["--trainer.limit_val_batches", "0"],
            "(ModelCheckpoint): monitor 'val/loss', but trainer.limit_val_batches is 0",
        ),
        "an accumulation scheduler beside accumulate_grad_batches": (  # Lightning's traceback at the fit's start
            ["--trainer.callbacks+=lightning.pytorch.callbacks.GradientAccumulationScheduler"]
            + ["--trainer.callbacks.scheduling", "{0: 2}"],
            "(GradientAccumulationScheduler) beside trainer.accumulate_grad_batches 2: each sets the accumulation; "
            "keep one",
        ),
        "a validation interval of 0": (  # Lightning's ZeroDivisionError after the first micro-batch trained
            ["--trainer.val_check_interval", "0"],
            "trainer.val_check_interval must be a number of micro-batches >= 1 or a share of the epoch > 0, or null, "
            "got 0",
        ),
        "a negative logging interval": (  # Lightning logged every step
            ["--trainer.log_every_n_steps", "-1"],
            "trainer.log_every_n_steps must be a whole number >= 0 (0: never), got -1",
        ),
        "several nodes from one plain process": (  # Lightning waited half an hour for the other node
            ["--trainer.num_nodes", "2"],
            "trainer.num_nodes is 2, but this process was started alone (no torchrun, srun, or NODE_RANK and "
            "MASTER_ADDR a node's processes find each other by): launch one per node (docs/cluster.md)",
        ),
        "stochastic weight averaging": (
            ["--trainer.callbacks+=lightning.pytorch.callbacks.StochasticWeightAveraging"]
            + ["--trainer.callbacks.swa_lrs", "0.001"],
            "(StochasticWeightAveraging): it averages a copy of the module made before the model is built",
        ),
        "a learning-rate finder inside fit": (
            ["--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateFinder"],
            "(LearningRateFinder): inside fit it sets the optimizer's learning rate, which HBPLitModule's schedule",
        ),
        "a run without an end": (
            ["--trainer.max_steps", "-1", "--trainer.max_epochs", "-1"],
            "trainer.max_steps: -1 with trainer.max_epochs: -1 trains without an end",
        ),
        "barebones beside a checkpoint callback": (
            ["--trainer.barebones", "true"],
            "trainer.barebones: true beside trainer.callbacks[3] (ModelCheckpoint), which saves checkpoints",
        ),
        "an option the tokenizer sets": (
            ["--model.vocab_size", "9000"],
            "model.vocab_size is set from data.vocab_size, not on its own: the tokenizer's size; a vocabulary with "
            "more rows is model.model.vocab_size in a config mapping",
        ),
        "a misspelled over_length": (
            ["--data.over_length", "trunc"],
            "data.over_length must be one of error, drop, truncate, got 'trunc'",
        ),
        "a null cache folder": (["--data.cache_dir", "null"], "data.cache_dir must be a folder for the tokenized data"),
        "a misspelled attention backend": (
            ["--model.attn_backend", "flsh"],
            "model.attn_backend: attention backend must be one of",
        ),
        "a misspelled LoRA setting": (
            ["--model.lora", "{rank: 4, alpah: 8}"],
            "model.lora: unknown setting(s) ['alpah']",
        ),
        "an empty LoRA mapping": (
            ["--model.lora", "{}"],
            "model.lora: {} names no LoRA setting, and the full model would train",
        ),
        "an infinite learning rate": (["--model.lr", ".inf"], "model.lr must be a finite number >= 0, got inf"),
        "LoRA target modules matching nothing": (
            ["--model.lora", "{rank: 4, target_modules: [nonexistent]}"],
            "model.lora: peft refuses these settings on LlamaForCausalLM: Target modules {'nonexistent'} not found",
        ),
        "the optimizer offloaded without ZeRO": (
            [
                "--trainer.strategy",
                "lit_hbp.lightning.strategy.HBPStrategy",
                "--trainer.strategy.stage",
                "0",
                "--trainer.strategy.offload_optimizer",
                "true",
            ],
            "HBPStrategy offload_optimizer: true needs ZeRO stage 1-3, not 0",
        ),  # fmt: skip
        "MLP tiles under ZeRO-3": (
            [
                "--trainer.strategy",
                "hbp_stage_3",
                "--data.levels",
                "[{pack_len: 1024}, {pack_len: 4096}, {pack_len: 16384, ckpt_layers: 2, mlp_tiles: 4}]",
            ],
            "level 2 (pack_len 16384): mlp_tiles: 4 needs ZeRO stage 0-2, not 3",
        ),  # fmt: skip
        "Lightning's best checkpoint in a new process": (
            ["--ckpt_path", "best"],
            "--ckpt_path best: Lightning's best model of a fit earlier in the same process; a new process has none",
        ),
        "an HPC checkpoint that is not there": (["--ckpt_path", "hpc"], "--ckpt_path hpc: no HPC checkpoint"),
        "the model registry": (["--ckpt_path", "registry"], "--ckpt_path registry: Lightning's model registry"),
        "a demo folder holding another demo": (
            ["--data.demo", "vision"],
            "data.demo: vision, but data.demo_dir",
        ),
        "an accumulation schedule under DeepSpeed": (
            [
                "--trainer.strategy",
                "hbp",
                "--trainer.callbacks+=lightning.pytorch.callbacks.GradientAccumulationScheduler",
                "--trainer.callbacks.scheduling",
                "{0: 2, 1: 4}",
            ],
            "(GradientAccumulationScheduler) under DeepSpeed (trainer.strategy), whose engine takes one",
        ),  # fmt: skip
        "a precision DeepSpeed has not": (
            ["--trainer.strategy", "hbp", "--trainer.precision", "64-true"],
            "trainer.precision: '64-true' is not one DeepSpeed trains in (trainer.strategy)",
        ),
        "a CUDA-only attention backend on a CPU": (
            ["--model.attn_backend", "flex", "--trainer.accelerator", "cpu"],
            "model.attn_backend: 'flex' cannot run on cpu (CUDA only",
        ),
        "a missing data file as the list of sources": (
            ["--data.sources", "nothere.jsonl"],
            "data.sources: nothere.jsonl cannot be read (no such file or folder here)",
        ),
        "a data file as the list of sources": (
            ["--data.sources", str(demo / "short.jsonl")],
            "sources[0]: '{",  # jsonargparse read the file's records as the list
        ),
        "a negative curriculum warm-up": (
            ["--trainer.callbacks+=lit_hbp.callbacks.HBPCurriculum", "--trainer.callbacks.warmup_steps", "-1"],
            "HBPCurriculum warmup_steps: must be >= 0, got -1",
        ),
        "a timeline hardware lit-hbp has not": (
            ["--trainer.callbacks+=lit_hbp.callbacks.PackingMetrics", "--trainer.callbacks.hardware", "h1000"],
            "PackingMetrics hardware: unknown 'h1000' (did you mean 'h100'?)",
        ),
        "an export dtype misspelled": (
            ["--trainer.callbacks+=lit_hbp.callbacks.HBPExport", "--trainer.callbacks.dirpath", "out"]
            + ["--trainer.callbacks.dtype", "bf16"],
            "HBPExport dtype: 'bf16' (did you mean 'bfloat16'?) is not one of",
        ),
        "a throughput window of one log": (
            ["--trainer.callbacks+=lit_hbp.callbacks.HBPThroughputMonitor", "--trainer.callbacks.window_size", "1"],
            "HBPThroughputMonitor window_size: must be >= 2 (rates between logs), got 1",
        ),
        "weight averaging under DeepSpeed": (
            ["--trainer.strategy", "hbp", "--trainer.callbacks+=lightning.pytorch.callbacks.EMAWeightAveraging"],
            "(EMAWeightAveraging) under DeepSpeed (trainer.strategy) the averaged weights reach no checkpoint",
        ),
        "missing tokenizer": (
            ["--data.tokenizer", str(demo.parent / "tokenzer")],
            f"data.tokenizer: '{demo.parent / 'tokenzer'}' is neither a local folder",
        ),
        "a tokenizer folder without a tokenizer": (
            ["--data.tokenizer", str(empty_folder)],
            f"data.tokenizer: {empty_folder} is a folder without a tokenizer (none of tokenizer.json,",
        ),
        "a file as the tokenizer": (
            ["--data.tokenizer", str(demo / "short.jsonl")],
            f"data.tokenizer: {demo / 'short.jsonl'} is a file: give the folder that holds the tokenizer's files",
        ),
        "a learning-rate monitor without a logger": (  # (the data file missing too: the logger's error comes first)
            ["--trainer.logger", "false", "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor"]
            + ["--data.sources", f"[{{path: {tmp / 'chats.jsonl'}}}]"],
            "error: trainer.callbacks[4] (LearningRateMonitor) writes to the trainer's logger, and trainer.logger: "
            "false sets none (Lightning refuses the pair when the fit starts): remove trainer.logger: false or the "
            "callback\n",
        ),
        "levels that fit nowhere": (  # NoLevelFits ended fit with a traceback and exit 1 (the tools said it, exit 2)
            ["--data.levels", "{class_path: lit_hbp.autoselect.AnalyticSelector, init_args: {margin_gib: 79.5}}"],
            "error: the longest sample (",
        ),
        "a tokenizer folder whose tokenizer does not load": (
            ["--data.tokenizer", str(broken_tokenizer)],
            f"data.tokenizer: the tokenizer in {broken_tokenizer} does not load: ",
        ),
    }


CASES = ["malformed JSON", "record without messages", "empty file", "over-length", "misspelled source field",
         "misspelled model key", "missing model folder", "abbreviated option", "missing tokenizer",
         "misspelled record format", "bad level count", "no devices", "another trainer's option name",
         "a config file that is no YAML", "levels without the curriculum's", "missing data file",
         "LightningCLI's optimizer", "a negative learning-rate floor", "Lightning's overfit loader",
         "a misspelled strategy", "a strategy class given as a name", "clipping by value under DeepSpeed",
         "negative collate workers", "a ZeRO stage DeepSpeed has not", "a precision plugin not installed",
         "a demo_dir link to nothing", "a demo_dir that is a file", "a validation interval past limit_train_batches",
         "a validation interval past the epoch", "an epoch cut inside an optimizer step",
         "stochastic weight averaging", "a run without an end", "barebones beside a checkpoint callback",
         "an option the tokenizer sets", "a misspelled over_length", "a null cache folder",
         "a misspelled attention backend",
         "a misspelled LoRA setting", "an empty LoRA mapping", "an infinite learning rate",
         "LoRA target modules matching nothing", "the optimizer offloaded without ZeRO", "MLP tiles under ZeRO-3",
         "Lightning's best checkpoint in a new process", "an HPC checkpoint that is not there", "the model registry",
         "a demo folder holding another demo",
         "an accumulation schedule under DeepSpeed", "a precision DeepSpeed has not",
         "a CUDA-only attention backend on a CPU", "a data file as the list of sources",
         "a missing data file as the list of sources",
         "a monitor a separator away from a logged metric", "a validation inside an optimizer step",
         "a checkpoint by time inside an optimizer step", "a negative curriculum warm-up",
         "a timeline hardware lit-hbp has not", "an export dtype misspelled",
         "a throughput window of one log", "weight averaging under DeepSpeed", "a tokenizer folder without a tokenizer",
         "a file as the tokenizer", "a tokenizer folder whose tokenizer does not load",
         "a learning-rate monitor without a logger", "levels that fit nowhere", "a negative data seed",
         "a monitor with Lightning's epoch ending", "a validation metric monitored without validation data",
         "a validation metric monitored with no validation batches",
         "an accumulation scheduler beside accumulate_grad_batches", "a learning-rate finder inside fit",
         "a validation interval of 0", "a negative logging interval",
         "several nodes from one plain process",
         "a validation inside an optimizer step, Lightning's default checkpoint", "liger on the CPU",
         "a frozen vision tower of a text model"]  # fmt: skip
# Found from the config, the paths and the files' first bytes, before the resolved config is printed; the
# others (a record's content) when the data is tokenized, after it.
AFTER_THE_CONFIG = {"malformed JSON", "record without messages", "over-length", "a validation interval past the epoch",
                    "levels that fit nowhere", "LoRA target modules matching nothing",
                    "MLP tiles under ZeRO-3"}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_users_mistake_is_one_short_error_with_exit_status_2(case, tmp_path, small_demo, monkeypatch, capsys, caplog):
    if case == "a precision plugin not installed" and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer-engine is installed here: the precision trains")
    caplog.set_level("INFO")
    monkeypatch.chdir(tmp_path)
    for name in ("LIT_HBP_DEBUG", "MASTER_ADDR", "NODE_RANK"):  # (a second node's address: not this test's)
        monkeypatch.delenv(name, raising=False)
    args, says = bad_inputs(tmp_path, small_demo)[case]
    base = ["fit", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
            "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false"]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        main(base + args)
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert says in err, err
    lines = [line for line in err.splitlines() if line.startswith(("error:", "tip:"))]
    assert len(lines) == 2 and "Traceback" not in err, err
    assert not (tmp_path / "runs" / "tiny_cpu").exists()  # no run folder left behind
    printed = err + caplog.text
    assert ("resolved config" in printed) == (case in AFTER_THE_CONFIG), printed  # the error first where it can be
    assert "Seed set" not in printed


def test_the_debug_variable_brings_the_traceback_back(tmp_path, small_demo, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LIT_HBP_DEBUG", "1")
    args, says = bad_inputs(tmp_path, small_demo)["malformed JSON"]
    with pytest.raises(DataError, match="malformed JSON"):
        main(["fit", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo), *args])


def test_export_of_a_missing_checkpoint_is_a_short_error(tmp_path, capsys):
    from lit_hbp.export import main as export_main

    (tmp_path / "last.ckpt").write_bytes(b"")
    assert export_main([str(tmp_path / "lats.ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: checkpoint not found: {tmp_path / 'lats.ckpt'} (did you mean 'last.ckpt'?)"
    assert not (tmp_path / "out").exists()


def test_a_loader_workers_error_is_reported_by_its_own_message():
    """A DataLoader worker's error reaches the main process re-raised by torch with the worker's whole traceback as
    its message: the report prints the error's own line, as for the same error in the main process."""
    from torch._utils import ExceptionWrapper

    from lit_hbp.cli.parser import own_message
    from lit_hbp.errors import DataError

    try:
        raise DataError("d.jsonl:4: image img/big.png does not exist")
    except DataError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(DataError) as caught:
        wrapped.reraise()
    assert "Original Traceback" in str(caught.value)
    assert own_message(caught.value) == "d.jsonl:4: image img/big.png does not exist"
    assert own_message(DataError("a: b")) == "a: b"


def test_a_monitor_that_is_a_projects_own_metric_is_left_to_lightning():
    """Only a logged name but for its separators or case is refused: a project's own ``val/losses`` is not."""
    from lit_hbp.cli.checks import check_monitors

    def entry(monitor: str) -> dict:
        return {"class_path": "lightning.pytorch.callbacks.EarlyStopping", "init_args": {"monitor": monitor}}

    for own in ("val/losses", "train/gradnorm2", "val/acc", "packing/levels", "val/loss"):
        check_monitors([entry(own)])
    for typo in ("val_loss", "Val/Loss", "train.grad_norm", "train/loss_step", "val/loss_epoch"):
        with pytest.raises(ConfigError, match=f"monitor {typo!r} is logged by nothing"):
            check_monitors([entry(typo)])


def test_preview_stops_on_a_tokenizer_folder_without_a_tokenizer_in_one_line(tmp_path, small_demo, capsys):
    """``preview`` reads ``data.tokenizer`` as ``fit`` does: an empty folder ended in transformers' traceback
    (exit 1); it is the same short error naming data.tokenizer and the folder (exit 2)."""
    (tmp_path / "tok").mkdir()
    with pytest.raises(SystemExit) as stop:
        main(["preview", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
              "--data.tokenizer", str(tmp_path / "tok")])  # fmt: skip
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err, err
    assert err.startswith(f"error: data.tokenizer: {tmp_path / 'tok'} is a folder without a tokenizer"), err


def test_the_subcommand_after_the_config_option_and_an_unknown_one(tmp_path, small_demo, capsys):
    """``--config X preview`` said ``invalid choice: 'preview' (choose from 'fit', 'validate')``, and so did an
    unknown word, for a subcommand ``lit-hbp --help`` lists: preview after ``--config`` runs as ``preview
    --config`` does (the same samples), and an unknown word's error lists preview among the choices."""
    config = ["--config", str(ROOT / "configs/tiny_cpu.yaml")]
    rest = ["--data.demo_dir", str(small_demo), "--n", "2", "--json"]
    main(["preview", *config, *rest])
    first = capsys.readouterr().out
    main([*config, "preview", *rest])
    assert capsys.readouterr().out == first and first.count("\n") == 2
    for argv in (["bogus"], [*config, "bogus"]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2, err
        assert (
            err.splitlines()[0] == "error: argument subcommand: invalid choice: 'bogus' (choose from 'fit', "
            "'validate', 'preview')"
        ), err


def test_print_config_before_the_subcommand_prints_what_it_prints_after(small_demo, capsys):
    """``--print_config fit ...`` is LightningCLI's: the config ``fit ... --print_config`` prints, under ``fit:`` (as
    plain LightningCLI prints it); ``--print_config preview ...`` stopped on "invalid choice: 'preview'" (Lightning's
    parser read the line): it prints what ``preview ... --print_config`` prints."""
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    def printed(run, argv: list[str]) -> dict:
        with pytest.raises(SystemExit) as stop:
            run(argv)
        out, err = capsys.readouterr()
        assert stop.value.code == 0, err
        return yaml.safe_load(out)

    def plain(argv: list[str]) -> None:
        LightningCLI(BoringModel, BoringDataModule, args=argv)

    assert printed(plain, ["--print_config", "fit", "--trainer.max_steps", "7"]) == {
        "fit": printed(plain, ["fit", "--trainer.max_steps", "7", "--print_config"])
    }
    line = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo)]
    line += ["--trainer.max_steps", "7"]
    after = printed(main, ["fit", *line, "--print_config"])
    assert after["trainer"]["max_steps"] == 7 and printed(main, ["--print_config", "fit", *line]) == {"fit": after}
    for flag in ("--print_config", "--print_config=skip_null"):
        after = printed(main, ["preview", *line, flag])
        assert after["data"]["demo_dir"] == str(small_demo) and printed(main, [flag, "preview", *line]) == after


@pytest.mark.parametrize(
    "typed, argv, start",
    [
        (["python", "-m", "lit_hbp.cli.command", "fit"], ["/x/lit_hbp/cli/command.py", "fit"],
         "python -m lit_hbp.cli.command"),
        (["/v/bin/python", "-X", "dev", "train.py", "fit"], ["train.py", "fit"], "/v/bin/python -X dev train.py"),
        (["python", "my project/train.py", "fit"], ["my project/train.py", "fit"], "python 'my project/train.py'"),
    ],
)  # fmt: skip
@pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")
def test_a_tip_names_the_command_as_the_user_typed_it(typed, argv, start, monkeypatch, capsys):
    """A tip's command runs in a shell: ``python -m lit_hbp.cli.command`` (argparse's prog said ``command.py``,
    a file name no shell runs), ``python train.py`` with the interpreter's options; the console script by its
    name where it is the one on the PATH."""
    from lit_hbp.cli.program import program

    monkeypatch.setattr("sys.orig_argv", typed)
    monkeypatch.setattr("sys.argv", argv)
    assert program() == start
    with pytest.raises(SystemExit) as e:
        main(["fit", "--trainer.max_step", "3"])
    assert e.value.code == 2
    assert f"tip: `{start} fit --help` lists the options" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["fitt"])
    assert e.value.code == 2 and f"tip: `{start} --help` lists the subcommands" in capsys.readouterr().err


def test_the_console_script_on_the_path_is_named_alone(monkeypatch, tmp_path):
    from lit_hbp.cli.program import program

    script = tmp_path / "bin" / "lit-hbp"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setattr("sys.orig_argv", ["/v/bin/python3", str(script), "fit"])
    monkeypatch.setattr("sys.argv", [str(script), "fit"])
    monkeypatch.setenv("PATH", str(script.parent))
    assert program() == "lit-hbp"
    monkeypatch.setenv("PATH", str(tmp_path))  # another lit-hbp first on the PATH, or none: the path typed
    assert program() == shlex.join(["/v/bin/python3", str(script)])


def test_validate_without_a_checkpoint_of_a_config_mappings_random_model_is_refused(tmp_path, small_demo, capsys):
    """``validate`` without ``--ckpt_path`` scored the random weights a config mapping builds (val/loss 9.05, exit 0);
    one short error now (a checkpoint folder as ``model.model`` is validated as it is)."""
    with pytest.raises(SystemExit) as stop:
        main(["validate", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
              "--data.cache_dir", str(tmp_path / "cache")])  # fmt: skip
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: validate without --ckpt_path scores the model as"), err


def test_validate_with_auto_and_no_checkpoint_of_the_run_is_refused(tmp_path, small_demo, monkeypatch, capsys):
    """``validate --ckpt_path auto`` with no checkpoint in the run's folders said "training starts from the
    beginning" and scored the weights model.model builds (random ones for a config mapping): refused, naming where
    it looked. ``fit --help`` says what ``--ckpt_path`` takes here (``auto``; not Lightning's best or registry)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["validate", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
              "--data.cache_dir", str(tmp_path / "cache"), "--ckpt_path", "auto"])  # fmt: skip
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert err.startswith("error: --ckpt_path auto: no checkpoint in runs: nothing of this run to validate"), err
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert stop.value.code == 0
    assert "'auto' (the newest complete checkpoint of this run's folders, else a fresh start)" in said, said
    assert "registry" not in said.split("--ckpt_path CKPT_PATH", 2)[-1].split("--weights_only")[0]
