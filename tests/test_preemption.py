"""Runs that survive the cluster, the way a scheduler treats them: ``lit-hbp fit`` in subprocesses,
SIGTERM sent as SLURM sends it (to every process of the job), SIGKILL at random moments of a run
that checkpoints every step, a rank killed mid-step, and ``--ckpt_path auto`` resuming from the
newest complete checkpoint. Each resumed run is compared with the same run never interrupted."""

import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import HANG_S
from conftest import SHORTER as TINY_SHORTER

from lit_hbp.lightning.checkpoints import newest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
STEP_SHOWN = re.compile(r"Epoch \d+: +\d+%\|[^|]*\| *[1-9]\d*/\d+ steps")  # the bar after an optimizer step
SMALL = ["--model.model.hidden_size", "32", "--model.model.intermediate_size", "64", "--model.self_check", "false"]
# conftest's 5K long level in place of tiny_cpu.yaml's 16K one: what these tests check (signals, saves, resumes)
# does not depend on a pack's length.
SHORTER = {"tiny_cpu.yaml": list(TINY_SHORTER)}


def command(config: str, demo: Path, cache: Path, max_steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, str(ROOT / "train.py"), "fit", "--config", str(ROOT / "configs" / config),
        "--data.demo_dir", str(demo), "--data.cache_dir", str(cache), "--trainer.max_steps", str(max_steps),
        *SMALL, *SHORTER.get(config, []), *extra,
    ]  # fmt: skip


def env() -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def run(cmd: list[str], cwd: Path, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


class Reference:
    """The uninterrupted run a test compares with, started at once and awaited when needed: it runs
    beside the interrupted one (on its own folder and cache), which the test watches step by step."""

    def __init__(self, cmd: list[str], cwd: Path):
        cwd.mkdir(parents=True, exist_ok=True)
        self.cmd, self.log = cmd, cwd / "reference.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=log, stderr=subprocess.STDOUT)

    def result(self, timeout: float = HANG_S) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.proc.kill()
        out = self.log.read_text(errors="replace")
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, out, out)


def ranks_of(proc: subprocess.Popen) -> list[int]:
    """The pids of a run's rank processes: the one started, and the ranks Lightning's launcher started
    (its children running train.py; DataLoader workers are children too and are left out)."""
    pids = [proc.pid]
    for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        if any(arg.endswith(b"train.py") for arg in cmdline):
            pids.append(int(child))
    return pids


class Job:
    """A run in a subprocess whose output is read as it comes."""

    def __init__(self, cmd: list[str], cwd: Path):
        cwd.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(
            target=lambda: self.chunks.extend(iter(lambda: self.proc.stdout.read1(4096), b""))
        )
        self.reader.start()

    @property
    def out(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def wait_for(self, pattern: re.Pattern, timeout: float = HANG_S) -> None:
        deadline = time.monotonic() + timeout
        while not pattern.search(self.out):
            assert self.proc.poll() is None, self.out[-3000:]
            assert time.monotonic() < deadline, f"{pattern.pattern!r} not shown:\n{self.out[-3000:]}"
            time.sleep(0.05)

    def wait_for_file(self, ready, timeout: float = HANG_S) -> None:
        """Until ``ready()`` (a condition on the files the run writes) holds, while the run runs."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, self.out[-3000:]
            assert time.monotonic() < deadline, f"not ready:\n{self.out[-3000:]}"
            time.sleep(0.05)

    def kill_after(self, seconds: float) -> None:
        """SIGKILL ``seconds`` from now unless the run ended before (the moment is the test's choice, not
        a wait for anything), then wait for it to end."""
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
        self.end()

    def end(self, timeout: float = HANG_S) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.proc.kill()
            self.reader.join()
        return self.proc.returncode


def saved_steps(folder: Path) -> list[int]:
    """The optimizer steps of the step checkpoints in ``folder`` (``epoch=E-step=S.ckpt``)."""
    return [
        int(m.group(1)) for p in folder.glob("epoch=*-step=*.ckpt") if (m := re.search(r"-step=(\d+)\.ckpt$", p.name))
    ]


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint: a Lightning file, or a DeepSpeed folder gathered to fp32."""
    if path.is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(path))
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


