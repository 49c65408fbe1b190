"""What an export serves is what the run trained, as the family's own model would save and load it: a LoRA
merged over tied embeddings, a base folder's generation config marked ``_from_model_config``, the padding id
config.json keeps, the weights a family keeps in fp32 under bf16; and a path that is not a run's checkpoint
named for what it is."""

import copy
import json

import numpy as np
import pytest
import torch
from conftest import quiet_trainer, save_pretrained_checkpoint
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
)

from lit_hbp.export import cast_for_saving, export_checkpoint, main
from lit_hbp.lightning.datamodule import HBPDataModule
from lit_hbp.lightning.module import HBPLitModule

PROBE = [5, 17, 3, 44, 9, 28, 11, 2, 60, 31]
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    rng = np.random.default_rng(5)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    path = tmp_path_factory.mktemp("serving") / "d.jsonl"
    with path.open("w") as f:
        for _ in range(40):
            q, a = " ".join(rng.choice(words, rng.integers(2, 25))), " ".join(rng.choice(words, rng.integers(2, 20)))
            f.write(json.dumps({"prompt": q, "response": a}) + "\n")
    return path


def run(folder, chats, root, steps=1, **module_kw):
    """``steps`` optimizer steps of the model folder (its tokenizer beside it), saved; the module and the checkpoint."""
    dm = HBPDataModule(sources=[{"path": str(chats)}], tokenizer=str(folder), levels=["128:1"], cache_dir=str(root))
    torch.manual_seed(0)
    module = HBPLitModule(model=str(folder), vocab_size=dm.vocab_size, self_check=False, lr=1e-2, **module_kw)
    trainer = quiet_trainer(max_steps=steps)
    trainer.fit(module, dm)
    trainer.save_checkpoint(root / "run.ckpt")
    return module, str(root / "run.ckpt")


def trained_logits(module) -> torch.Tensor:
    """The trained network run as the family's own model: unprepared, eager attention (a copy)."""
    from lit_hbp import unprepare_model

    net = unprepare_model(copy.deepcopy(module.model))
    base = net.get_base_model() if hasattr(net, "peft_config") else net
    base.set_attn_implementation("eager")
    with torch.no_grad():
        return net.eval()(input_ids=torch.tensor([PROBE]), use_cache=False).logits[0]


def served_logits(folder) -> torch.Tensor:
    net = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return net(input_ids=torch.tensor([PROBE]), use_cache=False).logits[0]


@pytest.mark.parametrize("targets", [["embed_tokens", "q_proj"], ["embed_tokens", "lm_head", "v_proj"]])
def test_lora_merged_over_tied_embeddings_serves_what_the_run_trained(chats, toy_tokenizer, tmp_path, targets):
    """Training runs ``E + dE`` into the layers and the shared ``E`` (or ``E + dH``) out of them; merged into the one
    shared tensor, the input's adapter reached the output head too (logits 4.7 off, no argmax agreeing)."""
    base = save_pretrained_checkpoint(tmp_path / "base", toy_tokenizer, "llama", tie_word_embeddings=True, **SHAPE)
    lora = {"rank": 4, "alpha": 8, "target_modules": targets}
    module, ckpt = run(base, chats, tmp_path, steps=3, lora=lora)
    out = export_checkpoint(ckpt, tmp_path / "merged", merge_lora=True)
    torch.testing.assert_close(served_logits(out), trained_logits(module), atol=2e-5, rtol=1e-5)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


def test_a_generation_config_marked_from_the_model_config_is_served_as_the_base_model_uses_it(
    chats, toy_tokenizer, tmp_path
):
    """Mistral-7B-v0.1's and Gemma-2-it's generation_config.json say ``_from_model_config: true`` beside their
    sampling defaults and EOS ids, which transformers uses: the export kept none of them."""
    base = save_pretrained_checkpoint(tmp_path / "base", toy_tokenizer, "llama", **SHAPE)
    marked = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": [1, 7], "do_sample": True,
              "temperature": 0.3, "top_k": 5, "repetition_penalty": 1.3}  # fmt: skip
    (base / "generation_config.json").write_text(json.dumps(marked))
    own = AutoModelForCausalLM.from_pretrained(base).generation_config  # what the base model generates with
    _, ckpt = run(base, chats, tmp_path)
    served = json.loads((export_checkpoint(ckpt, tmp_path / "served") / "generation_config.json").read_text())
    for key in ("do_sample", "temperature", "top_k", "repetition_penalty"):
        assert served[key] == getattr(own, key), key
    assert set(served["eos_token_id"]) >= set(own.eos_token_id)


