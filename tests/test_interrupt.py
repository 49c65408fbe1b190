"""Ctrl-C during fit: the running optimizer step finishes, is saved where a resume continues exactly,
and the command that resumes is printed; a second Ctrl-C stops at once; several ranks agree on the
step; DataLoader workers survive the terminal's SIGINT."""

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import HANG_S, TINY_LLAMA, chat_datamodule, console_script, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_hbp.callbacks import FinalCheckpoint, HBPExport, InterruptCheckpoint, leave_signals_to_main
from lit_hbp.callbacks.interrupt import FIRST_PRESS, resume_command, torchrun_argv
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.module import HBPLitModule

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 6


class Send(L.Callback):
    """Sends ``signum`` to this process at the end of each micro-batch in ``at``."""

    def __init__(self, signum: int, *at: int):
        self.signum, self.at = signum, at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx in self.at:
            os.kill(os.getpid(), self.signum)


def CtrlC(*at: int) -> Send:
    """Presses Ctrl-C (SIGINT to this process) at the end of each micro-batch in ``at``."""
    return Send(signal.SIGINT, *at)


class Trained(L.Callback):
    """The micro-batches trained: (epoch, micro-batch of the epoch's plan, global step after it)."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((batch.epoch, batch.micro_index, trainer.global_step))


def fit(root: Path, demo: Path, callbacks: list, ckpt_path=None, max_steps: int = MAX_STEPS, **trainer_kw):
    """The tiny model on the demo chats (levels 256 and 1024), accumulate 2, seeded as every run here."""
    L.seed_everything(0)
    dm = chat_datamodule(demo, str(demo / "tokenizer"), root.parent / "cache")
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
    trained = Trained()
    trainer = quiet_trainer(
        max_steps=max_steps,
        accumulate_grad_batches=2,
        default_root_dir=root,
        callbacks=[*callbacks, trained],
        **trainer_kw,
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return types.SimpleNamespace(trainer=trainer, rows=trained.rows, weights=module.state_dict())


@pytest.fixture(autouse=True)
def ctrl_c_as_in_a_terminal():
    """Python's own Ctrl-C handler, as a program started from a terminal has it: a test run started as
    a shell's background job (``pytest &``, a CI script) inherits SIGINT ignored, which the callback
    keeps ignoring, as Python does."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_demo):
    """The uninterrupted run (``fit`` with no callback of its own) the stopped and resumed runs are compared
    with: one fit for the module, the process left as it found it (``seed_everything`` sets PL_GLOBAL_SEED)."""
    from conftest import ProcessState

    state = ProcessState()
    try:
        return fit(tmp_path_factory.mktemp("interrupt") / "reference", small_demo, [])
    finally:
        state.restore()


