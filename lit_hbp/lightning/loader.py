"""The data module's loader: the samples a micro-batch collates from (``StoreSamples``, with their images and
videos decoded by the checkpoint's processor in the loader's workers), the dataset that collates and
SP-shards the micro-batch its sampler names, the resumable sampler over an epoch's plan and the loader
Lightning checkpoints (``HBPDataModule`` builds them; a measured level search packs its probes through
``StoreSamples`` too).
"""

from __future__ import annotations

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
from lit_hbp.lightning.data_identity import data_changes, older_key_note, say_edited_sources
from lit_hbp.lightning.plan_checks import (
    accumulation_at,
    check_epoch_end_restart,
    check_resumed_position,
    check_unloaded_positions,
    epoch_batches,
    planned_by,
    restart_epoch_count,
    start_skipped_epoch,
)
from lit_hbp.lightning.rng import set_rank_state
from lit_hbp.packing import Level, MicroBatch, Plan
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
            start_skipped_epoch(trainer)
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
            changed = ", ".join(
                ", ".join(data_changes(saved, now)) or f"data: {a[k]} -> {b[k]}{older_key_note(saved)}"
                if k == "data"
                else f"{k}: {saved.get(k)} -> {now.get(k)}"
                for k in b
                if a.get(k) != b.get(k)
            )
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
        if saved is not None:
            say_edited_sources(saved, now)
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
