"""From a run to a usable model: export of ZeRO 2/3 checkpoints to save_pretrained folders (bit-exact
in fp32, loadable by transformers, resumable by lit-hbp), LoRA adapters (gradient parity with HF +
peft, only adapters train under ZeRO and SP), the export callback and the strategy's names."""

import copy
import json
import os
import shutil
import stat

import lightning as L
import numpy as np
import pytest
import torch
from conftest import CHAT_TEMPLATE, TINY_LLAMA, quiet_trainer, separate_loss
from levels_first import EachLevelFirst

from lit_hbp.data.collate import collate_packs
from lit_hbp.errors import ConfigError
from lit_hbp.export import export_checkpoint, load_checkpoint
from lit_hbp.lightning.module import HBPLitModule

TINY = {**TINY_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2}
LORA = {"rank": 4, "alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}
PROBE = [5, 17, 3, 44, 9, 28, 11, 2, 60, 31]  # token ids of the sample whose logits are compared
# A base model's own generation_config.json, as Llama-3 instruct's: sampling defaults and several EOS ids
# (7, 9, 11: none of them the toy tokenizer's EOS, 1, nor its chat template's end of turn, <|end|> = 5).
BASE_GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [7, 9, 11]}
SERVED_STOPS = [1, 5, 7, 9, 11]  # the tokenizer's EOS, the end of turn, then the base's, each once


