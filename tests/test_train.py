"""End to end: the tiny CPU config trains and logs; a mid-epoch resume continues exactly."""

import csv
import glob
import json
import os
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import HANG_S, NARROW, SHORTER, TINY_LLAMA, quiet_trainer

from lit_hbp.callbacks import HBPCurriculum, PackingMetrics
from lit_hbp.cli.app import main
from lit_hbp.lightning.datamodule import HBPDataModule
from lit_hbp.lightning.module import HBPLitModule

ROOT = Path(__file__).resolve().parents[1]


def scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(f"{logdir}/**/events.out.tfevents.*", recursive=True)
    acc = EventAccumulator(events)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_tiny_config_trains_and_logs(tmp_path, small_demo, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs/tiny_cpu.yaml"),
            "--data.demo_dir",
            str(small_demo),
            "--trainer.max_steps",
            "24",
            "--trainer.val_check_interval",
            "16",  # micro-batches: validations after steps 8, 16 and 24
            "--trainer.enable_progress_bar",
            "false",
            *NARROW,
            *SHORTER,
        ]
    )
    logged = scalars(tmp_path / "runs")
    for tag in (
        "train/loss",
        "train/level",
        "train/supervised_tokens",
        "train/tokens",
        "curriculum/warmup",
        "packing/abr",
        "packing/pr",
        "packing/level",
        "train/lr",
        "train/device/items_per_sec",
        "train/device/flops_per_sec",
        "time/level0_micro_step_s",
        "time/level0_tokens_per_s_per_device",
    ):
        assert tag in logged, tag
    loss = [v for _, v in logged["train/loss"]]
    assert np.mean(loss[-3:]) < np.mean(loss[:3]) - 0.5, loss
    # The curriculum: the steps logged within the first 10 optimizer steps (the config's
    # warmup_steps) trained the short levels (1K, 4K) only, and the callback says so.
    early = [v for step, v in logged["train/level"] if step < 10]
    assert early and set(early) <= {0.0, 1.0}, logged["train/level"]
    assert all(v == 1.0 for step, v in logged["curriculum/warmup"] if step < 10)
    ckpts = Path("runs/tiny_cpu/version_0/checkpoints")
    assert torch.load(ckpts / "last.ckpt", weights_only=False, map_location="cpu")["global_step"] == 24
    # `validate` alone from the checkpoint.
    validated = main(["validate", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
                      "--ckpt_path", str(ckpts / "last.ckpt"), "--trainer.enable_progress_bar", "false",
                      *NARROW, *SHORTER])  # fmt: skip
    assert float(validated.trainer.callback_metrics["val/loss"]) > 0
    # The checkpoint ranking follows the validation schedule: the one checkpoint kept is the step
    # whose fresh val/loss was the lowest, and it holds that val/loss as its score.
    val = dict(logged["val/loss"])
    assert sorted(val) == [7, 15, 23], val  # TensorBoard's step: global_step - 1 at a validation
    (best,) = [p for p in ckpts.iterdir() if p.name != "last.ckpt"]
    best_step = min(val, key=val.get) + 1
    assert best.name.endswith(f"-step={best_step}.ckpt"), (best.name, val)
    state = torch.load(best, weights_only=False, map_location="cpu")
    (callback,) = [v for k, v in state["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert float(callback["best_model_score"]) == pytest.approx(min(val.values()), rel=1e-6)


class Record(L.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(
            (
                trainer.current_epoch,
                batch.micro_index,
                tuple(batch.sample_index.tolist()),
                float(outputs["loss"]),
                batch.level,
            )
        )


def run(tmp_path, data, tokenizer, max_steps, ckpt_path=None, every=None, accumulate=2, seed=0, callbacks=()):
    L.seed_everything(seed)  # the data's seed too (HBPDataModule without a seed takes the run's)
    sources = data if isinstance(data, list) else [{"path": str(data)}]
    dm = HBPDataModule(
        sources=sources, tokenizer=tokenizer, levels=["128:1", "512:1"], cache_dir=str(tmp_path / "cache")
    )
    torch.manual_seed(0)
    module = HBPLitModule(
        model=TINY_LLAMA,
        vocab_size=dm.vocab_size,
        lr=1e-3,
    )
    record = Record()
    callbacks = [record, HBPCurriculum(3), PackingMetrics(), *callbacks]
    if every:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1, filename="{step}"
            )
        )
    trainer = quiet_trainer(
        max_steps=max_steps, accumulate_grad_batches=accumulate, callbacks=callbacks, enable_checkpointing=bool(every)
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return record.rows, dm


@pytest.fixture(scope="module")
def resume_data(tmp_path_factory):
    rng = np.random.default_rng(3)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    path = tmp_path_factory.mktemp("resume") / "d.jsonl"
    with path.open("w") as f:
        for _ in range(30):
            q, a = (" ".join(rng.choice(words, rng.integers(1, k))) for k in (30, 60))
            f.write(json.dumps({"prompt": q, "response": a}) + "\n")
    return path


@pytest.mark.slow
def test_resume_mid_epoch_reproduces_the_uninterrupted_run(tmp_path, resume_data, toy_tokenizer):
    full, dm = run(tmp_path / "full", resume_data, toy_tokenizer, max_steps=14, every=1)
    steps_per_epoch = dm.plan_for_epoch(0).n_steps
    assert steps_per_epoch < 14, "the run must cross an epoch boundary"
    # Mid first epoch, on the last step of the first epoch, mid second epoch.
    for stop in (3, steps_per_epoch, steps_per_epoch + 2):
        ckpt = tmp_path / "full" / "ckpt" / f"step={stop}.ckpt"
        resumed, _ = run(tmp_path / f"resumed{stop}", resume_data, toy_tokenizer, max_steps=14, ckpt_path=ckpt)
        expected = full[2 * stop :]
        assert [r[:3] + r[4:] for r in resumed] == [r[:3] + r[4:] for r in expected]
        np.testing.assert_allclose([r[3] for r in resumed], [r[3] for r in expected], rtol=1e-6, atol=1e-7)


class EpochStarts(L.Callback):
    """The epochs whose start the callbacks were told of, and the fit loop's epoch counts at the run's end."""

    def __init__(self):
        self.epochs, self.progress = [], None

    def on_train_epoch_start(self, trainer, pl_module):
        self.epochs.append(trainer.current_epoch)

    def on_train_end(self, trainer, pl_module):
        self.progress = trainer.fit_loop.epoch_progress.state_dict()


@pytest.mark.slow
def test_a_resume_from_an_epochs_last_step_starts_the_next_epoch_as_the_uninterrupted_run(
    tmp_path, resume_data, toy_tokenizer
):
    """Saved at the last step of epoch 0, a resume trained epoch 1 exactly but never called its start hooks:
    Lightning's fit loop took the restore for one inside epoch 0 (``PackingMetrics`` logged nothing of epoch 1's
    plan; a project's own epoch-start callback was skipped), and its epoch counts lagged one behind from there."""
    _, dm = run(tmp_path / "probe", resume_data, toy_tokenizer, max_steps=1)
    steps = dm.plan_for_epoch(0).n_steps
    full = EpochStarts()
    run(tmp_path / "full", resume_data, toy_tokenizer, max_steps=steps + 3, every=steps, callbacks=[full])
    assert full.epochs == [0, 1]
    resumed = EpochStarts()
    ckpt = tmp_path / "full" / "ckpt" / f"step={steps}.ckpt"
    run(tmp_path / "resumed", resume_data, toy_tokenizer, max_steps=steps + 3, ckpt_path=ckpt, callbacks=[resumed])
    assert resumed.epochs == [1] and resumed.progress == full.progress, (resumed.progress, full.progress)


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory):
    """Short chats and every fifth one long enough for the 512-token level."""
    rng = np.random.default_rng(5)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    path = tmp_path_factory.mktemp("mixed") / "d.jsonl"
    with path.open("w") as f:
        for i in range(40):
            n = int(rng.integers(80, 200)) if i % 5 == 0 else int(rng.integers(2, 20))
            q, a = " ".join(rng.choice(words, n)), " ".join(rng.choice(words, rng.integers(2, 15)))
            f.write(json.dumps({"prompt": q, "response": a}) + "\n")
    return path


@pytest.mark.slow
def test_curriculum_puts_short_steps_first_and_trains_every_sample_once(tmp_path, mixed_data, toy_tokenizer):
    """Checked against the data, not the plan's own report: the first 3 optimizer steps (A = 2) train
    the short level only, the long level is deferred (it appears later), and over the epoch every
    sample of the store is trained exactly once."""
    _, dm = run(tmp_path / "probe", mixed_data, toy_tokenizer, max_steps=1)
    steps = dm.plan_for_epoch(0).n_steps
    rows, dm = run(tmp_path / "epoch", mixed_data, toy_tokenizer, max_steps=steps)
    levels = [r[4] for r in rows]
    assert levels[:6] == [0] * 6 and 1 in levels[6:], levels
    trained = sorted(i for r in rows for i in r[2])
    assert trained == list(range(dm.store.lengths.size))


@pytest.mark.slow
def test_resume_refuses_a_different_plan(tmp_path, resume_data, toy_tokenizer):
    run(tmp_path / "full", resume_data, toy_tokenizer, max_steps=3, every=3)
    ckpt = tmp_path / "full" / "ckpt" / "step=3.ckpt"
    with pytest.raises(
        ValueError, match=r"cannot resume from this checkpoint: the plan of its epoch 0 .*accumulate: 2 -> 1"
    ):
        run(tmp_path / "other", resume_data, toy_tokenizer, max_steps=6, ckpt_path=ckpt, accumulate=1)
    # A resume under another seed_everything (the data module given no seed): the seed to set is named.
    with pytest.raises(ValueError, match=r"seed: 0 -> 1.* Its data seed was 0: set data.seed 0"):
        run(tmp_path / "seeded", resume_data, toy_tokenizer, max_steps=6, ckpt_path=ckpt, seed=1)


@pytest.mark.slow
def test_the_logged_token_counts_are_the_optimizer_steps(tmp_path, mixed_data, toy_tokenizer):
    """``train/tokens`` and ``train/supervised_tokens`` were the step's last micro-batch's (0 at a step whose last
    micro-batch was an empty completion pack, 16 trained): they are the step's, summed over its micro-batches,
    checked against the store's lengths and supervised counts of the samples each micro-batch held."""
    from collections import defaultdict

    from lightning.pytorch.loggers import CSVLogger

    L.seed_everything(0)
    dm = HBPDataModule(
        sources=[{"path": str(mixed_data)}], tokenizer=toy_tokenizer, levels=["128:1", "512:1"],
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3)
    want: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    empty = []

    class Count(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            index = batch.sample_index.numpy()
            empty.append(index.size == 0)
            want[trainer.global_step][0] += int(dm.store.lengths[index].sum())
            want[trainer.global_step][1] += int(dm.store.loss_tokens[index].sum())

    logger = CSVLogger(tmp_path, name="log")
    trainer = quiet_trainer(max_epochs=1, accumulate_grad_batches=2, callbacks=[Count()], logger=logger,
                            log_every_n_steps=1)  # fmt: skip
    trainer.fit(module, dm)
    assert any(empty), "the plan must end a step with an empty completion pack"
    rows = [r for r in csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")) if r.get("train/tokens")]
    got = {int(r["step"]): [float(r["train/tokens"]), float(r["train/supervised_tokens"])] for r in rows}
    assert len(got) == dm.plan_for_epoch(0).n_steps and got == {
        step: [float(a), float(b)] for step, (a, b) in want.items()
    }, (got, dict(want))


def write_token_records(path: Path, seed: int, lengths: list[int]) -> Path:
    """Pre-tokenized records of ``lengths`` tokens whose second half trains: an edit may keep every length."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for n in lengths:
            ids = rng.integers(5, 200, n).tolist()
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * (n // 2) + ids[n // 2 :]}) + "\n")
    return path


@pytest.mark.slow
def test_a_resume_names_the_data_setting_that_changed_and_says_a_source_edited_in_place(tmp_path, toy_tokenizer):
    """A resume whose samples changed was refused naming a hash (``data: 4c93.. -> ..``), and one whose source was
    edited in place keeping every length and supervised count went on without a word. Now the refusal names the
    setting (a source added, a source's repeat) or the edited source, and an edit that keeps the plan is said."""
    lengths = np.random.default_rng(0).integers(8, 60, 30).tolist()
    data = write_token_records(tmp_path / "d.jsonl", 1, lengths)
    run(tmp_path / "full", data, toy_tokenizer, max_steps=3, every=3)
    ckpt = tmp_path / "full" / "ckpt" / "step=3.ckpt"
    extra = write_token_records(tmp_path / "e.jsonl", 2, [20] * 4)
    refusals = {
        "added": (
            [{"path": str(data)}, {"path": str(extra)}],
            rf"data.sources: \['{data}'\] -> \['{data}', '{extra}'\]",
        ),
        "repeat": ([{"path": str(data), "repeat": 2}], rf"data.sources\[0\] \({data}\) repeat: None -> 2"),
    }
    for name, (sources, match) in refusals.items():
        with pytest.raises(ValueError, match=r"cannot resume from this checkpoint: the plan .*" + match):
            run(tmp_path / name, sources, toy_tokenizer, max_steps=4, ckpt_path=ckpt)
    write_token_records(data, 3, [n + (i == 4) for i, n in enumerate(lengths)])  # one sample one token longer
    with pytest.raises(ValueError, match=rf"\(the records of data.sources\[0\] \({data}\) hold other tokens"):
        run(tmp_path / "longer", data, toy_tokenizer, max_steps=4, ckpt_path=ckpt)
    write_token_records(data, 4, lengths)  # other tokens, every length and supervised count kept: the same plan
    with pytest.warns(UserWarning, match=rf"the records of data.sources\[0\] \({data}\) hold other tokens than"):
        rows, _ = run(tmp_path / "edited", data, toy_tokenizer, max_steps=4, ckpt_path=ckpt)
    assert len(rows) == 2  # the fourth step trained (two micro-batches)


def test_cli_links_vocab_size_and_interpolates(tmp_path, small_demo, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = main(
        [
            "--config",
            str(ROOT / "configs/tiny_cpu.yaml"),
            "--data.demo_dir",
            str(small_demo),
            "--model.lr",
            "0.5",
            "--model.model.num_hidden_layers",
            "3",
        ],
        run=False,
    )
    # Entries of the model config mapping given on the command line keep their YAML types.
    assert cli.model.hparams.model["num_hidden_layers"] == 3
    assert cli.model.hparams.vocab_size == len(cli.datamodule.tokenizer) == 2048
    assert cli.model.hparams.model["max_position_embeddings"] == cli.datamodule.levels[-1].pack_len == 16384
    assert cli.model.hparams.lr == 0.5
    assert cli.datamodule.sources[0].path == f"{small_demo}/short.jsonl"
    assert cli.trainer.accumulate_grad_batches == 2
    assert [type(c).__name__ for c in cli.trainer.callbacks][:3] == [
        "HBPCurriculum",
        "PackingMetrics",
        "HBPThroughputMonitor",
    ]


def test_a_barebones_run_trains_without_the_progress_bar(tmp_path, small_demo, monkeypatch):
    """``trainer.barebones: true`` (Lightning's least host work: no bar, no logger, no summary) ended in Lightning's
    refusal of lit-hbp's own progress bar, which barebones turns off: a run the plain Lightning CLI trains."""
    from lightning.pytorch.callbacks import ProgressBar

    monkeypatch.chdir(tmp_path)
    args = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo), "--trainer.barebones",
            "true", "--trainer.callbacks", "[]", "--trainer.logger", "false", "--trainer.log_every_n_steps", "0",
            "--trainer.max_steps", "1", "--model.self_check", "false", *NARROW]  # fmt: skip
    cli = main(args, run=False)
    assert cli.trainer.barebones and not any(isinstance(c, ProgressBar) for c in cli.trainer.callbacks)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 1


def test_llama3_8b_recipe_parses(capsys):
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(ROOT / "configs/llama3_8b_32gpu.yaml"), "--print_config"])
    assert e.value.code == 0
    printed = capsys.readouterr().out
    for expected in (
        "class_path: lit_hbp.lightning.strategy.HBPStrategy",
        "num_nodes: 4",
        "precision: bf16-mixed",
        "pack_len: 131072",
        "sp: 8",
        "ckpt_layers: 28",
        "loss: ave_token",
        "model: /models/Meta-Llama-3.1-8B-Instruct",
    ):
        assert expected in printed, expected


def config_command(tmp_path, small_demo, config: str, steps: int, *extra: str) -> list[str]:
    """``train.py fit --config configs/<config>`` for ``steps`` optimizer steps, the first step of each
    level first (``levels_first.EachLevelFirst``): every level trains, whatever steps the plan of this
    machine's demo data draws first. Run it in ``tmp_path`` with ``config_env()``."""
    import sys

    if not (tmp_path / "demo_data").exists():
        (tmp_path / "demo_data").symlink_to(small_demo)
    return [
        sys.executable, str(ROOT / "train.py"), "fit", "--config", str(ROOT / "configs" / config),
        "--trainer.max_steps", str(steps), "--trainer.callbacks+=levels_first.EachLevelFirst",
        "--trainer.enable_progress_bar", "false", *extra,
    ]  # fmt: skip


def config_env() -> dict:
    import os

    tests = str(Path(__file__).parent)
    return {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    }


def run_config(tmp_path, small_demo, config: str, steps: int, *extra: str, env: dict | None = None):
    import subprocess

    cmd = config_command(tmp_path, small_demo, config, steps, *extra)
    env = {**config_env(), **(env or {})}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_S)


