"""lit-hbp: Hierarchical Balance Packing for long-context SFT with PyTorch Lightning.

    from lit_hbp import HBPDataModule, HBPLitModule, HBPStrategy, HBPDDPStrategy, Level, PackedBatch, plan_hbp
    from lit_hbp import prepare_model, packed_loss, pack_samples   # inside your own LightningModule
    from lit_hbp import pack_inputs, prepared, unprepare_model     # the model's other calls, a teacher

The packing planner (``lit_hbp.packing``) imports numpy only; the Lightning pieces are imported
on first use so that ``import lit_hbp.packing`` never pulls in torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "HBPDataModule": "lit_hbp.data.datamodule",
    "HBPLitModule": "lit_hbp.module",
    "HBPStrategy": "lit_hbp.strategy",
    "HBPDDPStrategy": "lit_hbp.strategy",
    "PackedBatch": "lit_hbp.data.batch",
    "PackedLoss": "lit_hbp.causal_lm",
    "prepare_model": "lit_hbp.causal_lm",
    "packed_loss": "lit_hbp.causal_lm",
    "unprepare_model": "lit_hbp.causal_lm",
    "prepared": "lit_hbp.causal_lm",
    "zero3_loading": "lit_hbp.causal_lm",
    "pack_inputs": "lit_hbp.packed_call",
    "pack_scope": "lit_hbp.packed_call",
    "pack_samples": "lit_hbp.data.collate",
    "step_loss_norm": "lit_hbp.loss",
    "collate_packs": "lit_hbp.data.collate",
    "Source": "lit_hbp.data.sources",
    "export_checkpoint": "lit_hbp.export",
    "AtomicCheckpointIO": "lit_hbp.checkpoints",
    "newest_checkpoint": "lit_hbp.checkpoints",
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
