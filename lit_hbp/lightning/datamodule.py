"""HBPDataModule: sources -> tokenized samples -> per-epoch HBP plan -> this rank's micro-batches.

Every rank computes the same plan from the sample lengths (a pure function of the data, levels,
world size, accumulation and seed + epoch) and reads only its own micro-batches, so no data
placement is communicated and ``Trainer(use_distributed_sampler=False)`` is required. The loader
is resumable: a checkpoint records (epoch, micro-steps trained) and a resumed run continues with
exactly the batches an uninterrupted run would have seen next. The tokenizer (with the chat template the
run renders chats with) travels in every checkpoint (``state_dict``), so ``lit_hbp.export`` needs
neither the tokenizer folder nor the base model folder. One module on purpose (over 600 lines): Lightning's data
hooks, the state a resume restores and the plans they share live on the one object Lightning calls; what they
compute lives in ``lit_hbp.data`` and ``lit_hbp.packing``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lit_hbp.data.sources import Source, check_sources
from lit_hbp.data.store import OVER_LENGTH_FIX, SampleStore
from lit_hbp.data.tokenize import (
    TRAIN_ON,
    TokenizedSource,
    check_num_proc,
    id_bound,
    tokenize_source,
    tokenizer_fingerprint,
)
from lit_hbp.errors import ConfigError, DataError
from lit_hbp.lightning.data_identity import data_settings
from lit_hbp.lightning.loader import (  # noqa: F401  (public here too: their first home)
    FixedPlanSampler,
    MediaInputs,
    MicroBatchDataset,
    PlanLoader,
    PlanSampler,
    StoreSamples,
    leave_signals_to_main,
    media_inputs,
)
from lit_hbp.lightning.plan_checks import (  # noqa: F401  (public here too: their first home)
    accumulation_at,
    check_accumulation_windows,
    check_checkpoint_positions,
    check_data_trainer,
    check_validation_interval,
)
from lit_hbp.lightning.renderers import (  # noqa: F401  (public here too: their first home)
    PROCESSOR_FILES,
    load_processor,
    load_renderers,
    load_tokenizer,
    tokenizer_files,
    tokenizer_from_files,
)
from lit_hbp.lightning.resume_checks import check_held_out, check_same_validation, same_records
from lit_hbp.lightning.rng import every_rank_state
from lit_hbp.model.sp_media import WHOLE_ITEMS, split_items_problem
from lit_hbp.packing import DEFAULT_PACKER, PACKERS, Level, Plan, plan_hbp, validate_levels
from lit_hbp.packing.levels import LEVEL_FIELDS, LevelSelector, as_level
from lit_hbp.packing.plan import OVER_LENGTH
from lit_hbp.packing.vision_load import VisionLoad
from lit_hbp.parallel.kind import resolve_sp_kind
from lit_hbp.parallel.topology import layout_levels


class HBPDataModule(L.LightningDataModule):
    """Level-tagged, attention-balanced packed micro-batches for HBP training.

    Validation is planned with the training levels (balanced, no curriculum, the same plan every time)
    and sharded so every validation sample is evaluated once per run over ranks and SP groups.

    Args:
        sources: the training data, a list of paths or of mappings ``{path, format, file_type, repeat |
            weight, split, subset, fields, roles}`` (``--data.sources.help`` describes each field). path:
            a .jsonl file, a .json file (a JSON array or JSON Lines), .parquet, .arrow, a
            ``datasets.save_to_disk`` folder, or ``org/name`` of a Hub data set in the local cache.
            format: auto (by each record's fields) | openai ({"messages", "tools"}: tool calls, tool
            results, content parts, per-message weight 0/1) | sharegpt ({"conversations": [{"from",
            "value"}], "system", "tools"}) | alpaca ({"instruction", "input", "output", "system",
            "history"}) | prompt_response | text | tokens (pre-tokenized input_ids with labels or
            assistant_masks). fields renames a format's fields ({messages: dialog, role: speaker}),
            roles maps a data set's role names onto chat roles ({bot: assistant}).
        tokenizer: a local Hugging Face tokenizer folder, or a tokenizer in the Hugging Face cache by its
            name; its chat template renders chat records unless ``chat_template`` is given.
        levels: the HBP levels, e.g. ``["16K:1", "128K:8:28"]`` (PACK_LEN[:SP[:CKPT_LAYERS[:PACKS_PER_RANK]]],
            K = 1024) or mappings ``{pack_len: 16K, sp: 1, ckpt_layers: 0, packs_per_rank: 1, ulysses,
            cp, sp_kind}``; or a ``LevelSelector`` that chooses them at set-up for this model, data and
            world with the paper's auto-selection: ``lit_hbp.autoselect.AnalyticSelector`` (cost model)
            or ``MeasuredSelector`` (a few real training steps per candidate on the run's own world).
        packer: packing algorithm of every level: bfd (default) | ffd | ffs | greedy | isf | mffd |
            random | spfhp (``lit_hbp.packing.PACKERS``).
        over_length: samples longer than the largest level: error (default: stop, naming them) | drop |
            truncate (keep the window with the most supervised tokens: unsupervised tokens, such as the
            start of a long document, are cut first, the answer kept while it fits). Every dropped or
            truncated sample is counted in the log and listed in data_report.json.
        train_on: which turns of a chat train: assistant (default: every assistant turn, tool calls
            included) | last_assistant (the last assistant turn only) | all (every token); a message's
            ``weight`` (0 or 1) decides for its own turn.
        seed: seed of mixing and of the plan (epoch e plans with seed + e); None (default): the run's
            ``seed_everything`` (Lightning's ``PL_GLOBAL_SEED`` at construction, 0 without one), so a seed sweep
            draws other data orders, as a shuffled DataLoader would.
        cache_dir: where tokenized sources are cached (one cache a source, tokenizer and setting,
            written once by one process while every other rank and node waits on its lock: put it
            on a file system they share).
        num_workers: DataLoader worker processes for collation; None (default): 2 when training on
            a GPU, where batches are also pinned and prefetched so the copy overlaps the step, else 0.
        demo_dir: build the embedded demo data set and tokenizer here if missing
            (``python -m lit_hbp.demo.text``); the tiny configs point their sources at it.
        demo: which demo ``demo_dir`` holds: text (default) | vision (a tiny vision-language checkpoint
            folder and an image-chat data set, ``python -m lit_hbp.demo.vision``) | video (a tiny Qwen2-VL
            folder and chats with short videos, ``python -m lit_hbp.demo.video``; needs torchvision).
        val_sources: validation data (the same forms as ``sources``), every record once.
        val_fraction: also hold out this seeded fraction of the training records (every repeat and
            every copy of a held-out record, the same tokens on another line, leaves training) for validation.
        chat_template: the chat template to render chat records with, instead of the tokenizer's own: a
            Jinja string, a path to a template file, or a built-in name: tags | plain (each ends an
            assistant turn with the tokenizer's EOS). It is set on the tokenizer, which checkpoints and
            the export carry. A tokenizer without a template and no ``chat_template`` can tokenize only
            ``{"text"}`` and pre-tokenized records.
        num_proc: processes that tokenize a source; None (default): every core of the node for a
            source over 8 MB (a table: 8,192 rows; records with images or videos: 128 KB), the main process for a
            smaller one.
        processor_kwargs: a vision-language checkpoint's image (and video) processor settings instead of its
            folder's (``max_pixels``, ``size``, ``image_grid_pinpoints``: how many tokens an image becomes), each
            checked to be one the processor holds; checkpoints and the export carry the processor so set.
    """

    def __init__(
        self,
        sources: list[str | dict | Source],
        tokenizer: str,
        levels: list[Level | dict | str | int] | LevelSelector,
        packer: str = DEFAULT_PACKER,
        over_length: str = "error",
        train_on: str = "assistant",
        seed: int | None = None,
        cache_dir: str | None = "data_cache",
        num_workers: int | None = None,
        demo_dir: str | None = None,
        val_sources: list[str | dict | Source] | None = None,
        val_fraction: float = 0.0,
        chat_template: str | None = None,
        num_proc: int | None = None,
        demo: str = "text",
        processor_kwargs: dict | None = None,
    ):
        super().__init__()
        self.save_hyperparameters("tokenizer")  # in checkpoints: export writes the run's tokenizer
        if packer not in PACKERS:
            raise ConfigError(f"unknown packer {packer!r}; choose one of {sorted(PACKERS)}")
        if train_on not in TRAIN_ON:
            raise ConfigError(f"data.train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        if over_length not in OVER_LENGTH:  # before the data is tokenized, not after
            raise ConfigError(f"data.over_length must be one of {', '.join(OVER_LENGTH)}, got {over_length!r}")
        if not isinstance(cache_dir, (str, os.PathLike)) or not str(cache_dir).strip():  # null: not a temporary one
            raise ConfigError(
                f"data.cache_dir must be a folder for the tokenized data (it is read again by later runs), got "
                f"{cache_dir!r}"
            )
        if not sources:
            raise ConfigError("no data sources given")
        self.sources = [Source.of(s, f"sources[{i}]") for i, s in enumerate(sources)]
        self.val_sources = [Source.of(s, f"val_sources[{i}]") for i, s in enumerate(val_sources or [])]
        for s in self.val_sources:
            if s.repeat is not None or s.weight is not None:
                raise ConfigError(f"val_sources: {s.path} has a repeat or weight; validation reads every record once")
        if not 0 <= val_fraction < 1:
            raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.val_fraction = val_fraction
        self.selector: LevelSelector | None = None
        self._chosen: tuple[Level, ...] | None = None  # the selector's levels of the run a fit resumes
        if isinstance(levels, LevelSelector):
            self.selector, self.levels = levels, None
        elif isinstance(levels, str):
            raise ConfigError(
                f"levels must be a list of levels or a LevelSelector (e.g. lit_hbp.autoselect.AnalyticSelector), "
                f"got {levels!r}"
            )
        else:
            self.levels = tuple(as_level(x, f"data.levels[{i}]") for i, x in enumerate(levels))
            # Checked against the real world size at setup; here only what needs no world.
            validate_levels(self.levels, math.lcm(*(lv.sp for lv in self.levels)) if self.levels else 1)
            for i, lv in enumerate(self.levels):  # a level of sp 1 too: a misspelled kind would pass unseen
                try:
                    resolve_sp_kind(lv.sp_kind)
                except ValueError as e:
                    raise ConfigError(f"data.levels[{i}]: {e}") from None
        self.packer, self.over_length, self.train_on, self.seed = packer, over_length, train_on, data_seed(seed)
        if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 0):
            raise ConfigError(f"data.num_workers must be a whole number >= 0 (0: collate in the training process), "
                              f"got {num_workers!r}")  # fmt: skip
        self.cache_dir, self.num_workers = cache_dir, num_workers
        check_num_proc(num_proc)
        self.num_proc = num_proc
        from lit_hbp.demo import DEMOS, ensure_kind

        if demo not in DEMOS:
            raise ConfigError(f"data.demo must be one of {', '.join(DEMOS)}, got {demo!r}")
        if demo_dir is not None:
            ensure_kind(demo_dir, demo)
        elif demo != "text":  # the kind of a demo nothing builds
            raise ConfigError(f"data.demo: {demo} names the demo data.demo_dir builds, and no demo_dir is given")
        check_sources(self.sources, "sources")
        check_sources(self.val_sources, "val_sources", apart=self.sources)
        self.tokenizer, self.processor, self.model_config = load_renderers(tokenizer, chat_template, processor_kwargs)
        self.pad_id = next(x for x in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0) if x is not None)
        self.store: SampleStore | None = None
        self.val_store: SampleStore | None = None
        self._val_plan: Plan | None = None
        self.warmup_steps, self.short_levels = 0, None
        self.resume_from: dict | None = None
        self.resume_rng: dict | None = None  # this rank's generators at the checkpoint ({} none), until fetched
        self.carried_count: int | None = None  # a finished epoch's batch count Lightning carries into the next
        self._plans: dict[tuple[int, int], Plan] = {}  # (epoch, accumulation): the epoch's plan
        self._planned_steps: tuple | None = None  # (key, count): ``counted_once``'s
        self._told: tuple[int, int] | None = None  # (epoch, accumulation) of the plan whose summary was logged last
        self._set_up_for, self.held_out = 0, None  # the world size, the held-out records (``records_identity``)
        self.validation: dict | None = None  # the validation set's records (``records_identity``)

    @property
    def vocab_size(self) -> int:
        """Tokens the model's embedding must cover (linked to the model in the CLI)."""
        return id_bound(self.tokenizer)

    def state_dict(self) -> dict:
        """The tokenizer's files, chat template included, and a vision-language checkpoint's processor
        files: a checkpoint is then all an export needs. Every rank's generators (``lightning.rng``; a collective:
        a checkpoint is dumped on every rank), which a resumed fit sets as it fetches its first micro-batch."""
        state = {"tokenizer_files": tokenizer_files(self.tokenizer), "rng": every_rank_state(), "seed": self.seed,
                 "val_fraction": self.val_fraction, "held_out": self.held_out,
                 "validation": self.validation}  # fmt: skip
        if self.processor is not None:
            state["processor_files"] = tokenizer_files(self.processor)
        if self.selector is not None:  # what it chose: a search on resume may choose others (a measured one by time)
            state["selected_levels"] = [{f: getattr(lv, f) for f in LEVEL_FIELDS} for lv in self.levels or ()]
        return state

    def load_state_dict(self, state: dict) -> None:
        """A resumed run keeps the tokenizer it was given (its data are tokenized with it); one that
        differs from the checkpoint's is said, since the ids and the chat format would change mid-run. A fit
        takes this rank's generators of the checkpoint (``PlanLoader`` sets them); a validation holds out what the
        checkpoint held out (``check_held_out``); a resumed fit that validates on other records says so, or refuses
        where a callback ranks val/ scores (``check_same_validation``)."""
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == TrainerFn.VALIDATING and self.val_fraction:
            check_held_out(state, trainer._checkpoint_connector._loaded_checkpoint, self.seed, self.val_fraction,
                           self.held_out)  # fmt: skip
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._resume_selection(state.get("selected_levels"))
            if same_records(state.get("held_out"), self.held_out):  # else the plan's own checks refuse the resume
                check_same_validation(state.get("validation"), self.validation, trainer.callbacks)
            states = state.get("rng")
            self.resume_rng = states[trainer.global_rank] if len(states or ()) == trainer.world_size else {}
            if states is None or len(states) != trainer.world_size:
                why = (
                    "by an older lit-hbp"
                    if states is None
                    else f"by {len(states)} rank(s), this run has {trainer.world_size}"
                )
                rank_zero_info(
                    f"the checkpoint holds no random state of this run's ranks (saved {why}): dropout draws other "
                    "masks from here than the run it continues"
                )
        images = state.get("processor_files")
        if images and self.processor is not None and images != tokenizer_files(self.processor):
            rank_zero_warn(
                "the checkpoint was trained with other processor settings than data.tokenizer / "
                "data.processor_kwargs give now (images may become other token counts); this run goes on with these"
            )
        files = state.get("tokenizer_files")
        if not files:
            return
        with tempfile.TemporaryDirectory() as tmp:
            saved = tokenizer_fingerprint(tokenizer_from_files(files, tmp))
        if saved != tokenizer_fingerprint(self.tokenizer):
            rank_zero_warn(
                "the checkpoint was trained with another tokenizer (vocabulary, special tokens or chat template) "
                "than data.tokenizer / data.chat_template give now; where the samples keep their lengths, the run "
                "goes on with the new one and saves it"
            )

    def _resume_selection(self, saved: list | None) -> None:
        """A resumed fit plans with the levels its selector chose for the checkpoint's run: the search at this
        set-up may have chosen others (a measured search by its timings), whose plan the resume cannot continue.
        The data is set up again with them (its largest level decides over-long samples)."""
        chosen = tuple(as_level(x) for x in saved or ())
        if self.selector is None or not chosen or chosen == tuple(self.levels or ()):
            return
        rank_zero_info(
            f"data.levels: resuming with the levels {type(self.selector).__name__} chose for the checkpoint's run "
            f"({', '.join(f'{lv.pack_len}:{lv.sp}' for lv in chosen)}), not this set-up's search's"
        )
        self._chosen, self._set_up_for = chosen, None
        self.setup("fit")
        strategy = self.trainer.strategy
        if getattr(strategy, "sp_groups", None) is not None:  # set up before the restore (DeepSpeed's): again
            strategy.levels = strategy.prepare_levels(self.trainer)

    def set_curriculum(self, warmup_steps: int, short_levels: list[int] | None = None) -> None:
        """Plan the first epoch with ``warmup_steps`` steps of the short levels first (HBPCurriculum)."""
        self.warmup_steps, self.short_levels = int(warmup_steps), short_levels
        self._plans.clear()
        self._planned_steps, self._told = None, None

    def write_report(self) -> Path:
        """Write the data report (all skipped, dropped and truncated samples with their file and line)
        next to the run's logs, or into the cache folder without a logger; return its path."""
        log_dir = self.trainer.log_dir if self.trainer is not None and self.trainer.loggers else None
        path = Path(log_dir or self.cache_dir) / "data_report.json"
        if self.trainer is None or self.trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            report = self.store.final_report()
            if self.val_store is not None:
                report["validation"] = self.val_store.final_report()
            path.write_text(json.dumps(report, indent=1))
        return path

    def sharding_levels(self) -> tuple[Level, ...]:
        """The levels with the (ulysses, cp) layouts of the model being trained (``layout_levels``,
        as the strategy resolves them): the plan does not depend on them, the shards do."""
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        config = getattr(getattr(module, "model", None), "config", None)
        return self.levels if config is None else layout_levels(self.levels, config, self.trainer.num_devices)

    def plan_key(self, epoch: int | None = None) -> dict:
        """What the plan of ``epoch`` (the current one by default) depends on: a resumed run must plan the same
        (``settings`` and ``content`` name what changed, ``lightning.data_identity``)."""
        world, _, accumulate = self._world(epoch)
        data = hashlib.sha1(self.store.lengths.tobytes() + self.store.loss_tokens.tobytes()).hexdigest()[:16]
        return dict(
            world_size=world,
            accumulate=accumulate,
            seed=self.seed,
            packer=self.packer,
            levels=[[lv.pack_len, lv.sp, lv.ckpt_layers, lv.packs_per_rank] for lv in self.levels],
            warmup_steps=self.warmup_steps,
            short_levels=self.short_levels,
            samples=int(self.store.lengths.size),
            data=data,
            settings=data_settings(self),  # what made the samples; said, never compared, by a resume
            content=[ts.content for ts in self.store.sources],
        )

    def trainer_setting(self, name: str) -> Any:
        return getattr(self.trainer, name, None) if self.trainer is not None else None

    def _world(self, epoch: int | None = None) -> tuple[int, int, int]:
        """(world size, rank, micro-batches an optimizer step accumulates in ``epoch``, the current one by default):
        a ``GradientAccumulationScheduler`` sets the trainer's at the epoch's start, after its loader planned it."""
        t = self.trainer
        if t is None:
            return 1, 0, 1
        return t.world_size, t.global_rank, accumulation_at(t, t.current_epoch if epoch is None else epoch)

    def _tokenize(self, source: Source, label: str, progress: bool = True) -> TokenizedSource:
        return tokenize_source(
            source, self.tokenizer, self.train_on, self.cache_dir, progress, label=label, num_proc=self.num_proc,
            processor=self.processor,
        )  # fmt: skip

    def _media_inputs(self, store: SampleStore) -> MediaInputs | None:
        """The loader's media inputs when ``store`` has samples with images or videos."""
        return media_inputs(store, self.processor, self.model_config)

    def self_check_samples(self, n: int = 2) -> list[tuple[np.ndarray, dict]]:
        """The ``n`` shortest training samples with images or videos, as (ids, the processor's tensors):
        the self-check packs them beside its text documents, so the run's own media, processor and vision
        tower are checked too (the same samples on every rank). Empty without media."""
        store = self.store
        inputs = self._media_inputs(store) if store is not None else None
        if inputs is None:
            return []
        with_media = np.flatnonzero(store.media_counts() > 0)
        out = []
        for i in with_media[np.argsort(store.lengths[with_media], kind="stable")[:n]].tolist():
            ids = store.tokens(i)[0]
            out.append((ids, inputs.media(ids, store.media(i), store.where(i))))
        return out

    def tokenize_sources(self, progress: bool = True) -> list[TokenizedSource]:
        """Every training source tokenized (from its cache when it has one), in the order given."""
        return [self._tokenize(s, f"sources[{i}]", progress) for i, s in enumerate(self.sources)]

    def prepare_data(self) -> None:
        """Tokenize every source into the cache (Lightning calls it on one process per node; the cache
        lock makes the nodes take turns on a shared cache_dir)."""
        for field, sources in (("sources", self.sources), ("val_sources", self.val_sources)):
            for i, s in enumerate(sources):
                self._tokenize(s, f"{field}[{i}]")

    def setup(self, stage: str) -> None:
        """The data tokenized, held out and checked, once per world size: a data module set up again under a Trainer
        of another size (``ddp_spawn`` after a one-device try) plans its ranks, levels and validation set anew."""
        self.resume_rng = self.carried_count = None  # a checkpoint's are restored after this, for this fit only
        world, rank, _ = self._world()
        validates = bool(self.val_fraction or self.val_sources)
        check_data_trainer(self.trainer, stage, self.packer, validates)
        if stage == "validate" and not validates:
            raise ConfigError(
                "nothing to validate: the data has no validation split; set data.val_fraction (a share of the "
                "training records held out) or data.val_sources"
            )
        if self.store is not None and self._set_up_for == world:
            return
        tokenized = self.tokenize_sources(progress=rank == 0)
        store = SampleStore.build(tokenized, None, self.over_length, self.seed)
        if self.selector is not None:  # chosen for this world
            if self.trainer is None:
                raise ValueError(f"{type(self.selector).__name__} chooses levels for a run: set up through a Trainer")
            self.levels = self._chosen or self._selected_levels(store)
        validate_levels(self.levels, world)
        held = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        if self.val_fraction:
            store, *held = store.hold_out(self.val_fraction, self.seed)
        val = self._validation_store(tokenized, *held, rank)
        max_len = self.levels[-1].pack_len
        if self.over_length == "error":  # every over-long sample named at once: training's first, the most
            said = [store.over_length_said(max_len), val.over_length_said(max_len) if val is not None else None]
            if any(said):
                parts = [said[0], said[1] and f"and of the validation set: {said[1]}"]
                raise DataError("; ".join(p for p in parts if p) + f". {OVER_LENGTH_FIX}")
        before = store.lengths.size
        shifted = store.apply_over_length(max_len, self.over_length)
        if shifted:
            rank_zero_warn(shifted)
        if store.lengths.size == 0 and before:
            raise DataError(
                f"every training sample ({before}) is longer than the largest level ({max_len} tokens) and "
                f"data.over_length: {self.over_length} left none: add a larger level (data.levels)"
            )
        if val is not None:
            val.apply_over_length(max_len, self.over_length)
            if val.lengths.size == 0:
                raise DataError("the validation set is empty after its over-length samples were dropped")
        self.val_store = val
        self.held_out = store.records_identity(*held)
        none = dict(records=0, where="", what="")
        self.validation = val.records_identity(val.source_of, val.row_of) if val is not None else none
        if self.val_sources and self.val_store is not None:
            self.val_store.count_training_copies(store, len(tokenized))
        self.store, self._set_up_for, self._plans, self._val_plan = store, world, {}, None
        self._planned_steps, self._told = None, None
        summary = self.store.summary()
        if self.val_store is not None:
            summary += "\nvalidation " + self.val_store.summary()
        rank_zero_info(summary + f"\n  every skipped, dropped and truncated sample: {self.write_report()}")
        family = getattr(self.model_config, "model_type", None)
        if (
            stage in ("fit", "validate")
            and self.val_store is not None
            and self.val_store.has_media
            and (family in WHOLE_ITEMS)
        ):
            self.val_plan()  # its media on an SP level refused now, not at the first validation after steps trained

    def _validation_store(self, tokenized: list, held_src, held_rows, rank: int) -> SampleStore | None:
        """The validation samples, each once: the records held out of the training sources
        (``val_fraction``) and every record of ``val_sources``, over-length ones still in (``setup`` applies
        ``over_length`` to both sets)."""
        extra = [self._tokenize(s, f"val_sources[{i}]", rank == 0) for i, s in enumerate(self.val_sources)]
        if not held_src.size and not extra:
            return None
        src = np.concatenate([held_src] + [np.full(len(t), len(tokenized) + k, np.int64) for k, t in enumerate(extra)])
        rows = np.concatenate([held_rows] + [np.arange(len(t), dtype=np.int64) for t in extra])
        return SampleStore.from_rows(tokenized + extra, src, rows)

    def _selected_levels(self, store: SampleStore) -> tuple:
        """The selector's levels for ``store``, its images and videos counted (``vision_load``): a selector
        of one's own that takes no ``vision`` is refused for data with them; one that takes ``samples`` (a
        measured search) gets the samples too, to pack into its probes."""
        vision = self.vision_load(store)
        if vision is None:
            return tuple(self.selector.levels_for(store.lengths, self.trainer))
        takes = inspect.signature(self.selector.levels_for).parameters
        if "vision" not in takes:
            raise ConfigError(
                f"data.levels: {type(self.selector).__name__}.levels_for takes no vision argument, so it would choose "
                "levels without the vision tower's work and memory for this data's images and videos; accept "
                "vision=None (a lit_hbp.packing.VisionLoad) or give the levels"
            )
        samples = {"samples": StoreSamples(store, self._media_inputs(store))} if "samples" in takes else {}
        return tuple(self.selector.levels_for(store.lengths, self.trainer, vision=vision, **samples))

    def vision_load(self, store: SampleStore) -> VisionLoad | None:
        """Per sample of ``store``, the patches its images and videos give the tower and their work
        (``media.vision_load``): what the level search prices; None without images or a model config."""
        if not store.has_media or self.model_config is None:
            return None
        from lit_hbp.data.media import vision_load

        return vision_load(store.media_pixels(), self.model_config)

    def vision_work(self, store: SampleStore) -> np.ndarray | None:
        """Per sample of ``store``, its images' encoding in the planner's units (``media.vision_work``),
        so the balance weighs it beside attention; None without images or a model config."""
        if not store.has_media or self.model_config is None:
            return None
        from lit_hbp.data.media import vision_work

        return vision_work(store.media_pixels(), self.model_config)

    def counted_once(self, key: tuple, count: Callable[[], int]) -> int:
        """``count()`` of the plans (the run's optimizer steps, ``plan_checks.planned_optimizer_steps``), counted once
        for ``key`` until the data is planned anew (set up again, a curriculum set): the progress bar asks each
        epoch."""
        if self._planned_steps is None or self._planned_steps[0] != key:
            self._planned_steps = key, int(count())
        return self._planned_steps[1]

    def plan_for_epoch(self, epoch: int, say: bool = True) -> Plan:
        """The plan of ``epoch`` (curriculum warm-up in the first epoch only), its summary logged once (``say``
        False: not yet, the plan counted before its epoch, ``plan_checks.planned_optimizer_steps``)."""
        world, _, accumulate = self._world(epoch)
        if (epoch, accumulate) not in self._plans:
            if self.store is None:
                raise RuntimeError("HBPDataModule.setup() must run before planning")
            plan = plan_hbp(
                self.store.lengths,
                self.levels,
                world,
                accumulate,
                self.seed + epoch,
                self.packer,
                loss_tokens=self.store.loss_tokens,
                over_length="error",
                warmup_steps=self.warmup_steps if epoch == 0 else 0,
                short_levels=self.short_levels,
                extra_work=self.vision_work(self.store),
            )
            self._refuse_split_items(self.store, plan)
            self._plans = {(epoch, accumulate): plan}
        plan = self._plans[epoch, accumulate]
        if say and self._told != (epoch, accumulate):
            self._told = (epoch, accumulate)
            m = plan.metrics()
            rank_zero_info(
                f"epoch {epoch} {plan.summary()}\n  metrics: " + ", ".join(f"{k} {v:.4g}" for k, v in m.items())
            )
        return plan

    def _refuse_split_items(self, store: SampleStore, plan: Plan, what: str = "") -> None:
        """A plan putting media the family's SP call refuses on an SP level, refused as it is made."""
        family = getattr(self.model_config, "model_type", None)
        if (problem := split_items_problem(family, store, plan, self.levels)) is not None:
            raise ConfigError(what + problem)

    @property
    def plan(self) -> Plan | None:
        """The plan of the epoch being trained (what PackingMetrics reads)."""
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        return self.plan_for_epoch(epoch) if self.store is not None else None

    def val_plan(self) -> Plan:
        """The validation set planned with the training levels, once (seed fixed, no curriculum)."""
        if self._val_plan is None:
            world, _, _ = self._world()
            plan = plan_hbp(
                self.val_store.lengths,
                self.levels,
                world,
                1,
                self.seed,
                self.packer,
                loss_tokens=self.val_store.loss_tokens,
                over_length="error",
                extra_work=self.vision_work(self.val_store),
            )
            self._refuse_split_items(self.val_store, plan, "the validation set: ")
            self._val_plan = plan
            rank_zero_info(f"validation {plan.summary()}")
        return self._val_plan

    def val_dataloader(self) -> DataLoader | list:
        if self.val_store is None:
            return []
        _, rank, _ = self._world()
        workers, pin = self._loader_settings()
        dataset = MicroBatchDataset(
            self.val_store, self.sharding_levels(), rank, self.pad_id, self._media_inputs(self.val_store)
        )
        sampler = FixedPlanSampler(self.val_plan(), rank)
        settings = self._worker_settings(workers, self.seed)
        return DataLoader(dataset, sampler=sampler, batch_size=None, **settings, pin_memory=pin)

    def _loader_settings(self) -> tuple[int, bool]:
        """(worker processes, pinned memory): on a GPU 2 workers collate into pinned memory."""
        on_gpu = self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        workers = self.num_workers if self.num_workers is not None else (2 if on_gpu else 0)
        return workers, on_gpu

    @staticmethod
    def _worker_settings(workers: int, seed: int) -> dict:
        """Worker processes that ignore Ctrl-C: the terminal's SIGINT reaches them too, and the main
        process finishes the running optimizer step (InterruptCheckpoint) with their batches. The loader's own
        generator seeds them: a loader drawing from torch's global one at each epoch and validation would move
        the dropout masks a resumed run must draw as the uninterrupted one did (``lightning.rng``)."""
        generator = torch.Generator().manual_seed(seed)
        return dict(num_workers=workers, worker_init_fn=leave_signals_to_main if workers else None, generator=generator)

    def train_dataloader(self) -> PlanLoader:
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        _, rank, _ = self._world()
        workers, pin = self._loader_settings()
        media = self._media_inputs(self.store)
        dataset = MicroBatchDataset(self.store, self.sharding_levels(), rank, self.pad_id, media)
        sampler = PlanSampler(self, epoch, rank)
        if self.trainer is not None:
            check_validation_interval(self.trainer, len(sampler))
            check_accumulation_windows(self.trainer, len(sampler), self._world(epoch)[2])
            check_checkpoint_positions(self.trainer, self.val_store is not None, len(sampler), self._world(epoch)[2])
        return PlanLoader(self, dataset, sampler, **self._worker_settings(workers, self.seed + epoch), pin_memory=pin)


def data_seed(seed: int | None, run_seed: Any = None) -> int:
    """The data's seed: ``data.seed`` where given, else the run's ``seed_everything`` (``run_seed``, else the
    ``PL_GLOBAL_SEED`` Lightning's ``seed_everything`` sets; False or none: 0)."""
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(
                f"data.seed must be a non-negative integer (or null: the run's seed_everything), got {seed!r}"
            )
        return int(seed)
    run_seed = os.environ.get("PL_GLOBAL_SEED") if run_seed is None else run_seed
    return 0 if run_seed is None or isinstance(run_seed, bool) else int(run_seed)
