"""InterruptCheckpoint: Ctrl-C ends training at the next optimizer step with a checkpoint to resume from.

Lightning's own handling of Ctrl-C (``_call_and_handle_interrupt``) stops at once and exits: the steps
since the last scheduled checkpoint are lost and nothing says which file to resume from.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info

from lit_hbp.callbacks.checkpoint import FinalCheckpoint, StepEndCallback

FIRST_PRESS = (
    "Ctrl-C: training stops after the current optimizer step and saves a checkpoint; "
    "press Ctrl-C again to stop at once without saving"
)
FALLBACK_NAME = "interrupted.ckpt"


class InterruptCheckpoint(StepEndCallback):
    """The first Ctrl-C (SIGINT) lets the running optimizer step finish, saves it and stops fit; the
    second raises KeyboardInterrupt (Lightning's default: stop at once, nothing saved).

    While training runs (``on_train_start`` to ``on_train_end`` or a failure; setup and the sanity
    check keep Lightning's plain Ctrl-C: there is nothing to save yet) a SIGINT handler of the main
    thread records the request. At the next optimizer-step boundary (``global_step`` increased, in
    ``on_train_batch_end`` after the checkpoint callbacks' hooks, so the micro-batches of an
    accumulation complete first) the step is saved where a scheduled ``every_n_train_steps`` save
    would be, i.e. the exact mid-epoch resume state: into every ``ModelCheckpoint`` that keeps a
    latest checkpoint (``FinalCheckpoint.save_final``: ``last.ckpt`` of ``save_last``), or, when none
    holds the step with the trainer's state, ``interrupted.ckpt`` in the first checkpoint callback's
    ``dirpath``, else ``<log_dir>/checkpoints``, else ``default_root_dir``. Then ``should_stop`` is
    set (``min_steps``/``min_epochs`` do not hold it back), the validation Lightning would run on a
    stop is skipped (it can take long; a resume from a step-end save skips a validation scheduled at
    that step anyway), and every ``ModelCheckpoint`` counts the step as saved: its epoch-end hook
    would otherwise save again after Lightning closed the epoch, and that file would resume at the
    next epoch. Rank 0 prints the path and the command that resumes (the run's command line, the
    torchrun one under torchrun, with ``--ckpt_path <path>``).

    Several processes (DDP, DeepSpeed): a terminal's Ctrl-C reaches every rank, not at the same
    step. At each optimizer-step boundary the ranks all-reduce (max) their request over a gloo
    group of their own, so all of them stop and save (a ZeRO save is collective) at the same step;
    gloo on a CPU tensor costs one small host message per step and, on GPUs, no device
    synchronization.

    DataLoader workers get the terminal's SIGINT too: give them ``ignore_sigint`` as
    ``worker_init_fn``. The CLI adds this callback; in a plain Lightning project add it to
    ``Trainer(callbacks=...)``.
    """

    def __init__(self) -> None:
        self.requested = False  # this process got a Ctrl-C (set by the signal handler)
        self.checkpoint: str | None = None  # the file saved at the interrupt
        self._installed = False
        self._previous: Any = None  # the SIGINT handler to restore
        self._pid = 0
        self._announce = False
        self._group: Any = None
        self._group_world: Any = None  # the default group ``_group`` was made under
        self._final = FinalCheckpoint()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.requested, self.checkpoint = False, None
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            if self._group is None or self._group_world is not dist.group.WORLD:
                # new_group is collective: every rank reaches on_train_start.
                self._group, self._group_world = dist.new_group(backend="gloo"), dist.group.WORLD
        # Signal handlers belong to the main thread. A process that ignores SIGINT (a shell's background
        # job: `python train.py &`) keeps ignoring it, as Python itself does.
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
            self._pid, self._announce = os.getpid(), trainer.is_global_zero
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            return  # a forked DataLoader worker inherited the handler: the main process decides
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self._announce:
            # os.write, not print: a handler that runs inside a buffered write to the same stream fails.
            os.write(2, f"\n{FIRST_PRESS}\n".encode())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.stepped(trainer):
            return  # inside an accumulation
        stop = self.requested
        if self._group is not None:
            flag = torch.tensor([int(stop)], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            stop = bool(flag.item())
        if stop:
            self._save_and_stop(trainer)

    def _save_and_stop(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        checkpoints = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
        written = self._final.save_final(trainer)
        # ModelCheckpoint has no public "last saved file": these attributes are what its hooks use.
        held = [
            cb._last_checkpoint_saved
            for cb in checkpoints
            if not cb.save_weights_only and (cb._last_checkpoint_saved in written or cb._last_global_step_saved == step)
        ]
        path = held[0] if held else self._fallback_path(trainer, checkpoints)
        if not held:
            trainer.save_checkpoint(path)
        for cb in checkpoints:
            cb._last_global_step_saved = step
        trainer.should_stop = True
        # Lightning keeps training past should_stop until min_steps / min_epochs are met: a Ctrl-C
        # overrides them for this fit (the resumed run gets them back from its command line).
        trainer.fit_loop.min_epochs = None
        trainer.fit_loop.epoch_loop.min_steps = None
        trainer.fit_loop.epoch_loop._skip_next_val = True  # Lightning's own flag: no validation after this step
        self.checkpoint = path
        text = f"Ctrl-C: stopped after optimizer step {step}, saved to {path}\nresume with: {resume_command(path)}"
        bar = trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar) and bar.is_enabled and trainer.is_global_zero:
            bar.print(text)  # above the bar (tqdm.write), not into its line
        else:
            rank_zero_info(text)

    @staticmethod
    def _fallback_path(trainer: L.Trainer, checkpoints: list[ModelCheckpoint]) -> str:
        dirpath = next((cb.dirpath for cb in checkpoints if cb.dirpath), None)
        if dirpath is None:
            log_dir = trainer.log_dir if trainer.loggers else None  # log_dir is collective: every rank asks
            dirpath = os.path.join(log_dir, "checkpoints") if log_dir else trainer.default_root_dir
        return os.path.join(dirpath, FALLBACK_NAME)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        """Put the previous SIGINT handler back, unless something replaced ours since (Lightning
        ignores SIGINT while it shuts down after a KeyboardInterrupt)."""
        if self._installed and signal.getsignal(signal.SIGINT) == self._on_sigint:
            signal.signal(signal.SIGINT, signal.SIG_DFL if self._previous is None else self._previous)
        self._installed = False


def launch_argv() -> list[str]:
    """The command line that started this run: under torchrun (``TORCHELASTIC_RUN_ID`` set) the
    launcher's, read from its process (a worker's own is ``python -u train.py ...``, which would
    restart one process); else this process's (``sys.orig_argv``: the interpreter and its options
    as typed)."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                launcher = torchrun_argv([a.decode() for a in f.read().split(b"\0") if a])
        except OSError:  # not Linux: the worker's own line is the best there is
            launcher = None
        if launcher:
            return launcher
    return list(sys.orig_argv)