def with_generation_config(folder):
    """``folder`` (a save_pretrained model folder) with BASE_GENERATION as its generation_config.json."""
    from transformers import GenerationConfig

    GenerationConfig(**BASE_GENERATION, bos_token_id=1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    rng = np.random.default_rng(5)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    path = tmp_path_factory.mktemp("export") / "d.jsonl"
    with path.open("w") as f:
        for i in range(80):
            n = int(rng.integers(60, 150)) if i % 8 == 0 else int(rng.integers(2, 25))
            q, a = " ".join(rng.choice(words, n)), " ".join(rng.choice(words, rng.integers(2, 20)))
            f.write(json.dumps({"prompt": q, "response": a}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, toy_tokenizer) -> str:
    """TINY saved as a user's checkpoint folder (save_pretrained, with the tokenizer and a generation config
    of its own, BASE_GENERATION): the ZeRO-3 runs start from it, so a ZeRO-3 partitioned load of a folder
    is checked too, and its generation config's way through DeepSpeed's checkpoint to the export."""
    from conftest import save_pretrained_checkpoint

    shape = {k: v for k, v in TINY.items() if k != "model_type"}
    folder = save_pretrained_checkpoint(tmp_path_factory.mktemp("tiny_folder"), toy_tokenizer, "llama", **shape)
    return str(with_generation_config(folder))


@pytest.fixture
def pool(shared_pool2):
    """The session's two gloo workers (conftest's shared_pool2): starting a pool costs more than most runs."""
    return shared_pool2


def train_and_save(
    stage: int, data: str, tokenizer: str, cache: str, out: str, lora: dict | None, model: str | dict = TINY
) -> dict:
    """2 ranks, levels sp 1 and sp 2, a few optimizer steps of ``model`` (a mapping or a checkpoint
    folder); the checkpoint saved to ``out``; the trained weights (gathered), the probe's logits
    through the module, and what the optimizer holds."""
    import deepspeed

    from lit_hbp.callbacks import HBPExport
    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.lightning.strategy import HBPStrategy

    dm = HBPDataModule(sources=[{"path": data}], tokenizer=tokenizer, levels=["96:1", "384:2"], cache_dir=cache)
    torch.manual_seed(0)
    module = HBPLitModule(model=model, vocab_size=dm.vocab_size, lr=1e-2, lora=lora)
    initial = {}

    class Initial(L.Callback):
        def on_train_start(self, trainer, pl_module):
            params = list(pl_module.model.named_parameters())
            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                initial.update({n: p.detach().clone() for n, p in params})

    merge = bool(lora) and isinstance(model, dict)  # an adapter of a mapping's model has no base to load beside it
    export = HBPExport(out + "_callback", merge_lora=merge)
    # Each level's first step first: the 4 steps train the sp 2 level too, whatever the plan's shuffle drew.
    callbacks = [Initial(), export, EachLevelFirst()]
    trainer = quiet_trainer(devices=2, strategy=HBPStrategy(stage=stage), max_steps=4, callbacks=callbacks)
    trainer.fit(module, dm)
    sp_trained = {dm.levels[lv].sp for lv in dm.plan_for_epoch(0).step_level[: trainer.global_step].tolist()}
    trainer.save_checkpoint(out)
    params = list(module.model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        weights = {n: p.detach().clone() for n, p in params}
        module.model.eval()
        with torch.no_grad():
            logits = module.model(input_ids=torch.tensor([PROBE]), use_cache=False).logits[0]
    states = trainer.optimizers[0].optimizer.state  # the AdamW inside ZeRO: this rank's flat partitions
    trained = sum(s["exp_avg"].numel() for s in states.values())
    return dict(weights=weights, initial=initial, logits=logits, trained_numel=trained, sp_trained=sp_trained)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_export_of_a_zero_checkpoint_is_exact_and_loads_in_transformers(
    pool, chats, toy_tokenizer, tiny_folder, tmp_path, stage
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = str(tmp_path / "run.ckpt")
    model, tokenizer = (tiny_folder, tiny_folder) if stage == 3 else (TINY, toy_tokenizer)
    results = pool.run(train_and_save, stage, str(chats), tokenizer, str(tmp_path / "cache"), ckpt, None, model)
    trained = results[0]
    if stage == 3:  # the folder's weights, loaded partitioned over the ranks, are what training starts from
        start = dict(AutoModelForCausalLM.from_pretrained(tiny_folder).named_parameters())
        assert all(torch.equal(start[n], w) for n, w in trained["initial"].items())
    out = export_checkpoint(ckpt, tmp_path / "hf")
    net = AutoModelForCausalLM.from_pretrained(out)
    exported = dict(net.named_parameters())
    assert set(exported) == set(trained["weights"])
    for name, w in trained["weights"].items():
        assert torch.equal(exported[name], w), name  # bit-exact in fp32
    assert any(not torch.equal(trained["initial"][n], w) for n, w in trained["weights"].items())
    net.eval()
    with torch.no_grad():
        logits = net(input_ids=torch.tensor([PROBE])).logits[0]
    torch.testing.assert_close(logits, trained["logits"], atol=1e-5, rtol=1e-5)
    assert net.config.use_cache and len(AutoTokenizer.from_pretrained(out)) == net.config.vocab_size
    # The model config and the tokenizer survive DeepSpeed's client state and Lightning's ZeRO converter.
    gathered = load_checkpoint(ckpt)
    assert {k: gathered["hf_config"][k] for k in TINY} == TINY
    assert gathered["hf_saved_dtype"] == ("float32" if stage == 3 else None)  # the folder's; a mapping says none
    assert "tokenizer.json" in gathered["HBPDataModule"]["tokenizer_files"]
    assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
    served = json.loads((out / "generation_config.json").read_text())
    if stage == 3:  # from a folder with a generation config of its own: kept, with every EOS
        assert {k: served[k] for k in ("do_sample", "temperature", "top_p")} == {
            k: BASE_GENERATION[k] for k in ("do_sample", "temperature", "top_p")
        }
        assert net.generation_config.eos_token_id == SERVED_STOPS
    else:  # from a mapping: <|endoftext|>, and <|end|> closing a turn; no sampling defaults
        assert net.generation_config.eos_token_id == [1, 5]
        assert not {"do_sample", "temperature", "top_p", "top_k"} & set(served)
    generated = net.generate(torch.tensor([PROBE]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (1, len(PROBE) + 4)
    # The callback's folder holds the same weights; bf16 export casts them.
    by_callback = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "run.ckpt_callback").named_parameters())
    assert all(torch.equal(by_callback[n], w) for n, w in trained["weights"].items())
    half = export_checkpoint(ckpt, tmp_path / "bf16", dtype="bfloat16")
    net16 = AutoModelForCausalLM.from_pretrained(half, dtype=torch.bfloat16)
    assert all(torch.equal(p, trained["weights"][n].bfloat16()) for n, p in net16.named_parameters())
    # model: <folder> resumes fine-tuning from the exported weights.
    again = HBPLitModule(model=str(out), vocab_size=net.config.vocab_size)
    again.configure_model()
    assert all(torch.equal(p, trained["weights"][n]) for n, p in again.model.named_parameters())
    batch = collate_packs([np.arange(1)], lambda i: (np.array(PROBE), np.ones(len(PROBE), bool)), loss_norm=9.0)
    loss = again(batch)[0]
    loss.backward()
    assert torch.isfinite(loss) and again.model.model.embed_tokens.weight.grad is not None


def test_export_of_a_zero_stage_0_folder_is_exact_and_one_missing_its_optimizer_states_is_named(
    chats, toy_tokenizer, tmp_path, capsys
):
    """ZeRO stage 0 shards nothing and writes no optimizer-states file: DeepSpeed's zero_to_fp32 crashed on its folder
    (a 26-line traceback; HBPExport after the whole run). Its model states hold the whole fp32 weights: exported
    bit-exact. A stage-2 folder whose optimizer-states files were lost is named in one line, exit 2."""
    from transformers import AutoModelForCausalLM

    from lit_hbp.export import main as export_main
    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.lightning.strategy import HBPStrategy, release_process_groups

    data = [{"path": str(chats)}]
    dm = HBPDataModule(sources=data, tokenizer=toy_tokenizer, levels=["384:1"], cache_dir=str(tmp_path))
    for stage in (0, 2):
        torch.manual_seed(0)
        module = HBPLitModule(model=TINY, vocab_size=dm.vocab_size, lr=1e-2, self_check=False)
        trainer = quiet_trainer(max_steps=2, strategy=HBPStrategy(stage=stage))
        try:
            trainer.fit(module, dm)
            trainer.save_checkpoint(tmp_path / f"s{stage}.ckpt")
        finally:
            release_process_groups()
        if stage == 0:
            out = export_checkpoint(tmp_path / "s0.ckpt", tmp_path / "hf")
            exported = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
            trained = dict(module.model.named_parameters())
            assert set(exported) == set(trained)
            assert all(torch.equal(exported[n], w.detach()) for n, w in trained.items())
    for lost in (tmp_path / "s2.ckpt").rglob("*optim_states.pt"):
        lost.unlink()
    assert export_main([str(tmp_path / "s2.ckpt"), str(tmp_path / "hf2")]) == 2
    said = capsys.readouterr().err.strip()
    assert said.endswith(
        "its tag folder has no optimizer-states files (*_optim_states.pt), where DeepSpeed's ZeRO stage 2 keeps "
        "the fp32 weights: copy the whole folder"
    )


@pytest.mark.slow
def test_zero2_on_two_ranks_logs_the_grad_norm_of_the_gradient_over_both(pool, toy_tokenizer, tmp_path):
    """train/grad_norm on two ranks (tests/test_grad_norm.py has the one-process checks), here to share
    this module's pool."""
    from test_grad_norm import check_two_ranks

    check_two_ranks(pool, toy_tokenizer, tmp_path)


def test_lora_adapter_gradients_equal_hf_and_peft_on_each_sample_alone():
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY, vocab_size=300, loss="sum", lora=LORA)
    module.configure_model()
    ref = copy.deepcopy(module.model)
    ref.base_model.model.set_attn_implementation("eager")
    rng = np.random.default_rng(0)
    samples = {i: (rng.integers(0, 300, n), rng.random(n) < 0.7) for i, n in enumerate([7, 40, 23, 61, 12])}
    batch = collate_packs([np.arange(5)], samples.__getitem__, loss_norm=1.0)
    module(batch)[0].backward()
    expected = separate_loss(ref, samples)
    expected.backward()
    adapters = 0
    for (name, p), q in zip(module.model.named_parameters(), ref.parameters()):
        if "lora_" in name:
            adapters += 1
            # relative to the gradient's own scale (a summed loss of ~500 puts float32's rounding at ~1e-5 of
            # an entry of 5): an elementwise tolerance flips with the thread count's summation order
            assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max(), name
        else:
            assert not p.requires_grad and p.grad is None, name
    assert adapters == 2 * 7 * TINY["num_hidden_layers"]  # A and B of q, k, v, o, gate, up, down


def test_the_self_check_passes_with_lora_on_the_input_embedding():
    """LoRA with ``embed_tokens`` among its target modules: the self-check read ``num_embeddings`` off peft's
    wrapper and stopped the fit with an AttributeError traceback. Its packed loss and every adapter's gradient are
    exact (the check's own reference: each document alone); a broken pack is still caught."""
    from lit_hbp.model.selfcheck import run_self_check

    torch.manual_seed(0)
    lora = {"rank": 4, "alpha": 8, "target_modules": ["embed_tokens", "q_proj"], "init_lora_weights": False}
    module = HBPLitModule(model=TINY, vocab_size=300, lora=lora)
    module.configure_model()
    loss_err, grad_err, leak, _ = run_self_check(module, [1])[1]
    assert max(loss_err, grad_err, leak) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_lora_trains_only_adapters_under_zero_and_sp_and_exports(
    pool, chats, toy_tokenizer, tiny_folder, tmp_path, stage
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = str(tmp_path / "lora.ckpt")
    model, tokenizer = (tiny_folder, tiny_folder) if stage == 3 else (TINY, toy_tokenizer)
    results = pool.run(train_and_save, stage, str(chats), tokenizer, str(tmp_path / "cache"), ckpt, LORA, model)
    r = results[0]
    assert r["sp_trained"] == {1, 2}  # under ZeRO and SP: micro-batches of both levels trained
    lora = {n for n in r["weights"] if "lora_" in n}
    # Adam states for the adapters only, partitioned over the ranks by ZeRO (flat partitions may be
    # padded for alignment, far below the frozen model's size).
    adapter_numel = sum(r["weights"][n].numel() for n in lora)
    assert lora and adapter_numel <= sum(x["trained_numel"] for x in results) <= adapter_numel + 256
    for name, w in r["weights"].items():
        assert torch.equal(w, r["initial"][name]) != (name in lora), name  # base frozen, adapters moved
    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "merged", merge_lora=True))
    merged.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=torch.tensor([PROBE])).logits[0], r["logits"], atol=1e-5, rtol=1e-5)
    if model == TINY:  # the base was built from a config mapping: its weights are in the checkpoint alone
        with pytest.raises(ValueError, match="an adapter alone could not be loaded; export with --merge-lora"):
            export_checkpoint(ckpt, tmp_path / "adapter")
        assert not (tmp_path / "adapter").exists()
        return
    adapter = export_checkpoint(ckpt, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert {"generation_config.json", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in adapter.iterdir()}
    served = json.loads((adapter / "generation_config.json").read_text())
    assert served["eos_token_id"] == SERVED_STOPS  # the base's own kept
    assert served.get("temperature") == BASE_GENERATION["temperature"]
    # The frozen base the run started from (peft names: base_model.model.<name>, wrapped layers' .base_layer).
    base = copy.deepcopy(merged)
    start = {
        n.removeprefix("base_model.model.").replace(".base_layer.", "."): w
        for n, w in r["initial"].items()
        if "lora_" not in n
    }
    base.load_state_dict(start, strict=True)
    with_adapter = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        got = with_adapter(input_ids=torch.tensor([PROBE])).logits[0]
    torch.testing.assert_close(got, r["logits"], atol=1e-5, rtol=1e-5)


class Force:
    """A logits processor: generation emits ``ids[i]`` at its step i, and keeps emitting the last."""

    def __init__(self, prompt_len: int, ids: list[int]):
        self.prompt_len, self.ids = prompt_len, ids

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.ids[min(step, len(self.ids) - 1)]] = 0.0
        return forced


