"""Lightning callbacks HBPLitModule cannot serve, refused by name before anything trains.

Fine-tuning (freezing) and pruning callbacks act on the module in their ``setup``, before ``configure_model``
builds the model, so they would act on nothing without a word (served where the model was built before fit);
stochastic weight averaging copies the module there too and replaces the schedule; a batch-size finder scales a
batch size the packs do not have (a micro-batch is a pack of its level's tokens); the learning-rate finder run
inside ``fit`` sets the optimizer's rate, which the module's schedule takes back at the next step. Tuner's
``lr_find`` (a finder that stops before training) is served, with one micro-batch per step: with several, the
curve it reads is the last micro-batch's share of each step's loss (a token share, zero for an empty pack).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning.pytorch.callbacks import (
    BaseFinetuning,
    BatchSizeFinder,
    LearningRateFinder,
    ModelPruning,
    StochasticWeightAveraging,
    WeightAveraging,
)

from lit_hbp.errors import ConfigError
from lit_hbp.lightning.checkpoints import AVERAGED_UNDER_DEEPSPEED
from lit_hbp.lightning.meter import MicroStepEnd

BUILT_TOO_LATE = "(HBPLitModule builds its model in configure_model, after every callback's setup)"
ALWAYS = {
    StochasticWeightAveraging: (
        f"it averages a copy of the module made before the model is built {BUILT_TOO_LATE}, so it would average "
        "nothing and replace the learning-rate schedule; use lightning.pytorch.callbacks.WeightAveraging (an EMA of "
        "the weights), which builds the model first"
    ),
    BatchSizeFinder: (
        "a micro-batch is one pack of its level's tokens (data.levels: pack_len, packs_per_rank), not a number of "
        "samples, so there is no batch size to scale; let the level search size the packs for the device's memory "
        "(data.levels: class_path lit_hbp.autoselect.MeasuredSelector, docs/levels.md)"
    ),
}
UNBUILT = {  # served where the module's model was built before fit (``module.configure_model()``)
    BaseFinetuning: (
        f"it freezes the module's parameters in its setup {BUILT_TOO_LATE}, so nothing would be frozen; freeze in a "
        "subclass's configure_model, after super().configure_model() (requires_grad_(False) on the modules), or "
        "train LoRA adapters (model.lora)"
    ),
    ModelPruning: (
        f"it collects the module's layers in its setup {BUILT_TOO_LATE}, so nothing would be pruned; prune with "
        "torch.nn.utils.prune in a callback of your own, on the built model"
    ),
}
FINDER_IN_FIT = (
    "inside fit it sets the optimizer's learning rate, which HBPLitModule's schedule takes back at the next step; "
    "run lightning.pytorch.tuner.Tuner(trainer).lr_find(module, datamodule=...) before fit, then fit a module "
    "made with lr set to its suggestion"
)
FINDER_ACCUMULATES = (
    "with accumulate_grad_batches {n} its curve reads each step's last micro-batch's share of the loss (a share by "
    "tokens, zero for an empty pack), not the step's loss; find the rate with accumulate_grad_batches 1"
)


def refusal(callback: Any, accumulate: int = 1, built: bool = False) -> str | None:
    """Why ``callback`` (an instance, or a config's class) cannot serve HBPLitModule, or None; ``built``: the module's
    model is there at the callback's setup."""
    kind = callback if isinstance(callback, type) else type(callback)
    for refused, why in (ALWAYS | ({} if built else UNBUILT)).items():
        if issubclass(kind, refused):
            return why
    if issubclass(kind, LearningRateFinder):
        if isinstance(callback, type) or not getattr(callback, "_early_exit", False):  # Tuner.lr_find's stops early
            return FINDER_IN_FIT
        if accumulate > 1:
            return FINDER_ACCUMULATES.format(n=accumulate)
    return None


def refusals(callbacks: list, accumulate: int = 1, built: bool = False) -> Iterator[tuple[int, type, str]]:
    """(index, class, why) of each of ``callbacks`` HBPLitModule cannot serve, in their order (their setups'):
    a ``WeightAveraging`` builds the model in its setup, for the callbacks after it."""
    for i, callback in enumerate(callbacks):
        kind = callback if isinstance(callback, type) else type(callback)
        why = refusal(callback, accumulate, built)
        if why is not None:
            yield i, kind, why
        built = built or issubclass(kind, WeightAveraging)


def check_callbacks(trainer: Any, built: bool) -> None:
    """The first of ``trainer``'s callbacks HBPLitModule cannot serve, refused by name (a ``ConfigError``)."""
    for _, kind, why in refusals(trainer.callbacks, trainer.accumulate_grad_batches, built):
        raise ConfigError(f"trainer callback {kind.__name__}: {why}")


def check_started_callbacks(module: Any, trainer: Any) -> None:
    """At the fit's start: a subclass whose ``configure_callbacks`` drops ``super()``'s (its refusals never ran,
    and the step's metrics would be logged after the callbacks that read them: a ``ModelCheckpoint`` of
    ``train/loss`` would rank each save by the step before's), and weight averaging under DeepSpeed."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if not any(isinstance(callback, MicroStepEnd) for callback in trainer.callbacks):
        name = type(module).__name__
        raise ConfigError(
            f"{name}.configure_callbacks() drops HBPLitModule's own callbacks: return "
            f"super().configure_callbacks() + [your callbacks] (they log each step's metrics before any callback "
            "reads them, and refuse the callbacks a fit cannot serve)"
        )
    for callback in trainer.callbacks:
        if isinstance(callback, WeightAveraging) and isinstance(trainer.strategy, DeepSpeedStrategy):
            raise ConfigError(f"trainer callback {type(callback).__name__}: {AVERAGED_UNDER_DEEPSPEED}")
