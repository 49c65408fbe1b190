"""LoRA settings: each peft.LoraConfig field lit-hbp takes trains as peft would, or is refused by name before the data.

References are independent: a PeftModel built by hand from the unprepared model with eager attention, each document
alone; peft's own behaviour for what a setting does.
"""

import json

import numpy as np
import pytest
import torch
from conftest import TINY_LLAMA, separate_loss
from test_config_checks import TINY as TINY_YAML
from test_config_checks import cli_error

from lit_hbp.data.collate import collate_packs
from lit_hbp.errors import ConfigError
from lit_hbp.export import check_adapter_servable
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.model.build import LORA_REFUSED

TINY = {**TINY_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2}


def module_of(lora, config=TINY) -> HBPLitModule:
    torch.manual_seed(0)
    module = HBPLitModule(model=config, vocab_size=300, loss="sum", lora=lora)
    module.configure_model()
    return module


@pytest.mark.parametrize("field", sorted(LORA_REFUSED))
def test_a_lora_field_lit_hbp_cannot_train_as_peft_would_is_refused_by_name(field):
    """Activated LoRA (``alora_invocation_tokens``) trained as plain LoRA (packed calls skip PeftModel.forward,
    which finds the invocation: 0.12 off peft per document, every adapter gradient off); ``layer_replication``
    copied decoder layers after they were prepared, so the copies let documents attend to each other (the
    self-check blamed the family; without it, silently wrong); ``inference_mode``, ``runtime_config``, LoftQ,
    Megatron and the data-driven inits stopped with tracebacks after the data was read. Each is one error naming
    the field, when the module is built."""
    value = {"inference_mode": True, "use_qalora": True, "use_bdlora": True}.get(field, {"x": 1})
    if field == "alora_invocation_tokens":
        value = [5, 6]
    with pytest.raises(ConfigError, match=rf"^model\.lora\.{field}: .* is refused: .*; leave it out$"):
        HBPLitModule(model=TINY, vocab_size=300, lora={"rank": 4, field: value})
    if field in ("inference_mode", "use_qalora", "use_bdlora"):  # false: what peft does by default, taken
        HBPLitModule(model=TINY, vocab_size=300, lora={"rank": 4, field: False})


@pytest.mark.parametrize("init", ["eva", "corda", "loftq"])
def test_an_init_that_needs_the_data_or_a_quantized_base_is_refused(init):
    with pytest.raises(ConfigError, match=rf"^model\.lora\.init_lora_weights: '{init}' is refused"):
        HBPLitModule(model=TINY, vocab_size=300, lora={"rank": 4, "init_lora_weights": init})