def one_step_checkpoint(model: str, chats, root) -> str:
    """One optimizer step of ``model`` (a folder with its tokenizer) on one process, saved."""
    from lit_hbp.lightning.datamodule import HBPDataModule

    dm = HBPDataModule(sources=[{"path": str(chats)}], tokenizer=model, levels=["96:1", "384:1"], cache_dir=str(root))
    module = HBPLitModule(model=model, vocab_size=dm.vocab_size, self_check=False)
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, dm)
    trainer.save_checkpoint(root / "run.ckpt")
    return str(root / "run.ckpt")


def test_a_lora_bias_beside_layers_without_one_exports_as_an_adapter_and_merging_is_refused_in_one_line(
    chats, toy_tokenizer, tmp_path
):
    """``lora_bias: true`` on Llama (no layer has a bias): it trained, and ``--merge-lora`` stopped in peft's
    traceback ("Impossible to merge LoRA with lora_bias=True because the base layer has no bias"). The run says at
    set-up that it exports as an adapter only; the merge is refused in one line; a base built from a config mapping
    (no adapter export either) is refused before training."""
    from conftest import save_pretrained_checkpoint
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lit_hbp.lightning.datamodule import HBPDataModule

    shape = {k: v for k, v in TINY.items() if k != "model_type"}
    base = save_pretrained_checkpoint(tmp_path / "base", toy_tokenizer, "llama", **shape)
    lora = {"rank": 4, "lora_bias": True}
    dm = HBPDataModule(sources=[{"path": str(chats)}], tokenizer=str(base), levels=["96:1", "384:1"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    module = HBPLitModule(model=str(base), vocab_size=dm.vocab_size, self_check=False, lora=lora)
    trainer = quiet_trainer(max_steps=1)
    with pytest.warns(UserWarning, match=r"lora_bias: true trains a bias beside \d+ adapted layer\(s\) without a bias"):
        trainer.fit(module, dm)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    with pytest.raises(ConfigError, match=r"--merge-lora: the run trained a LoRA bias .* export the adapter"):
        export_checkpoint(tmp_path / "run.ckpt", tmp_path / "merged", merge_lora=True)
    adapter = export_checkpoint(tmp_path / "run.ckpt", tmp_path / "adapter")
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    probe = torch.tensor([PROBE])
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids=probe).logits, module.model.eval()(input_ids=probe).logits)
    mapping = HBPLitModule(model=TINY, vocab_size=dm.vocab_size, lora=lora)
    with pytest.raises(ConfigError, match=r"built from a config mapping has no base folder .* leave lora_bias out"):
        mapping.configure_model()


