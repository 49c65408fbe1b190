"""The parameters the memory model prices as weights, gradients and Adam states, against the model itself: a
shared, looped or nested layer's held once (``model.parameters()``'s count of a tiny model of the family), a LoRA
run's adapters and ``modules_to_save`` copies as the run's own ``apply_lora`` makes them (what takes a gradient)."""

import copy
import warnings

import pytest
import torch
from conftest import TINY_LLAMA
from families import small_config
from transformers import AutoConfig, AutoModelForCausalLM

from lit_hbp.cost.config import spec_of
from lit_hbp.cost.hardware import HARDWARE
from lit_hbp.cost.run_settings import config_settings, cost_model
from lit_hbp.errors import ConfigError
from lit_hbp.model.build import apply_lora, build_causal_lm

# Zamba's shared attention block (used by every hybrid layer) and Mamba layer nested in its hybrid layer, Zamba2's
# shared blocks, HRM's and Dory's layers looped over several cycles; Llama's, counted once each already; GPT-2's
# learned positions (a table the formula's embeddings left out: -46% on this shape).
SHARED = ["zamba", "zamba2", "hrm_text", "dory", "llama", "gpt2"]


def tiny(family: str) -> tuple[dict, torch.nn.Module]:
    """The family's small config mapping and the model transformers builds from it."""
    config = small_config(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoConfig.for_model(family, **{k: v for k, v in config.items() if k != "model_type"})
        return config, AutoModelForCausalLM.from_config(hf)


@pytest.mark.parametrize("family", SHARED)
def test_a_layer_shared_looped_or_nested_holds_its_parameters_once(family):
    """The level search's spec (``spec_of``: the model built on the meta device) holds the parameters the built
    model holds, each tensor once: it counted a layer per use (Zamba +3%, Zamba2 -17%, HRM +238%, Dory +62% on
    these shapes), pricing its weights, gradients and Adam states at what the run does not hold."""
    config, net = tiny(family)
    reference = sum(p.numel() for p in net.parameters())
    spec = spec_of(config)
    assert spec.params == reference
    run = config_settings({"trainer": {"strategy": "hbp", "precision": "bf16-mixed"}}, HARDWARE["h100"], 1)
    parts = cost_model(spec, run).static_parts()
    assert (parts["params"], parts["grads"], parts["optimizer"]) == (2 * reference, 2 * reference, 12 * reference)


def test_the_layers_matrices_count_once():
    """HRM runs its layers in cycles: the matrices the layers hold (what autocast's copies of them price) are
    each counted once (16 layers of the config priced over its 4 held layers: four times them)."""
    config, net = tiny("hrm_text")
    spec = spec_of(config)
    layers = [m for n, m in net.named_modules() if type(m).__name__ == "HrmTextDecoderLayer"]
    held = sum(p.numel() for layer in layers for p in layer.parameters() if p.dim() >= 2)
    assert spec.layers * spec.total_layer_params == pytest.approx(held)


LORAS = [
    {"rank": 8},
    {"rank": 64, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    {"rank": 4, "modules_to_save": ["lm_head"]},
    {"r": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"], "use_dora": True},
    {"rank": 2, "bias": "lora_only", "target_modules": "all-linear"},
]


def adapted_biases(base, lora) -> list[str]:
    """The biases of the layers peft's LoRA adapts (what ``bias: lora_only`` trains), by peft alone."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    kw = {"r": lora["rank"], "target_modules": lora["target_modules"]}
    net = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **kw))
    return [n for n, m in net.named_modules() if isinstance(m, BaseTunerLayer) and m.get_base_layer().bias is not None]


@pytest.mark.parametrize("family", ["llama", "qwen2", "zamba2"])
@pytest.mark.parametrize("lora", LORAS, ids=lambda lora: "-".join(f"{k}={v}" for k, v in lora.items()))
def test_a_lora_run_prices_the_gradients_and_states_of_what_it_trains(family, lora):
    """The LoRA run's own ``apply_lora`` on the real model: its parameters that take a gradient (adapters of
    ``rank`` x (inputs + outputs) on every target, DoRA's magnitudes, ``modules_to_save``' copies, the biases
    ``lora_only`` trains) are what the memory model prices gradients and Adam states for (0 before: the level
    search chose levels a rank-256 8B run's 9 GiB of gradients and states did not fit); it holds all of them."""
    config = small_config(family)
    torch.manual_seed(0)
    base = build_causal_lm(config)
    names = [name for name, _ in base.named_modules()]
    targets = lora.get("target_modules")
    unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)] if isinstance(
        targets, list) else []  # fmt: skip
    if unmatched:  # zamba2 has no gate_proj: a listed name that changes nothing is refused
        with pytest.raises(ConfigError, match=f"model.lora.target_modules: {unmatched[0]!r} names no adapted module"):
            apply_lora(base, dict(lora))
        return
    if lora.get("bias") and not adapted_biases(copy.deepcopy(base), lora):
        with pytest.raises(ConfigError, match="model.lora.bias: 'lora_only' trains the"):
            apply_lora(base, dict(lora))  # it would train nothing more: refused (no adapted layer has a bias)
        return
    net = apply_lora(base, dict(lora))
    trained = sum(p.numel() for p in net.parameters() if p.requires_grad)
    held = sum(p.numel() for p in net.parameters())
    spec = spec_of(config)
    for strategy, precision, grad, state, weight in (("hbp", "bf16-mixed", 2, 12, 2), ("ddp", "32-true", 4, 8, 4)):
        train = {"trainer": {"strategy": strategy, "precision": precision}, "model": {"model": config, "lora": lora}}
        parts = cost_model(spec, config_settings(train, HARDWARE["h100"], 1, spec)).static_parts()
        assert parts["grads"] == pytest.approx(grad * trained) and parts["optimizer"] == pytest.approx(state * trained)
        assert parts["params"] == pytest.approx(weight * held)


def test_a_vision_language_models_lora_is_counted_on_its_checkpoint_folder(tmp_path):
    """A Qwen2-VL folder: LoRA on its language model's linear layers (``apply_lora``'s default there), counted on
    the folder's model; its tower frozen, its parameters and the language model's held."""
    from vision_models import build_qwen

    folder = str(build_qwen(tmp_path / "qwen"))
    lora = {"rank": 8}
    net = apply_lora(build_causal_lm(folder), dict(lora))
    trained = sum(p.numel() for p in net.parameters() if p.requires_grad)
    held = sum(p.numel() for p in net.parameters())
    spec = spec_of(folder)
    train = {"trainer": {"strategy": "hbp", "precision": "bf16-mixed"}, "model": {"model": folder, "lora": lora}}
    cost = cost_model(spec, config_settings(train, HARDWARE["h100"], 1, spec))
    parts = cost.static_parts()
    assert not cost.vision_trained and parts["grads"] == pytest.approx(2 * trained)
    assert parts["optimizer"] == pytest.approx(12 * trained) and parts["params"] == pytest.approx(2 * held)


def test_the_level_search_and_the_memory_command_count_lora_on_the_model_they_price(tmp_path, capsys):
    """A config's LoRA counted on the model the tool prices (its --model, a preset: the published Llama's
    shape): rank 256 on Llama-3.1-8B trains 0.67B parameters, whose bf16 gradients and fp32 master and Adam
    states the table shows (they were 0)."""
    import yaml

    from lit_hbp.autoselect.selector import RunSetting
    from lit_hbp.cost.memory import main
    from lit_hbp.model_spec import MODELS

    lora = {"rank": 256}
    mapping = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}  # fmt: skip
    with torch.device("meta"):
        net = apply_lora(build_causal_lm(mapping), lora)
    trained = sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert trained == pytest.approx(0.671e9, rel=1e-3)
    config = {"trainer": {"strategy": "hbp", "precision": "bf16-mixed", "devices": 8},
              "model": {"model": {**TINY_LLAMA, "vocab_size": 300}, "lora": lora},
              "data": {"levels": [{"pack_len": 4096, "ckpt_layers": 32}]}}  # fmt: skip
    run = RunSetting.from_config(config, None, 8, spec=MODELS["llama3.1-8b"])
    parts = run.cost_model(HARDWARE["h100"]).static_parts()
    assert parts["grads"] == pytest.approx(2 * trained / 8) and parts["optimizer"] == pytest.approx(12 * trained / 8)
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["--config", str(path), "--model", "llama3.1-8b"]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["0", "4096"])
    assert float(row[8]) == pytest.approx(12 * trained / 8 / 2**30, abs=0.05)  # optimizer, ZeRO-2 over 8


