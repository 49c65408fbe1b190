"""The learning-rate schedule of an ``HBPLitModule`` run: linear warm-up, then a cosine to a floor, over the
run's optimizer steps; and what a resumed run whose schedule is not its checkpoint's says."""

from __future__ import annotations

import math

import torch

from lit_hbp.errors import ConfigError
from lit_hbp.lightning.plan_checks import planned_optimizer_steps

LR_SCHEDULE = "hbp_lr_schedule"  # the checkpoint's key of the run's schedule: {"total": steps, "warmup": steps}
NO_END = (
    "trainer.max_steps: -1 with trainer.max_epochs: -1 trains without an end, which the learning-rate schedule "
    "(warm-up, then cosine to the run's last step) needs: set max_steps or max_epochs (max_time still stops a run "
    "earlier, saving it)"
)


def run_steps(trainer) -> float:
    """The run's optimizer steps (Lightning's ``estimated_stepping_batches``, or an ``HBPDataModule``'s count from
    each epoch's plan where epochs differ: ``planned_optimizer_steps``), what the schedule spans. For a run
    bounded by ``max_epochs`` Lightning builds the train loader to count them, before the checkpoint being
    resumed is restored; that loader would never be given its saved position (the epoch trained again from its
    first micro-batch, without a word), so it is let go and built again after the restore, which hands it the
    position (on every fit: a strategy that restores after its set-up, DeepSpeed, names no checkpoint yet)."""
    steps = trainer.estimated_stepping_batches
    if math.isfinite(steps) and (planned := planned_optimizer_steps(trainer)) is not None:
        steps = planned
    loop = getattr(trainer, "fit_loop", None)
    if loop is not None:
        loop._combined_loader = None  # Lightning's fit loop builds it again in setup_data
    if not math.isfinite(steps):
        raise ConfigError(NO_END)
    return steps


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """The learning rate's share of ``lr`` at optimizer ``step``: linear warm-up over ``warmup`` steps from
    ``1 / (warmup + 1)`` (no step at rate 0), then a cosine to ``min_ratio`` at ``total``, the step after the run's
    last (as transformers' ``cosine_with_min_lr``)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(total - warmup, 1)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def take_schedule_now(scheduler) -> None:
    """The optimizer's rates set to ``scheduler``'s (its ``LambdaLR``) at the step it was restored to: a run resumed on
    another schedule holds the rate the checkpoint's schedule gave that step, and trained it once more before the new
    schedule's first step. A scheduler of another kind (a subclass's own) is left as it is."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    rates = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = lr
    scheduler._last_lr = rates


def long_warmup(warmup: int, total: int, lr: float) -> str | None:
    """What a run whose warm-up is longer than the run says: its rate rises all run (as the setting says; not cut
    to the run, which would reach ``lr`` sooner than asked). None otherwise."""
    if warmup <= total:
        return None
    return (
        f"model.warmup_steps {warmup} is longer than the run's {total} optimizer steps: the learning rate rises "
        f"toward model.lr for the whole run and ends at {lr * lr_factor(total - 1, total, warmup, 0.0):.3g}"
    )


def schedule_moved(resumed: dict | None, now: dict | None, step: int, lr: float, min_ratio: float) -> str | None:
    """What a run resumed at ``step`` on schedule ``now`` says when its checkpoint's run followed ``resumed`` (a run
    extended with more max_steps): it follows the new one, as Lightning would, not silently. None when both are
    the same or one is unknown (a checkpoint written before lit-hbp kept it)."""
    if resumed is None or now is None or resumed == now:
        return None
    was = lr * lr_factor(step, resumed["total"], resumed["warmup"], min_ratio)
    will = lr * lr_factor(step, now["total"], now["warmup"], min_ratio)
    return (
        f"resumed at step {step} on a learning-rate schedule of {now['total']} optimizer steps ({now['warmup']} of "
        f"warm-up); the checkpoint's run followed {resumed['total']} ({resumed['warmup']}): the learning rate "
        f"moves from {was:.3g} to {will:.3g} here and follows the new schedule (resume with the run's own "
        "max_steps, max_epochs and limit_train_batches to keep its)"
    )
