"""``python train.py fit --config configs/tiny_cpu.yaml``: LightningCLI for HBP training.

YAML configs may use OmegaConf interpolation (``${data.levels.2.pack_len}``) so a value is written
once; it is resolved after the config files and the command line are merged (``omegaconf+``), so
``--data.demo_dir X`` also moves every path written as ``${data.demo_dir}/...``. The tokenizer's
size is linked from the data module into the model.
"""

from __future__ import annotations

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI

from lit_hbp import strategy  # noqa: F401  (registers --trainer.strategy hbp, hbp_stage_0 ... hbp_stage_3)
from lit_hbp.data.datamodule import HBPDataModule
from lit_hbp.module import HBPLitModule


class HBPCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main(args: list[str] | None = None, run: bool = True) -> HBPCLI:
    """Parse the command line (or ``args``), build trainer, model and data; fit unless ``run=False``."""
    # Configs write ${data.x} whether or not a subcommand (fit.) prefixes the parsed tree.
    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    return HBPCLI(
        HBPLitModule,
        HBPDataModule,
        parser_kwargs={"parser_mode": "omegaconf+"},
        trainer_defaults={"use_distributed_sampler": False, "reload_dataloaders_every_n_epochs": 1},
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