def test_an_adapter_export_names_its_base_by_a_path_a_server_finds(chats, toy_tokenizer, tmp_path, monkeypatch):
    """A LoRA run started from a folder given relative to the run's working directory (``model: base``) wrote
    ``base_model_name_or_path: base`` in the exported adapter: from a server's working directory peft looked for it
    on the Hub, or loaded another folder of that name (logits 0.65 off). The run now names its base by its absolute
    path, which peft's own ``AutoPeftModelForCausalLM`` loads from anywhere; an adapter whose named base is gone
    when it is exported is said."""
    from conftest import save_pretrained_checkpoint
    from peft import AutoPeftModelForCausalLM

    from lit_hbp.lightning.datamodule import HBPDataModule

    shape = {k: v for k, v in TINY.items() if k != "model_type"}
    save_pretrained_checkpoint(tmp_path / "base", toy_tokenizer, "llama", **shape)
    monkeypatch.chdir(tmp_path)
    dm = HBPDataModule(sources=[{"path": str(chats)}], tokenizer="base", levels=["96:1", "384:1"], cache_dir="cache")
    module = HBPLitModule(model="base", vocab_size=dm.vocab_size, self_check=False, lora={"rank": 4})
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, dm)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    adapter = export_checkpoint(tmp_path / "run.ckpt", tmp_path / "adapter")
    named = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str((tmp_path / "base").resolve())
    monkeypatch.chdir(tmp_path / "adapter")  # a server elsewhere
    served = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
    probe = torch.tensor([PROBE])
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids=probe).logits, module.model.eval()(input_ids=probe).logits)
    shutil.rmtree(tmp_path / "base")
    with pytest.warns(UserWarning, match=r"the adapter names its base model '.*base' .* which is not a folder here"):
        export_checkpoint(tmp_path / "run.ckpt", tmp_path / "adapter_again")