@pytest.mark.slow
def test_sigterm_saves_the_step_exits_143_and_the_printed_command_resumes_exactly(tmp_path, small_demo):
    max_steps = 12
    cmd = command("tiny_cpu.yaml", small_demo, tmp_path / "cache", max_steps)
    reference = Reference(command("tiny_cpu.yaml", small_demo, tmp_path / "reference_cache", max_steps),
                          tmp_path / "reference")  # fmt: skip

    job = Job(cmd, tmp_path / "run")
    job.wait_for(STEP_SHOWN)
    job.proc.send_signal(signal.SIGTERM)
    status = job.end()
    out = job.out
    assert status == 128 + signal.SIGTERM, out[-3000:]  # not 0: a scheduler sees an interrupted job
    assert "SIGTERM: training stops after the current optimizer step and saves a checkpoint" in out
    step, path = re.search(r"SIGTERM: stopped after optimizer step (\d+), saved to (\S+)", out).groups()
    assert path == "runs/tiny_cpu/version_0/checkpoints/last.ckpt"
    assert torch.load(tmp_path / "run" / path, weights_only=False)["global_step"] == int(step) < max_steps
    resume = re.search(r"resume with: (.*)", out).group(1)
    assert shlex.split(resume) == [*cmd, "--ckpt_path", path]

    resumed = run(shlex.split(resume), tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming at optimizer step {step}, epoch 0, micro-batch {2 * int(step)} of" in resumed.stderr
    assert sorted(p.name for p in (tmp_path / "run/runs/tiny_cpu").iterdir()) == ["version_0"]  # logs continue there
    final = "runs/tiny_cpu/version_0/checkpoints/last.ckpt"
    done = reference.result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_weights(weights(tmp_path / "run" / final), weights(tmp_path / "reference" / final))


@pytest.mark.slow
def test_sigterm_to_every_rank_of_a_deepspeed_run_and_ckpt_path_auto_resume_exactly(tmp_path, small_demo):
    """2 processes (Lightning's launcher, gloo, ZeRO-2, a level with sp 2): SIGTERM to every rank, as
    SLURM sends it; the requeued job's command is the same, with ``--ckpt_path auto``."""
    cmd = command("tiny_cpu_sp.yaml", small_demo, tmp_path / "cache", 6, "--ckpt_path", "auto")
    reference = Reference(command("tiny_cpu_sp.yaml", small_demo, tmp_path / "reference_cache", 6, "--ckpt_path",
                                  "auto"), tmp_path / "reference")  # fmt: skip

    job = Job(cmd, tmp_path / "run")
    job.wait_for(STEP_SHOWN)
    ranks = ranks_of(job.proc)
    assert len(ranks) == 2
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    assert job.end() == 128 + signal.SIGTERM, job.out[-3000:]
    assert "Forcefully terminating" not in job.out  # rank 1 ended with 0: rank 0's watch did not kill it
    step, path = re.search(r"SIGTERM: stopped after optimizer step (\d+), saved to (\S+)", job.out).groups()
    assert int(step) < 6 and Path(tmp_path / "run" / path).is_dir()  # a DeepSpeed folder
    assert f"resume with: {shlex.join([*cmd[:-2], '--ckpt_path', path])}" in job.out

    resumed = run(cmd, tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"--ckpt_path auto: resuming from {path}" in resumed.stderr
    final = "runs/tiny_cpu_sp/version_0/checkpoints/epoch=0-step=6.ckpt"
    done = reference.result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--ckpt_path auto: no checkpoint in" in done.stderr
    assert_same_weights(weights(tmp_path / "run" / final), weights(tmp_path / "reference" / final))


# A signal a process sends itself is handled before the next line runs: no waiting.
SECOND_SIGNAL = """
import os, signal, time
from lit_hbp.callbacks import InterruptCheckpoint
from lit_hbp.callbacks.interrupt import REPEAT_S

interrupt = InterruptCheckpoint()
interrupt._pid, interrupt._announce = os.getpid(), True
signal.signal(signal.SIGTERM, interrupt._on_signal)  # what on_train_start installs
os.kill(os.getpid(), signal.SIGTERM)
print("first: received", interrupt.received, flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # the same, delivered twice (SLURM's to the rank, torchrun's forward)
print("still running after the same SIGTERM again", flush=True)
time.sleep(REPEAT_S + 0.1)
os.kill(os.getpid(), signal.SIGTERM)
print("still running after a second SIGTERM")
"""


def test_a_second_sigterm_stops_at_once_and_the_first_delivered_twice_does_not():
    """Under SLURM and torchrun a rank gets the scheduler's SIGTERM and torchrun's forward of it within
    milliseconds: the second aborted the save of the running step. The same signal again within ``REPEAT_S`` is that
    one request; a later one stops at once."""
    out = run([sys.executable, "-c", SECOND_SIGNAL], Path.cwd())
    assert out.returncode == -signal.SIGTERM, out.stdout + out.stderr  # ended by the signal, as without a handler
    assert out.stdout.strip().splitlines() == [
        f"first: received {int(signal.SIGTERM)}",
        "still running after the same SIGTERM again",
    ]
    assert "SIGTERM: training stops after the current optimizer step" in out.stderr
    assert out.stderr.count("SIGTERM again: stopping at once without saving") == 1


@pytest.mark.slow
def test_a_rank_killed_mid_step_stops_the_other_with_a_message(tmp_path, small_demo):
    """Rank 1 of a 2-process run (Lightning's launcher, gloo, sp 2) SIGKILLed mid-run: the run ends
    non-zero (a hang fails ``end``'s bound) and its output names the lost rank, whichever process
    noticed first: rank 0's next collective fails and LostRankReport says rank 1 (its pid) is gone, or
    the launcher's watch in rank 0 (every 5 s) sees its child's status -9 first and ends the run."""
    job = Job(command("tiny_cpu_sp.yaml", small_demo, tmp_path / "cache", 40), tmp_path / "run")
    job.wait_for(STEP_SHOWN)
    main, rank1 = ranks_of(job.proc)
    os.kill(rank1, signal.SIGKILL)
    status = job.end()
    out = job.out
    assert status != 0, out[-3000:]
    ours = re.search(rf"rank 1 \(pid {rank1}\) on \S+ is gone", out)
    launchers = re.search(rf"\[rank: 1\] Child process with PID {rank1} terminated with code -9\.", out)
    assert ours or launchers, out[-3000:]
    print("the lost rank was named by", "LostRankReport" if ours else "Lightning's launcher")  # (-rA shows which)
    assert "Traceback" not in out, out[-3000:]  # the lost rank is the news, not the collective that noticed


@pytest.mark.slow
def test_sigkill_at_random_moments_leaves_a_checkpoint_that_loads_and_auto_resumes(tmp_path, small_demo):
    """A run that checkpoints every optimizer step, killed (SIGKILL: no handler runs) at random moments
    after its first step; every time the newest checkpoint loads, and ``--ckpt_path auto`` continues
    from it."""
    cmd = command(
        "tiny_cpu.yaml", small_demo, tmp_path / "cache", 40, "--ckpt_path", "auto",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps", "1", "--trainer.callbacks.save_last", "true",
        "--trainer.callbacks.save_top_k", "-1",
    )  # fmt: skip
    rng = random.Random(0)
    folder = tmp_path / "run/runs/tiny_cpu/version_0/checkpoints"
    steps = [0]
    for trial in range(3):
        job = Job(cmd, tmp_path / "run")
        # After a step saved beyond the one this trial starts from (the file is complete once its name
        # shows: AtomicCheckpointIO renames it into place), at a random moment: inside a step or a save.
        job.wait_for_file(lambda: max(saved_steps(folder), default=0) > steps[-1])
        job.kill_after(rng.uniform(0.0, 2.0))
        if trial:
            assert f"--ckpt_path auto: resuming from {newest}" in job.out  # noqa: F821 (the previous trial's)
        newest = newest_checkpoint([folder])
        step = torch.load(newest, weights_only=False)["global_step"]
        for path in folder.glob("*.ckpt"):  # every file under a checkpoint's name loads
            torch.load(path, weights_only=False)
        newest = str(Path(newest).relative_to(tmp_path / "run"))
        steps.append(step)
    assert steps == sorted(steps) and len(set(steps)) == 4  # each trial saved a step beyond the last


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_then_a_sigterm_saves_and_torchrun_exits_1(tmp_path, small_demo):
    """``torchrun --max-restarts 1 ... --ckpt_path auto``: a worker SIGKILLed after its first saved step
    is started again by the agent and resumes from the newest complete checkpoint by itself. Then SIGTERM
    to torchrun's own process (what Kubernetes sends a pod's first process): torchrun forwards it, the
    worker saves the step and prints the torchrun line that resumes, and torchrun ends with status 1 and
    torch's ``SignalException`` (its elastic agent raises on the signal it got), as docs/cluster.md says."""
    max_steps = 40
    cmd = command(
        "tiny_cpu.yaml", small_demo, tmp_path / "cache", max_steps, "--ckpt_path", "auto",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps", "1", "--trainer.callbacks.save_last", "true",
    )  # fmt: skip
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                "--max-restarts", "1"]  # fmt: skip
    job = Job([*launcher, *cmd[1:]], tmp_path / "run")
    job.wait_for(re.compile(r"Epoch \d+: +\d+%\|[^|]*\| *[2-9]/\d+ steps"))  # step 1 saved, step 2 done
    (worker,) = (int(p) for p in Path(f"/proc/{job.proc.pid}/task/{job.proc.pid}/children").read_text().split())
    os.kill(worker, signal.SIGKILL)
    job.wait_for(re.compile(r"resuming at optimizer step \d+"))
    assert re.search(r"--ckpt_path auto: resuming from (\S+)", job.out), job.out[-3000:]
    resumed_at = job.out.rindex("resuming at optimizer step")
    shown = re.compile(r"Epoch \d+: +\d+%\|[^|]*\| *[1-9]\d*/\d+ steps")
    deadline = time.monotonic() + HANG_S
    while not shown.search(job.out[resumed_at:]):  # an optimizer step of the restarted worker
        assert job.proc.poll() is None and time.monotonic() < deadline, job.out[-3000:]
        time.sleep(0.05)
    job.proc.send_signal(signal.SIGTERM)
    assert job.end() == 1, job.out[-3000:]
    out = job.out
    stopped = re.search(r"SIGTERM: stopped after optimizer step (\d+), saved to (\S+)", out)
    assert stopped, out[-4000:]  # what the worker said instead
    step, path = stopped.groups()
    assert torch.load(tmp_path / "run" / path, weights_only=False)["global_step"] == int(step) < max_steps
    assert re.search(r"resume with: .*torch\.distributed\.run .*--ckpt_path " + re.escape(path), out), out[-3000:]
    assert "SignalException" in out and "got signal: 15" in out


def test_a_peer_still_being_torn_down_is_awaited_and_named(monkeypatch, capsys):
    """A killed rank's sockets close before the kernel makes it a zombie, so the survivor's collective
    can fail ("Connection reset by peer") while the peer still looks alive: the report waits for it
    (bounded) and names it. Another error is reported at once, without waiting."""
    import socket
    from types import SimpleNamespace

    from lit_hbp.callbacks import lost_rank

    host = socket.gethostname()
    report = lost_rank.LostRankReport()
    report.peers = [(host, 100), (host, 101)]
    looks = iter([True, True, True, False])  # rank 1 is seen alive three times, then gone
    seen = []
    monkeypatch.setattr(lost_rank, "process_alive", lambda pid: seen.append(pid) or next(looks))
    trainer = SimpleNamespace(global_rank=0)
    error = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:51113: Connection reset by peer.")
    report.on_exception(trainer, None, error)
    assert report.lost == [1] and seen == [101] * 4
    assert "rank 1 (pid 101) on" in capsys.readouterr().err
    assert getattr(error, lost_rank.LostRankReport.MARK) == [1]

    monkeypatch.setattr(lost_rank, "process_alive", lambda pid: seen.append(pid) or True)
    seen.clear()
    report.on_exception(trainer, None, ValueError("a bug"))
    assert report.lost == [] and seen == [101]  # looked once, no wait
