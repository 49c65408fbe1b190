"""InterruptCheckpoint: Ctrl-C, a scheduler's SIGTERM or a SLURM warning signal ends training at the
next optimizer step with a checkpoint to resume from, and a non-zero exit status.

Lightning's own handling stops at once (Ctrl-C: ``_call_and_handle_interrupt``) or ends the run with
exit status 0 (SIGTERM: ``SIGTERMException`` is a ``SystemExit`` without a code), so a preempted job
looks successful; either way the steps since the last scheduled checkpoint are lost and nothing says
which file to resume from. Under SLURM with ``auto_requeue`` its USR1 handler saves in the middle of
a step, from inside the signal handler.
"""

from __future__ import annotations

import functools
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lit_hbp.callbacks.checkpoint import FinalCheckpoint, StepEndCallback
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.loader import leave_signals_to_main  # noqa: F401  (public here too)

FIRST_PRESS = (
    "Ctrl-C: training stops after the current optimizer step and saves a checkpoint; "
    "press Ctrl-C again to stop at once without saving"
)
FALLBACK_NAME = "interrupted.ckpt"
SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")
REPEAT_S = 2.0  # the same signal again this soon is the first delivered twice (a scheduler's and a launcher's)


def signal_label(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def first_signal_note(signum: int) -> str:
    """What a process prints when the first interrupting signal arrives."""
    if signum == signal.SIGINT:
        return FIRST_PRESS
    name = signal.Signals(signum).name
    return (
        f"{name}: training stops after the current optimizer step and saves a checkpoint; "
        f"another signal stops at once without saving"
    )


class InterruptCheckpoint(StepEndCallback):
    """The first interrupting signal (Ctrl-C's SIGINT, the SIGTERM of SLURM, Kubernetes or torchrun, a
    SLURM warning signal such as ``--signal=USR1@90``) lets the running optimizer step finish, saves it
    and stops fit; a second signal stops at once (SIGINT: KeyboardInterrupt, Lightning's default; any
    other: the signal's default action, the process ends by it), except the same signal within ``REPEAT_S``
    of the first: one request delivered twice (SLURM signals every process of a step, torchrun among them,
    and torchrun forwards the signal to its workers). ``exit_status`` is then ``128 +
    signal number`` (130 for Ctrl-C, 143 for SIGTERM), what a shell reports for a process ended by the
    signal: the CLI exits with it, so a scheduler and ``fit ... && export ...`` see an interrupted run.

    While training runs (``on_train_start`` to ``on_train_end`` or a failure; before that Lightning's
    handlers apply, and there is nothing to save yet) handlers of the main thread record the signal.
    At the next optimizer-step boundary (``global_step`` increased, in ``on_train_batch_end`` after
    the checkpoint callbacks' hooks, so the micro-batches of an accumulation complete first; or the end
    of a validation running at a step's end, ``on_validation_end``) the step is saved where a scheduled
    ``every_n_train_steps`` save would be, i.e. the exact mid-epoch resume state: into every
    ``ModelCheckpoint`` that keeps a latest checkpoint (``FinalCheckpoint.save_final``: ``last.ckpt`` of
    ``save_last``), or, when none holds the step with the trainer's state,
    ``interrupted.ckpt`` in the first checkpoint callback's ``dirpath``, else ``<log_dir>/checkpoints``,
    else ``default_root_dir``. Then ``should_stop`` is set (``min_steps``/``min_epochs`` do not hold it
    back), the validation Lightning would run on a stop is skipped (it can take long; one scheduled at that
    step runs first, as in the uninterrupted run, and the step is saved at its end), and every ``ModelCheckpoint``
    counts the step as saved: its epoch-end hook would otherwise save again after Lightning closed the
    epoch, and that file would resume at the next epoch. Rank 0 prints the path and the command that
    resumes (the run's command line, the torchrun one under torchrun, with ``--ckpt_path <path>``).

    SLURM with requeueing (Lightning's ``SLURMEnvironment(auto_requeue=True)``, its default under
    ``sbatch``): the requeue signal (``requeue_signal``, USR1) is handled at the step boundary by
    Lightning's own requeue handler, which saves ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir`` and runs
    ``scontrol requeue``; the requeued job resumes from it by itself (Lightning's ``hpc`` resume, or
    ``--ckpt_path auto``). Older ``hpc_ckpt_*.ckpt`` are removed once the new one is written.

    Several processes (DDP, DeepSpeed): a terminal's Ctrl-C reaches every rank, a scheduler's SIGTERM
    every rank or one, not at the same step. At each optimizer-step boundary the ranks all-reduce (max)
    what they received over a gloo group of their own, so all of them stop and save (a ZeRO save is
    collective) at the same step; gloo on a CPU tensor costs one small host message per step and, on
    GPUs, no device synchronization. Lightning's per-micro-batch broadcast of its own SIGTERM flag, a
    device tensor read on the host, is switched off while these handlers are installed: they replace
    its SIGTERM handler.

    DataLoader workers get a terminal's Ctrl-C and a scheduler's group signal too: ``HBPDataModule``'s
    loaders leave them to the main process (``leave_signals_to_main``, give it to your own loaders as
    ``worker_init_fn``). The CLI adds this callback; in a plain Lightning project add it to
    ``Trainer(callbacks=...)`` and exit with ``exit_status`` when it is set.

    Args:
        signals: the signals handled, by name (``SIGINT``, ``SIGTERM``, ``SIGUSR1``, ``SIGUSR2``, ...).
    """

    def __init__(self, signals: Sequence[str] = SIGNALS) -> None:
        self.signals = tuple(_signal_number(name) for name in signals)
        self.received: int | None = None  # the first signal this process got (set by the handler)
        self.signal: int | None = None  # the signal the ranks stopped for
        self.checkpoint: str | None = None  # the file saved at the interrupt
        self.requeued = False
        self._installed: dict[int, Any] = {}  # signal -> the handler to restore
        self._started_at: int | None = None  # the optimizer step this fit started from (on_train_start)
        self._pid = 0
        self._received_at = 0.0  # time.monotonic() of the first signal
        self._stop_after_validation: int | None = None  # the signal of a step whose validation runs first
        self._announce = False
        self._group: Any = None
        self._group_world: Any = None  # the default group ``_group`` was made under
        self._final = FinalCheckpoint()

    @property
    def requested(self) -> bool:
        """This process received an interrupting signal."""
        return self.received is not None

    @property
    def exit_status(self) -> int | None:
        """``128 + signal`` once training stopped for a signal (a shell's status for a process the
        signal ended), else None."""
        return None if self.signal is None else 128 + int(self.signal)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's SIGTERM handler, in place until on_train_start (the sanity check's validation), broadcasts
        # from inside the handler, amid whatever collective the ranks are in: gloo aborts the process ("collective
        # mismatch") and the others report it lost. This one records the signal, as Lightning's loops read it.
        connector = trainer._signal_connector
        connector._sigterm_notifier_fn = functools.partial(_note_sigterm, connector)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received, self.signal, self.checkpoint, self.requeued = None, None, None, False
        self._stop_after_validation = None
        self._started_at = trainer.global_step  # the step this fit starts from (restored by now)
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            if self._group is None or self._group_world is not dist.group.WORLD:
                # new_group is collective: every rank reaches on_train_start.
                self._group, self._group_world = dist.new_group(backend="gloo"), dist.group.WORLD
        # Signal handlers belong to the main thread. A process that ignores a signal (a shell's background
        # job ignores SIGINT: `python train.py &`) keeps ignoring it, as Python itself does.
        if threading.current_thread() is not threading.main_thread():
            return
        self._pid, self._announce = os.getpid(), trainer.is_global_zero
        for signum in self.signals:
            if signal.getsignal(signum) != signal.SIG_IGN:
                self._installed[signum] = signal.signal(signum, self._on_signal)
        if signal.SIGTERM in self._installed:
            # Lightning reads its own SIGTERM flag (never set now) from a device tensor at every micro-batch.
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _nothing

    def _on_signal(self, signum: int, frame: Any) -> None:
        # A forked process inherited the handler (a loader's workers have leave_signals_to_main).
        if os.getpid() != self._pid:
            if signum != signal.SIGINT:  # one told to end (a pool's terminate) ends, as it would without us
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return  # the terminal's Ctrl-C: the main process decides
        if self.received is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            if signum == self.received and time.monotonic() - self._received_at < REPEAT_S:
                return  # the same request twice: SLURM signals every process of the step, torchrun forwards its own
            os.write(2, f"\n{signal_label(signum)} again: stopping at once without saving\n".encode())
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received, self._received_at = signum, time.monotonic()
        if self._announce:
            # os.write, not print: a handler that runs inside a buffered write to the same stream fails.
            os.write(2, f"\n{first_signal_note(signum)}\n".encode())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.stepped(trainer):
            return  # inside an accumulation
        signum = self._agreed_signal(trainer)
        if signum is None or self._ends_here(trainer, signum):
            return
        if self._validation_due(trainer):
            # The uninterrupted run validates at this step, and a resume from a save here skips that validation
            # (Lightning fast-forwards it): it runs, and the step is saved at its end (``on_validation_end``).
            self._stop_after_validation = signum
            return
        self._save_and_stop(trainer, signum)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        signum, self._stop_after_validation = self._stop_after_validation, None
        if signum is None:
            if trainer.fit_loop.epoch_loop.batch_progress.current.processed % trainer.accumulate_grad_batches:
                return  # a validation inside an optimizer step: the step's end decides
            # A signal during the validation: its end is a step's end, saved there rather than a whole step later.
            signum = self._agreed_signal(trainer)
            if signum is None or self._ends_here(trainer, signum):
                return
        self._save_and_stop(trainer, signum)

    def _agreed_signal(self, trainer: L.Trainer) -> int | None:
        """The signal the ranks stop for (any rank's: all-reduced over the agreement's group), or None."""
        got = [int(self.received == s) for s in self.signals]
        if self._group is not None:
            flags = torch.tensor(got, dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
            got = flags.tolist()
        received = [s for s, flag in zip(self.signals, got) if flag]
        if not received:
            return None
        requeue = _requeue_signal(trainer)
        return min(received, key=lambda s: (s != requeue, s != signal.SIGTERM))

    def _ends_here(self, trainer: L.Trainer, signum: int) -> bool:
        """At the run's final step it ends complete, as it would have (exit 0, its export written; a resume from here
        would train nothing, and a requeued job neither): saved, the signal dropped."""
        ends = trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step
        if not (ends or FinalCheckpoint.last_epoch_ends(trainer)):
            return False
        self._final.save_final(trainer)
        self.received = None
        rank_zero_info(
            f"{signal_label(signum)} at the run's final optimizer step {trainer.global_step}: it ends complete"
        )
        return True

    @staticmethod
    def _validation_due(trainer: L.Trainer) -> bool:
        """Whether Lightning validates right after this optimizer step (its epoch loop's own check)."""
        loop = trainer.fit_loop
        fetcher = getattr(loop, "_data_fetcher", None)
        return fetcher is not None and bool(loop.epoch_loop._should_check_val_fx(fetcher))

    def _save_and_stop(self, trainer: L.Trainer, signum: int) -> None:
        step = trainer.global_step
        checkpoints = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
        if trainer.fast_dev_run:  # Lightning suppresses checkpointing in a dev run: stop, save nothing
            path = None
        elif signum == _requeue_signal(trainer):
            path = self._requeue(trainer, signum)
        else:
            written = self._final.save_final(trainer)
            # ModelCheckpoint has no public "last saved file": these attributes are what its hooks use.
            held = [
                cb._last_checkpoint_saved
                for cb in checkpoints
                if not cb.save_weights_only
                and (cb._last_checkpoint_saved in written or cb._last_global_step_saved == step)
            ]
            path = held[0] if held else self._fallback_path(trainer, checkpoints)
            if not held:
                trainer.save_checkpoint(path)
        for cb in checkpoints:
            cb._last_global_step_saved = step
        self._final.give_back_last()  # nothing saves at this epoch's end now
        trainer.should_stop = True
        # Lightning keeps training past should_stop until min_steps / min_epochs are met: a signal
        # overrides them for this fit (the resumed run gets them back from its command line).
        trainer.fit_loop.min_epochs = None
        trainer.fit_loop.epoch_loop.min_steps = None
        trainer.fit_loop.epoch_loop._skip_next_val = True  # Lightning's own flag: no validation after this step
        self.signal, self.checkpoint = signum, path
        text = f"{signal_label(signum)}: stopped after optimizer step {step}, saved to {path}\n"
        if path is None:
            text = f"{signal_label(signum)}: stopped after optimizer step {step}; fast_dev_run saves no checkpoint"
        elif self.requeued:
            text += "the SLURM job is requeued and resumes from there by itself"
        else:
            text += f"resume with: {resume_command(path)}"
        bar = trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar) and bar.is_enabled and trainer.is_global_zero:
            bar.print(text)  # above the bar (tqdm.write), not into its line
        else:
            rank_zero_info(text)

    def _requeue(self, trainer: L.Trainer, signum: int) -> str:
        """Lightning's SLURM requeue (save ``hpc_ckpt_<n>.ckpt``, ``scontrol requeue``), at the step
        boundary; the older hpc checkpoints are removed once the new one is written."""
        connector = trainer._checkpoint_connector  # Lightning's requeue handler saves where this says
        folder = str(trainer.default_root_dir)
        path = connector.hpc_save_path(folder)
        older = [os.path.join(folder, f) for f in os.listdir(folder)] if os.path.isdir(folder) else []
        trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)
        trainer.strategy.barrier("hpc_checkpoint_written")
        for old in older:
            name = os.path.basename(old)
            if name.startswith("hpc_ckpt_") and name.endswith(".ckpt") and old != path:
                trainer.strategy.remove_checkpoint(old)
        self.requeued = True
        return path

    @staticmethod
    def _fallback_path(trainer: L.Trainer, checkpoints: list[ModelCheckpoint]) -> str:
        dirpath = next((cb.dirpath for cb in checkpoints if cb.dirpath), None)
        if dirpath is None:
            log_dir = trainer.log_dir if trainer.loggers else None  # log_dir is collective: every rank asks
            dirpath = os.path.join(log_dir, "checkpoints") if log_dir else trainer.default_root_dir
        return os.path.join(dirpath, FALLBACK_NAME)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore(trainer)
        self._release_group()
        if self.signal is None:
            _spend_requeue_checkpoint(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore(trainer)
        self._release_group()
        if trainer.state.fn == TrainerFn.FITTING:
            say_newest_checkpoint(trainer, self._started_at)

    def _release_group(self) -> None:
        """Destroy the gloo group of the agreement now: its worker threads, joined when the group is
        freed, would otherwise end during interpreter shutdown, where one that frees a tensor takes
        the GIL and aborts the process (``terminate called without an active exception``)."""
        made_here = self._group_world is not None and dist.is_available() and dist.is_initialized()
        if made_here and self._group_world is dist.group.WORLD:  # a world destroyed since took it along
            dist.destroy_process_group(self._group)
        self._group = self._group_world = None

    def _restore(self, trainer: L.Trainer) -> None:
        """Put the previous handlers back, unless something replaced ours since (Lightning ignores
        SIGINT while it shuts down after a KeyboardInterrupt)."""
        for signum, previous in self._installed.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._installed = {}
        trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def say_newest_checkpoint(trainer: L.Trainer, started_at: int | None) -> None:
    """A fit stopped by an error (a callback's, a rank lost, a second Ctrl-C during a save) after it trained a step
    (``started_at``: the step it started from) ends in its traceback alone: say which checkpoint holds the run and
    how to resume it (one saved since, or the one it resumed from), or that none was saved (the steps are lost).
    Nothing where no step was trained (an error at set-up or in the restore: the run is where it was)."""
    step = trainer.global_step
    if started_at is None or step <= started_at:
        return
    saved = [
        (cb._last_global_step_saved, path)
        for cb in trainer.checkpoint_callbacks
        if isinstance(cb, ModelCheckpoint) and cb._last_global_step_saved > started_at
        for path in (cb._last_checkpoint_saved, cb.last_model_path)
        if path and os.path.exists(path)
    ]
    if not saved and trainer.ckpt_path and os.path.exists(trainer.ckpt_path):
        saved = [(started_at, trainer.ckpt_path)]
    if not saved:
        rank_zero_info(
            f"the run stopped on an error at optimizer step {step} with no checkpoint saved: its steps are lost"
        )
        return
    at, path = max(saved, key=lambda x: (x[0], os.path.getmtime(x[1])))
    rank_zero_info(
        f"the run stopped on an error at optimizer step {step}; its newest checkpoint, {path}, holds step {at} "
        f"(the steps after it train again): once mended, resume with: {resume_command(path)}"
    )


def _spend_requeue_checkpoint(trainer: L.Trainer) -> None:
    """A run that resumed from a SLURM requeue checkpoint (``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``) and ended
    without a signal removes it: Lightning resumes any such file there by itself under SLURM, and ``--ckpt_path auto``
    finds it, so a later run of another config in the same folder continued this one's, silently."""
    resumed = trainer.ckpt_path
    if not resumed or "://" in str(resumed):
        return
    path = Path(resumed)
    if path.name.startswith("hpc_ckpt_") and path.parent.resolve() == Path(trainer.default_root_dir).resolve():
        trainer.strategy.remove_checkpoint(str(path))
        rank_zero_info(f"training ended: the SLURM requeue checkpoint it resumed from, {path}, is removed")


def _note_sigterm(connector: Any, signum: int, frame: Any) -> None:
    """Lightning's ``_sigterm_notifier_fn`` without its broadcast: the launcher's processes told once, the signal
    recorded for the loops, which stop at their next check (``SIGTERMException``)."""
    launcher = connector.trainer.strategy.launcher
    if not connector.received_sigterm and launcher is not None:
        launcher.kill(signum)
    connector.received_sigterm = True


def _nothing() -> None:
    return None


def _signal_number(name: str) -> int:
    """``signal.SIGTERM`` for ``"SIGTERM"`` (or ``"TERM"``); a short error for a signal that is
    unknown here or cannot be handled."""
    key = name if str(name).upper().startswith("SIG") else f"SIG{name}"
    try:
        signum = signal.Signals[str(key).upper()]
    except KeyError:
        raise ConfigError(f"InterruptCheckpoint signals: {name!r} is not a signal of this system") from None
    if signum in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError(f"InterruptCheckpoint signals: {signum.name} cannot be handled by a process")
    return int(signum)


def _requeue_signal(trainer: L.Trainer) -> int | None:
    """The signal Lightning requeues a SLURM job on, when it is set to (``auto_requeue``)."""
    environment = trainer._accelerator_connector.cluster_environment  # the trainer has no public accessor
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
        return int(environment.requeue_signal)
    return None


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
