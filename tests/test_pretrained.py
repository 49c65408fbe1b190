"""A checkpoint folder (``save_pretrained``) trains as a model built from a config mapping does: train
mode in every micro-batch, per-level activation checkpointing really recomputing, special token ids
from the tokenizer for mappings; and the training paths (self-check, validation, resume) run from a
folder, not only from a mapping."""

import lightning as L
import numpy as np
import pytest
from conftest import TINY_LLAMA, chat_datamodule, quiet_trainer
from transformers import AutoTokenizer

from lit_hbp.lightning.datamodule import HBPDataModule
from lit_hbp.lightning.module import HBPLitModule


class CountLayerCalls(L.Callback):
    """Per micro-batch: the level, whether every module of the model was in training mode, and how
    often the MLP of the first and of the last decoder layer ran (forward plus any recompute)."""

    def __init__(self):
        self.rows: list[dict] = []
        self._calls = {}

    def on_train_start(self, trainer, pl_module):
        layers = pl_module._layers
        for name, layer in (("first", layers[0]), ("last", layers[-1])):
            layer.mlp.register_forward_pre_hook(lambda *_, name=name: self._count(name))

    def _count(self, name):
        self._calls[name] += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._calls = {"first": 0, "last": 0}
        self._training = all(m.training for m in pl_module.model.modules())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(dict(level=int(batch.level), training=self._training, **self._calls))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_checkpoint_folder_trains_in_train_mode_with_each_levels_checkpointing(family, request, small_demo, tmp_path):
    folder = request.getfixturevalue(f"pretrained_{family}")
    dm = HBPDataModule(
        sources=[{"path": str(small_demo / "short.jsonl")}],
        tokenizer=folder,
        levels=["256:1", "1024:1:3"],  # the long level checkpoints 3 of the 4 decoder layers
        cache_dir=str(tmp_path / "cache"),
        over_length="drop",
    )
    module = HBPLitModule(model=folder, vocab_size=dm.vocab_size, lr=1e-3)
    counter = CountLayerCalls()
    quiet_trainer(max_steps=12, accumulate_grad_batches=2, callbacks=[counter]).fit(module, dm)
    rows = counter.rows
    assert len(rows) == 24 and {r["level"] for r in rows} == {0, 1}
    assert all(r["training"] for r in rows), rows
    for r in rows:  # a checkpointed layer runs its forward again in the backward; the others once
        assert (r["first"], r["last"]) == ((2, 1) if r["level"] == 1 else (1, 1)), r


def test_a_mapping_takes_its_special_token_ids_from_the_tokenizer(small_demo, toy_tokenizer, tmp_path):
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    dm = chat_datamodule(small_demo, toy_tokenizer, tmp_path / "cache")
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size)
    quiet_trainer(max_steps=1).fit(module, dm)
    config = module.model.config
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id,
    )  # fmt: skip
    # A mapping that names an id keeps it.
    module = HBPLitModule(model={**TINY_LLAMA, "eos_token_id": 5}, vocab_size=dm.vocab_size)
    quiet_trainer(max_steps=1).fit(module, chat_datamodule(small_demo, toy_tokenizer, tmp_path / "cache"))
    assert module.model.config.eos_token_id == 5


