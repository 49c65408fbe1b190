"""lit-hbp: Hierarchical Balance Packing for long-context SFT with PyTorch Lightning.

    from lit_hbp import HBPDataModule, HBPLitModule, HBPStrategy, HBPDDPStrategy, Level, PackedBatch, plan_hbp
    from lit_hbp import prepare_model, packed_loss, pack_samples   # inside your own LightningModule
    from lit_hbp import pack_inputs, prepared, unprepare_model     # the model's other calls, a teacher

The packing planner (``lit_hbp.packing``) imports numpy only; the Lightning pieces are imported
on first use so that ``import lit_hbp.packing`` never pulls in torch.

The folders, in the order a micro-batch meets them (each imports only from those before it): ``packing``
(the plan, numpy only) -> ``data`` (records, tokens, the token cache, collate) -> ``parallel`` (SP groups,
Ulysses and context parallelism) -> ``model`` (prepare_model, the packed call, attention, the loss, the
self-check) -> ``cost`` (the cost and memory models) -> ``lightning`` (HBPLitModule, HBPDataModule, the
strategies) -> ``autoselect`` and ``simulate`` (the level search, the cluster simulator) -> ``callbacks``
-> ``cli``; beside them ``errors``, ``model_spec``, ``moe_spec`` and ``report`` (used by all), ``demo`` and ``export``.
Modules that moved there in 0.2 keep their old import path for one release (``MOVED``), with a
DeprecationWarning.
"""

import importlib.abc
import importlib.util
import sys
import warnings
from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "HBPDataModule": "lit_hbp.lightning.datamodule",
    "HBPLitModule": "lit_hbp.lightning.module",
    "HBPStrategy": "lit_hbp.lightning.strategy",
    "HBPDDPStrategy": "lit_hbp.lightning.strategy",
    "PackedBatch": "lit_hbp.data.batch",
    "PackedLoss": "lit_hbp.model.causal_lm",
    "prepare_model": "lit_hbp.model.causal_lm",
    "packed_loss": "lit_hbp.model.causal_lm",
    "unprepare_model": "lit_hbp.model.causal_lm",
    "prepared": "lit_hbp.model.causal_lm",
    "zero3_loading": "lit_hbp.model.build",
    "pack_inputs": "lit_hbp.model.packed_call",
    "pack_scope": "lit_hbp.model.packed_call",
    "pack_samples": "lit_hbp.data.collate",
    "step_loss_norm": "lit_hbp.model.loss",
    "collate_packs": "lit_hbp.data.collate",
    "Source": "lit_hbp.data.sources",
    "export_checkpoint": "lit_hbp.export",
    "AtomicCheckpointIO": "lit_hbp.lightning.checkpoints",
    "newest_checkpoint": "lit_hbp.lightning.checkpoints",
    "Level": "lit_hbp.packing",
    "plan_hbp": "lit_hbp.packing",
    "plan_single_level": "lit_hbp.packing",
    "pack": "lit_hbp.packing",
    "UserInputError": "lit_hbp.errors",
    "ConfigError": "lit_hbp.errors",
    "DataError": "lit_hbp.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lit_hbp' has no attribute {name!r}")


MOVED = {  # lit-hbp 0.1's module -> where it lives now
    "lit_hbp.calls": "lit_hbp.model.calls",
    "lit_hbp.packed_call": "lit_hbp.model.packed_call",
    "lit_hbp.causal_lm": "lit_hbp.model.causal_lm",
    "lit_hbp.loss": "lit_hbp.model.loss",
    "lit_hbp.tiling": "lit_hbp.model.tiling",
    "lit_hbp.offload": "lit_hbp.model.offload",
    "lit_hbp.mixers": "lit_hbp.model.mixers",
    "lit_hbp.selfcheck": "lit_hbp.model.selfcheck",
    "lit_hbp.vision": "lit_hbp.model.vision",
    "lit_hbp.attention": "lit_hbp.model.attention",
    "lit_hbp.attention.backends": "lit_hbp.model.attention.backends",
    "lit_hbp.attention.flex": "lit_hbp.model.attention.flex",
    "lit_hbp.attention.tower": "lit_hbp.model.attention.tower",
    "lit_hbp.parallel.media": "lit_hbp.model.sp_media",
    "lit_hbp.costmodel": "lit_hbp.cost.costmodel",
    "lit_hbp.memory": "lit_hbp.cost.memory",
    "lit_hbp.gpu_peaks": "lit_hbp.cost.gpu_peaks",
    "lit_hbp.run_settings": "lit_hbp.cost.run_settings",
    "lit_hbp.config": "lit_hbp.cost.config",
    "lit_hbp.module": "lit_hbp.lightning.module",
    "lit_hbp.strategy": "lit_hbp.lightning.strategy",
    "lit_hbp.meter": "lit_hbp.lightning.meter",
    "lit_hbp.checkpoints": "lit_hbp.lightning.checkpoints",
    "lit_hbp.data.datamodule": "lit_hbp.lightning.datamodule",
    "lit_hbp.command": "lit_hbp.cli.command",
    "lit_hbp.preview": "lit_hbp.cli.preview",
    "lit_hbp.checks": "lit_hbp.cli.checks",
    "lit_hbp.demo_vlm": "lit_hbp.demo.vision",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """An old import path (``MOVED``) is the module at its new one, the same object (a class a config
    names as ``lit_hbp.strategy.HBPStrategy`` is ``lit_hbp.lightning.strategy.HBPStrategy``), with a
    DeprecationWarning; ``python -m`` of an old path runs the new module."""

    def find_spec(self, name: str, path=None, target=None):
        new = MOVED.get(name)
        if new is None:
            return None
        warnings.warn(
            f"{name} moved to {new} in lit-hbp 0.2; the old path works until 0.3", DeprecationWarning, stacklevel=2
        )
        return importlib.util.spec_from_loader(name, self, origin=new)

    def create_module(self, spec):
        return import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        """The module at its new path has run already."""

    def get_code(self, fullname: str):
        spec = importlib.util.find_spec(MOVED[fullname])
        return spec.loader.get_code(MOVED[fullname])

    def get_source(self, fullname: str):
        spec = importlib.util.find_spec(MOVED[fullname])
        return spec.loader.get_source(MOVED[fullname])


if not any(isinstance(f, _MovedModule) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModule())  # before the path finder: a submodule of a moved package too
