"""lit-hbp: Hierarchical Balance Packing for long-context SFT with PyTorch Lightning.

    from lit_hbp import HBPDataModule, HBPLitModule, Level, plan_hbp

The packing planner (``lit_hbp.packing``) imports numpy only; the Lightning pieces are imported
on first use so that ``import lit_hbp.packing`` never pulls in torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "HBPDataModule": "lit_hbp.data.datamodule",
    "HBPLitModule": "lit_hbp.module",
    "Source": "lit_hbp.data.sources",
    "Level": "lit_hbp.packing",
    "plan_hbp": "lit_hbp.packing",
    "plan_single_level": "lit_hbp.packing",
    "pack": "lit_hbp.packing",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lit_hbp' has no attribute {name!r}")