# Imported first by every process of a run (PYTHONPATH), so its exit hook runs last: after lit-hbp's.
THREADS_AT_EXIT = """
import atexit, json, os, sys

def _count():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:
            pass
    with open(os.path.join(os.environ["THREADS_AT_EXIT"], str(os.getpid())), "w") as f:
        import torch.distributed as dist
        json.dump({"argv": sys.argv, "gloo_threads": sum(n.startswith("pt_gloo") for n in names),
                   "initialized": dist.is_initialized()}, f)

atexit.register(_count)
"""


@pytest.mark.slow
def test_tiny_sp_config_trains_on_two_processes(tmp_path, small_demo):
    """Also: at exit the process groups are gone before interpreter shutdown. A gloo worker thread
    still running then can free a tensor, take the GIL and abort the process after a successful fit
    (``terminate called without an active exception``): 8 such threads per rank before lit-hbp
    destroyed its groups at exit; at most those of the groups DeepSpeed's engine keeps (2 or 4) now."""
    hook, counts = tmp_path / "hook", tmp_path / "threads"
    hook.mkdir(), counts.mkdir()
    (hook / "sitecustomize.py").write_text(THREADS_AT_EXIT)
    env = {"PYTHONPATH": os.pathsep.join([str(hook), config_env()["PYTHONPATH"]]), "THREADS_AT_EXIT": str(counts)}
    # 4 steps, each logged: the first step of each level first (a 2K step at sp 1, an 8K step at sp 2), then two more.
    out = run_config(tmp_path, small_demo, "tiny_cpu_sp.yaml", 4, *NARROW, "--trainer.log_every_n_steps", "1", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "terminate called" not in out.stderr
    ranks = [json.loads(f.read_text()) for f in counts.iterdir()]
    ranks = [r for r in ranks if "fit" in r["argv"]]  # not the helper processes of a run
    assert len(ranks) == 2 and not any(r["initialized"] for r in ranks), ranks
    assert max(r["gloo_threads"] for r in ranks) <= 4, ranks  # those of the groups DeepSpeed's engine still holds
    assert "HBPStrategy levels: 2048 tokens sp 1 ckpt 0, 8192 tokens sp 2 ckpt 2" in out.stderr + out.stdout
    logged = scalars(tmp_path / "runs")
    assert {v for _, v in logged["train/sp"]} == {1.0, 2.0}
    assert len(logged["train/loss"]) >= 4 and all(v > 0 for _, v in logged["train/loss"])


# Every step's loss logged, and a validation (CP layouts included) at the last of the 3 steps (one of each level,
# ``EachLevelFirst``); the config's layout on a model half as wide (the same 2 heads and 4 layers: what the layout
# depends on), cheaper to run.
EVERY_STEP = ("--trainer.log_every_n_steps", "1", "--trainer.val_check_interval", "6",
              "--model.model.hidden_size", "64", "--model.model.intermediate_size", "192")  # fmt: skip
LEVELS_2D = (
    "HBPStrategy levels: 2048 tokens sp 1 ckpt 0, 4096 tokens sp 2 (ulysses 1 x cp 2) ckpt 2, "
    "8192 tokens sp 4 (ulysses 2 x cp 2) ckpt 4"
)


def run_two_nodes(folder: Path, small_demo) -> str:
    """configs/tiny_cpu_2d.yaml as 2 nodes x 2 processes on this machine, each node its own torchrun (as on a
    cluster: ``torchrun --nnodes 2 --node-rank N --nproc-per-node 2 --rdzv-endpoint HOST:PORT``), with
    a shared cache folder: the data is tokenized once for both nodes, Ulysses stays inside a node and
    CP goes across. Returns node 0's output."""
    import subprocess
    import sys

    from lit_hbp.autoselect.launch import free_port

    folder.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for node in (0, 1):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                    "--nproc-per-node", "2", "--rdzv-endpoint", endpoint]  # fmt: skip
        cmd = config_command(folder, small_demo, "tiny_cpu_2d.yaml", 3, *EVERY_STEP, "--trainer.num_nodes", "2",
                             "--trainer.devices", "2")  # fmt: skip
        nodes.append(subprocess.Popen([*launcher, *cmd[1:]], cwd=folder, env=config_env(), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))  # fmt: skip
    outs = [p.communicate(timeout=HANG_S)[0] for p in nodes]
    for p, out in zip(nodes, outs):
        assert p.returncode == 0, out[-3000:]
    assert LEVELS_2D in outs[0]  # Ulysses 2 inside each node of 2, CP 2 across the nodes
    assert sum("tokenizing short.jsonl" in out for out in outs) == 1, "one node tokenizes, the other reads its cache"
    return outs[0]


