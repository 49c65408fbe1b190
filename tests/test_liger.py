"""liger=True against a liger-kernel install laid out as upstream's (``src/liger_kernel/transformers/
functional.py`` and ``monkey_patch.py``, with their signatures), on a faked CUDA device: the fused
linear cross-entropy accumulates the LM head's gradient in fp32 (``accum_dtype``), Liger patches the
Hugging Face model before peft wraps it, and a Liger without ``accum_dtype`` is refused."""

from __future__ import annotations

import importlib
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_LLAMA

from lit_hbp.data.collate import collate_packs
from lit_hbp.lightning.module import HBPLitModule

# liger_fused_linear_cross_entropy as liger-kernel 0.6.2+ declares it (accum_dtype since 0.6.2),
# computed with torch so it runs on CPU, recording what it is given.
FUNCTIONAL = """
import torch

CALLS = []


def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index: int = -100,
        lse_square_scale: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean", softcap=None,
        return_z_loss: bool = False, accum_dtype=None, use_token_scaling: bool = False,
        return_token_accuracy: bool = False, return_predicted_tokens: bool = False):
    CALLS.append(dict(accum_dtype=accum_dtype, reduction=reduction))
    logits = torch.nn.functional.linear(input, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
"""
OLD_FUNCTIONAL = """
def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index: int = -100,
        lse_square_scale: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean", softcap=None,
        return_z_loss: bool = False):
    raise AssertionError("liger 0.6.1 has no accum_dtype: lit-hbp must refuse it before training")
"""
# _apply_liger_kernel_to_instance and apply_liger_kernel_to_llama as upstream resolve the model: the
# base model through ``base_model_prefix``, then its ``norm`` and ``layers`` (a peft wrapper resolves
# to the causal LM, which has neither).
MONKEY_PATCH = """
import inspect

SEEN = []


def apply_liger_kernel_to_llama(rope: bool = True, cross_entropy: bool = False, fused_linear_cross_entropy: bool = True,
        rms_norm: bool = True, swiglu: bool = True, model=None) -> None:
    SEEN.append(dict(model=type(model).__name__, cross_entropy=cross_entropy,
                     fused_linear_cross_entropy=fused_linear_cross_entropy))
    base_model = getattr(model, model.base_model_prefix, model)
    base_model.norm
    for decoder_layer in base_model.layers:
        decoder_layer.mlp, decoder_layer.input_layernorm


MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": apply_liger_kernel_to_llama}


def _apply_liger_kernel_to_instance(model, **kwargs) -> None:
    model_type = getattr(model, "config", None) and getattr(model.config, "model_type", None)
    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    params = inspect.signature(apply_fn).parameters
    apply_fn(model=model, **{k: v for k, v in kwargs.items() if k in params})
"""


def install(site: Path, functional: str) -> None:
    files = {
        "liger_kernel/__init__.py": "",
        "liger_kernel/transformers/__init__.py": "",
        "liger_kernel/transformers/functional.py": functional,
        "liger_kernel/transformers/monkey_patch.py": MONKEY_PATCH,
        "liger_kernel-0.6.4.dist-info/METADATA": "Metadata-Version: 2.1\nName: liger_kernel\nVersion: 0.6.4\n",
    }
    for path, text in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(textwrap.dedent(text))


@pytest.fixture
def liger(tmp_path, monkeypatch):
    """Installs a fake liger-kernel (``functional`` source given to the returned function) on a faked CUDA."""

    def setup(functional: str = FUNCTIONAL):
        site = tmp_path / "site"
        install(site, functional)
        monkeypatch.syspath_prepend(str(site))
        importlib.invalidate_caches()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        return importlib.import_module("liger_kernel.transformers.functional"), importlib.import_module(
            "liger_kernel.transformers.monkey_patch"
        )

    yield setup
    for name in [n for n in sys.modules if n == "liger_kernel" or n.startswith("liger_kernel.")]:
        del sys.modules[name]


