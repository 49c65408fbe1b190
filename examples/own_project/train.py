"""Train the project's ChatLM on packed, attention-balanced micro-batches.

    python train.py --checkpoint /models/my-llama --data chats.jsonl              # 1 process
    python train.py --checkpoint /models/my-llama --data chats.jsonl --devices 2  # 2 processes, a level at sp 2

What adopting lit-hbp changed here: the data module is ``HBPDataModule`` (levels, each with its own
sequence-parallel degree), the strategy ``HBPStrategy`` when a level uses sequence parallelism, the
Trainer leaves sampling to the data module (``use_distributed_sampler=False``), and lit-hbp's
callbacks join the project's own TensorBoard logger and checkpointing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

sys.path.insert(0, str(Path(__file__).parent))  # the project's own modules, wherever it is run from

from chat_lm import ChatLM  # noqa: E402

from lit_hbp import HBPDataModule, HBPStrategy  # noqa: E402
from lit_hbp.callbacks import HBPProgressBar, HBPThroughputMonitor, LevelSummary, PackingMetrics  # noqa: E402


def main(argv: list[str] | None = None) -> L.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a save_pretrained folder (model and tokenizer)")
    parser.add_argument("--data", required=True, help="chats: JSONL, JSON, parquet, ... (lit-hbp's formats)")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--out", default="runs/chat_lm", help="logs and checkpoints")
    args = parser.parse_args(argv)

    # Short chats in 1K packs on every rank; long ones in 4K packs split over all ranks.
    levels = [{"pack_len": 1024, "sp": 1}, {"pack_len": 4096, "sp": args.devices, "ckpt_layers": 2}]
    data = HBPDataModule(
        sources=[args.data], tokenizer=args.checkpoint, levels=levels, over_length="truncate",
        cache_dir=str(Path(args.out) / "data_cache"),
    )  # fmt: skip
    trainer = L.Trainer(
        devices=args.devices,
        strategy=HBPStrategy(stage=2) if args.devices > 1 else "auto",
        use_distributed_sampler=False,
        max_steps=args.max_steps,
        accumulate_grad_batches=2,
        logger=TensorBoardLogger(args.out),
        callbacks=[ModelCheckpoint(save_last=True), PackingMetrics(), HBPThroughputMonitor(), LevelSummary(),
                   HBPProgressBar()],
    )  # fmt: skip
    trainer.fit(ChatLM(args.checkpoint), data)
    return trainer


if __name__ == "__main__":
    main()