@pytest.fixture
def lightning_log():
    """The messages of Lightning's logger (rank_zero_info) during a test."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_ctrl_c_saves_the_running_step_and_a_resume_continues_exactly(
    tmp_path, small_demo, capfd, lightning_log, reference
):
    # Ranked by a metric, last.ckpt, and saving at epoch ends: after a stop Lightning closes the epoch
    # and this callback's epoch-end hook would save last.ckpt again (a resume would skip to epoch 1).
    ckpt = ModelCheckpoint(tmp_path / "ckpt", monitor="train/loss", save_last=True, save_on_train_epoch_end=True)
    interrupt = InterruptCheckpoint()
    before = signal.getsignal(signal.SIGINT)
    stopped = fit(tmp_path / "stopped", small_demo, [CtrlC(4), interrupt, ckpt], enable_checkpointing=True)

    # Micro-batch 4 is the first of optimizer step 3: its second micro-batch still trains, then fit stops.
    assert stopped.rows == reference.rows[:6] and stopped.rows[-1] == (0, 5, 3)
    last = str(tmp_path / "ckpt" / "last.ckpt")
    assert interrupt.checkpoint == last
    assert torch.load(last, weights_only=False)["global_step"] == 3
    assert signal.getsignal(signal.SIGINT) is before
    assert FIRST_PRESS in capfd.readouterr().err
    said = "\n".join(lightning_log)
    assert f"Ctrl-C: stopped after optimizer step 3, saved to {last}" in said
    assert f"resume with: {resume_command(last)}" in said

    resumed = fit(tmp_path / "resumed", small_demo, [], ckpt_path=last)
    assert resumed.rows == reference.rows[6:]
    assert resumed.weights.keys() == reference.weights.keys()
    for name, value in resumed.weights.items():
        assert torch.equal(value, reference.weights[name]), name


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_sigterm_and_sigusr1_save_the_running_step_and_set_the_exit_status(tmp_path, small_demo, signum, lightning_log):
    """A scheduler's SIGTERM (SLURM, Kubernetes, torchrun) or a SLURM warning signal: handled like the
    first Ctrl-C, with ``128 + signal`` as the exit status; Lightning's handler is back afterwards."""
    interrupt = InterruptCheckpoint()
    before = signal.getsignal(signum)
    run = fit(tmp_path / "run", small_demo, [Send(signum, 4), interrupt, FinalCheckpoint()])
    assert run.trainer.global_step == 3 and len(run.rows) == 6
    assert interrupt.signal == signum and interrupt.exit_status == 128 + signum
    assert torch.load(interrupt.checkpoint, weights_only=False)["global_step"] == 3
    name = signal.Signals(signum).name
    assert f"{name}: stopped after optimizer step 3, saved to {interrupt.checkpoint}" in "\n".join(lightning_log)
    assert signal.getsignal(signum) is before
    assert "_broadcast_sigterm_tensor" not in vars(run.trainer.fit_loop.epoch_loop)


def test_a_signal_at_the_runs_final_step_ends_it_complete(tmp_path, small_demo, lightning_log, reference):
    """SIGTERM inside the last optimizer step (max_steps): the run exited 143 as interrupted, its export was not
    written, and the resume line it printed was refused (the checkpoint trains nothing more). It ends as the run
    without a signal ends: the final step saved, no exit status, nothing to resume."""
    interrupt = InterruptCheckpoint()
    save = ModelCheckpoint(tmp_path / "ckpt", save_last=True)
    run = fit(tmp_path / "run", small_demo, [save, Send(signal.SIGTERM, 2 * MAX_STEPS - 1), interrupt],
              enable_checkpointing=True)  # fmt: skip
    assert run.trainer.global_step == MAX_STEPS and run.rows == reference.rows
    assert interrupt.signal is None and interrupt.exit_status is None and interrupt.checkpoint is None
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == MAX_STEPS
    assert f"SIGTERM at the run's final optimizer step {MAX_STEPS}: it ends complete" in "\n".join(lightning_log)


class Validated(L.Callback):
    """(optimizer step, val/loss) of each validation of the fit."""

    def __init__(self):
        self.rows = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.rows.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))


def validating_fit(tmp_path, demo, every: int, root: str, callbacks: list, ckpt_path=None) -> tuple:
    """The tiny model validating every ``every`` micro-batches (accumulate 2), saving ``last.ckpt`` and each step
    ranked by its val/loss: (the validations, the micro-batches trained, the weights)."""
    L.seed_everything(0)
    dm = chat_datamodule(demo, str(demo / "tokenizer"), tmp_path / "cache", val_fraction=0.05)
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
    validated, trained = Validated(), Trained()
    saves = ModelCheckpoint(tmp_path / root, monitor="val/loss", save_last=True, save_top_k=-1, filename="{step}")
    trainer = quiet_trainer(max_steps=MAX_STEPS, accumulate_grad_batches=2, default_root_dir=tmp_path / root,
                            callbacks=[saves, *callbacks, validated, trained], val_check_interval=every,
                            check_val_every_n_epoch=None, limit_val_batches=2, num_sanity_val_steps=0,
                            enable_checkpointing=True)  # fmt: skip
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return validated.rows, trained.rows, module.state_dict()


