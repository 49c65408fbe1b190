"""What a resume must keep of the run its checkpoint saved: the module's arguments (but for those that choose how a
step is computed), the model config it trained, and the records a fit held out for validation; refused, naming
each, where a resume or a validation of the checkpoint would otherwise train or score something else without a word.
"""

from __future__ import annotations

from typing import Any

from lit_hbp.errors import ConfigError

# Module arguments that choose how a step is computed, not what it computes: a resume may change them (another
# machine's kernels, compile on or off, the self-check skipped) and takes the config's.
EXECUTION = ("attn_backend", "compile", "liger", "self_check", "ce_chunk_size")


def check_resumed_settings(
    given: dict, saved: dict, option: str = "--ckpt_path", keys: tuple | None = None, validating: bool = False
) -> None:
    """A resume continues the run as its checkpoint saved it: a module argument given otherwise than the checkpoint's
    run did (``keys``, all by default) would be dropped without a word (``lr``: the restored optimizer and schedule
    train on at the checkpoint's rate). Refused, naming each one (tuples and lists alike); a validation of the
    checkpoint (``validating``) likewise scores it with its own settings. ``EXECUTION`` settings may change."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value

    changed = [
        f"model.{key}: {plain(given[key])!r} (the checkpoint's {plain(value)!r})"
        for key, value in saved.items()
        if not key.startswith("_")
        and key not in EXECUTION
        and key in given
        and (keys is None or key in keys)
        and plain(given[key]) != plain(value)
    ]
    if changed:
        doing = (
            "validates the checkpoint with the model settings it saved"
            if validating
            else ("resumes the run as its checkpoint saved it, with its model settings")
        )
        other = "validate" if validating else "start a new run"
        raise ConfigError(
            f"{option} {doing}, not these: "
            f"{'; '.join(changed)}; give the run's own values (or drop them), or {other} from the exported "
            "model (python -m lit_hbp.export CKPT OUT, then model.model: OUT)"
        )


# Config fields that say where or how a model was loaded, not what it computes
LOADING_FIELDS = frozenset({"_name_or_path", "transformers_version", "use_cache", "dtype", "torch_dtype",
                            "_attn_implementation_autoset", "attn_implementation", "_commit_hash"})  # fmt: skip


def check_resumed_config(now: dict, saved: dict | None) -> None:
    """A resume continues the model its checkpoint's run trained: the model config it builds now (``model.model``: a
    folder edited since, a Hub id's new revision) must be the checkpoint's ``hf_config`` (the weights come from the
    checkpoint, so a moved folder of the same model resumes); a field that differs (RoPE's theta, a norm's eps) would
    train the checkpoint's weights under another computation without a word. Refused, naming the fields."""
    if not saved:
        return  # written before lit-hbp kept the config

    def flat(config: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in config.items():
            if key in LOADING_FIELDS:
                continue
            if isinstance(value, dict) and key.endswith("_config"):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    a, b = flat(saved), flat(now)
    changed = [
        f"{k}: {b.get(k)!r} (the checkpoint's {a.get(k)!r})"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k)
    ]
    if changed:
        raise ConfigError(
            f"ckpt_path resumes the model its checkpoint trained, but model.model now builds another config: "
            f"{'; '.join(changed[:6])}{' ...' if len(changed) > 6 else ''}; restore the model folder the run started "
            "from, or start a new run from the exported model (python -m lit_hbp.export CKPT OUT, then model.model: "
            "OUT)"
        )


def plan_seed(checkpoint: dict) -> int | None:
    """The data seed a checkpoint's training loader planned with (its fit loop's saved loader state); None
    without one (saved before its loader's first state)."""
    loops = checkpoint.get("loops") or {}
    states = ((loops.get("fit_loop") or {}).get("state_dict") or {}).get("combined_loader") or []
    seeds = [s["plan"].get("seed") for s in states if isinstance(s, dict) and isinstance(s.get("plan"), dict)]
    return seeds[0] if seeds and isinstance(seeds[0], int) else None


def check_held_out(
    saved: dict, checkpoint: dict | None, seed: int, val_fraction: float, held_out: dict | None = None
) -> None:
    """A validation of a checkpoint whose ``val_fraction`` hold-out was drawn with another data seed or share than
    this run's, or from other sources (``check_same_records``): it would validate on other records, some the
    checkpoint trained on, and read low without a word. ``saved``: the data module's state in it; ``checkpoint``:
    the whole (older ones name the seed in the loader's); ``held_out``: this run's held-out records."""
    held_seed = saved.get("seed", plan_seed(checkpoint or {}))
    held_fraction = saved.get("val_fraction", val_fraction)
    if held_seed is not None and (held_seed, held_fraction) != (seed, val_fraction):
        raise ConfigError(
            f"data.val_fraction: the checkpoint held out {held_fraction} of the training records with data seed "
            f"{held_seed}; this run's seed {seed} and val_fraction {val_fraction} hold out other records, some of "
            f"which it trained on: validate with the data module's seed={held_seed} and val_fraction={held_fraction} "
            "(data.seed, data.val_fraction)"
        )
    check_same_records(saved.get("held_out"), held_out)


def fit_held_out(checkpoint: dict) -> dict | None:
    """The records a checkpoint's fit held out for validation (``HBPDataModule.state_dict``'s ``held_out``); None
    from a checkpoint without them (another data module, or saved by an older lit-hbp)."""
    states = [v for v in checkpoint.values() if isinstance(v, dict) and "tokenizer_files" in v]
    return states[0].get("held_out") if states else None