@pytest.mark.slow
def test_tiny_2d_config_trains_ulysses_x_cp_on_four_processes(tmp_path, small_demo):
    """configs/tiny_cpu_2d.yaml: a 2-head model at sp 4 (Ulysses 2 x CP 2) and a CP-only level, on 2 nodes of 2
    processes (``run_two_nodes``), its self-check passed on every layout (each pack against its documents alone)."""
    import subprocess
    import sys

    printed = run_two_nodes(tmp_path / "two_nodes", small_demo)
    assert "sp 4 (ulysses 2 x cp 2): loss" in printed  # the self-check ran the layout
    tmp_path = tmp_path / "two_nodes"
    logged = scalars(tmp_path / "runs")
    assert len(logged["train/loss"]) >= 2 and all(v > 0 for _, v in logged["train/loss"])
    imbalance = [v for _, v in logged["packing/cp_area_imbalance"]]
    assert imbalance and max(imbalance) < 1.05, "every CP micro-batch balanced by the planner"
    # What the run trained exports to a Hugging Face folder that loads and generates.
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "runs" / "tiny_cpu_2d" / "version_0" / "checkpoints" / "last.ckpt"
    assert logged["val/loss"] and logged["val/loss"][-1][1] > 0  # validated on the 4 processes, CP included
    as_typed = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # a shell without the suite's setting
    exported = subprocess.run(
        [sys.executable, "-m", "lit_hbp.export", str(ckpt), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env=as_typed,
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert "Setting accelerator" not in exported.stderr  # DeepSpeed's warning, which transformers' import set off
    net = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert net.config.num_attention_heads == 2
    out = net.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_tiny_auto_config_parses(tmp_path, small_demo, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = main(["--config", str(ROOT / "configs/tiny_cpu_auto.yaml"), "--data.demo_dir", str(small_demo)], run=False)
    assert cli.datamodule.levels is None, "chosen at setup"
    selector = cli.datamodule.selector
    assert type(selector).__name__ == "MeasuredSelector" and selector.candidates == [2048, 8192]
    assert selector.memory_gib == 8 and selector.margin_gib == 2.0


def test_seed_everything_seeds_the_data_order_unless_data_seed_is_given(tmp_path, small_demo, monkeypatch):
    """As a shuffled DataLoader follows ``seed_everything`` in plain Lightning, a seed sweep draws other data
    orders: ``--seed_everything N`` plans as ``--data.seed N`` does, and the config summary names the data seed;
    a ``data.seed`` given wins."""
    monkeypatch.chdir(tmp_path)
    base = ["--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo)]

    def plan(*args: str) -> tuple[int, list]:
        cli = main([*base, *args], run=False)
        dm = cli.datamodule
        assert f"\n  seed: {dm.seed}\n" in cli.config_summary().split("\ndata:\n")[1]
        dm.setup("fit")
        return dm.seed, dm.plan_for_epoch(0).members.tolist()

    swept = {s: plan("--seed_everything", str(s)) for s in (0, 1)}
    assert swept[0][0] == 0 and swept[1][0] == 1 and swept[0][1] != swept[1][1]
    assert plan("--seed_everything", "0", "--data.seed", "1") == swept[1]  # the data seed given wins
    assert plan("--seed_everything", "1", "--data.seed", "0") == swept[0]


def test_a_resume_of_a_seeded_run_keeps_its_data_seed_and_continues_identically(
    tmp_path, small_demo, monkeypatch, capfd
):
    """A run started with ``--seed_everything 1`` plans its data with seed 1; resumed from its step-4 checkpoint
    with the config's own seed (0), it takes the checkpoint's data seed and trains steps 5 and 6 with the losses of
    the uninterrupted run; a ``data.seed`` given that differs is refused by name."""

    def fit(folder: str, *args: str) -> dict:
        """The run's train/loss by step, from the newest TensorBoard events file of its folder."""
        (tmp_path / folder).mkdir(exist_ok=True)
        monkeypatch.chdir(tmp_path / folder)
        main(["fit", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo),
              "--data.cache_dir", str(tmp_path / "cache"), "--trainer.max_steps", "6",
              "--trainer.val_check_interval", "8",  # micro-batches: a validation and its checkpoint at step 4
              "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
              *NARROW, *args])  # fmt: skip
        events = glob.glob(f"{tmp_path / folder}/runs/**/events.out.tfevents.*", recursive=True)
        return dict(scalars(Path(max(events, key=os.path.getmtime)).parent)["train/loss"])

    whole = fit("whole", "--seed_everything", "1")
    (step4,) = (tmp_path / "whole" / "runs" / "tiny_cpu" / "version_0" / "checkpoints").glob("*step=4.ckpt")
    capfd.readouterr()
    with pytest.raises(SystemExit) as stop:
        fit("refused", "--ckpt_path", str(step4), "--data.seed", "0")
    assert stop.value.code == 2 and "seed: 1 -> 0" in capfd.readouterr().err
    resumed = fit("resumed", "--ckpt_path", str(step4))  # the config's seed_everything: 0
    assert {s: resumed[s] for s in (4, 5)} == {s: whole[s] for s in (4, 5)}, (resumed, whole)
