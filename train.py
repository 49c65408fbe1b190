"""Train with HBP: ``python train.py fit --config configs/tiny_cpu.yaml [--trainer.* ...]``."""

from lit_hbp.cli import main

if __name__ == "__main__":
    main()