def test_a_signal_at_a_step_with_a_validation_due_validates_it_first(tmp_path, small_demo):
    """SIGTERM in step 3 of a run validating at every optimizer step (2 micro-batches): the stopped run
    skipped step 3's validation and the resumed one fast-forwarded it (a resume from a save at a step's end does), so
    it never ran: its val/loss never logged nor ranked by a ModelCheckpoint monitoring it. It runs, the step is saved
    at its end, and the two runs together validate what the uninterrupted one does."""
    reference = validating_fit(tmp_path, small_demo, 2, "reference", [])
    interrupt = InterruptCheckpoint()
    stopped = validating_fit(tmp_path, small_demo, 2, "stopped", [Send(signal.SIGTERM, 4), interrupt])
    assert interrupt.exit_status == 128 + signal.SIGTERM and stopped[0][-1][0] == 3
    resumed = validating_fit(tmp_path, small_demo, 2, "resumed", [], interrupt.checkpoint)
    assert stopped[0] + resumed[0] == reference[0]
    assert stopped[1] + resumed[1] == reference[1]
    for name, value in resumed[2].items():
        assert torch.equal(value, reference[2][name]), name


def test_the_signals_handled_are_checked():
    assert InterruptCheckpoint(["TERM", "SIGUSR2"]).signals == (signal.SIGTERM, signal.SIGUSR2)
    with pytest.raises(ConfigError, match="SIGKILL cannot be handled"):
        InterruptCheckpoint(["SIGKILL"])
    with pytest.raises(ConfigError, match="'SIGFOO' is not a signal"):
        InterruptCheckpoint(["SIGFOO"])


def test_a_slurm_job_is_requeued_at_the_step_and_resumes_by_itself(tmp_path, small_demo, monkeypatch, reference):
    """``sbatch --signal=USR1@90 --requeue``: Lightning's SLURMEnvironment requeues on USR1. The save
    waits for the step boundary; Lightning's own handler writes hpc_ckpt_<n>.ckpt and runs
    ``scontrol requeue <job>``; the requeued job, same command, resumes from it by itself."""
    bin_dir, called = tmp_path / "bin", tmp_path / "scontrol.args"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {called}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    slurm = dict(SLURM_JOB_ID="4242", SLURM_JOB_NAME="sft", SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0",
                 SLURM_NODEID="0", SLURM_NODELIST="localhost")  # fmt: skip
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    job = tmp_path / "job"
    interrupt = InterruptCheckpoint()
    stopped = fit(job, small_demo, [Send(signal.SIGUSR1, 4), interrupt])
    assert stopped.rows == reference.rows[:6]
    assert interrupt.requeued and interrupt.exit_status == 128 + signal.SIGUSR1
    assert interrupt.checkpoint == str(job / "hpc_ckpt_1.ckpt")
    assert called.read_text().split() == ["requeue", "4242"]

    # The requeued job (the same command, no --ckpt_path) resumes by itself, and is requeued again.
    interrupt = InterruptCheckpoint()
    again = fit(job, small_demo, [Send(signal.SIGUSR1, 8), interrupt])
    assert again.rows == reference.rows[6:10]
    assert sorted(p.name for p in job.glob("hpc_ckpt_*")) == ["hpc_ckpt_2.ckpt"]  # the older one is removed
    last = fit(job, small_demo, [InterruptCheckpoint()])
    assert last.rows == reference.rows[10:]
    for name, value in last.weights.items():
        assert torch.equal(value, reference.weights[name]), name
    # Complete: its requeue checkpoint is spent. Lightning resumed any hpc_ckpt in the folder by itself, so another
    # run in it (the CLI's runs/ is every config's) continued this one, silently.
    assert not list(job.glob("hpc_ckpt_*"))
    assert fit(job, small_demo, [InterruptCheckpoint()], max_steps=2).rows == reference.rows[:4]


def test_ctrl_c_stops_before_min_steps(tmp_path, small_demo):
    """Lightning trains on past ``should_stop`` until ``min_steps``; a Ctrl-C stop does not."""
    interrupt = InterruptCheckpoint()
    run = fit(tmp_path / "run", small_demo, [CtrlC(1), interrupt, FinalCheckpoint()], min_steps=5, min_epochs=2)
    assert run.trainer.global_step == 1 and len(run.rows) == 2
    assert torch.load(interrupt.checkpoint, weights_only=False)["global_step"] == 1


