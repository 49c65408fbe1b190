"""lit-hbp: Hierarchical Balance Packing for long-context SFT with PyTorch Lightning.

The packing planner (``lit_hbp.packing``) imports numpy only; the Lightning pieces are imported
lazily so that ``import lit_hbp.packing`` never pulls in torch.
"""

__version__ = "0.1.0"
