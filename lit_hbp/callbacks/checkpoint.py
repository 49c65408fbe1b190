"""FinalCheckpoint: the end of fit leaves a checkpoint of the final optimizer step.

Lightning's ModelCheckpoint saves ``last.ckpt`` only together with a scheduled save
(``every_n_train_steps``, an epoch end, a validation), and its ``on_train_end`` writes ``last`` only
when it never wrote one. With ``every_n_train_steps=20`` and ``max_steps=150`` the last checkpoint
holds step 140 and the final 10 optimizer steps are lost.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn


class StepEndCallback(L.Callback):
    """A callback that acts at the end of an optimizer step (the last micro-batch of an accumulation)
    and after the checkpoint callbacks' own hooks, so a save they make at that step comes first."""

    _step_before = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning runs the checkpoint callbacks last: run after them.
        trainer.callbacks = [c for c in trainer.callbacks if c is not self] + [self]

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_before = trainer.global_step

    def stepped(self, trainer: L.Trainer) -> bool:
        """Whether the micro-batch that just ended completed an optimizer step."""
        return trainer.global_step > self._step_before


class FinalCheckpoint(StepEndCallback):
    """Make every checkpoint callback that keeps a latest checkpoint hold the run's final step.

    For each ``ModelCheckpoint`` of the trainer that did not save at the final step:
    ``save_last`` set: ``last.ckpt`` is written at the final step; no ``save_last``, no ``monitor``
    and ``save_top_k`` 1 (the checkpoint callback Lightning adds by default, which keeps the latest
    checkpoint) or -1 (every step it saves): its checkpoint is written at the final step. A callback that ranks
    checkpoints by a monitored metric and keeps no last one is left alone: the final step has no
    fresh value of that metric to rank it by. One with a last one that ranks at the epoch's end still ranks
    the final step there, as Lightning does, but does not write ``last.ckpt`` again after the epoch closed.

    When ``max_steps`` ends the run, or it is stopped (``trainer.should_stop``: ``max_time``, early stopping,
    a callback; a stop asked inside an optimizer step is held until the step's end, where Lightning validates
    once more, as after any stop asked there: a second ``val/loss``, of the final weights), the save happens at that
    step's end (in ``on_train_batch_end`` / ``on_validation_end``, after the checkpoint callbacks' own hooks),
    as a scheduled ``every_n_train_steps`` save would: a checkpoint written later, after Lightning has closed
    the epoch, would resume at the next epoch and skip the rest of this one (a resume refuses one). So is the
    last step of a run that ends with its last epoch (``max_epochs``), before Lightning closes the epoch; what
    ends otherwise at an epoch's end (early stopping there) is saved in ``on_train_end``.
    A resume from this checkpoint with the same ``max_steps`` trains nothing more. In a run ``max_steps`` bounds,
    what a callback without a monitor saves at an epoch's end is saved at that epoch's last step's end too
    (``save_epoch_end``): written after Lightning closed the epoch, no resume can continue it exactly.

    The CLI adds this callback; in a plain Lightning project add it to ``Trainer(callbacks=...)``.
    """

    def __init__(self) -> None:
        self._saved_at: dict[int, int] = {}  # id(ModelCheckpoint) -> global step this callback saved it at
        self._held = False  # a stop asked inside an optimizer step, held until the step's end
        self._last_held: dict[int, tuple[ModelCheckpoint, Any]] = {}  # id -> (callback, its save_last), until the end

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stopping = (trainer.should_stop or self._held) and trainer.fit_loop._can_stop_early  # min_steps/epochs met
        if stopping and not self.stepped(trainer):
            self._hold(trainer)  # max_time's Timer asks at any micro-batch: stop at the step's end instead
            return
        if stopping:
            trainer.should_stop, self._held = True, False
        ends = trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step
        if self.stepped(trainer) and (ends or stopping or self.last_epoch_ends(trainer)):
            self.save_final(trainer)
        elif self.stepped(trainer) and trainer.fit_loop._iteration_based_training():
            if trainer.fit_loop.epoch_loop._num_ready_batches_reached():
                self.save_epoch_end(trainer)

    @staticmethod
    def save_epoch_end(trainer: L.Trainer) -> None:
        """At the last step of an epoch of a run ``max_steps`` bounds: what each ModelCheckpoint without a monitor
        would save at the epoch's end (Lightning's default one saves only there) is saved at the step's end, before
        Lightning closes the epoch. Written after, a resume trains the next epoch's micro-batches as this one's
        (plain Lightning too), and is refused: a run the default callback alone saved had no checkpoint to resume
        from. Its epoch-end hook then finds the step saved."""
        for cb in trainer.checkpoint_callbacks:
            due = isinstance(cb, ModelCheckpoint) and cb.monitor is None and cb._should_save_on_train_epoch_end(trainer)
            every = getattr(cb, "_every_n_epochs", 0)
            if (
                not due
                or every < 1
                or (trainer.current_epoch + 1) % every
                or cb._should_skip_saving_checkpoint(trainer)
            ):
                continue
            candidates = cb._monitor_candidates(trainer)  # the calls of its own on_train_epoch_end
            cb._save_topk_checkpoint(trainer, candidates)
            cb._save_last_checkpoint(trainer, candidates)

    @staticmethod
    def last_epoch_ends(trainer: L.Trainer) -> bool:
        """Whether the micro-batch that just ended is the last of the run's last epoch (``max_epochs``): its step is
        saved at its end, as Lightning's ``every_n_train_steps`` saves it (``epoch=N-1-step=M``, the epoch Lightning
        stores N-1). Saved after Lightning closed the epoch it was ``epoch=N-step=M`` (the epoch stored N), which a
        run that also has a ``max_steps`` resumed with no micro-batch of epoch N (Lightning's own ``last.ckpt``
        written at ``on_train_end`` too)."""
        last = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1
        return last and trainer.fit_loop.epoch_loop._num_ready_batches_reached()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        in_fit = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        if not (trainer.should_stop and in_fit and trainer.fit_loop._can_stop_early):  # early stopping, at last
            return
        if trainer.fit_loop.epoch_loop.batch_progress.current.processed % trainer.accumulate_grad_batches:
            self._hold(trainer)  # a validation inside an optimizer step
        else:
            self.save_final(trainer)

    def _hold(self, trainer: L.Trainer) -> None:
        """Hold a stop asked inside an optimizer step until the step's end, where it is saved: a checkpoint
        written inside it lacks the gradient its first micro-batches accumulated (a resume refuses it)."""
        trainer.should_stop, self._held = False, True

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.give_back_last()

    def give_back_last(self) -> None:
        """Each ModelCheckpoint's ``save_last`` as it was, where ``save_final`` held it back until the run's end."""
        for cb, save_last in self._last_held.values():
            cb.save_last = save_last
        self._last_held = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.give_back_last()  # the run's last epoch-end hooks ran (Lightning calls checkpoint callbacks' last)
        self.save_final(trainer)

    def save_final(self, trainer: L.Trainer) -> list[str]:
        """Save the current step into every checkpoint callback that keeps a latest checkpoint and
        has not saved this step; return the paths written (every rank calls it: ZeRO saves are
        collective)."""
        step = trainer.global_step
        epoch = trainer.fit_loop.epoch_progress.current
        open_epoch = epoch.processed < epoch.started  # at a step's end: Lightning has not closed the epoch yet
        written: list[str] = []
        if step == 0 or trainer.fast_dev_run:  # a dev run: Lightning suppresses checkpointing, so does this
            return written
        # ModelCheckpoint has no public "save now": these are the methods its own hooks call.
        for cb in trainer.checkpoint_callbacks:
            if not isinstance(cb, ModelCheckpoint):
                continue
            if cb._last_global_step_saved == step or self._saved_at.get(id(cb)) == step:
                continue
            keeps_latest = cb.monitor is None and cb.save_top_k != 0  # the newest (1) or every step it saved (-1)
            if not cb.save_last and not keeps_latest:
                continue
            previous = cb._last_global_step_saved
            candidates = cb._monitor_candidates(trainer)
            if cb.save_last:
                if cb.save_last == "link":
                    # A link would point at the latest scheduled checkpoint, an older step: write the file.
                    cb._last_checkpoint_saved = ""
                    _unlink_if_link(trainer, cb.last_model_path)
                cb._save_last_checkpoint(trainer, candidates)
                written.append(cb.last_model_path)
            else:
                cb._save_topk_checkpoint(trainer, candidates)
                written.append(cb.best_model_path)
            if cb.monitor is not None:
                # A callback that ranks by a metric keeps its schedule: a validation right after this step, or the
                # epoch's end, still ranks this step by the metric it brings (the epoch's mean, a fresh val/loss).
                # One without a metric has this step saved: its epoch-end hook must not write it again after
                # Lightning closed the epoch (a resume would then skip the rest of the epoch).
                cb._last_global_step_saved = previous
                if cb.save_last and open_epoch and cb._should_save_on_train_epoch_end(trainer):
                    # its epoch-end ranking would also write last.ckpt again, after the epoch closed: held back
                    # until the run's end (this is its final step)
                    self._last_held[id(cb)] = (cb, cb.save_last)
                    cb.save_last = False
            self._saved_at[id(cb)] = step
        return written


def _unlink_if_link(trainer: L.Trainer, path: str) -> None:
    """Remove a symbolic link before a checkpoint is written at its path (writing would go through
    it into the checkpoint it points at)."""
    if trainer.is_global_zero and path and os.path.islink(path):
        os.remove(path)
    trainer.strategy.barrier("final_checkpoint_unlink")