def test_without_a_checkpoint_callback_it_writes_interrupted_ckpt(tmp_path, small_demo):
    interrupt = InterruptCheckpoint()
    export = HBPExport(str(tmp_path / "exported"))
    run = fit(tmp_path / "run", small_demo, [CtrlC(1), interrupt, FinalCheckpoint(), export])
    assert run.trainer.global_step == 1 and len(run.rows) == 2
    assert interrupt.checkpoint == str(tmp_path / "run" / "interrupted.ckpt")
    assert torch.load(interrupt.checkpoint, weights_only=False)["global_step"] == 1
    assert not (tmp_path / "exported").exists()  # an interrupted run is resumed, not exported


def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path, small_demo):
    interrupt = InterruptCheckpoint()
    try:
        with pytest.raises(SystemExit) as e:  # Lightning's KeyboardInterrupt handling exits with status 1
            fit(tmp_path / "run", small_demo, [CtrlC(0, 1), interrupt], max_steps=1000)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning left SIGINT ignored
    assert e.value.code == 1
    assert interrupt.checkpoint is None and not list(tmp_path.rglob("*.ckpt"))


class Fails(L.Callback):
    """Raises at the end of micro-batch ``at`` (a project's callback with a bug)."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.at:
            raise RuntimeError("a bug of the project's own")


def test_a_run_stopped_by_an_error_names_its_newest_checkpoint_and_the_resume(tmp_path, small_demo, lightning_log):
    """A fit that stops on an exception ended in its traceback alone: which checkpoint holds the run (the steps
    after it train again) and how to resume were left to the user to find, and a run with none said nothing."""
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="a bug of the project's own"):
        fit(tmp_path / "run", small_demo, [Fails(9), InterruptCheckpoint(), every], enable_checkpointing=True)
    path = str(tmp_path / "ckpt" / "step=4.ckpt")
    assert torch.load(path, weights_only=False)["global_step"] == 4
    (said,) = [m for m in lightning_log if m.startswith("the run stopped on an error")]
    assert said.startswith(f"the run stopped on an error at optimizer step 5; its newest checkpoint, {path}, holds "
                           "step 4 (the steps after it train again): once mended, resume with: ")  # fmt: skip
    assert said.endswith(f"--ckpt_path {path}")
    lightning_log.clear()
    with pytest.raises(RuntimeError):
        fit(tmp_path / "none", small_demo, [Fails(3), InterruptCheckpoint()])
    assert (
        "the run stopped on an error at optimizer step 2 with no checkpoint saved: its steps are lost" in lightning_log
    )
    lightning_log.clear()  # an error before this fit trained a step: the run is where it was, nothing to say
    with pytest.raises(RuntimeError):
        fit(tmp_path / "early", small_demo, [Fails(0), InterruptCheckpoint()])
    assert not [m for m in lightning_log if m.startswith("the run stopped on an error")]


def test_resume_command_replaces_the_ckpt_path():
    argv = ["python", "-u", "train.py", "fit", "--ckpt_path", "old.ckpt", "--config", "a b.yaml", "--ckpt_path=x"]
    assert resume_command("runs/last.ckpt", argv) == (
        "python -u train.py fit --config 'a b.yaml' --ckpt_path runs/last.ckpt"
    )


def test_the_launcher_command_is_recognised(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", f"{tmp_path}/bin:/usr/bin")
    typed = ["--nproc_per_node", "8", "train.py", "fit", "--config", "c.yaml"]
    assert torchrun_argv(["/usr/bin/python3", f"{tmp_path}/bin/torchrun", *typed]) == ["torchrun", *typed]
    assert torchrun_argv(["python", "-u", "/opt/env/bin/torchrun", *typed]) == ["/opt/env/bin/torchrun", *typed]
    module = ["python3", "-X", "utf8", "-m", "torch.distributed.run", *typed]
    assert torchrun_argv(module) == module
    assert torchrun_argv(["python", "train.py", "fit"]) is None
    assert torchrun_argv(["python", "-m", "lit_hbp.train", "fit"]) is None


@pytest.mark.slow
def test_under_torchrun_the_resume_command_is_the_launchers(tmp_path):
    """A real torchrun: the worker's own command line is ``python -u script.py ...``; the resume
    command is the torchrun line the user typed."""
    script = tmp_path / "show.py"
    script.write_text("from lit_hbp.callbacks.interrupt import resume_command\nprint(resume_command('new.ckpt'))\n")
    bin_dir = os.path.dirname(console_script("torchrun"))  # typed as `torchrun`, as users do
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "1", str(script), "fit", "--ckpt_path", "old.ckpt"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S, check=True).stdout
    want = shlex.join(
        ["torchrun", "--standalone", "--nproc_per_node", "1", str(script), "fit", "--ckpt_path", "new.ckpt"]
    )
    assert out.strip().splitlines()[-1] == want, out


class Pids(torch.utils.data.Dataset):
    """Item i: the worker's pid, a little later than the one before."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        time.sleep(0.01)
        return os.getpid()


