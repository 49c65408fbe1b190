"""No pickle from a stranger: every checkpoint lit-hbp opens (export, resume, validate) is read by torch's
weights-only unpickler with an allow-list of what lit-hbp, Lightning and DeepSpeed write. A crafted
checkpoint whose pickle would run code (its ``__reduce__`` writes a file) is refused naming what it
names, and the file is never written; the documented opt-in (``--trust-checkpoint``, ``--weights_only
false``) opens a file one trusts."""

import fractions
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from lit_hbp.cli.app import check_resume
from lit_hbp.export import load_checkpoint
from lit_hbp.export import main as export_main
from lit_hbp.lightning.checkpoints import (
    SAFE_GLOBALS,
    UnsafeCheckpoint,
    check_checkpoint,
    pickled_globals,
    safe_globals,
    safe_load,
    unsafe_globals,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
        "max_position_embeddings": 64}  # fmt: skip


class WritesAFile:
    """What an attacker puts in a checkpoint: unpickling it calls ``exec``, which writes ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def lit_hbp_checkpoint() -> dict:
    """A checkpoint as HBPLitModule writes one (weights under ``model.``, hyper-parameters, hf_config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**TINY)
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(config)
    return {
        "global_step": 3,
        "state_dict": {f"model.{k}": v for k, v in net.state_dict().items()},
        "hyper_parameters": {"model": dict(TINY), "lora": None, "_instantiator": "lightning.pytorch.cli.x"},
        "hf_config": config.to_dict(),
    }


def crafted(path: Path, marker: Path, protocol: int = 2) -> Path:
    ckpt = lit_hbp_checkpoint()
    ckpt["hyper_parameters"]["note"] = WritesAFile(marker)
    torch.save(ckpt, path, pickle_protocol=protocol)
    return path