@pytest.mark.parametrize("own", [True, False], ids=["base-generation-config", "none"])
def test_export_keeps_the_base_models_generation_config_and_stops_at_all_its_ends(chats, toy_tokenizer, tmp_path, own):
    from conftest import save_pretrained_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    shape = {k: v for k, v in TINY.items() if k != "model_type"}
    base = save_pretrained_checkpoint(tmp_path / "base", toy_tokenizer, "llama", **shape)
    if own:
        with_generation_config(base)
    else:
        (base / "generation_config.json").unlink()
    ckpt = one_step_checkpoint(str(base), chats, tmp_path)
    assert ("hf_generation_config" in torch.load(ckpt, weights_only=False)) == own
    out = export_checkpoint(ckpt, tmp_path / "served")

    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    ends = {tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")}
    served = json.loads((out / "generation_config.json").read_text())
    sampling = {"do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens", "max_length"}
    if own:
        assert {k: served[k] for k in ("do_sample", "temperature", "top_p")} == {
            k: BASE_GENERATION[k] for k in ("do_sample", "temperature", "top_p")
        }
        assert set(served["eos_token_id"]) >= set(BASE_GENERATION["eos_token_id"]) | ends
        assert sampling & set(served) == {"do_sample", "temperature", "top_p"}  # nothing the base did not have
    else:  # as before: the tokenizer's EOS and the end of turn, no sampling defaults
        assert served["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]
        assert not sampling & set(served)
    assert len(served["eos_token_id"]) == len(set(served["eos_token_id"]))
    assert (served["bos_token_id"], served["pad_token_id"]) == (tok.bos_token_id, tok.pad_token_id)

    # Generation with the served config stops at each of its ends, and only there.
    net = AutoModelForCausalLM.from_pretrained(out).eval()
    generation = GenerationConfig.from_pretrained(out)
    prompt = torch.tensor([PROBE])
    with torch.no_grad():
        for end in served["eos_token_id"]:
            forced = [Force(len(PROBE), [20, end])]
            new = net.generate(prompt, generation_config=generation, logits_processor=forced, max_new_tokens=6)
            assert new[0, len(PROBE) :].tolist() == [20, end], end
        forced = [Force(len(PROBE), [20])]
        new = net.generate(prompt, generation_config=generation, logits_processor=forced, max_new_tokens=6)
        assert new.shape[1] == len(PROBE) + 6  # no end: it runs to the limit


def test_a_base_generation_config_with_sampling_flags_but_no_do_sample_exports_as_transformers_saves_it(
    chats, toy_tokenizer, tmp_path, monkeypatch
):
    """Llama 2's generation_config.json sets temperature and top_p without do_sample: transformers saves such a
    published config back (with a warning), but the export stopped on its strict check after writing the tokenizer,
    leaving a half folder a second export refused. The flags are kept as transformers' own save keeps them; an export
    that fails leaves nothing behind."""
    from conftest import save_pretrained_checkpoint
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

    shape = {k: v for k, v in TINY.items() if k != "model_type"}
    base = save_pretrained_checkpoint(tmp_path / "base", toy_tokenizer, "llama", **shape)
    (base / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "temperature": 0.6, "top_p": 0.9}))
    AutoModelForCausalLM.from_pretrained(base).generation_config.save_pretrained(tmp_path / "reference")
    reference = json.loads((tmp_path / "reference" / "generation_config.json").read_text())
    ckpt = one_step_checkpoint(str(base), chats, tmp_path)

    def fails(*args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedModel, "save_pretrained", fails)
        with pytest.raises(OSError, match="disk full"):
            export_checkpoint(ckpt, tmp_path / "served")
    assert sorted(p.name for p in tmp_path.iterdir() if "served" in p.name) == []  # nothing half-written
    out = export_checkpoint(ckpt, tmp_path / "served")
    served = json.loads((out / "generation_config.json").read_text())
    flags = ("do_sample", "temperature", "top_p")
    assert {k: served.get(k) for k in flags} == {k: reference.get(k) for k in flags} == {
        "do_sample": None, "temperature": 0.6, "top_p": 0.9
    }  # fmt: skip
    assert GenerationConfig.from_pretrained(out).eos_token_id == [1, 5]  # the served stops, as for any base
    (tmp_path / "made").mkdir()  # the folder's mode as the user's umask makes it (a staging folder's was 0700)
    assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE((tmp_path / "made").stat().st_mode)
    # An empty folder, or a link to one (the current directory, a mount point), is written into, as before.
    (tmp_path / "empty").mkdir()
    (tmp_path / "linked").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "linked")
    for given, held in (("empty", "empty"), ("link", "linked")):
        export_checkpoint(ckpt, tmp_path / given)
        assert sorted(p.name for p in (tmp_path / held).iterdir()) == sorted(p.name for p in out.iterdir())


