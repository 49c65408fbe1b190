"""The data module's loader: the samples a micro-batch collates from (``StoreSamples``, with their images and
videos decoded by the checkpoint's processor in the loader's workers), the dataset that collates and
SP-shards the micro-batch its sampler names, the resumable sampler over an epoch's plan and the loader
Lightning checkpoints (``HBPDataModule`` builds them; a measured level search packs its probes through
``StoreSamples`` too).
"""

from __future__ import annotations

import math
import os
import signal
import threading
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, Sampler

from lit_hbp.data.batch import PackedBatch
from lit_hbp.data.collate import collate_packs
from lit_hbp.data.store import SampleStore
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.rng import set_rank_state
from lit_hbp.packing import Level, MicroBatch, Plan
from lit_hbp.packing.packers import SEEDED_PACKERS
from lit_hbp.parallel.kind import resolve_sp_kind
from lit_hbp.parallel.topology import sp_coords


class MediaInputs:
    """What a loader worker needs to turn a sample's image and video files into the model's inputs: the
    checkpoint's processor (pixels, grids) and, for a family whose positions depend on its media,
    the positions' function on the checkpoint's config (``lit_hbp.data.media``)."""

    def __init__(self, processor, config, token_types: bool):
        from lit_hbp.data.media import WorkerMedia, rope_stand_in
        from lit_hbp.data.media_batch import MRopePositions, pads_images

        self.media = WorkerMedia(processor, token_types)
        self.pad_images = pads_images(config)
        inner = rope_stand_in(config) if config is not None else None
        self.rope = MRopePositions(inner) if inner is not None else None


class StoreSamples:
    """A store's samples as ``collate_packs`` reads them: ids and supervised mask, and with ``inputs`` their
    images and videos as the processor's tensors (decoded at each call, in the process that collates) and the
    family's positions. The loader's dataset collates from it, and a measured level search packs its probes
    with the run's own samples through it (``lit_hbp.autoselect.measured``)."""

    def __init__(self, store: SampleStore, inputs: MediaInputs | None = None):
        self.store = store
        self.inputs = inputs if inputs is not None and store.has_media else None

    def tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.store.tokens(i)

    def media(self, i: int) -> dict:
        """Sample i's images and videos as the processor's tensors (none for a text sample)."""
        media = self.store.media(i)
        return self.inputs.media(self.store.tokens(i)[0], media, self.store.where(i)) if media else {}

    def batch(self, packs: list[np.ndarray], lv: Level, sp_rank: int, pad_id: int = 0, **plan) -> PackedBatch:
        """This SP rank's shard of the micro-batch of ``packs`` (arrays of sample ids), cut as the level ``lv``
        cuts it; ``plan``: the plan's fields (``collate_packs``: the level's index, its checkpointing, ...)."""
        media = {}
        if self.inputs is not None:
            inputs = self.inputs
            media = dict(media=self.media, rope=inputs.rope, where=self.store.where, pad_images=inputs.pad_images)
        batch = collate_packs(
            packs, self.tokens, sp=lv.sp, sp_kind=lv.sp_kind, cp=lv.layout[1], pad_id=pad_id, **plan, **media
        )
        return resolve_sp_kind(lv.sp_kind).shard(batch, lv.sp, sp_rank) if lv.sp > 1 else batch


def media_inputs(store: SampleStore, processor, config) -> MediaInputs | None:
    """The media inputs of a vision-language checkpoint's ``processor`` and ``config`` for ``store``: None when
    its samples have no images or videos, or the checkpoint no processor."""
    if processor is None or not store.has_media:
        return None
    return MediaInputs(processor, config, any(s.token_types for s in store.sources))


