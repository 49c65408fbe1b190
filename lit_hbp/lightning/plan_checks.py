"""The Trainer's settings against the data module's epoch plans: how many micro-batches an optimizer step
accumulates in an epoch (the trainer's, or a ``GradientAccumulationScheduler``'s), how many of an epoch's
micro-batches Lightning runs and how many optimizer steps a run takes; the settings a plan cannot train exactly
(epochs of other lengths, validations and checkpoints inside an optimizer step, ranks that are not the plan's),
refused when the loader is built; and where a resumed run continues in its epoch's plan.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lit_hbp.errors import ConfigError
from lit_hbp.packing.packers import SEEDED_PACKERS


def accumulation_schedule(trainer: Any) -> tuple[dict[int, int], bool]:
    """({first epoch: micro-batches an optimizer step accumulates from it}, whether a
    ``GradientAccumulationScheduler`` set them): the trainer's from epoch 0, else the scheduler's, which sets the
    trainer's at each epoch's start (after that epoch's loader planned it)."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    schedule, scheduled = {0: trainer.accumulate_grad_batches}, False
    for c in getattr(trainer, "callbacks", []):  # a stand-in trainer may have none
        if isinstance(c, GradientAccumulationScheduler):  # the last one sets the trainer's last: it decides
            schedule, scheduled = dict(c.scheduling), True  # from epoch 0 (Lightning's callback adds {0: 1})
    return schedule, scheduled


def accumulation_at(trainer: Any, epoch: int) -> int:
    """The micro-batches an optimizer step of ``epoch`` accumulates."""
    schedule = accumulation_schedule(trainer)[0]
    return schedule[max(e for e in schedule if e <= epoch)]


def epoch_batches(limit: int | float, micro_steps: int) -> int:
    """The training batches of an epoch of ``micro_steps`` a rank that Lightning's fit loop runs under
    ``limit_train_batches`` (an int counts batches, a float is a share, ``True`` one batch)."""
    limit = int(limit) if isinstance(limit, bool) else limit
    return min(micro_steps, limit) if isinstance(limit, int) else int(micro_steps * limit)


def planned_optimizer_steps(trainer: Any) -> int | None:
    """The optimizer steps of a ``max_epochs`` run of an ``HBPDataModule``, epoch by epoch from each epoch's plan:
    Lightning counts the first epoch's times the epochs, which an accumulation scheduled by epoch or a seeded
    packer's draw (epochs of other lengths) makes too many or too few, and the schedule would end elsewhere than
    the run. None where Lightning's count is exact (every epoch planned alike) or the data is not lit-hbp's."""
    datamodule = getattr(trainer, "datamodule", None)
    if not hasattr(datamodule, "plan_for_epoch") or trainer.max_epochs is None or trainer.max_epochs < 1:
        return None
    epochs, limit = trainer.max_epochs, trainer.limit_train_batches
    schedule = accumulation_schedule(trainer)[0]
    if set(schedule.values()) == {trainer.accumulate_grad_batches} and datamodule.packer not in SEEDED_PACKERS:
        return None  # (a scheduler's one accumulation is not yet the trainer's: Lightning counts it as 1)
    bound = trainer.max_steps if trainer.max_steps >= 0 else math.inf
    key = (epochs, limit, bound, tuple(sorted(schedule.items())), datamodule.seed, trainer.world_size)

    def count() -> int:
        if epochs > 20:  # ~0.05 s a plan of 100K samples: say what the set-up is doing
            rank_zero_info(f"counting the optimizer steps of {epochs} epochs' plans for the learning-rate schedule")
        steps = 0
        for epoch in range(epochs):
            if steps >= bound:
                break
            batches = epoch_batches(limit, datamodule.plan_for_epoch(epoch, say=False).n_micro_steps)
            steps += math.ceil(batches / accumulation_at(trainer, epoch))
        datamodule.plan_for_epoch(trainer.current_epoch, say=False)  # the one the loader plans next, kept
        return int(min(steps, bound))

    return datamodule.counted_once(key, count)


def check_data_trainer(trainer: Any, stage: str, packer: str, validates: bool) -> None:
    """What every Trainer an ``HBPDataModule`` is set up under must allow, checked at each set-up (a data module
    given to a second Trainer too): ranks are the plan's, not a distributed sampler's; no overfit loader; a fit's
    epochs, validation interval, accumulation windows and checkpoints that fall where the plan's steps end."""
    connector = getattr(trainer, "_accelerator_connector", None)
    if connector is None:  # no Trainer, or a stand-in
        return
    if connector.use_distributed_sampler:
        raise ConfigError("HBPDataModule assigns data to ranks itself: set Trainer(use_distributed_sampler=False)")
    if trainer.overfit_batches:
        raise ConfigError(
            f"trainer.overfit_batches must be 0 with HBPDataModule, got {trainer.overfit_batches!r}: "
            "its loader plans packs, levels and ranks, which Lightning's sequential overfit loader would "
            "replace; use limit_train_batches to train on a few batches"
        )
    accumulate = trainer.accumulate_grad_batches
    if isinstance(accumulate, bool) or not isinstance(accumulate, int):  # Lightning 1.x's {epoch: n} is no more
        raise ConfigError(
            f"trainer.accumulate_grad_batches must be an int, got {accumulate!r}: schedule it by epoch with "
            "lightning.pytorch.callbacks.GradientAccumulationScheduler"
        )
    if stage == "fit":
        check_epoch_lengths(trainer, packer)
        check_validation_interval(trainer)
        check_accumulation_windows(trainer)
        check_checkpoint_positions(trainer, validates)


def check_epoch_lengths(trainer: Any, packer: str) -> None:
    """Before the data is read: an epoch whose plan may have another number of micro-steps than the first's
    (a seeded packer's draw, an accumulation scheduled by epoch) needs its loader rebuilt, which Lightning
    does only with ``reload_dataloaders_every_n_epochs=1``; else the loader's length is the first epoch's."""
    t = trainer
    if t.reload_dataloaders_every_n_epochs == 1 or t.max_epochs == 1:
        return
    why = []
    if packer in SEEDED_PACKERS:
        why.append(f"data.packer {packer!r} draws each epoch's packs anew")
    if len(set(accumulation_schedule(t)[0].values())) > 1:
        why.append("a GradientAccumulationScheduler changes the micro-steps per optimizer step")
    if why:
        raise ConfigError(
            f"trainer.reload_dataloaders_every_n_epochs is {t.reload_dataloaders_every_n_epochs} but "
            f"{' and '.join(why)}, so an epoch after the first may have another length than its loader: set "
            "Trainer(reload_dataloaders_every_n_epochs=1) (the CLI's default)"
        )


def check_validation_interval(trainer: Any, micro_steps: int | None = None) -> None:
    """An int ``val_check_interval`` larger than the epoch's training batches, with validation by epoch: Lightning
    stops with a traceback once the loader is built, after the data is tokenized. Refused by name before the data
    is read when ``limit_train_batches`` (an int) already says so, else once the plan's ``micro_steps`` are
    known, on the condition Lightning's fit loop checks (``limit_train_batches`` applied as it applies it)."""
    t, interval = trainer, getattr(trainer, "val_check_interval", None)  # a stand-in trainer: not asked
    if not isinstance(interval, int) or isinstance(interval, bool) or t.check_val_every_n_epoch is None:
        return
    if getattr(t, "_val_check_time_interval", None) is not None or not t.limit_val_batches > 0:
        return
    limit = t.limit_train_batches
    if micro_steps is None:
        if not isinstance(limit, int) or interval <= limit:
            return
        batches, why = limit, f"trainer.limit_train_batches is {limit}"
    else:
        batches = epoch_batches(limit, micro_steps)
        if interval <= batches or batches == 0:
            return
        limited = f" ({micro_steps} before limit_train_batches {limit})" if batches != micro_steps else ""
        why = f"this epoch's plan has {batches} micro-batches a rank{limited}"
    raise ConfigError(
        f"trainer.val_check_interval is {interval} batches but {why}, so validation would never run within an "
        "epoch (Lightning stops on it): give a smaller val_check_interval, a float (a share of the epoch), or "
        "check_val_every_n_epoch: null to count batches across epochs"
    )


def check_accumulation_windows(trainer: Any, micro_steps: int | None = None, accumulate: int | None = None) -> None:
    """An epoch that ``limit_train_batches`` ends inside an optimizer step: Lightning steps on the cut window (or,
    under DeepSpeed, carries it into the next epoch's step), whose micro-batches are normalized by the tokens of
    the whole planned step, so that step trains on a silently smaller (or mixed) loss. Refused by name, unless
    ``max_steps`` ends the run first: an int limit that is not a multiple of every accumulation of the fit (a
    ``GradientAccumulationScheduler``'s too) before the data is read, a float one once the plan's ``micro_steps``
    (of an epoch accumulating ``accumulate``) are known, ``limit_train_batches`` applied as Lightning's fit loop
    applies it."""
    limit = getattr(trainer, "limit_train_batches", None)  # a stand-in trainer: not asked
    if limit is None or getattr(trainer, "fast_dev_run", False):  # a smoke run: nothing it trains is kept
        return
    limit = int(limit) if isinstance(limit, bool) else limit  # Lightning reads True as 1 batch
    if micro_steps is None:
        if not isinstance(limit, int):
            return
        batches, why = limit, f"trainer.limit_train_batches is {limit}"
    else:
        batches = epoch_batches(limit, micro_steps)
        why = f"trainer.limit_train_batches {limit} cuts the epoch's {micro_steps} micro-batches a rank at {batches}"
    if accumulate is None:  # every accumulation of the epochs the run reaches
        schedule, scheduled = accumulation_schedule(trainer)
        epochs = getattr(trainer, "max_epochs", None)
        accumulations = {a for e, a in schedule.items() if epochs is None or epochs < 0 or e < max(epochs, 1)}
    else:
        accumulations, scheduled = {accumulate}, accumulation_schedule(trainer)[1]
    cut = sorted(a for a in accumulations if batches % a)
    steps = getattr(trainer, "max_steps", -1)
    if not cut or (steps >= 0 and steps * max(accumulations) <= batches):  # or the run ends before the cut
        return
    m = math.lcm(*accumulations)
    fits = sorted({max(batches // m * m, m), batches // m * m + m})
    by = "its GradientAccumulationScheduler" if scheduled else "trainer.accumulate_grad_batches"
    raise ConfigError(
        f"{why}, but an optimizer step accumulates {cut[-1]} micro-batches ({by}): the epoch would end inside a "
        "step, whose loss is normalized by the tokens of micro-batches it never trains; give a multiple of "
        f"{m} ({' or '.join(map(str, fits))})"
    )


def check_checkpoint_positions(
    trainer: Any, validates: bool = True, micro_steps: int | None = None, accumulate: int | None = None
) -> None:
    """A ``ModelCheckpoint`` that would save inside an optimizer step writes checkpoints no resume can continue
    exactly (``check_resumed_position`` refuses them, after the run that wrote them): one with
    ``train_time_interval`` (it saves at any micro-batch), or one saving at the end of validations that fall
    inside a step (an int ``val_check_interval`` not a multiple of the accumulation, one by time; a float one
    once the plan's ``micro_steps`` of an epoch accumulating ``accumulate`` are known), as Lightning's
    ``on_validation_end`` decides to save. ``validates``: whether the run has validation data."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if getattr(trainer, "fast_dev_run", False):  # a smoke run saves nothing
        return
    if accumulate is None:  # every accumulation of the epochs the run reaches
        schedule, scheduled = accumulation_schedule(trainer)
        epochs = getattr(trainer, "max_epochs", None)
        reached = [a for e, a in schedule.items() if epochs is None or epochs < 0 or e < max(epochs, 1)]
        accumulations = sorted(set(reached))
    else:
        accumulations, scheduled = [accumulate], accumulation_schedule(trainer)[1]
    if accumulations[-1] == 1:
        return
    by = "its GradientAccumulationScheduler" if scheduled else "trainer.accumulate_grad_batches"
    step = f"an optimizer step accumulates {accumulations[-1]} micro-batches ({by})"
    validates = validates and getattr(trainer, "limit_val_batches", 1) != 0
    interval = getattr(trainer, "val_check_interval", 1.0)
    by_time = getattr(trainer, "_val_check_time_interval", None) is not None
    if by_time:
        inside, every = True, "by time"
    elif isinstance(interval, int) and not isinstance(interval, bool):
        inside, every = any(interval % a for a in accumulations), f"every {interval} micro-batches"
    elif isinstance(interval, float) and interval < 1.0 and micro_steps is not None:
        batches = max(1, int(epoch_batches(trainer.limit_train_batches, micro_steps) * interval))
        inside, every = any(batches % a for a in accumulations), f"every {batches} micro-batches ({interval})"
    else:
        inside = False
    for cb in getattr(trainer, "callbacks", []):
        if not isinstance(cb, ModelCheckpoint):
            continue
        name = f"trainer callback {type(cb).__name__}"
        if cb._train_time_interval is not None:
            raise ConfigError(
                f"{name} saves every train_time_interval {cb._train_time_interval}, at whatever micro-batch it "
                f"falls, but {step}: a checkpoint saved inside a step cannot be resumed exactly (the gradient of "
                "its first micro-batches is in none). Save every_n_train_steps instead"
            )
        if not (inside and validates):
            continue
        on_epoch_end = cb._save_on_train_epoch_end
        if on_epoch_end is None:  # Lightning's default: after validations run more often than once an epoch
            on_epoch_end = not by_time and trainer.check_val_every_n_epoch == 1 and interval == 1.0
        # what on_validation_end saves: the top-k of an epoch trigger, a step trigger's save deferred until its
        # monitored metric is logged, a last checkpoint linked without a top-k to link to (written anew)
        saves = (cb._every_n_epochs >= 1 and cb.save_top_k != 0) or (
            cb.monitor is not None and bool(cb._every_n_train_steps)
        )
        saves = saves or (cb.save_last == "link" and cb.save_top_k == 0)
        if saves and not on_epoch_end:
            default = is_default_checkpoint(cb)
            if default:
                name = "Lightning's default ModelCheckpoint (trainer.enable_checkpointing adds it when none is given)"
            fix = (
                "add a ModelCheckpoint with save_on_train_epoch_end: true, or trainer.enable_checkpointing: false"
                if default
                else "save_on_train_epoch_end: true"
            )
            raise ConfigError(
                f"{name} saves after each validation, which runs {every} (trainer.val_check_interval), but {step}: "
                "a checkpoint saved inside a step cannot be resumed exactly. Give a val_check_interval that is a "
                f"multiple of {math.lcm(*accumulations)}, or {fix}"
            )


def is_default_checkpoint(cb: Any) -> bool:
    """Whether ``cb`` is a ``ModelCheckpoint()`` with every setting Lightning's default: the one
    ``enable_checkpointing`` adds when the trainer has none, which a user cannot find in their callbacks."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return (
        type(cb) is ModelCheckpoint
        and cb.dirpath is None
        and cb.filename is None
        and cb.monitor is None
        and cb.save_last is None
        and cb.save_top_k == 1
        and not cb._every_n_train_steps
        and cb._every_n_epochs == 1
        and cb._train_time_interval is None
        and cb._save_on_train_epoch_end is None
    )


def check_resumed_position(epoch: int, micro: int, batches: int, current_epoch: int, accumulate: int) -> None:
    """Refuse a checkpoint whose saved position a resume cannot continue exactly: one saved inside an optimizer
    step (the gradient its first micro-batches accumulated is in no checkpoint: a validation's save off the step
    boundary, ``train_time_interval``), or one saved after its run stopped mid-epoch and Lightning had closed the
    epoch (a resume would start the next epoch and never train the rest of this one)."""
    where = f"epoch {epoch}, micro-batch {micro} of {batches}"
    if micro % accumulate:
        raise ConfigError(
            f"cannot resume exactly from this checkpoint: it was saved inside an optimizer step ({where}, "
            f"accumulate_grad_batches {accumulate}), and the gradient of the step's first {micro % accumulate} "
            "micro-batch(es) is in no checkpoint. Resume from one saved at a step boundary (every_n_train_steps, a "
            "validation every multiple of accumulate_grad_batches micro-batches, the end of fit)"
        )
    if current_epoch != epoch:
        raise ConfigError(
            f"cannot resume exactly from this checkpoint: its run stopped in {where} and the checkpoint was written "
            f"after Lightning closed the epoch, so a resume would start epoch {current_epoch} and never train the "
            f"rest of epoch {epoch}. Resume from a checkpoint saved at the stopping step (FinalCheckpoint saves "
            "one there)"
        )


def planned_by(key: dict, epoch: int) -> dict:
    """What of a ``plan_key`` the plan of ``epoch`` depends on: not a level's ``ckpt_layers`` (more checkpointing
    is how a run that ran out of memory resumes), nor the curriculum after epoch 0 (it orders the first epoch only)."""
    out = {k: v for k, v in key.items() if k not in ("settings", "content")}  # named by a refusal, not compared
    out["levels"] = [[p, sp, *rest] for p, sp, _, *rest in key.get("levels") or []]
    if epoch > 0:
        out["warmup_steps"], out["short_levels"] = 0, None
    return out


def check_epoch_end_restart(trainer: Any, epoch: int, micro: int, batches: int) -> None:
    """A checkpoint written in ``on_train_epoch_end`` (an epoch-end ModelCheckpoint) of a run bounded by
    ``max_steps``, at the epoch's end or after the run stopped inside it (``max_steps``, ``max_time``): Lightning's
    fit loop resumes it with the next epoch's plan from the saved micro-batch on (plain Lightning does so too),
    training the next epoch's first micro-batches as the finished one's and every later epoch one plan ahead.
    Refused by name, unless nothing is left to train (Lightning then skips the fit)."""
    loop = trainer.fit_loop
    done = loop.epoch_progress.current
    if not (loop._iteration_based_training() and done.processed == done.started == done.completed + 1):
        return
    steps, epochs = trainer.max_steps, trainer.max_epochs
    if 0 <= steps <= trainer.global_step or (epochs is not None and 0 <= epochs <= done.processed):
        return
    where = (
        f"at the end of epoch {epoch}"
        if micro >= batches
        else f"after its run stopped in epoch {epoch} at micro-batch {micro} of {batches} and Lightning closed it"
    )
    raise ConfigError(
        f"cannot resume exactly from this checkpoint: it was written {where} (on_train_epoch_end) of a run bounded "
        "by trainer.max_steps, which Lightning resumes with the next epoch's micro-batches as that epoch's. Resume "
        "from one saved at the step (every_n_train_steps, a validation's save, FinalCheckpoint), or bound the run by "
        "max_epochs"
    )


def check_unloaded_positions(datamodule: Any) -> None:
    """A checkpoint's loader position Lightning never handed the loader: it hands it only when it counts the saved
    epoch unfinished, and a run stopped inside an epoch (``should_stop``) closes it first, so the resume started
    the next epoch without a word. Checked at the epoch's first micro-batch (``check_resumed_position``)."""
    trainer = datamodule.trainer
    states = getattr(getattr(trainer, "fit_loop", None), "_combined_loader_states_to_load", None) or []
    for state in states:
        if isinstance(state, dict) and {"epoch", "micro_step"} <= state.keys():
            epoch, micro = state["epoch"], state["micro_step"]
            batches = epoch_batches(trainer.limit_train_batches, datamodule.plan_for_epoch(epoch).n_micro_steps)
            if micro < batches:
                check_resumed_position(epoch, micro, batches, trainer.current_epoch, accumulation_at(trainer, epoch))
                raise ConfigError(
                    f"the checkpoint's loader position (epoch {epoch}, micro-batch {micro} of {batches}) was never "
                    "handed to the loader, which would train the epoch from its first micro-batch: resume with "
                    "lit-hbp's HBPLitModule, or call lit_hbp.lightning.schedule.run_steps(trainer) where your "
                    "configure_optimizers reads trainer.estimated_stepping_batches"
                )


def restart_epoch_count(trainer: Any, carried: int) -> None:
    """A resume from the last step of an epoch: Lightning's fit loop moves on to the next epoch with the finished
    epoch's batch count, and resets it only when that count reaches the new epoch's length; a longer next epoch (a
    seeded packer's, an accumulation scheduled by epoch) was cut to the difference of the two. As the new epoch's
    first batch is fetched (its fetcher and progress then count the carried batches), the count restarts, as
    Lightning restarts it for an epoch at least as short."""
    loop = trainer.fit_loop.epoch_loop
    fetcher = trainer.fit_loop._data_fetcher
    if loop.batch_progress.current.ready != carried or fetcher is None:
        return  # reset by Lightning itself
    loop.batch_progress.reset_on_run()
    loop.scheduler_progress.reset_on_run()
    loop.automatic_optimization.optim_progress.reset_on_run()
    fetcher.fetched -= carried


def start_skipped_epoch(trainer: Any) -> None:
    """A resume from the last step of an epoch (saved at its last batch's end): Lightning's fit loop takes the
    restore for one inside that epoch, moves on to the next and skips its start: no ``on_train_epoch_start`` of
    any callback or the module (``PackingMetrics`` logged nothing of its plan), and the epoch counts ``ready`` and
    ``started`` one behind for the rest of the run (a later restore then misread). Here, as the next epoch's first
    batch is fetched, its start runs as Lightning's ``on_advance_start`` runs it for an epoch not resumed."""
    from lightning.pytorch.trainer import call

    loop = trainer.fit_loop
    progress = loop.epoch_progress.total
    if not loop.restarted_mid_epoch or progress.started != progress.processed:
        return  # Lightning started this epoch itself
    loop.epoch_progress.increment_ready()
    call._call_callback_hooks(trainer, "on_train_epoch_start")
    call._call_lightning_module_hook(trainer, "on_train_epoch_start")
    loop.epoch_progress.increment_started()