def test_strategy_names_are_registered_with_lightning():
    """Importing the strategies (``from lit_hbp import HBPStrategy``; the command line does) registers their names;
    this test alone in a process failed, as it had relied on another test's import."""
    import lit_hbp.lightning.strategy  # noqa: F401

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="hbp_stage_3", logger=False)
    assert type(trainer.strategy).__name__ == "HBPStrategy" and trainer.strategy.zero_stage_3
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="hbp", logger=False)
    assert trainer.strategy.config["zero_optimization"]["stage"] == 2


def test_unknown_lora_settings_are_named():
    """Refused when the module is built (before the data is read), naming the config key."""
    with pytest.raises(ConfigError, match=r"^model.lora: unknown setting\(s\) \['alfa'\]"):
        HBPLitModule(model=TINY, vocab_size=300, lora={"rank": 4, "alfa": 8})
    # Two names of one peft field: the one given last won.
    with pytest.raises(ConfigError, match=r"^model.lora: rank \(16\) and r \(4\) are the same setting \(peft's r\)"):
        HBPLitModule(model=TINY, vocab_size=300, lora={"rank": 16, "r": 4})


def test_strategy_name_works_on_the_command_line(tmp_path, small_demo, monkeypatch):
    from pathlib import Path

    from lit_hbp.cli.app import main

    monkeypatch.chdir(tmp_path)
    root = Path(__file__).resolve().parents[1]
    args = ["--config", str(root / "configs/tiny_cpu.yaml"), "--data.demo_dir", str(small_demo)]
    cli = main(args + ["--trainer.strategy", "hbp_stage_2"], run=False)
    assert type(cli.trainer.strategy).__name__ == "HBPStrategy"
    assert cli.trainer.strategy.config["zero_optimization"]["stage"] == 2


