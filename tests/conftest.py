import os
import sys
from pathlib import Path

# Brute-force references live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
# DeepSpeed must not look for CUDA here, and its JIT op is compiled once into the repo's cache.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _threads_as_they_were():
    """A test leaves the process's thread settings as it found them: Lightning's launchers set
    OMP_NUM_THREADS (and torch's thread count) in the process that runs ``fit``, and every process a
    later test starts would inherit it (4 training processes x 2 OpenMP threads on 2 cores)."""
    import torch

    before, threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    yield
    if before is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = before
    torch.set_num_threads(threads)


def flat_tokens(t):
    """(ids, supervised mask) of every sample of a TokenizedSource, back to back, as int64 and bool."""
    parts = [t.sample(i) for i in range(len(t))]
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    return np.concatenate([p[0] for p in parts]).astype(np.int64), np.concatenate([p[1] for p in parts])


# A two-layer Llama-style model small enough to train in seconds on CPU.
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_toy_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A small byte-level BPE tokenizer saved as a Hugging Face fast tokenizer (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, what is packing?", "def f(x): return x"]
    tok.train_from_iterator(corpus * 50, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return path


# The shapes of the pretrained folders the tests fine-tune (save_pretrained, as users' checkpoints are).
PRETRAINED_SHAPES = {
    "llama": {**TINY_LLAMA, "num_hidden_layers": 4, "max_position_embeddings": 4096},
    "qwen2": {**TINY_LLAMA, "model_type": "qwen2", "num_hidden_layers": 4, "max_position_embeddings": 4096},
}


def save_pretrained_checkpoint(
    path: Path, tokenizer: str | Path, family: str = "llama", seed: int = 0, **shape
) -> Path:
    """A randomly initialized causal LM written the way a user's checkpoint folder looks: config.json,
    generation_config.json, safetensors weights and the tokenizer files side by side, its special
    token ids and vocabulary those of ``tokenizer``. ``shape`` overrides PRETRAINED_SHAPES[family]."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = {**PRETRAINED_SHAPES[family], **shape}
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **cfg,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")


@pytest.fixture(autouse=True)
def no_leftover_process_group(monkeypatch):
    """Each test starts and ends without a process group (DeepSpeed's cached ones included) or a launcher's
    environment in this process:
    an in-process DeepSpeed fit initializes one (Lightning sets MASTER_PORT to the port its store
    listens on), and a later test's subprocess would inherit the variable and fail on the busy port."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # As at a run's exit: DeepSpeed's cached groups too (an in-process DeepSpeed fit caches a clone of
        # the world group, which a later test's engine would otherwise try to use after it was destroyed).
        from lit_hbp.strategy import release_process_groups

        release_process_groups()


@pytest.fixture(scope="session")
def toy_tokenizer(tmp_path_factory) -> str:
    return str(build_toy_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="session")
def pretrained_llama(tmp_path_factory, toy_tokenizer) -> str:
    """A 4-layer Llama checkpoint folder with the toy tokenizer (``save_pretrained``)."""
    return str(save_pretrained_checkpoint(tmp_path_factory.mktemp("llama_ckpt"), toy_tokenizer, "llama"))


@pytest.fixture(scope="session")
def pretrained_qwen2(tmp_path_factory, toy_tokenizer) -> str:
    """A 4-layer Qwen2 checkpoint folder with the toy tokenizer (``save_pretrained``)."""
    return str(save_pretrained_checkpoint(tmp_path_factory.mktemp("qwen2_ckpt"), toy_tokenizer, "qwen2"))


@pytest.fixture(scope="session")
def small_demo(tmp_path_factory) -> Path:
    """The embedded demo data set, built small (a few hundred chats, a few long samples)."""
    from lit_hbp.demo import build_demo

    out = tmp_path_factory.mktemp("demo")
    build_demo(out, n_short=400, n_long=8, vocab_size=2048)
    return out


@pytest.fixture(scope="session")
def demo_pretrained(tmp_path_factory, small_demo) -> str:
    """A 4-layer Llama checkpoint folder with the small demo's tokenizer, covering the tiny configs'
    16K level: what ``--model.model <folder>`` of configs/tiny_cpu.yaml fine-tunes."""
    out = tmp_path_factory.mktemp("demo_llama")
    shape = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=16384)
    return str(save_pretrained_checkpoint(out, small_demo / "tokenizer", "llama", **shape))


@pytest.fixture(scope="session")
def paper_shaped_mix():
    """../shared/workloads' paper_mix recipe at a quarter of its size (log-normal chats,
    log-uniform long samples): the tests make their own, CI has no shared folder."""
    import numpy as np

    rng = np.random.default_rng(20250310)
    short = np.clip(np.rint(rng.lognormal(np.log(700), 1.1, 100_000)), 32, 32768)
    long_ = np.rint(np.exp(rng.uniform(np.log(8192), np.log(131072), 500)))
    return rng.permutation(np.r_[short, long_]).astype(np.int64)


def separate_loss(model, samples, device="cpu"):
    """The independent reference of every packed loss: each sample run alone through the model's own
    forward (the caller picks its attention), cross-entropy of its supervised next tokens, summed
    over the samples. ``samples``: {i: (token ids, supervised mask)}."""
    import torch
    import torch.nn.functional as F

    total = 0.0
    for ids, target in samples.values():
        ids = torch.as_tensor(ids, device=device).long()
        labels = torch.where(torch.as_tensor(target[1:], device=device), ids[1:], -100)
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
        total = total + F.cross_entropy(logits, labels, reduction="sum")
    return total


def chat_datamodule(demo, tokenizer, cache, **kw):
    """The demo chats in 256- and 1024-token levels: the data of the short training runs."""
    from lit_hbp.data.datamodule import HBPDataModule

    return HBPDataModule(
        sources=[{"path": str(demo / "short.jsonl")}],
        tokenizer=tokenizer,
        levels=["256:1", "1024:1"],
        cache_dir=str(cache),
        over_length="drop",
        **kw,
    )


QUIET = dict(
    accelerator="cpu",
    use_distributed_sampler=False,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


def quiet_trainer(**kw):
    """A Trainer for a test run: CPU, HBPDataModule's own sampling, nothing logged, saved or printed
    (``kw`` overrides any of those)."""
    import lightning as L

    return L.Trainer(**{**QUIET, **kw})


@pytest.fixture(scope="session")
def sp_data(tmp_path_factory):
    """Chats of 2-25 words, every eighth with a prompt of 60-150: packs of every level of the SP tests."""
    import json

    import numpy as np

    rng = np.random.default_rng(7)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
    path = tmp_path_factory.mktemp("spdata") / "d.jsonl"
    with path.open("w") as f:
        for i in range(160):
            n = int(rng.integers(60, 150)) if i % 8 == 0 else int(rng.integers(2, 25))
            f.write(
                json.dumps(
                    {
                        "prompt": " ".join(rng.choice(words, n)),
                        "response": " ".join(rng.choice(words, rng.integers(2, 20))),
                    }
                )
                + "\n"
            )
    return path