def test_the_static_read_names_every_global_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    for protocol in (2, 4):  # GLOBAL, and STACK_GLOBAL (pickle's default protocol)
        data = pickle.dumps({"x": WritesAFile(marker), "f": fractions.Fraction(1, 3)}, protocol=protocol)
        assert {"builtins.exec", "fractions.Fraction"} <= {g.replace("__builtin__", "builtins") for g in
                                                           pickled_globals(data)}  # fmt: skip
    assert not marker.exists()
    ckpt = crafted(tmp_path / "c.ckpt", marker)
    assert [g.split(".")[-1] for g in unsafe_globals(ckpt)] == ["exec"]
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 4])
def test_exporting_a_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path, capsys, protocol):
    marker = tmp_path / "ran"
    ckpt = crafted(tmp_path / "crafted.ckpt", marker, protocol)
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: refused to open {ckpt}: its pickle names ") and "exec" in err, err
    assert "--trust-checkpoint" in err and len(err.strip().splitlines()) == 1, err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_the_command_line_export_refuses_it_too(tmp_path):
    """``python -m lit_hbp.export`` as a person runs it: exit 2, one line, the file never written."""
    marker = tmp_path / "ran"
    ckpt = crafted(tmp_path / "crafted.ckpt", marker)
    run = subprocess.run([sys.executable, "-m", "lit_hbp.export", str(ckpt), str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("error: refused to open"), run.stderr
    assert not marker.exists()


def test_a_crafted_deepspeed_folder_is_refused_before_deepspeed_reads_it(tmp_path, capsys):
    """DeepSpeed's own loaders unpickle with weights_only=False: every file of the tag folder ``latest``
    names is checked first."""
    marker = tmp_path / "ran"
    folder = tmp_path / "run.ckpt"
    (folder / "global_step3").mkdir(parents=True)
    (folder / "latest").write_text("global_step3")
    tag = folder / "global_step3"
    torch.save({"module": {"w": torch.zeros(2)}}, tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": WritesAFile(marker)}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert export_main([str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in err and "exec" in err, err
    assert not marker.exists()


def test_trust_checkpoint_opens_a_file_with_more_than_lit_hbp_writes(tmp_path, capsys):
    """The opt-in is used, not dropped: a checkpoint carrying an extra (harmless) class is refused
    without it and exported with it, weights equal."""
    ckpt = lit_hbp_checkpoint()
    ckpt["note"] = fractions.Fraction(1, 3)
    path = tmp_path / "extra.ckpt"
    torch.save(ckpt, path)
    with pytest.raises(UnsafeCheckpoint, match=r"fractions\.Fraction.*--trust-checkpoint"):
        load_checkpoint(path)
    with pytest.warns(UserWarning, match="no tokenizer written"):
        assert export_main([str(path), str(tmp_path / "out"), "--trust-checkpoint"]) == 0
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "out" / "model.safetensors")
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, ckpt["state_dict"][f"model.{name}"], rtol=0, atol=0)


def test_what_lit_hbp_and_deepspeed_write_is_allowed():
    """The allow-list resolves to the classes DeepSpeed's ZeRO optimizer states hold, and a file holding
    them loads (the real ZeRO 2/3 and LoRA checkpoints are exported through it in test_export.py)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    assert set(safe_globals()) == {ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address}
    assert sorted(f"{c.__module__}.{c.__qualname__}" for c in safe_globals()) == sorted(SAFE_GLOBALS)


def test_deepspeed_state_round_trips_through_the_allow_list(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0),
             "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}], "t": torch.arange(3)}  # fmt: skip
    torch.save(state, tmp_path / "optim.pt")
    back = safe_load(tmp_path / "optim.pt")
    assert back["zero_stage"] is ZeroStageEnum.gradients and back["loss_scaler"].cur_scale == 1.0
    assert back["param_slice_mappings"][0]["w"].numel == 4 and back["t"].tolist() == [0, 1, 2]


def test_resume_checks_with_the_allow_list_unless_weights_only_is_false(tmp_path):
    """``--weights_only`` is Lightning's own fit/validate option: unset, lit-hbp sets it true and checks
    the file with the allow-list; ``false`` (a file one trusts) skips the check and Lightning loads
    any pickle."""
    path = tmp_path / "extra.ckpt"
    torch.save({"global_step": 1, "note": fractions.Fraction(1, 3)}, path)
    section = Namespace(ckpt_path=str(path), weights_only=None, trainer=Namespace(strategy="auto"))
    with pytest.raises(UnsafeCheckpoint, match=r"fractions\.Fraction.*--weights_only false"):
        check_resume(section)
    assert section.weights_only is True
    trusted = Namespace(ckpt_path=str(path), weights_only=False, trainer=Namespace(strategy="auto"))
    check_resume(trusted)  # no error
    check_checkpoint(path, trust=True)


def test_a_token_cache_holding_a_pickle_is_refused_and_runs_nothing(tmp_path):
    """The token cache's ``samples.npz`` is read numbers-only: a folder someone else planted in a shared
    ``cache_dir`` with an object array (a pickle) is a short DataError naming it, and nothing runs."""
    import json

    import numpy as np

    from lit_hbp.data.cache import read_cache
    from lit_hbp.errors import DataError

    marker = tmp_path / "ran"
    folder = tmp_path / "cache" / "short-0123"
    folder.mkdir(parents=True)
    (folder / "ids.bin").write_bytes(b"")
    (folder / "spans.bin").write_bytes(b"")
    (folder / "meta.json").write_text(json.dumps({"tokens": 0, "spans": 0, "samples": 1, "id_dtype": "uint16"}))
    np.savez(folder / "samples.npz", offsets=np.array([WritesAFile(marker)], dtype=object), rows=np.zeros(1, int))
    with pytest.raises(DataError, match=r"samples\.npz: Object arrays cannot be loaded when allow_pickle=False"):
        read_cache(folder)
    assert not marker.exists()


class _Pickled:
    """An object that pickles as ``getattr(owner, name)``: how Python 3.11.0-3.11.4 write an enum member."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def test_an_enum_member_pickled_as_getattr_loads_and_no_other_getattr_does(tmp_path):
    """Debian's Python 3.11.2 pickles DeepSpeed's ZeroStageEnum as getattr(ZeroStageEnum, 'gradients'):
    it loads as that member; getattr for any other attribute or class is refused and runs nothing."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.save({"zero_stage": _Pickled(ZeroStageEnum, "gradients")}, tmp_path / "old.pt")
    assert safe_load(tmp_path / "old.pt")["zero_stage"] is ZeroStageEnum.gradients
    for owner, name in [(ZeroStageEnum, "__init__"), (LossScaler, "update_scale"), (ZeroStageEnum, "nothing")]:
        torch.save({"x": _Pickled(owner, name)}, tmp_path / "bad.pt")
        with pytest.raises(UnsafeCheckpoint, match="not a member of an allow-listed enum"):
            safe_load(tmp_path / "bad.pt")


@pytest.mark.slow
def test_a_plain_checkpoint_loads_without_importing_deepspeed(tmp_path):
    """Only a file that names DeepSpeed's classes imports DeepSpeed (slow, and it prints its accelerator
    warning): exporting a plain run's checkpoint does not. In a fresh interpreter, so nothing imported
    by an earlier test counts; a file naming ZeroStageEnum then imports exactly what it names."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    plain, ds = tmp_path / "plain.ckpt", tmp_path / "ds.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, plain)
    torch.save({"zero_stage": ZeroStageEnum.gradients}, ds)
    code = (
        "import sys\nfrom lit_hbp.lightning.checkpoints import safe_load\n"
        f"assert safe_load({str(plain)!r})['epoch'] == 1\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))\n"
        f"print(safe_load({str(ds)!r})['zero_stage'].name)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.splitlines() == ["[]", "gradients"]
