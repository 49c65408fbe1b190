"""Train with HBP: ``python train.py fit --config configs/tiny_cpu.yaml [--trainer.* ...]``."""

from lit_hbp.cli.command import entry_point

if __name__ == "__main__":
    entry_point()