def test_dataloader_workers_leave_signals_to_main():
    """A terminal's Ctrl-C and a scheduler's group signal reach the workers too: torch's workers die of SIGTERM by
    a handler of their own, which ``leave_signals_to_main`` replaces: a signal from another process (``kill``, as a
    scheduler or torchrun sends it) is the main process's to act on; a SIGTERM from the main process (a loader's
    shutdown terminating its workers) ends the worker, as torch's handler does. Five items after the signals: more
    than the loader fetches ahead, so a dead worker could not have given them."""
    loader = torch.utils.data.DataLoader(Pids(), num_workers=1, worker_init_fn=leave_signals_to_main)
    items = iter(loader)
    worker = int(next(items))
    for name in ("INT", "TERM", "USR1", "TERM", "USR2"):
        subprocess.run(["kill", f"-{name}", str(worker)], check=True)
    assert [int(next(items)) for _ in range(5)] == [worker] * 5
    os.kill(worker, signal.SIGTERM)  # from its main process
    with pytest.raises(RuntimeError, match=f"{worker}"):
        list(items)


def _echo(conn):
    """A worker that answers every message with the message (until a signal ends it)."""
    conn.send("started")
    while True:
        conn.send(conn.recv())


def test_a_forked_process_told_to_end_ends():
    """A process forked while the handlers are installed inherits them (a pool's workers, or a loader's without
    ``leave_signals_to_main``): SIGTERM (a pool's terminate) still ends it, SIGINT is left to the main process. No
    waiting for a while: a signal sent before a message is handled before the message is read, so the worker
    answering the message sent after SIGINT is the worker having survived it."""
    import multiprocessing

    interrupt = InterruptCheckpoint()
    interrupt._pid = os.getpid()
    before = {s: signal.signal(s, interrupt._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        ctx = multiprocessing.get_context("fork")
        ours, theirs = ctx.Pipe()
        worker = ctx.Process(target=_echo, args=(theirs,))
        worker.start()
        assert ours.poll(HANG_S) and ours.recv() == "started"
        os.kill(worker.pid, signal.SIGINT)
        ours.send("still there?")
        assert ours.poll(HANG_S) and ours.recv() == "still there?"  # (EOFError if SIGINT had ended it)
        os.kill(worker.pid, signal.SIGTERM)
        worker.join(HANG_S)
        assert worker.exitcode == -signal.SIGTERM
        assert interrupt.received is None  # the main process got nothing
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


GROUP_SIGNAL_FIT = """
import os, signal, subprocess, sys
from pathlib import Path
import lightning as L, torch
from lightning.pytorch.callbacks import ModelCheckpoint
from conftest import TINY_LLAMA, chat_datamodule, quiet_trainer
from lit_hbp.callbacks import InterruptCheckpoint
from lit_hbp.lightning.module import HBPLitModule

root, demo, signum = Path(sys.argv[1]), Path(sys.argv[2]), getattr(signal, sys.argv[3])

class GroupSignal(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 4:
            # what scancel and `kill -TERM -<pgid>` do: another process signals the group
            subprocess.run(["kill", "-s", sys.argv[3][3:], "--", f"-{os.getpgrp()}"])

torch.set_num_threads(1)
L.seed_everything(0)
dm = chat_datamodule(demo, str(demo / "tokenizer"), root / "cache", num_workers=2)
module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, lr=1e-3, self_check=False)
interrupt = InterruptCheckpoint()
trainer = quiet_trainer(max_steps=6, accumulate_grad_batches=2, default_root_dir=root, enable_checkpointing=True,
                        callbacks=[ModelCheckpoint(root / "ckpt", save_last=True), GroupSignal(), interrupt])
trainer.fit(module, dm)
print("stopped at", trainer.global_step, "saved", os.path.basename(interrupt.checkpoint), flush=True)
sys.exit(interrupt.exit_status)
"""


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGUSR1"])
def test_a_signal_to_the_process_group_with_loader_workers_saves_the_running_step(tmp_path, small_demo, signum):
    """SLURM's scancel and ``srun --signal`` signal every process of the step, the loader's workers with it: the
    workers died of it and the fit failed mid-step ("DataLoader worker exited unexpectedly", nothing saved). In a
    session of its own, so the group signalled is the run's alone."""
    run = subprocess.run(
        [sys.executable, "-c", GROUP_SIGNAL_FIT, str(tmp_path), str(small_demo), signum],
        cwd=Path(__file__).parent,
        start_new_session=True,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert run.returncode == 128 + getattr(signal, signum), run.stderr[-3000:]
    assert "stopped at 3 saved last.ckpt" in run.stdout
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 3


def ddp_fit(root: str, demo: str, press_on_rank: int) -> dict:
    """One rank of a 2-process DDP fit; only ``press_on_rank`` gets a Ctrl-C (after micro-batch 4). Python's
    own Ctrl-C handler, as ``ctrl_c_as_in_a_terminal`` sets it in the test's process (a worker of the shared
    pool may have started while SIGINT was ignored; the pool puts the worker's handler back)."""
    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt = InterruptCheckpoint()
    press = [CtrlC(4)] if dist.get_rank() == press_on_rank else []
    run = fit(Path(root), Path(demo), [*press, interrupt], devices=2, strategy="ddp")
    return dict(step=run.trainer.global_step, rows=run.rows, checkpoint=interrupt.checkpoint)


@pytest.mark.slow
def test_ranks_stop_together_when_one_of_them_gets_ctrl_c(tmp_path, small_demo, shared_pool2):
    ranks = shared_pool2.run(ddp_fit, str(tmp_path / "run"), str(small_demo), 1)
    # Rank 1 asked after micro-batch 4 (inside optimizer step 3): both ranks finish step 3 and stop.
    assert [r["step"] for r in ranks] == [3, 3]
    assert [len(r["rows"]) for r in ranks] == [6, 6]
    path = str(tmp_path / "run" / "interrupted.ckpt")
    assert [r["checkpoint"] for r in ranks] == [path, path]
    assert torch.load(path, weights_only=False)["global_step"] == 3


class SigtermInSanityCheck(L.Callback):
    """SIGTERM to this process ``times`` times after the sanity check's first validation batch (Lightning's launcher
    forwards a SIGTERM its own process got to the other ranks: those get it twice)."""

    def __init__(self, times: int):
        self.times = times

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking and batch_idx == 0:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGTERM)


def sanity_sigterm_fit(root: str, demo: str) -> str:
    """One rank of a 2-process DDP fit signalled in its sanity check: once on rank 0, twice on rank 1."""
    import torch.distributed as dist
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    L.seed_everything(0)
    dm = chat_datamodule(Path(demo), str(Path(demo) / "tokenizer"), Path(root) / "cache", val_fraction=0.2)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, self_check=False)
    send = SigtermInSanityCheck(1 + dist.get_rank())
    trainer = quiet_trainer(max_steps=2, devices=2, strategy="ddp", callbacks=[send, InterruptCheckpoint()])
    try:
        trainer.fit(module, dm)
    except SIGTERMException:
        return f"stopped at step {trainer.global_step}"
    return "trained"


@pytest.mark.slow
def test_a_sigterm_in_the_sanity_check_stops_every_rank_with_nothing_to_save(tmp_path, small_demo, shared_pool2):
    """Before training Lightning's own SIGTERM handler broadcast from inside the handler: a rank that got the signal
    twice (forwarded by Lightning's launcher) broadcast into whatever collective the other was in, gloo aborted it
    ("collective mismatch") and the other reported it lost, exit 1. Every rank now stops as the docs say."""
    ranks = shared_pool2.run(sanity_sigterm_fit, str(tmp_path), str(small_demo), timeout=600)  # it hung, or aborted
    assert ranks == ["stopped at step 0", "stopped at step 0"]


@pytest.mark.parametrize("scheduled", [False, True], ids=["last_ckpt", "a_scheduled_save_at_that_step"])
def test_a_run_resumed_after_a_stop_logs_the_loss_the_uninterrupted_run_logs(tmp_path, small_demo, scheduled):
    """Lightning logs at the step a run stops at, whatever ``log_every_n_steps`` says (here every second step):
    the stopped run logs its loss since the last logged step there (that step's alone, not the last value again),
    and the run resumed from the stop's checkpoint logs what the uninterrupted run logs (a checkpoint of the stop
    carried nothing, the resumed run's first ``train/loss`` averaged only the steps after the resume); also from a
    scheduled ``ModelCheckpoint`` save of that step, made before the stop was asked."""
    from test_hot_path import MemoryLogger

    each, whole, stopped, resumed = MemoryLogger(), MemoryLogger(), MemoryLogger(), MemoryLogger()
    fit(tmp_path / "each", small_demo, [], logger=each, log_every_n_steps=1)
    every2 = dict(log_every_n_steps=2, enable_checkpointing=True)
    fit(tmp_path / "whole", small_demo, [], logger=whole, **every2)
    saves = [ModelCheckpoint(tmp_path / "ckpt", save_last=True)]
    if scheduled:
        saves.append(ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}"))
    interrupt = InterruptCheckpoint()
    fit(tmp_path / "stopped", small_demo, [*saves, CtrlC(4), interrupt], logger=stopped, **every2)
    # the scheduled save of step 3 ran before the stop was asked (the interrupt is a step-end callback, after it)
    ckpt = str(tmp_path / "ckpt" / "step=3.ckpt") if scheduled else interrupt.checkpoint
    fit(tmp_path / "resumed", small_demo, [], ckpt, logger=resumed, **every2)
    logged, step_3 = whole.values("train/loss"), each.values("train/loss")[2]  # the logger's step: global_step - 1
    assert sorted(logged) == [1, 3, 5]
    assert stopped.values("train/loss") == pytest.approx({1: logged[1], 2: step_3}, rel=1e-6)  # step 3's alone
    assert resumed.values("train/loss") == pytest.approx({3: logged[3], 5: logged[5]}, rel=1e-6)


class SignalInValidation(L.Callback):
    """Sends SIGTERM to this process in the first validation batch after optimizer step ``after``."""

    def __init__(self, after: int):
        self.after, self.sent = after, False

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking and trainer.global_step == self.after and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_during_a_validation_saves_at_its_end_and_resumes_exactly(tmp_path, small_demo):
    """A validation ends at an optimizer step's end: a signal during it waited for it and a whole training step more
    (a step of a long level can outlast a scheduler's grace period). Saved at the validation's end, the resumed run
    trains and validates what the uninterrupted one does."""
    reference = validating_fit(tmp_path, small_demo, 4, "reference", [])
    interrupt = InterruptCheckpoint()
    stopped = validating_fit(tmp_path, small_demo, 4, "stopped", [SignalInValidation(2), interrupt])
    assert interrupt.exit_status == 128 + signal.SIGTERM and stopped[1][-1][2] == 2  # no step after the validation
    assert torch.load(interrupt.checkpoint, weights_only=False)["global_step"] == 2
    resumed = validating_fit(tmp_path, small_demo, 4, "resumed", [], interrupt.checkpoint)
    assert stopped[0] + resumed[0] == reference[0]
    assert stopped[1] + resumed[1] == reference[1]
    for name, value in resumed[2].items():
        assert torch.equal(value, reference[2][name]), name