def test_trainable_token_indices_train_as_peft_trains_them_and_pass_the_self_check():
    """``trainable_token_indices`` (peft's trainable rows of the embedding): the self-check read the vocabulary
    off peft's wrapper and stopped the fit with an AttributeError traceback. The packed loss and every trainable
    tensor's gradient equal a PeftModel built by hand, each document alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lit_hbp.model.selfcheck import run_self_check

    lora = {"rank": 4, "init_lora_weights": False, "trainable_token_indices": [5, 17, 44]}
    module = module_of(lora)
    loss_err, grad_err, leak, _ = run_self_check(module, [1])[1]
    assert max(loss_err, grad_err, leak) < 1e-4
    base = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"},
                                                        vocab_size=300, attn_implementation="eager"))  # fmt: skip
    config = {"r": 4, "init_lora_weights": False, "trainable_token_indices": [5, 17, 44]}
    reference = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear", **config))
    reference.load_state_dict(module.model.state_dict())
    rng = np.random.default_rng(0)
    samples = {i: (rng.integers(0, 60, n), rng.random(n) < 0.7) for i, n in enumerate([7, 40, 23])}
    module.zero_grad()
    module(collate_packs([np.arange(3)], samples.__getitem__, loss_norm=1.0))[0].backward()
    separate_loss(reference, samples).backward()
    got = {n: p.grad for n, p in module.model.named_parameters() if p.requires_grad}
    want = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and any("trainable_tokens_delta" in n for n in got)
    for name, grad in want.items():
        assert (got[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


def test_lora_only_biases_where_no_adapted_layer_has_one_are_refused():
    """``bias: lora_only`` on Qwen2 adapting only ``o_proj`` and ``down_proj`` (no biases there): peft trains no bias,
    silently; lit-hbp refused this only where the whole model had none. Refused; adapting ``q_proj`` trains its bias."""
    qwen2 = {**TINY, "model_type": "qwen2"}
    with pytest.raises(ConfigError, match="model.lora.bias: 'lora_only' trains the biases of the layers LoRA adapts"):
        module_of({"rank": 4, "bias": "lora_only", "target_modules": ["o_proj", "down_proj"]}, qwen2)
    module = module_of({"rank": 4, "bias": "lora_only", "target_modules": ["q_proj", "o_proj"]}, qwen2)
    trained = {n for n, p in module.model.named_parameters() if p.requires_grad and n.endswith(".bias")}
    assert trained and all("q_proj" in n for n in trained), trained


def test_dora_under_zero3_is_refused_before_the_data(capsys, tmp_path, monkeypatch):
    """``use_dora`` at ZeRO stage 3: peft's DoRA read the partitioned weights' shape, and the self-check stopped the
    fit blaming the family (``IndexError: tuple index out of range``). Refused by name before the data is read."""
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", TINY_YAML, "--trainer.strategy", "hbp_stage_3"]
    err = cli_error(capsys, [*args, "--model.lora", json.dumps({"rank": 4, "use_dora": True})])
    assert err[0].startswith("error: model.lora.use_dora: DoRA reads each adapted weight whole"), err
    from lit_hbp.model.build import check_lora_strategy

    check_lora_strategy({"rank": 4, "use_dora": True}, 2)  # stages 0-2 train it


def test_a_checkpoint_folder_holding_an_adapter_or_quantized_weights_is_refused(tmp_path):
    """A folder with ``adapter_config.json`` beside ``config.json``: transformers loads the adapter with the base, so
    ``model.lora`` dropped it silently and without LoRA the run stopped with "optimizer got an empty parameter
    list"; a quantized folder (``quantization_config``) failed in ``from_pretrained`` after the data was read. Both
    refused when the module is built."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path / "model"
    config = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}, vocab_size=300)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    HBPLitModule(model=str(folder), vocab_size=300)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(ConfigError, match=r"^model: .* holds a peft adapter \(adapter_config.json\)"):
        HBPLitModule(model=str(folder), vocab_size=300, lora={"rank": 4})
    (folder / "adapter_config.json").unlink()
    saved = json.loads((folder / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=r"quantized checkpoint \(quantization_config, quant_method 'bitsandbytes'\)"):
        HBPLitModule(model=str(folder), vocab_size=300, lora={"rank": 4})


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda"])
def test_an_adapter_alone_of_an_init_that_moved_base_weights_is_refused(init):
    """PiSSA and OLoRA move the adapter's start out of each base weight: the adapter exported alone, loaded on the
    original base (what a server does), was 0.48 off the trained model in its logits. The export asks for
    ``--merge-lora``, which is exact."""
    hparams = {"lora": {"rank": 4, "init_lora_weights": init}, "model": "/some/folder"}
    with pytest.raises(ConfigError, match=rf"init_lora_weights '{init}', which moved part of each base weight"):
        check_adapter_servable(hparams, merge_lora=False)
    check_adapter_servable(hparams, merge_lora=True)
    check_adapter_servable({"lora": {"rank": 4, "init_lora_weights": "gaussian"}, "model": "/f"}, merge_lora=False)


@pytest.mark.parametrize("order", ["peft_then_prepare", "prepare_then_peft"])
def test_a_users_own_activated_lora_is_refused_by_the_public_core(order):
    """A user's own PeftModel with ``alora_invocation_tokens`` through ``prepare_model`` + ``packed_loss`` trained as
    plain LoRA, silently: the invocation offsets are computed in PeftModel.forward, which a packed call skips."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lit_hbp import pack_samples, packed_loss, prepare_model

    config = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}, vocab_size=64)
    net = AutoModelForCausalLM.from_config(config)
    lora = LoraConfig(r=4, alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"])
    batch = pack_samples([(np.arange(1, 9), np.ones(8, bool)), (np.arange(3, 12), np.ones(9, bool))])
    with pytest.raises(ValueError, match=r"activated LoRA \(alora_invocation_tokens\) .* would train as plain LoRA"):
        if order == "peft_then_prepare":
            prepare_model(get_peft_model(net, lora))
        else:
            packed_loss(get_peft_model(prepare_model(net), lora), batch)


@pytest.fixture
def in_process_deepspeed():
    """An in-process DeepSpeed fit leaves DeepSpeed holding its process groups: released the DeepSpeed way."""
    deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    yield
    if torch.distributed.is_initialized():
        deepspeed.comm.destroy_process_group()


@pytest.mark.parametrize("init", [True, "gaussian"])
def test_lora_under_zero3_starts_as_its_base_model(sp_data, toy_tokenizer, tmp_path, in_process_deepspeed, init):
    """Under ZeRO-3 peft made each adapter inside ``zero.Init``, which partitioned it as it was made, so peft's
    ``lora_B = 0`` wrote into an empty shard: the run began from base + a random B A (0.63 off the base model's
    logits; ZeRO-2 began at the base). Every adapter's B is zero when training starts, A drawn as peft draws it."""
    import deepspeed
    import lightning as L
    from conftest import quiet_trainer

    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.lightning.strategy import HBPStrategy

    class Start(L.Callback):
        def on_train_start(self, trainer, pl_module):
            params = [(n, p) for n, p in pl_module.model.named_parameters() if "lora_" in n]
            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                self.norms = {n: float(p.norm()) for n, p in params}
                self.std = float(torch.cat([p.flatten() for n, p in params if "lora_A" in n]).std())

    dm = HBPDataModule(sources=[{"path": str(sp_data)}], tokenizer=toy_tokenizer, levels=[256], cache_dir=str(tmp_path))
    module = HBPLitModule(model=TINY, vocab_size=dm.vocab_size, lora={"rank": 4, "init_lora_weights": init})
    start = Start()
    trainer = quiet_trainer(strategy=HBPStrategy(stage=3), max_steps=1, callbacks=[start])
    trainer.fit(module, dm)
    assert len(start.norms) == 2 * 7 * TINY["num_hidden_layers"]
    assert all(v == 0 for n, v in start.norms.items() if "lora_B" in n), start.norms
    assert all(v > 0 for n, v in start.norms.items() if "lora_A" in n), start.norms
    if init == "gaussian":  # peft's gaussian start: std 1 / rank
        assert start.std == pytest.approx(1 / 4, rel=0.15)


def test_inits_from_the_base_weight_and_trainable_tokens_are_refused_under_zero3():
    from lit_hbp.model.build import check_lora_strategy

    for lora, field in (
        ({"init_lora_weights": "pissa"}, "init_lora_weights"),
        ({"init_lora_weights": "olora"}, "init_lora_weights"),
        ({"init_lora_weights": "orthogonal"}, "init_lora_weights"),
        ({"trainable_token_indices": [3]}, "trainable_token_indices"),
        ({"use_dora": True}, "use_dora"),
    ):
        with pytest.raises(ConfigError, match=rf"^model\.lora\.{field}: .* which DeepSpeed ZeRO stage 3 partitions"):
            check_lora_strategy({"rank": 4, **lora}, 3)
        check_lora_strategy({"rank": 4, **lora}, 2)
    check_lora_strategy({"rank": 4, "init_lora_weights": "gaussian"}, 3)


def test_peft_does_not_change_the_runs_lora_settings():
    """peft rewrote ``modules_to_save: [embed_tokens]`` with ``ensure_weight_tying`` on a tied model to
    ``[embed_tokens, model.embed_tokens]`` in the run's own hyperparameters, so a resume with the run's YAML was
    refused as a changed setting."""
    lora = {"rank": 4, "modules_to_save": ["embed_tokens"], "ensure_weight_tying": True}
    module = module_of(dict(lora, modules_to_save=["embed_tokens"]), {**TINY, "tie_word_embeddings": True})
    assert module.hparams.lora == lora


@pytest.mark.parametrize(
    "lora, says",
    [
        ({"rank_pattern": {"q_projj": 16}}, r"model\.lora\.rank_pattern: 'q_projj' matches no module LoRA adapts"),
        ({"alpha_pattern": {"nope": 64}}, r"model\.lora\.alpha_pattern: 'nope' matches no module LoRA adapts"),
        ({"exclude_modules": ["nope_proj"]}, r"model\.lora\.exclude_modules: 'nope_proj' names no module of"),
        ({"target_modules": ["q_proj", "nope_proj"]}, r"model\.lora\.target_modules: 'nope_proj' names no adapted"),
    ],
)
def test_lora_names_and_patterns_that_match_nothing_are_refused(lora, says):
    """A pattern or a listed name that matched no module was taken and changed nothing (peft says nothing unless no
    target at all matches), as ``modules_to_save`` naming no module was before it was refused. What matches is taken:
    the q projections at rank 16, the others at 4."""
    with pytest.raises(ConfigError, match=says):
        module_of({"rank": 4, **lora})
    with pytest.raises(ConfigError, match=r"model\.lora\.modules_to_save: give a list of module names, e.g. \[lm_"):
        module_of({"rank": 4, "modules_to_save": "lm_head"})  # it named the module 'l'
    module = module_of({"rank": 4, "rank_pattern": {"q_proj": 16}, "exclude_modules": ["lm_head"]})
    ranks = {n.rsplit(".", 1)[-1]: m.r["default"] for n, m in module.model.named_modules() if "layers.0." in n
             and isinstance(getattr(m, "r", None), dict)}  # fmt: skip
    assert ranks["q_proj"] == 16 and ranks["k_proj"] == 4, ranks


def test_a_users_poly_adapter_is_refused_by_the_public_core():
    """peft's Poly routes each call by the ``task_ids`` PeftModel.forward is given, which a packed call never runs:
    ``prepare_model`` took it and the packed call failed deep in peft ("task_ids should not be None")."""
    import peft
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lit_hbp import prepare_model

    config = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}, vocab_size=64)
    poly = peft.PolyConfig(task_type="CAUSAL_LM", r=4, n_tasks=2, n_skills=2, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"peft's POLY routes each call by what the wrapper's own forward is given"):
        prepare_model(peft.get_peft_model(AutoModelForCausalLM.from_config(config), poly))