class MicroBatchDataset(Dataset):
    """Collates (and SP-shards) the micro-batch its sampler names. It holds no plan: the sampler, in
    the main process, reads the epoch's plan and hands each item over, so worker processes (started
    with a copy of this dataset) can never collate from a stale epoch's plan."""

    def __init__(
        self, store: SampleStore, levels: tuple[Level, ...], rank: int, pad_id: int, media: MediaInputs | None = None
    ):
        self.samples = StoreSamples(store, media)  # images decoded here, in the loader's worker
        self.levels, self.rank, self.pad_id = levels, rank, pad_id

    def __getitem__(self, item: tuple[int, int, MicroBatch]) -> PackedBatch:
        epoch, k, mb = item
        lv = self.levels[mb.level]
        plan = dict(
            level=mb.level,
            ckpt_layers=lv.ckpt_layers,
            offload=lv.offload,
            mlp_tiles=lv.mlp_tiles,
            loss_norm=mb.loss_norm,
            micro_index=k,
            epoch=epoch,
        )
        return self.samples.batch(mb.packs, lv, sp_coords(self.rank, lv.sp)[1], self.pad_id, **plan)


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
            raise ConfigError(
                f"{name} saves after each validation, which runs {every} (trainer.val_check_interval), but {step}: "
                "a checkpoint saved inside a step cannot be resumed exactly. Give a val_check_interval that is a "
                f"multiple of {math.lcm(*accumulations)}, or save_on_train_epoch_end: true"
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
    out = dict(key)
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


class PlanSampler(Sampler[tuple[int, int, MicroBatch]]):
    """This rank's micro-batches of the epoch, as (epoch, micro-step, MicroBatch); ``set_epoch``
    switches to that epoch's plan. Its length is always the whole epoch, and after a resume it
    starts at the first micro-step not yet trained."""

    def __init__(self, datamodule: Any, epoch: int, rank: int):  # an HBPDataModule
        self.dm, self.epoch, self.rank = datamodule, epoch, rank
        self.plan = datamodule.plan_for_epoch(epoch)
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            plan = self.dm.plan_for_epoch(epoch)
            if plan.n_micro_steps != len(self) and self.dm.trainer_setting("reload_dataloaders_every_n_epochs") != 1:
                raise RuntimeError(
                    f"the plan of epoch {epoch} has {plan.n_micro_steps} micro-steps but the loader was built for "
                    f"{len(self)}; with the randomized packer {self.dm.packer!r} set "
                    "Trainer(reload_dataloaders_every_n_epochs=1) so the epoch length is re-read"
                )
            self.plan, self.epoch = plan, epoch
            self.start = 0
        pending = self.dm.resume_from
        if pending is not None and pending["epoch"] == epoch:
            self.start = pending["micro_step"]
            self.dm.resume_from = None

    def __len__(self) -> int:
        return self.plan.n_micro_steps

    def __iter__(self):
        # A generator: Lightning may create the iterator before it calls set_epoch (on a restart),
        # so the epoch's plan and start are read when the first index is drawn, not here.
        start, self.start = self.start, 0
        check_unloaded_positions(self.dm)
        for k in range(start, len(self)):
            yield self.epoch, k, self.plan.micro_batch(self.rank, k)


class PlanLoader(DataLoader):
    """A DataLoader Lightning recognizes as resumable (it has state_dict / load_state_dict)."""

    def __init__(self, datamodule: Any, dataset: MicroBatchDataset, sampler: PlanSampler, **kwargs):  # an HBPDataModule
        self.dm = datamodule
        super().__init__(dataset, sampler=sampler, batch_size=None, **kwargs)

    def __iter__(self):
        return self._batches()

    def _batches(self):
        """The loader's batches, built when the fit loop fetches the first (after ``on_train_start``, the epoch's
        start and its ``set_epoch``; Lightning builds a restarted fit's iterator before those, and its workers
        would draw the indices of the epoch the loader was built for), after setting what that micro-batch
        needs, in the main process: the epoch's accumulation, which a restart never hands a
        ``GradientAccumulationScheduler`` (it skips its first epoch's start), and a resumed run's generators as
        they were after the checkpoint's step (``HBPDataModule.load_state_dict``), its checkpoint callbacks told
        that step is saved (a ``ModelCheckpoint`` holds no such state: it saved the step again at the first
        micro-batch, inside a step, over the file resumed from)."""
        trainer = self.dm.trainer
        if trainer is not None:
            trainer.accumulate_grad_batches = accumulation_at(trainer, self.sampler.epoch)
        rng, self.dm.resume_rng = self.dm.resume_rng, None
        if rng is not None and trainer is not None:
            if rng:
                set_rank_state(rng)
            from lightning.pytorch.callbacks import ModelCheckpoint

            for cb in trainer.callbacks:
                if isinstance(cb, ModelCheckpoint):
                    cb._last_global_step_saved = max(cb._last_global_step_saved, trainer.global_step)
        carried, self.dm.carried_count = self.dm.carried_count, None
        if carried and trainer is not None:  # the fetcher and the epoch's progress have counted the restored position
            restart_epoch_count(trainer, carried)
        yield from super().__iter__()

    def state_dict(self) -> dict:
        trainer = self.dm.trainer
        trained = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        epoch = self.sampler.epoch
        batches = epoch_batches(trainer.limit_train_batches, len(self.sampler))  # the epoch's plan's micro-batches
        return {"epoch": epoch, "micro_step": int(trained), "batches": batches, "plan": self.dm.plan_key(epoch)}

    def load_state_dict(self, state: dict) -> None:
        saved, now = state.get("plan"), self.dm.plan_key(state["epoch"])
        a, b = (None, None) if saved is None else (planned_by(saved, state["epoch"]), planned_by(now, state["epoch"]))
        if a != b:
            changed = ", ".join(f"{k}: {saved.get(k)} -> {now.get(k)}" for k in b if a.get(k) != b.get(k))
            raise ConfigError(
                f"cannot resume from this checkpoint: the plan of its epoch {state['epoch']} was made with other "
                f"settings ({changed}); its micro-step would point into a different plan and train samples twice or "
                "never (a resume plans that epoch again to find where it stopped, also after its last step). Resume "
                "with the same data, levels, world size, accumulate_grad_batches and seed, or start a new run from "
                "the exported model."
                + (
                    f" Its data seed was {saved.get('seed')}: set data.seed {saved.get('seed')} (without it a run "
                    "takes seed_everything's, and the command line a checkpoint path's)"
                    if saved.get("seed") != now.get("seed")
                    else ""
                )
            )
        trainer, epoch, micro = self.dm.trainer, state["epoch"], state["micro_step"]
        batches = epoch_batches(trainer.limit_train_batches, self.dm.plan_for_epoch(epoch).n_micro_steps)
        saved = state.get("batches", batches)  # the epoch's micro-batches when it was saved (its limit's)
        if batches <= micro < saved:
            raise ConfigError(
                f"cannot resume from this checkpoint with trainer.limit_train_batches {trainer.limit_train_batches}: "
                f"it was saved at micro-batch {micro} of epoch {epoch}, whose end the limit now puts at {batches}, "
                f"before it (Lightning would train the epoch again from its start); give a limit above {micro} (the "
                f"checkpoint's run had {saved} micro-batches in the epoch)"
            )
        check_epoch_end_restart(trainer, epoch, micro, batches)
        if micro < saved:
            check_resumed_position(epoch, micro, batches, trainer.current_epoch, accumulation_at(trainer, epoch))
        rank_zero_info(self.resume_message(state, now))
        if micro >= saved:  # saved at the end of its epoch: the next epoch starts from its beginning
            self.dm.carried_count = micro  # which Lightning's fit loop may count as that epoch's first batches
            return
        self.dm.resume_from = dict(state)
        self.sampler.set_epoch(self.sampler.epoch)

    def resume_message(self, state: dict, key: dict) -> str:
        """Where a resumed run continues and the plan it re-creates, so a resume is never silent."""
        epoch, micro = state["epoch"], state["micro_step"]
        plan = self.dm.plan_for_epoch(epoch)
        trainer = self.dm.trainer
        step = trainer.global_step if trainer is not None else micro // key["accumulate"]
        levels = ", ".join(f"{p}:{sp}" + (f":{ck}" if ck else "") for p, sp, ck, *_ in key["levels"])
        recreated = (
            f"levels {levels}; world {key['world_size']}, accumulate {key['accumulate']}, "
            f"seed {key['seed']} + epoch {epoch}, packer {key['packer']}"
        )
        end = plan.n_micro_steps if trainer is None else epoch_batches(trainer.limit_train_batches, plan.n_micro_steps)
        end = state.get("batches", end)
        if micro >= end:
            return (
                f"resuming at optimizer step {step}: epoch {epoch} was trained to its end ({end} "
                f"micro-batches of its plan); the next epoch starts from its first micro-batch ({recreated})"
            )
        return (
            f"resuming at optimizer step {step}, epoch {epoch}, micro-batch {micro} of {plan.n_micro_steps} of the "
            f"epoch's plan ({recreated}); the {micro} micro-batches before it are not trained again"
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


class FixedPlanSampler(Sampler[tuple[int, int, MicroBatch]]):
    """Every micro-batch of a fixed plan for one rank (validation: the same plan every run)."""

    def __init__(self, plan: Plan, rank: int):
        self.plan, self.rank = plan, rank

    def __len__(self) -> int:
        return self.plan.n_micro_steps

    def __iter__(self):
        for k in range(len(self)):
            yield 0, k, self.plan.micro_batch(self.rank, k)


WORKER_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")  # a scheduler's, a launcher's: the main process decides


def leave_signals_to_main(worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: the worker leaves the signals that stop a run to the main process. A
    terminal's Ctrl-C and a signal to a whole process group (SLURM's ``scancel`` and ``srun --signal``, torchrun
    forwarding a SIGTERM, ``kill -TERM -<pgid>``) reach the workers too; one that died of it (torch's workers die
    of SIGTERM) failed the step ``InterruptCheckpoint`` lets finish, with nothing saved. SIGINT is ignored; SIGTERM,
    SIGUSR1 and SIGUSR2 are waited for by a thread of the worker, which ends the worker on a SIGTERM from its own
    main process (its loader's shutdown, multiprocessing's exit), as torch's own handler does, and leaves any other
    to the main process. The workers still end with the main process (torch's watchdog)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # macOS: torch's own SIGTERM handler stays
        return
    waited = {getattr(signal, name) for name in WORKER_SIGNALS}
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)  # every thread started from here on inherits it
    threading.Thread(target=_wait_for_signals, args=(waited, os.getppid()), daemon=True, name="signals").start()


def _wait_for_signals(waited: set[int], parent: int) -> None:
    while True:
        got = signal.sigwaitinfo(waited)
        if got.si_signo == signal.SIGTERM and got.si_pid == parent:
            os._exit(0)  # torch's worker handler: a SIGTERM from the main process ends the worker quietly