def test_config_json_keeps_the_padding_id_the_model_trained_with(chats, toy_tokenizer, tmp_path):
    """A tokenizer without a padding token (Llama 3's, Mistral's): generation pads with EOS, but config.json's
    padding id stays the base model's, or the embedding of the EOS would never train when the export is fine-tuned
    (``padding_idx``)."""
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "tok")
    base = save_pretrained_checkpoint(tmp_path / "base", tmp_path / "tok", "llama", **SHAPE)
    assert AutoConfig.from_pretrained(base).pad_token_id is None
    _, ckpt = run(base, chats, tmp_path)
    out = export_checkpoint(ckpt, tmp_path / "served")
    assert json.loads((out / "config.json").read_text()).get("pad_token_id") is None
    assert json.loads((out / "generation_config.json").read_text())["pad_token_id"] == tok.eos_token_id
    served, own = (AutoModelForCausalLM.from_pretrained(f) for f in (out, base))
    assert served.model.embed_tokens.padding_idx == own.model.embed_tokens.padding_idx is None


def test_config_json_keeps_every_eos_id_the_base_config_lists(chats, toy_tokenizer, tmp_path):
    """Llama-3.1-Instruct's config.json lists three EOS ids; the export wrote the tokenizer's one alone, so a server
    that reads config.json ran past the end-of-turn ids the base model stopped at."""
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    base = save_pretrained_checkpoint(tmp_path / "base", toy_tokenizer, "llama", **SHAPE)
    config = json.loads((base / "config.json").read_text())
    listed = [5, tok.eos_token_id, 9]
    (base / "config.json").write_text(json.dumps({**config, "eos_token_id": listed}))
    assert AutoConfig.from_pretrained(base).eos_token_id == listed
    _, ckpt = run(base, chats, tmp_path)
    out = export_checkpoint(ckpt, tmp_path / "served")
    assert AutoConfig.from_pretrained(out).eos_token_id == listed
    assert set(json.loads((out / "generation_config.json").read_text())["eos_token_id"]) >= set(listed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_export_keeps_in_fp32_what_the_family_keeps(tmp_path, dtype):
    """A MoE router's gate and score bias stay fp32 when transformers loads the family in bf16 or fp16
    (``_keep_in_fp32_modules_strict``); the export's cast rounded them. The reference: the family's own model
    loaded from the same fp32 folder in that dtype."""
    config = AutoConfig.for_model("glm4_moe", vocab_size=64, n_routed_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16, first_k_dense_replace=0, head_dim=8, **SHAPE)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "fp32")
    own = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=dtype).state_dict()
    ours = cast_for_saving(AutoModelForCausalLM.from_pretrained(tmp_path / "fp32"), dtype).state_dict()
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in own.items()}
    assert any(v.dtype == torch.float32 for v in own.values()), "the family keeps something in fp32"
    for name, value in own.items():
        assert torch.equal(ours[name], value), name


def test_a_path_that_is_not_a_runs_checkpoint_is_named_for_what_it_is(toy_tokenizer, tmp_path, capsys):
    """DeepSpeed's tag folder or one of its files given for the checkpoint folder, and an exported (or base) model
    folder: one line saying what was given and what to give (a KeyError traceback, or "cut short", before)."""
    run_dir = tmp_path / "last.ckpt"  # DeepSpeed's layout: <checkpoint>/latest names <checkpoint>/<tag>/
    (run_dir / "global_step4").mkdir(parents=True)
    (run_dir / "latest").write_text("global_step4")
    states = run_dir / "global_step4" / "mp_rank_00_model_states.pt"
    torch.save({"module": {}}, states)
    hf = save_pretrained_checkpoint(tmp_path / "hf", toy_tokenizer, "llama", **SHAPE)
    capsys.readouterr()
    for given, says in (
        (run_dir / "global_step4", f"a tag folder of the DeepSpeed checkpoint {run_dir}: give that folder"),
        (states, f"is one file of the DeepSpeed checkpoint {run_dir}: give that folder"),
        (hf, "a Hugging Face model folder (an export, or a base model), not a checkpoint of a run"),
    ):
        assert main([str(given), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists()


def test_an_export_writes_the_dtype_the_base_was_saved_in_unless_told_another(chats, toy_tokenizer, tmp_path):
    """A bf16 base folder fine-tuned (in fp32) exported as float32 by default: twice its size, and not what the user
    started from. The reference: transformers' own ``from_pretrained(dtype="auto")`` of the export against the run's
    trained weights cast to bf16."""
    from safetensors import safe_open

    fp32 = save_pretrained_checkpoint(tmp_path / "fp32", toy_tokenizer, "llama", **SHAPE)
    base = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(base)
    AutoTokenizer.from_pretrained(fp32).save_pretrained(base)
    assert json.loads((base / "config.json").read_text())["dtype"] == "bfloat16"
    module, ckpt = run(base, chats, tmp_path, steps=2)
    trained = {k.removeprefix("model."): v.detach().to(torch.bfloat16) for k, v in module.state_dict().items()}
    assert main([ckpt, str(tmp_path / "served")]) == 0
    with safe_open(tmp_path / "served" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "served" / "config.json").read_text())["dtype"] == "bfloat16"
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "served", dtype="auto")
    assert served.dtype == torch.bfloat16
    assert served.state_dict().keys() == trained.keys()
    for name, value in served.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert main([ckpt, str(tmp_path / "asked"), "--dtype", "float32"]) == 0  # an explicit dtype still wins
    asked = AutoModelForCausalLM.from_pretrained(tmp_path / "asked", dtype="auto")
    assert asked.dtype == torch.float32
    assert json.loads((tmp_path / "asked" / "config.json").read_text())["dtype"] == "float32"