def test_the_fit_time_memory_check_counts_what_the_module_trains():
    """``HBPLitModule.cost_model`` (the fit-start check on a GPU) prices the module's own LoRA model: its trained
    parameters' gradients and states, and the adapters beside the weights."""
    import lightning as L

    from lit_hbp.lightning.module import HBPLitModule

    module = HBPLitModule(model={**TINY_LLAMA, "vocab_size": 300}, lora={"rank": 8, "modules_to_save": ["lm_head"]})
    module.configure_model()
    module.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, precision="32-true")
    trained = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    held = sum(p.numel() for p in module.model.parameters())
    cost, _ = module.cost_model(80 * 2**30)
    parts = cost.static_parts()
    assert parts["grads"] == pytest.approx(4 * trained) and parts["optimizer"] == pytest.approx(8 * trained)
    assert parts["params"] == pytest.approx(4 * held)


def test_a_lora_run_of_a_model_that_cannot_be_built_here_is_refused_by_name():
    from lit_hbp.cost.run_settings import settings_of
    from lit_hbp.errors import ConfigError
    from lit_hbp.model_spec import ModelSpec

    spec = ModelSpec("custom", 2, 64, 4, 4, 128, 300)
    with pytest.raises(ConfigError, match="model.lora: the cost model counts LoRA's trained parameters"):
        settings_of(HARDWARE["h100"], 1, None, {"lora": {"rank": 8}}, spec=spec)