def check_same_records(fit: dict | None, now: dict | None) -> None:
    """A validation holding out records (``SampleStore.records_identity``) other than its checkpoint's fit held
    out, by where they lie and by what they hold: a source was added, removed or moved in the list (the hold-out
    is a seeded draw over every source's records), or the fit held out none; some of them trained."""
    if fit is None or now is None or not now["records"] or now["where"] == fit["where"] or now["what"] == fit["what"]:
        return
    raise ConfigError(
        f"data.sources: this validation holds out {now['records']} records, the checkpoint's fit held out "
        f"{fit['records']} others and trained on some of these: its sources, their order, data.seed or "
        "data.val_fraction differ from the fit's; validate with the fit's data settings"
    )


def same_records(saved: dict | None, now: dict | None) -> bool:
    """Whether two ``SampleStore.records_identity`` name the same records (by where they lie or by what they
    hold; None: not known, taken as the same)."""
    if saved is None or now is None or (not saved["records"] and not now["records"]):
        return True
    return now["where"] == saved["where"] or now["what"] == saved["what"]


def check_same_validation(saved: dict | None, now: dict | None, callbacks: list) -> None:
    """A resumed fit that validates on other records than its checkpoint's run (``data.val_sources`` changed;
    identities by ``SampleStore.records_identity``, either way of matching keeps it the same): its ``val/`` scores
    cannot be compared with the earlier ones. A callback monitoring one (a ModelCheckpoint's top-k, an
    EarlyStopping's best) would rank them together without a word, keeping or deleting checkpoints by the old
    set's scores, so that is refused; otherwise it is said."""
    from lightning.pytorch.utilities import rank_zero_warn

    if same_records(saved, now):
        return
    what = f"{now['records']} records" if now["records"] else "nothing"
    theirs = f"{saved['records']} others" if saved["records"] else "nothing"
    monitors = [
        f"{type(cb).__name__} (monitor {cb.monitor!r})"
        for cb in callbacks
        if isinstance(getattr(cb, "monitor", None), str) and cb.monitor.startswith("val/")
    ]
    said = f"this run validates on {what}, the checkpoint's run on {theirs} (data.val_sources"
    if monitors:
        raise ConfigError(
            f"{said}): {', '.join(monitors)} would rank their val/ scores beside the earlier ones, which are not "
            "comparable; keep the checkpoint's validation data, or train on from its weights as a new run"
        )
    rank_zero_warn(f"{said}): val/ metrics from here on are not comparable with the earlier ones")


# Trainer settings a resume may change (Lightning takes the config's) but whose change is said: the run then goes on
# otherwise than the one it continues.
TRAINER_KEPT = ("gradient_clip_val", "gradient_clip_algorithm", "precision")
TRAINER_SETTINGS = "hbp_trainer"  # the checkpoint's key of them


def kept_trainer_settings(trainer: Any) -> dict:
    """The run's ``TRAINER_KEPT`` settings as its trainer holds them (what a checkpoint keeps as ``hbp_trainer``)."""
    out = {}
    for key in TRAINER_KEPT:
        value = getattr(trainer, key, None)
        value = getattr(value, "value", value)  # an enum (Lightning's GradClipAlgorithmType): its plain value
        out[key] = value if value is None or isinstance(value, (int, float)) else str(value)
    out["gradient_clip_val"] = out["gradient_clip_val"] or None  # 0: no clipping, as None
    out["gradient_clip_algorithm"] = out["gradient_clip_algorithm"] or "norm"  # Lightning's default
    return out


def kept_settings_moved(saved: dict | None, now: dict) -> str | None:
    """What a fit resumed with other clipping or precision than its checkpoint's run says (Lightning applies the
    config's without a word): the run goes on with these, not as the run it continues would have. None when the
    same, or the checkpoint holds none (written before lit-hbp kept them)."""
    if not saved:
        return None
    moved = [
        f"trainer.{k} {saved[k]!r} -> {now.get(k)!r}" for k in TRAINER_KEPT if k in saved and saved[k] != now.get(k)
    ]
    if not moved:
        return None
    was, will = str(saved.get("precision", "")), str(now.get("precision", ""))
    half = will.endswith("-true") and not will.startswith(("32", "64"))
    cast = (
        " (its fp32 weights and optimizer state are cast to the new precision)" if was.startswith("32") and half else ""
    )
    return (
        f"resumed with {', '.join(moved)} from the checkpoint's run: it goes on with these from here{cast}, not as the "
        "run it continues would have (resume with the run's own to keep them)"
    )


def check_resumed_fit(hparams: Any, checkpoint: dict, config: dict, trainer: Any) -> None:
    """A fit resumed from ``checkpoint``: module arguments (``hparams``) other than its run's refused, as is a model
    whose ``config`` is not the one it trained (``check_resumed_config``); other clipping or precision said."""
    from lightning.pytorch.utilities import rank_zero_warn

    saved = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items() if k != "model"}
    check_resumed_settings(hparams, saved, "ckpt_path")  # (SLURM's requeue, a project's Trainer.fit)
    check_resumed_config(config, checkpoint.get("hf_config"))  # the model itself
    said = kept_settings_moved(checkpoint.get(TRAINER_SETTINGS), kept_trainer_settings(trainer))
    if said is not None:
        rank_zero_warn(said)