def test_lora_adapters_exported_alone_stay_float32_and_merged_take_the_bases_dtype(chats, toy_tokenizer, tmp_path):
    """Adapters trained in fp32 over a bf16 base: alone they are written as trained (peft loads them in fp32; the
    base's dtype rounded them), merged into the base they take its dtype."""
    from safetensors import safe_open

    fp32 = save_pretrained_checkpoint(tmp_path / "fp32", toy_tokenizer, "llama", **SHAPE)
    base = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(base)
    AutoTokenizer.from_pretrained(fp32).save_pretrained(base)
    module, ckpt = run(base, chats, tmp_path, steps=2, lora={"rank": 4, "target_modules": ["q_proj"]})
    trained = {k: v.detach() for k, v in module.model.named_parameters() if "lora_" in k}
    assert trained and {v.dtype for v in trained.values()} == {torch.float32}
    assert main([ckpt, str(tmp_path / "adapter")]) == 0
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    assert {v.dtype for v in saved.values()} == {torch.float32}
    for name, value in trained.items():  # peft's names drop the adapter's name ("default")
        assert torch.equal(saved[name.removeprefix("model.").replace(".default", "")], value), name
    assert main([ckpt, str(tmp_path / "merged"), "--merge-lora"]) == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype="auto").dtype == torch.bfloat16


class Forced(LogitsProcessor):
    """Generation that emits ``ids`` in turn, whatever the model says: where it stops is the stopping rule's."""

    def __init__(self, ids: list[int]):
        self.ids, self.step = ids, 0

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -1e9)
        forced[:, self.ids[min(self.step, len(self.ids) - 1)]] = 0
        self.step += 1
        return forced


def test_a_vision_language_export_says_one_eos_at_the_top_level_in_its_text_config_and_to_generate(tmp_path):
    """LLaVA's config keeps its special ids in ``text_config`` (transformers 5: its top level has none). The export set
    the tokenizer's EOS at the top level and in the generation config and left the base's in text_config: a folder
    saying two EOS ids. The reference: transformers' generate, from the folder's generation config and, without that
    file, from its config.json (``GenerationConfig.from_model_config`` reads the top level, then text_config)."""
    from vision_models import build_llava

    folder = build_llava(tmp_path / "llava")
    AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    other = tok.convert_tokens_to_ids("<s>")
    assert "eos_token_id" not in config and config["text_config"]["eos_token_id"] == tok.eos_token_id != other
    config["text_config"]["eos_token_id"] = other  # the base model's EOS is not the tokenizer's
    (folder / "config.json").write_text(json.dumps(config))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"prompt": f"hello world {i}", "response": "a cat on a mat"}) + "\n"
                             for i in range(4)))  # fmt: skip
    _, ckpt = run(folder, chats, tmp_path)
    out = export_checkpoint(ckpt, tmp_path / "served")
    end = tok.convert_tokens_to_ids("<|end|>")  # the template's end of turn
    served = AutoConfig.from_pretrained(out)
    assert served.eos_token_id == served.text_config.eos_token_id == tok.eos_token_id
    assert served.bos_token_id == served.text_config.bos_token_id == tok.bos_token_id
    assert served.dtype == served.text_config.dtype == served.vision_config.dtype == torch.bfloat16  # the base's
    net = AutoModelForImageTextToText.from_pretrained(out, dtype="auto").eval()
    assert net.dtype == torch.bfloat16 and net.generation_config.eos_token_id[:2] == [tok.eos_token_id, end]
    prompt = torch.tensor([[tok.bos_token_id, 10, 11, 12]])

    def generated(model, ids):
        with torch.no_grad():
            new = model.generate(input_ids=prompt, max_new_tokens=len(ids), do_sample=False,
                                 logits_processor=LogitsProcessorList([Forced(ids)]))  # fmt: skip
        return new[0, prompt.shape[1] :].tolist()

    assert generated(net, [20, 21, tok.eos_token_id, 22, 23]) == [20, 21, tok.eos_token_id]
    assert generated(net, [20, end, 22]) == [20, end]
    (out / "generation_config.json").unlink()  # a reader of config.json alone
    alone = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert alone.generation_config.eos_token_id == tok.eos_token_id
    assert GenerationConfig.from_model_config(served.text_config).eos_token_id == tok.eos_token_id
    assert generated(alone, [20, other, 21, tok.eos_token_id, 22]) == [20, other, 21, tok.eos_token_id]


