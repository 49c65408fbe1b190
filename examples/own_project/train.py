"""Train the project's ChatLM on packed, attention-balanced micro-batches.

    python train.py --checkpoint /models/my-llama --data chats.jsonl              # 1 process
    python train.py --checkpoint /models/my-llama --data chats.jsonl --devices 2  # 2 processes, a level at sp 2

What adopting lit-hbp changed here: the data module is ``HBPDataModule`` (levels, each with its own
sequence-parallel degree), the strategy ``HBPStrategy`` when a level uses sequence parallelism, the
Trainer leaves sampling to the data module (``use_distributed_sampler=False``), and lit-hbp's
callbacks join the project's own TensorBoard logger and checkpointing. For a cluster: checkpoints
written atomically, SIGTERM/SIGUSR1/Ctrl-C saving the running step (exit status ``128 + signal``),
a lost rank named, and a run started again resuming from its newest complete checkpoint.
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

from lit_hbp import AtomicCheckpointIO, HBPDataModule, HBPStrategy, newest_checkpoint  # noqa: E402
from lit_hbp.callbacks import (  # noqa: E402
    HBPProgressBar,
    HBPThroughputMonitor,
    InterruptCheckpoint,
    LevelSummary,
    LostRankReport,
    PackingMetrics,
)


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
        plugins=[AtomicCheckpointIO()],
        callbacks=[ModelCheckpoint(save_last=True), PackingMetrics(), HBPThroughputMonitor(), LevelSummary(),
                   HBPProgressBar(), InterruptCheckpoint(), LostRankReport()],
    )  # fmt: skip
    # A job started again (requeued, restarted) continues from the newest complete checkpoint, if any.
    resume = newest_checkpoint(Path(args.out).glob("lightning_logs/version_*/checkpoints"))
    trainer.fit(ChatLM(args.checkpoint), data, ckpt_path=resume)
    return trainer


def exit_status(trainer: L.Trainer) -> int:
    """128 + signal when a signal stopped training (a scheduler then sees an interrupted job), else 0."""
    return next((c.exit_status for c in trainer.callbacks if isinstance(c, InterruptCheckpoint)), None) or 0


if __name__ == "__main__":
    sys.exit(exit_status(main()))
