"""Export a training checkpoint to a Hugging Face ``save_pretrained`` folder.

    python -m lit_hbp.export CKPT OUT_DIR [--dtype bfloat16] [--merge-lora] [--tokenizer PATH]

CKPT is what ``Trainer.save_checkpoint`` / ``ModelCheckpoint`` wrote: a Lightning checkpoint file, or
the checkpoint folder of a DeepSpeed run (HBPStrategy, ZeRO 0-3), whose partitioned parameters are
gathered into one fp32 state dict with Lightning's ``convert_zero_checkpoint_to_fp32_state_dict``
(DeepSpeed's zero_to_fp32). The module is rebuilt from the checkpoint's hyper-parameters, loaded,
and written with ``save_pretrained`` (safetensors) in the dtype asked for, with the tokenizer the
run trained with. The folder loads with ``AutoModelForCausalLM.from_pretrained`` (and vLLM or the
Hub) and is a valid ``model:`` of a new lit-hbp run. A LoRA run writes its adapter
(``adapter_config.json`` + weights, for peft), or with ``--merge-lora`` the merged full model.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_checkpoint(path: str | Path) -> dict:
    """The checkpoint as one dict with a full fp32 ``state_dict``, whatever wrote it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_dir():  # DeepSpeed: one shard per rank (ZeRO) under <dir>/checkpoint
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "consolidated.ckpt"
            convert_zero_checkpoint_to_fp32_state_dict(str(path), str(out))
            return torch.load(out, map_location="cpu", weights_only=False)
    return torch.load(path, map_location="cpu", weights_only=False)


def module_from_checkpoint(ckpt: dict):
    """The HBPLitModule the checkpoint was trained with, its weights loaded."""
    from lit_hbp.module import HBPLitModule

    hparams = dict(ckpt.get("hyper_parameters") or {})
    if "model" not in hparams:
        raise ValueError("the checkpoint has no HBPLitModule hyper-parameters (was it written by a lit-hbp run?)")
    init = inspect.signature(HBPLitModule).parameters
    module = HBPLitModule(**{k: v for k, v in hparams.items() if k in init})
    module.configure_model()
    state = {k: v for k, v in ckpt["state_dict"].items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not match its model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return module


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    merge_lora: bool = False,
    tokenizer: str | None = None,
) -> Path:
    """Write ``out_dir`` (see the module docstring); returns it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    ckpt = load_checkpoint(checkpoint)
    module = module_from_checkpoint(ckpt)
    net = module.model
    if hasattr(net, "peft_config") and merge_lora:
        net = net.merge_and_unload()
    net = net.to(DTYPES[dtype])
    base = net.get_base_model() if hasattr(net, "get_base_model") else net
    base.config.use_cache = True  # training turned the KV cache off; generation wants it
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(out, safe_serialization=True)
    tok = tokenizer or (ckpt.get("datamodule_hyper_parameters") or {}).get("tokenizer")
    if tok:
        from lit_hbp.data.datamodule import load_tokenizer

        load_tokenizer(tok).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lit_hbp.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", help="a Lightning checkpoint file or a DeepSpeed checkpoint folder")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--merge-lora", action="store_true", help="LoRA runs: write merged full weights, not the adapter")
    p.add_argument("--tokenizer", help="tokenizer to save alongside (default: the one the run trained with)")
    args = p.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out_dir, args.dtype, args.merge_lora, args.tokenizer)
    print(f"wrote {out}: " + ", ".join(sorted(x.name for x in out.iterdir())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