def test_a_checkpoint_whose_weights_do_not_fit_its_config_is_one_error_line(chats, tiny_folder, tmp_path, capsys):
    """Another model's weights under a checkpoint's config (or a config edited after the run) ended in a 39-line
    load_state_dict traceback; it is one line naming the mismatch, status 2, nothing written."""
    from lit_hbp.export import main

    ckpt = torch.load(one_step_checkpoint(tiny_folder, chats, tmp_path), map_location="cpu", weights_only=False)
    capsys.readouterr()
    for name, change in (("wider", {"hidden_size": 2 * TINY["hidden_size"]}), ("deeper", {"num_hidden_layers": 3})):
        bad = dict(ckpt, hf_config={**ckpt["hf_config"], **change})
        torch.save(bad, tmp_path / f"{name}.ckpt")
        assert main([str(tmp_path / f"{name}.ckpt"), str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: the checkpoint's weights do not fit its model config (llama): ") and (
            "size mismatch" in err if name == "wider" else "missing ['model.layers.2." in err
        ), err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / name).exists()


def test_an_output_folder_that_cannot_be_looked_up_or_made_is_one_error_line(chats, tiny_folder, tmp_path, capsys):
    """An OUT_DIR whose name is too long for the file system (``out.exists()`` raised), or one under a folder that
    takes no new folders though it looks writable (``/proc``: the checks pass, ``mkdir`` fails after the model is
    built), ended in a traceback and status 1; one line naming OUT_DIR, status 2, nothing written."""
    from lit_hbp.export import main

    ckpt = one_step_checkpoint(tiny_folder, chats, tmp_path)
    capsys.readouterr()
    for out in (tmp_path / ("x" * 300), "/proc/lit_hbp_export_test"):
        assert main([ckpt, str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: OUT_DIR {out}") and len(err.strip().splitlines()) == 1, err
    assert not any(p.name.startswith(".x") for p in tmp_path.iterdir())


def test_an_adapter_export_of_a_mappings_model_is_refused_before_training(tmp_path):
    """HBPExport of a LoRA run whose base model was built from a config mapping: refused when fit sets up (after
    training, the adapter alone could not be loaded anywhere); with merge_lora it exports the merged model."""
    from lit_hbp.callbacks import HBPExport
    from lit_hbp.errors import ConfigError

    module = HBPLitModule(model=TINY, vocab_size=300, lora={"rank": 4})
    trainer = L.Trainer(logger=False, default_root_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match="export with --merge-lora \\(HBPExport: merge_lora: true\\)"):
        HBPExport(str(tmp_path / "out")).setup(trainer, module, "fit")
    HBPExport(str(tmp_path / "out"), merge_lora=True).setup(trainer, module, "fit")


def test_an_export_folder_that_holds_what_the_run_writes_is_refused_before_training(tmp_path):
    """HBPExport's dirpath where a ModelCheckpoint saves (or a folder above it, or the logger's) trained the whole
    run, then stopped on "OUT_DIR ... already holds epoch=0-step=2.ckpt" (the export command's name, not the
    callback's). Refused when fit sets up; a folder inside one, of its own, is taken."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from lit_hbp.callbacks import HBPExport

    module = HBPLitModule(model=TINY, vocab_size=300)
    logger = CSVLogger(tmp_path / "logs")
    trainer = L.Trainer(callbacks=[ModelCheckpoint(tmp_path / "ckpt")], logger=logger, default_root_dir=tmp_path)
    default = L.Trainer(logger=False, default_root_dir=tmp_path / "plain")  # Lightning's own ModelCheckpoint
    for run, folder in (
        (trainer, "ckpt"),
        (trainer, "."),
        (trainer, "logs/lightning_logs/version_0"),
        (default, "plain"),
    ):
        with pytest.raises(ConfigError, match=f"^HBPExport dirpath {tmp_path / folder} holds .* where this run writes"):
            HBPExport(str(tmp_path / folder)).setup(run, module, "fit")
    HBPExport(str(tmp_path / "ckpt" / "hf")).setup(trainer, module, "fit")


def test_an_export_whose_staging_checkpoint_path_exists_is_refused_before_training(tmp_path):
    """HBPExport saves the run's last checkpoint at ``<dirpath>.checkpoint`` and removes it after converting: a user's
    file or folder of that name was overwritten and deleted without a word. Refused when fit sets up, left as it was;
    without it the same dirpath is taken."""
    import shutil

    from lit_hbp.callbacks import HBPExport

    module = HBPLitModule(model=TINY, vocab_size=300)
    trainer = L.Trainer(logger=False, default_root_dir=tmp_path / "run", enable_checkpointing=False)
    for kind in ("file", "folder"):
        held = tmp_path / "out_hf.checkpoint"
        if kind == "file":
            held.write_text("my notes")
        else:
            (held / "inside").mkdir(parents=True)
        with pytest.raises(ConfigError, match=f"^HBPExport dirpath {tmp_path / 'out_hf'}: {held} exists, where"):
            HBPExport(str(tmp_path / "out_hf")).setup(trainer, module, "fit")
        assert held.read_text() == "my notes" if kind == "file" else (held / "inside").is_dir()
        held.unlink() if kind == "file" else shutil.rmtree(held)
    HBPExport(str(tmp_path / "out_hf")).setup(trainer, module, "fit")
    (tmp_path / "notes.txt").write_text("mine")  # a folder under a file: the whole run trained, then FileExistsError
    with pytest.raises(ConfigError, match="notes.txt is a file, so no folder can be made under it"):
        HBPExport(str(tmp_path / "notes.txt" / "hf")).setup(trainer, module, "fit")


def test_exporting_a_runs_checkpoints_folder_names_the_checkpoints_in_it(tmp_path, capsys):
    """``python -m lit_hbp.export runs/.../checkpoints OUT`` (the folder, not a checkpoint in it) said "a folder
    without DeepSpeed's `latest` file": it names the checkpoints inside and the one to give (``last.ckpt``, else
    the newest), status 2, nothing written."""
    from lit_hbp.export import main

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for age, name in ((100, "step=3.ckpt"), (200, "step=1.ckpt")):  # the newest by time, not by name
        torch.save({"global_step": 1}, folder / name)
        os.utime(folder / name, (1e9 - age, 1e9 - age))
    assert main([str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "a folder of checkpoints (step=1.ckpt, step=3.ckpt), not one: give one of them" in err, err
    assert err.strip().endswith(f"e.g. {folder / 'step=3.ckpt'}") and not (tmp_path / "out").exists(), err
    torch.save({"global_step": 1}, folder / "last.ckpt")
    assert main([str(folder), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"e.g. {folder / 'last.ckpt'}")


def test_a_tokenizers_named_chat_templates_reach_the_checkpoint_and_the_export(toy_tokenizer, tmp_path):
    """A tokenizer whose chat templates are named ({default, tool_use}: transformers renders with ``tool_use`` when
    tools are given) saves the named ones in a subfolder (``additional_chat_templates/``); the checkpoint's tokenizer
    files kept only the folder's own files, so the export rendered a tool conversation without its tools, and a
    resume with the same tokenizer was told it was another. Against the run's own tokenizer: the same render."""
    from transformers import AutoTokenizer

    from lit_hbp.lightning.renderers import tokenizer_files, tokenizer_from_files, write_files

    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    tool_use = "TOOLS {{ tools | tojson }}\n" + tok.chat_template
    tok.chat_template = {"default": tok.chat_template, "tool_use": tool_use}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    files = tokenizer_files(tok)
    assert any(name.startswith("additional_chat_templates/") for name in files), sorted(files)
    exported = tokenizer_from_files(files, tmp_path / "export")
    want = tok.apply_chat_template(chat, tools=tools, tokenize=False)
    assert want.startswith("TOOLS [")
    assert exported.apply_chat_template(chat, tools=tools, tokenize=False) == want
    assert exported.chat_template == tok.chat_template
    with pytest.raises(ValueError, match="would be written outside"):
        write_files({"../escaped.jinja": b"x"}, tmp_path / "export")
    assert not (tmp_path / "escaped.jinja").exists()
