"""From a fine-tuned checkpoint to a model a server can run: the export needs only the checkpoint (the
base model folder and the tokenizer folder may be gone), carries the run's tokenizer and chat template,
and sets the special ids so that generation stops at the end of the assistant's turn."""

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import CHAT_TEMPLATE, TINY_LLAMA, build_toy_tokenizer, quiet_trainer, save_pretrained_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlavaConfig

from lit_hbp.data.tokenize import CHAT_TEMPLATES, tokenizer_fingerprint
from lit_hbp.export import end_of_turn_id, export_checkpoint, main, serving_token_ids
from lit_hbp.lightning.datamodule import HBPDataModule, tokenizer_from_files
from lit_hbp.lightning.module import HBPLitModule

ANSWER = "the lazy dog"
QUESTIONS = ["hello world", "what is packing?", "the quick brown fox", "def f(x): return x", "jumps over"]


def fixed_answer_chats(path, n=60):
    """Chats whose assistant answer is always ANSWER: a few dozen steps teach it, and where it ends."""
    rng = np.random.default_rng(0)
    rows = [{"prompt": f"{QUESTIONS[i % len(QUESTIONS)]} {rng.integers(100)}", "response": ANSWER} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_fine_tuned_folder_exports_from_the_checkpoint_alone_and_stops_at_the_end_of_its_turn(tmp_path):
    tok_dir = build_toy_tokenizer(tmp_path / "tokenizer")  # its template closes a turn with <|end|>, not EOS
    base_dir = save_pretrained_checkpoint(tmp_path / "base", tok_dir, "llama")
    dm = HBPDataModule(
        sources=[{"path": str(fixed_answer_chats(tmp_path / "chats.jsonl"))}],
        tokenizer=str(tok_dir),
        levels=["96:1"],
        cache_dir=str(tmp_path / "cache"),
    )
    torch.manual_seed(0)
    module = HBPLitModule(model=str(base_dir), vocab_size=dm.vocab_size, lr=1e-2)
    trainer = quiet_trainer(max_steps=30)
    trainer.fit(module, dm)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    shutil.move(base_dir, tmp_path / "moved_base")
    shutil.move(tok_dir, tmp_path / "moved_tokenizer")

    assert main([str(tmp_path / "run.ckpt"), str(tmp_path / "served")]) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "served")
    net = AutoModelForCausalLM.from_pretrained(tmp_path / "served").eval()
    reference = AutoTokenizer.from_pretrained(tmp_path / "moved_tokenizer")
    end = reference.convert_tokens_to_ids("<|end|>")
    assert tok.chat_template == CHAT_TEMPLATE and tok.get_vocab() == reference.get_vocab()
    expected = (reference.bos_token_id, reference.eos_token_id, reference.pad_token_id)
    assert (net.config.bos_token_id, net.config.eos_token_id, net.config.pad_token_id) == expected
    generation = net.generation_config
    assert (generation.bos_token_id, generation.pad_token_id) == (expected[0], expected[2])
    assert generation.eos_token_id == [reference.eos_token_id, end]
    assert net.config.use_cache and generation.use_cache
    assert json.loads((tmp_path / "served" / "config.json").read_text())["use_cache"] is True

    question = [{"role": "user", "content": "hello world 7"}]
    chat = tok.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = net.generate(**chat, max_new_tokens=20, do_sample=False)[0, chat["input_ids"].shape[1] :]
    assert out[-1].item() == end and len(out) < 20, tok.decode(out)
    assert tok.decode(out) == ANSWER + "<|end|>"


def test_a_mapping_built_run_exports_the_tokenizers_ids_and_its_chat_template(tmp_path):
    """Llama's default EOS, 2, is <|system|> in this vocabulary: the model and its export take the
    tokenizer's ids (the model's config from the module, the export's from the tokenizer)."""
    tok_dir = build_toy_tokenizer(tmp_path / "tokenizer", chat_template=None)
    dm = HBPDataModule(
        sources=[{"path": str(fixed_answer_chats(tmp_path / "chats.jsonl", 12))}],
        tokenizer=str(tok_dir),
        levels=["96:1"],
        cache_dir=str(tmp_path / "cache"),
        chat_template="tags",
    )
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, self_check=False)
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, dm)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    shutil.move(tok_dir, tmp_path / "moved_tokenizer")
    out = export_checkpoint(tmp_path / "run.ckpt", tmp_path / "served")
    reference = AutoTokenizer.from_pretrained(tmp_path / "moved_tokenizer")
    assert reference.eos_token_id != LlamaConfig().eos_token_id
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        reference.bos_token_id, reference.eos_token_id, reference.pad_token_id,
    )  # fmt: skip
    assert config["dtype"] == "float32"  # a mapping without a dtype: no saved one to keep
    assert GenerationConfig.from_pretrained(out).eos_token_id == [reference.eos_token_id]  # "tags" ends with EOS
    assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATES["tags"]


def test_end_of_turn_is_the_token_after_the_answer_when_it_is_one_added_token(toy_tokenizer):
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|end|>") == 5
    tok.chat_template = CHAT_TEMPLATES["plain"]
    assert end_of_turn_id(tok) == tok.eos_token_id == 1
    tok.chat_template = CHAT_TEMPLATE.replace("<|end|>", "\n<|end|>")  # a newline follows the answer
    assert end_of_turn_id(tok) is None
    tok.chat_template = CHAT_TEMPLATE.replace("<|end|>", "[END]")  # not a token of its own
    assert end_of_turn_id(tok) is None
    tok.chat_template = "{{ raise_exception('a system turn is required') }}"
    assert end_of_turn_id(tok) is None
    tok.chat_template = None
    assert end_of_turn_id(tok) is None