def mid_length_records(demo, path, low: int, high: int, n: int = 12):
    """``n`` chat records of ``low``..``high`` tokens (rendered with the demo tokenizer's template), cut
    from the demo's own long documents: a level between ``low`` and ``high`` then has samples whatever
    the demo holds."""
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo / "tokenizer")
    text = "\n".join(json.loads(line)["messages"][0]["content"] for line in (demo / "long.jsonl").open())
    rows, start = [], 0
    for i in range(n):
        target = low + (high - low) * (i + 1) // (n + 1)
        cut = len(tok.encode(text[start : start + 4 * target], add_special_tokens=False))
        chars = 4 * target * target // max(cut, 1)  # about ``target`` tokens
        messages = [{"role": "user", "content": text[start : start + chars]}, {"role": "assistant", "content": "ok"}]
        size = len(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
        assert low < size <= high, (size, low, high)
        rows.append(json.dumps({"messages": messages}))
        start += chars
    path.write_text("\n".join(rows) + "\n")
    return path


def test_the_cli_fine_tunes_a_folder_with_the_tiny_config_in_train_mode(
    small_demo, demo_pretrained, tmp_path, monkeypatch
):
    """The issue's user path: ``train.py fit --config configs/tiny_cpu.yaml --model.model <folder>``;
    every micro-batch in train mode, each level's checkpointed layers recomputed. The first step of
    each level runs first (``EachLevelFirst``), so the 3 steps visit all 3 levels whatever the data;
    a source of mid-length records gives the middle level packs of its own on any Python build (the
    demo is built from the host's standard library)."""
    from pathlib import Path

    from lit_hbp.cli.app import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
    middle = mid_length_records(small_demo, tmp_path / "middle.jsonl", 1100, 4000)
    cli = main(["fit", "--config", str(config), "--data.demo_dir", str(small_demo), "--model.model", demo_pretrained,
                f"--data.sources+={{path: {middle}}}",
                "--trainer.max_steps", "3", "--trainer.enable_progress_bar", "false",
                "--trainer.callbacks+=levels_first.EachLevelFirst",
                "--trainer.callbacks+=test_pretrained.CountLayerCalls"])  # fmt: skip
    (counter,) = [c for c in cli.trainer.callbacks if isinstance(c, CountLayerCalls)]
    ckpt = [lv.ckpt_layers for lv in cli.datamodule.levels]  # 0, 2 and 4 of the folder's 4 layers
    assert len(counter.rows) == 6 and all(r["training"] for r in counter.rows), counter.rows
    assert [r["level"] for r in counter.rows] == [0, 0, 1, 1, 2, 2]
    for r in counter.rows:
        assert (r["first"], r["last"]) == (1 + (ckpt[r["level"]] > 0), 1 + (ckpt[r["level"]] >= 4)), r


def test_a_model_in_the_hugging_face_cache_is_found_by_its_name(pretrained_llama, small_demo, tmp_path, monkeypatch):
    """``model: org/name`` of a model the Hugging Face cache holds (as ``hf download`` leaves it) loads
    without the network; a name the cache does not hold is refused at once, naming the option."""
    import shutil

    import huggingface_hub.constants

    from lit_hbp.errors import ConfigError

    snapshot = tmp_path / "hub" / "models--my-org--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(pretrained_llama, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    dm = HBPDataModule(sources=[{"path": str(small_demo / "short.jsonl")}], tokenizer="my-org/tiny-llama",
                       levels=["256:1", "1024:1"], cache_dir=str(tmp_path / "cache"), over_length="drop")  # fmt: skip
    module = HBPLitModule(model="my-org/tiny-llama", vocab_size=dm.vocab_size)
    quiet_trainer(max_steps=2).fit(module, dm)
    assert module.model.training and module.trainer.global_step == 2
    with pytest.raises(ConfigError, match=r"model: 'my-org/tiny-lama' is neither a checkpoint folder"):
        HBPLitModule(model="my-org/tiny-lama")


def test_the_own_model_line_fine_tunes_a_4k_context_folder(pretrained_llama, tmp_path, monkeypatch):
    """The README's and the guide's own-model line, as they write it, on a checkpoint folder whose
    context is 4K tokens: its levels fit the folder, its tokenizer is the folder's."""
    import json
    import re
    from pathlib import Path

    from lit_hbp.cli.app import main

    root = Path(__file__).resolve().parents[1]
    line = (
        "lit-hbp fit --config configs/own_model_cpu.yaml --model.model /models/my-llama "
        "--data.sources '[{path: chats.jsonl}]'"
    )
    for doc in ("README.md", "docs/finetune.md"):
        assert line in re.sub(r"\s*\\?\n\s*", " ", (root / doc).read_text()), doc
    words = "the quick brown fox jumps over the lazy dog hello world what is packing".split()
    rng = np.random.default_rng(0)
    with (tmp_path / "chats.jsonl").open("w") as f:
        for _ in range(80):
            ask, answer = (" ".join(rng.choice(words, int(rng.integers(3, 40)))) for _ in range(2))
            f.write(
                json.dumps({"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]})
            )
            f.write("\n")
    monkeypatch.chdir(tmp_path)
    args = line.split()[1:6] + ["--data.sources", "[{path: chats.jsonl}]"]
    args[2], args[4] = str(root / args[2]), pretrained_llama
    cli = main([*args, "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false"])
    assert cli.trainer.global_step == 2
    assert cli.model.base_model.config.max_position_embeddings == 4096
    assert cli.datamodule.tokenizer.name_or_path == pretrained_llama