def torchrun_argv(cmdline: Sequence[str]) -> list[str] | None:
    """``cmdline`` as the user typed it when it is a torchrun launcher's (``torchrun ...``, the
    interpreter running the console script dropped, or ``python -m torch.distributed.run ...``),
    else None."""
    rest = list(cmdline[1:])
    while rest and rest[0].startswith("-") and rest[0] != "-m":  # the interpreter's own options
        rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]
    if rest[:2] == ["-m", "torch.distributed.run"]:
        return list(cmdline)
    if rest and os.path.basename(rest[0]) == "torchrun":
        return ["torchrun", *rest[1:]] if os.path.dirname(rest[0]) in os.get_exec_path() else rest
    if cmdline and os.path.basename(cmdline[0]) == "torchrun":  # a launcher without an interpreter
        return list(cmdline)
    return None


def resume_command(path: str, argv: Sequence[str] | None = None) -> str:
    """The run's command line (``launch_argv``), any ``--ckpt_path`` removed, plus ``--ckpt_path
    path``, quoted for a POSIX shell."""
    kept: list[str] = []
    args = iter(launch_argv() if argv is None else argv)
    for arg in args:
        if arg == "--ckpt_path":
            next(args, None)
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return shlex.join([*kept, "--ckpt_path", path])


def ignore_sigint(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: the worker ignores SIGINT. A terminal's Ctrl-C reaches the
    workers too; one that died of it would fail the step InterruptCheckpoint lets finish. The
    workers still end with the main process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