def test_serving_ids_come_from_the_tokenizer_and_stop_at_every_end(toy_tokenizer):
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    base = LlamaConfig(bos_token_id=7, eos_token_id=[8, 9], pad_token_id=None)
    ids, stop = serving_token_ids(tok, base)
    assert ids == {"bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 0}
    assert stop == [1, 5, 8, 9]  # EOS, the template's <|end|>, then the config's own
    tok.pad_token, tok.bos_token = None, None
    ids, stop = serving_token_ids(tok, LlamaConfig(bos_token_id=7, eos_token_id=1))
    assert ids == {"bos_token_id": 7, "eos_token_id": 1, "pad_token_id": 1}  # pad: EOS; BOS: the config's
    assert stop == [1, 5]
    # A vision-language config keeps its ids in text_config (transformers 5: LLaVA's top level has none).
    composite = LlavaConfig(text_config={"model_type": "llama", "bos_token_id": 7, "eos_token_id": [8, 9]})
    assert getattr(composite, "eos_token_id", None) is None
    ids, stop = serving_token_ids(tok, composite)
    assert ids == {"bos_token_id": 7, "eos_token_id": 1, "pad_token_id": 1} and stop == [1, 5, 8, 9]


def test_the_checkpoint_carries_the_tokenizer_and_a_resume_keeps_its_own(tmp_path, toy_tokenizer, recwarn):
    data = fixed_answer_chats(tmp_path / "chats.jsonl", 4)
    dm = HBPDataModule(
        sources=[{"path": str(data)}], tokenizer=toy_tokenizer, levels=["96"], cache_dir=str(tmp_path / "c")
    )
    state = dm.state_dict()
    assert set(state["tokenizer_files"]) >= {"tokenizer.json", "tokenizer_config.json"}
    assert sum(len(b) for b in state["tokenizer_files"].values()) < 1_000_000
    back = tokenizer_from_files(state["tokenizer_files"], tmp_path / "back")
    assert tokenizer_fingerprint(back) == tokenizer_fingerprint(AutoTokenizer.from_pretrained(toy_tokenizer))
    other = HBPDataModule(
        sources=[{"path": str(data)}],
        tokenizer=toy_tokenizer,
        levels=["96"],
        cache_dir=str(tmp_path / "c"),
        chat_template="plain",
    )
    other.load_state_dict(state)
    assert other.tokenizer.chat_template == CHAT_TEMPLATES["plain"]  # its own, not the checkpoint's
    assert any("another tokenizer" in str(w.message) for w in recwarn)
    recwarn.clear()
    dm.load_state_dict(state)
    assert not any("another tokenizer" in str(w.message) for w in recwarn)


def test_export_of_an_older_checkpoint_without_config_names_the_missing_folder(tmp_path, toy_tokenizer):
    torch.manual_seed(0)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=400)
    module.configure_model()
    ckpt = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    ckpt["hyper_parameters"]["model"] = str(tmp_path / "gone")
    torch.save(ckpt, tmp_path / "old.ckpt")
    with pytest.raises(ValueError, match=f"from the model folder the run started from, {tmp_path / 'gone'}, which is"):
        export_checkpoint(tmp_path / "old.ckpt", tmp_path / "out", tokenizer=toy_tokenizer)
    ckpt["hyper_parameters"]["model"] = dict(TINY_LLAMA)  # a mapping: rebuilt from it, tokenizer from --tokenizer
    torch.save(ckpt, tmp_path / "old.ckpt")
    out = export_checkpoint(tmp_path / "old.ckpt", tmp_path / "out", tokenizer=toy_tokenizer)
    net = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(p, module.model.state_dict()[n]) for n, p in net.state_dict().items())
    assert net.generation_config.eos_token_id == [1, 5]  # not llama's default 2: the mapping named no EOS


def test_an_export_is_refused_where_it_would_mix_with_other_files_or_drop_an_option(tmp_path, toy_tokenizer, capsys):
    """Into a folder holding an earlier export (a LoRA adapter's files beside full weights load as the base
    model plus the old adapter); ``--tokenizer`` for a checkpoint holding the run's own; ``--merge-lora`` for a
    run without LoRA: each one line, status 2, nothing written. An empty folder is written."""
    dm = HBPDataModule(
        sources=[{"path": str(fixed_answer_chats(tmp_path / "chats.jsonl", 12))}],
        tokenizer=toy_tokenizer,
        levels=["96:1"],
        cache_dir=str(tmp_path / "cache"),
    )
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, self_check=False)
    trainer = quiet_trainer(max_steps=1)
    trainer.fit(module, dm)
    ckpt = str(tmp_path / "run.ckpt")
    trainer.save_checkpoint(ckpt)
    capsys.readouterr()  # the run's own output
    held = tmp_path / "held"
    held.mkdir()
    (held / "adapter_config.json").write_text("{}")
    cases = {
        "held": ([ckpt, str(held)], f"OUT_DIR {held} already holds adapter_config.json: a loader would read them"),
        "tokenizer": ([ckpt, str(tmp_path / "a"), "--tokenizer", toy_tokenizer], "the checkpoint holds the tokenizer"),
        "merge": ([ckpt, str(tmp_path / "b"), "--merge-lora"], "--merge-lora: the checkpoint's run trained no LoRA"),
        # under a file: a NotADirectoryError traceback after the checkpoint was read
        "under_file": ([ckpt, str(tmp_path / "chats.jsonl" / "hf")], "chats.jsonl is a file, so no folder can be made"),
    }
    for name, (argv, said) in cases.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and err.count("\n") == 1, err
    assert sorted(p.name for p in held.iterdir()) == ["adapter_config.json"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    (tmp_path / "empty").mkdir()
    assert main([ckpt, str(tmp_path / "empty")]) == 0
    assert (tmp_path / "empty" / "config.json").is_file()