def test_a_trained_copy_of_a_tied_head_is_untied_in_every_config_of_a_vision_language_export(tmp_path):
    """Gemma 3 tied (its top level and ``text_config``), LoRA with ``modules_to_save: [lm_head]``: merged, the head is
    the trained copy, but peft untied the top level's flag only, so a text model built from the export's
    ``text_config`` (a server reading it) tied the head back to the embedding. The reference: the export loaded
    both ways against the trained module's own logits."""
    from transformers import Gemma3ForCausalLM
    from vision_models import build_gemma3

    from lit_hbp import unprepare_model

    folder = build_gemma3(tmp_path / "gemma3")
    assert AutoConfig.from_pretrained(folder).get_text_config().tie_word_embeddings
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"hello {i} the fox", "response": "a cat on a mat"}) + "\n"
                            for i in range(16)))  # fmt: skip
    dm = HBPDataModule(sources=[{"path": str(data)}], tokenizer=str(folder), levels=["128:1"], cache_dir=str(tmp_path))
    torch.manual_seed(0)
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}
    module = HBPLitModule(model=str(folder), vocab_size=dm.vocab_size, self_check=False, lr=1e-2, lora=lora)
    trainer = quiet_trainer(max_steps=3)
    trainer.fit(module, dm)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    net = unprepare_model(copy.deepcopy(module.model))
    net.get_base_model().set_attn_implementation("eager")
    probe = torch.tensor([PROBE])
    with torch.no_grad():
        want = net.eval()(input_ids=probe, use_cache=False).logits[0]
    out = export_checkpoint(tmp_path / "run.ckpt", tmp_path / "merged", merge_lora=True)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["text_config"]["tie_word_embeddings"] is False
    whole = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    text = Gemma3ForCausalLM(AutoConfig.from_pretrained(out).text_config)  # what a text-only reader builds
    assert text.lm_head.weight is not text.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(whole.eval()(input_ids=probe, use_cache=False).logits[0], want, atol=2e-5, rtol=1e-5)


def test_a_deepspeed_half_precision_runs_frozen_weights_are_exported_as_it_kept_them_and_said(
    chats, toy_tokenizer, tmp_path, recwarn
):
    """ZeRO-2 in bf16 keeps a LoRA run's frozen base weights only as its module's bf16 copies: the merged float32
    export writes them rounded to bf16 (what the run computed with), no longer the base folder's values, while the
    adapter export leaves them to the base folder. Said for the merged export, not for the adapters alone. The
    reference: the base folder's weights and torch's own bf16 rounding of them."""
    from safetensors.torch import load_file

    from lit_hbp.lightning.strategy import HBPStrategy

    base = save_pretrained_checkpoint(tmp_path / "base", toy_tokenizer, "llama", **SHAPE)
    dm = HBPDataModule(sources=[{"path": str(chats)}], tokenizer=str(base), levels=["128:1"], cache_dir=str(tmp_path))
    torch.manual_seed(0)
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]}
    module = HBPLitModule(model=str(base), vocab_size=dm.vocab_size, self_check=False, lr=1e-2, lora=lora)
    trainer = quiet_trainer(max_steps=1, strategy=HBPStrategy(stage=2), devices=1, precision="bf16-mixed")
    trainer.fit(module, dm)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    recwarn.clear()
    export_checkpoint(tmp_path / "run.ckpt", tmp_path / "adapter")
    assert not [w for w in recwarn if "did not train" in str(w.message)]
    with pytest.warns(UserWarning, match=r"holds the \d+ weights the run did not train in bfloat16, as DeepSpeed"):
        out = export_checkpoint(tmp_path / "run.ckpt", tmp_path / "merged", merge_lora=True)
    name = "model.layers.0.mlp.down_proj.weight"  # no adapter on it
    kept, saved = load_file(base / "model.safetensors")[name], load_file(out / "model.safetensors")[name]
    assert saved.dtype == torch.float32 and torch.equal(saved, kept.bfloat16().float()) and not torch.equal(saved, kept)