def micro_batch():
    rng = np.random.default_rng(0)
    samples = {i: (rng.integers(0, 300, n), rng.random(n) < 0.6) for i, n in enumerate([30, 7, 51])}
    return collate_packs([np.arange(3)], samples.__getitem__, loss_norm=20.0, level=0)


def test_the_fused_loss_accumulates_the_head_gradient_in_fp32_and_equals_the_chunked_one(liger):
    functional, patch = liger()
    torch.manual_seed(0)
    fused = HBPLitModule(model=TINY_LLAMA, vocab_size=300, liger=True, attn_backend="sdpa")
    fused.configure_model()
    plain = HBPLitModule(model=TINY_LLAMA, vocab_size=300, attn_backend="sdpa")
    plain.configure_model()
    plain.model.load_state_dict(fused.model.state_dict())
    batch = micro_batch()
    loss, ce, n = fused(batch)
    assert functional.CALLS == [dict(accum_dtype=torch.float32, reduction="sum")]
    assert [s["model"] for s in patch.SEEN] == ["LlamaForCausalLM"]
    assert not patch.SEEN[0]["cross_entropy"] and not patch.SEEN[0]["fused_linear_cross_entropy"]
    want, want_ce, want_n = plain(batch)
    assert n == want_n and torch.allclose(loss, want, rtol=1e-5) and torch.allclose(ce, want_ce, rtol=1e-5)


def test_liger_patches_the_model_before_peft_wraps_it(liger):
    pytest.importorskip("peft", reason="peft is not installed")
    _, patch = liger()
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=300, liger=True, lora={"rank": 4}, attn_backend="sdpa")
    module.configure_model()  # upstream's resolution of a peft wrapper fails: AttributeError
    assert [s["model"] for s in patch.SEEN] == ["LlamaForCausalLM"]
    assert type(module.model).__name__.startswith("Peft")


def test_a_liger_without_accum_dtype_is_refused(liger):
    liger(OLD_FUNCTIONAL)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=300, liger=True, attn_backend="sdpa")
    with pytest.raises(ValueError, match=r"no accum_dtype.*liger-kernel>=0\.6\.2"):
        module.configure_model()


def test_the_gpu_extra_requires_the_liger_that_apply_liger_accepts():
    tomllib = pytest.importorskip("tomllib")
    from lit_hbp.model.build import LIGER_FLOOR

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert LIGER_FLOOR in project["optional-dependencies"]["gpu"]


@pytest.mark.parametrize(
    "setting, says",
    [
        ({"loss": "sample_mean"}, "the token weights differ per token"),
        ({"lora": {"rank": 4, "modules_to_save": ["lm_head"]}}, "the LM head is wrapped"),
        ({"lora": {"rank": 4, "target_modules": ["q_proj", "lm_head"]}}, "the LM head is wrapped"),
    ],
)
def test_liger_says_where_its_fused_loss_does_not_apply(liger, setting, says):
    """``liger=True`` with a loss whose weights differ per token or an LM head an adapter wraps ran the chunked loss
    (the same values) without a word, while the run looked like a fused one; a plain head with ``ave_token`` fuses
    and says nothing."""
    pytest.importorskip("peft", reason="peft is not installed")
    functional, _ = liger()
    batch = micro_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = HBPLitModule(model=TINY_LLAMA, vocab_size=300, liger=True, attn_backend="sdpa")
        fused.configure_model()
        fused(batch)
    assert len(functional.CALLS) == 1 and not [w for w in caught if "fused linear cross-entropy" in str(w.message)]
    functional.CALLS.clear()
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=300, liger=True, attn_backend="sdpa", **setting)
    module.configure_model()
    with pytest.warns(UserWarning, match=f"Liger's fused linear cross-entropy is not used, since {says}"):
        module(batch)
    assert functional.CALLS == []
