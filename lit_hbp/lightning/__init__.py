"""Lightning's side: ``HBPLitModule`` (``module``), ``HBPDataModule`` (``datamodule``), the strategies with
a sequence-parallel degree per level (``strategy``: ``HBPStrategy`` over DeepSpeed, ``HBPDDPStrategy``
over DDP), the step meter (``meter``) and checkpoint files (``checkpoints``). The callbacks are
``lit_hbp.callbacks``."""