def test_the_gradient_sync_moves_a_trained_vision_towers_gradients_too(tmp_path):
    """A Qwen2-VL folder trained whole: the gradient sync moves every trained parameter's gradient, the tower's
    with the language model's (the tower's were held and stepped, but left out of the sync's time). Counted on the
    folder's model."""
    from vision_models import build_qwen

    from lit_hbp.cost.costmodel import CostModel

    folder = str(build_qwen(tmp_path / "qwen"))
    everything = sum(p.numel() for p in build_causal_lm(folder).parameters())
    spec, hw, world = spec_of(folder), HARDWARE["h100"], 8
    cost = CostModel(spec, hw, world, vision_trained=True)
    hand = 2 * 2 * everything * (world - 1) / world / (hw.intra_node_bw * hw.eff_link) * (1 - cost.grad_sync_overlap)
    assert cost.grad_sync_seconds() == pytest.approx(hand, rel=1e-9)
    assert CostModel(spec, hw, world, vision_trained=False).grad_sync_seconds() < 0.99 * hand


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_tiled_mlp_recomputes_and_sums_its_own_matrices(family):
    """MLP tiles run each layer's MLP forward once more in the backward and sum its weights' gradients in fp32:
    GPT-2's MLP has two matrices, Llama's three (priced three for every family: GPT-2's 1.5x). Counted on the
    model transformers builds: a forward is 2 FLOPs per weight per token."""
    from lit_hbp.cost.costmodel import CostModel

    config, net = tiny(family)
    layer = next(m for name, m in net.named_modules() if name.endswith(("h.0.mlp", "layers.0.mlp")))
    weights = sum(p.numel() for name, p in layer.named_parameters() if p.dim() == 2)
    spec, hw, tokens = spec_of(config), HARDWARE["h100"], 1000.0
    cost = CostModel(spec, hw, 1)
    extra = (cost.dense_seconds(tokens, 0, tiles=2) - cost.dense_seconds(tokens, 0)) * hw.peak_flops * hw.eff_dense
    assert extra == pytest.approx(spec.layers * 2 * weights * tokens, rel=1e-9)
    assert cost.working_bytes(0.0, 1, tiles=2) == pytest.approx(4 * weights)  # the fp32 sums, of no token
