"""Models whose token mixers carry state from one document of a pack into the next (Mamba's scans, the
gated delta rule, lightning attention, RG-LRU, short convolutions, ...) are refused by ``prepare_model``
itself, before anything is done to the model, and by the command line before the data is read; a
leaking mixer of a kind nobody named is still stopped by the self-check. Each family is built tiny
from its default config with the mixer it is known for (``families.HYBRIDS``)."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from families import small_config

from lit_hbp import pack_samples, packed_loss, prepare_model
from lit_hbp.cli import main
from lit_hbp.mixers import stateful_mixers
from lit_hbp.packed_call import record_of

ROOT = Path(__file__).resolve().parents[1]
# family -> the class of the mixer that must be named (the ten, Qwen3-Next and Qwen3.5 text, the rest
# transformers 5.24 registers as causal LMs).
HYBRIDS = {
    "mamba": "MambaMixer",
    "mamba2": "Mamba2Mixer",
    "bamba": "BambaMixer",
    "nemotron_h": "NemotronHMamba2Mixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "falcon_h1": "FalconH1Mixer",
    "jamba": "JambaMambaMixer",
    "lfm2": "Lfm2ShortConv",
    "recurrent_gemma": "RecurrentGemmaRecurrentBlock",
    "minimax": "MiniMaxLightningAttention",
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "qwen3_5_text": "Qwen3_5GatedDeltaNet",
    "falcon_mamba": "FalconMambaMixer",
    "zamba2": "Zamba2MambaMixer",
    "lfm2_moe": "Lfm2MoeShortConv",
    "kimi_linear": "KimiLinearDeltaAttention",
    "bailing_hybrid": "BailingHybridDeltaAttention",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet",
    "qwen3_5_moe_text": "Qwen3_5MoeGatedDeltaNet",
    "xlstm": "xLSTMLayer",
    "lfm3": "Lfm3ShortConv",
}


def tiny(family: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = small_config(family)
    model_type = cfg.pop("model_type")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))


def three_documents(vocab: int) -> list:
    """Documents of 37, 5 and 70 tokens (one shorter than any short convolution's kernel after the first)."""
    rng = np.random.default_rng(0)
    return [(rng.integers(3, vocab, n), np.ones(n, bool)) for n in (37, 5, 70)]


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_prepare_model_refuses_a_stateful_mixer_before_touching_the_model(family):
    net = tiny(family)
    attn = [getattr(m.config, "_attn_implementation", None) for m in net.modules() if hasattr(m, "config")]
    net.eval()
    with pytest.raises(ValueError) as refused:
        prepare_model(net)
    message = str(refused.value)
    assert message.startswith(f"{family}: ") and f"({HYBRIDS[family]})" in message, message
    assert "carries its state from one document of a pack into the next" in message
    assert "docs/families.md" in message  # ... and says what is supported
    # nothing was done to it: no record, its attention and mode as they were, and no packed call can run
    assert record_of(net) is None and not net.training
    assert [getattr(m.config, "_attn_implementation", None) for m in net.modules() if hasattr(m, "config")] == attn
    batch = pack_samples(three_documents(net.config.vocab_size))
    with pytest.raises(ValueError, match="not prepared for packs"):
        packed_loss(net, batch)


def test_the_refused_families_are_the_ones_whose_packed_call_leaks():
    """Independent of the class names: a document after another in one sequence with each document's own
    positions, through the unprepared model (its own forward, eager attention where it has attention,
    the documents' positions restarted) differs from that document alone in every refused family; and a
    family that is not refused (llama) gives the last document what it computes alone once its attention
    is kept within documents (its 4-D block mask)."""

    def last_alone_and_packed(net, docs):
        ids = [torch.as_tensor(d[0])[None] for d in docs]
        with torch.no_grad():
            alone = net(input_ids=ids[-1], use_cache=False).logits[0]
            whole = torch.cat(ids, 1)
            pos = torch.cat([torch.arange(i.shape[1]) for i in ids])[None]
            n = whole.shape[1]
            bounds = np.r_[0, np.cumsum([i.shape[1] for i in ids])]
            doc = torch.as_tensor(np.repeat(np.arange(len(ids)), np.diff(bounds)))
            allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
            mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
            kwargs = {"attention_mask": mask} if not stateful_mixers(net) else {}
            packed = net(input_ids=whole, position_ids=pos, use_cache=False, **kwargs).logits[0, bounds[-2] :]
        return alone, packed

    for family in ("bamba", "qwen3_next", "lfm2", "mamba"):
        net = tiny(family).eval()
        alone, packed = last_alone_and_packed(net, three_documents(net.config.vocab_size))
        assert (alone - packed).abs().max() > 1e-4, family  # rounding here is about 1e-6 (llama below: 1e-5)
    net = tiny("llama").eval()
    net.set_attn_implementation("eager")
    alone, packed = last_alone_and_packed(net, three_documents(net.config.vocab_size))
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


class Decaying(torch.nn.Module):
    """An MLP beside a per-channel decaying scan over the sequence, named like nothing lit-hbp knows."""

    def __init__(self, mlp, width):
        super().__init__()
        self.mlp = mlp
        self.A_log = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x):
        decay = torch.exp(-self.A_log.exp())
        state, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            state = decay * state + x[:, t]
            out.append(state)
        return self.mlp(x) + 0.1 * torch.stack(out, 1)


class Convolving(torch.nn.Module):
    """An MLP beside a causal depthwise convolution over the sequence."""

    def __init__(self, mlp, width):
        super().__init__()
        self.mlp = mlp
        self.conv = torch.nn.Conv1d(width, width, 4, groups=width, padding=3)

    def forward(self, x):
        return self.mlp(x) + self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


class Leaking(torch.nn.Module):
    """An MLP beside a running mean over the sequence: a mixer with no name and no telltale weight."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[None, :, None]
        return self.mlp(x) + 0.5 * x.cumsum(1) / steps


@pytest.mark.parametrize(
    ("mixer", "named"),
    [(Decaying, r"`layers\.1\.mlp` \(Decaying\) is .*A_log"), (Convolving, r"`layers\.1\.mlp\.conv` \(Conv1d\)")],
)
def test_an_unnamed_mixer_with_a_decay_or_a_convolution_is_refused_by_what_it_holds(mixer, named):
    net = tiny("llama")
    net.model.layers[1].mlp = mixer(net.model.layers[1].mlp, net.config.hidden_size)
    with pytest.raises(ValueError, match=rf"^llama: layer 1's {named}"):
        prepare_model(net)


def test_a_leaking_mixer_nobody_can_name_is_stopped_by_the_self_check():
    """The second line: a mixer with neither a known name nor a decay or convolution passes
    ``prepare_model``, and the self-check at the start of fit refuses it."""
    from lit_hbp.module import HBPLitModule
    from lit_hbp.selfcheck import SelfCheckError, run_self_check

    torch.manual_seed(0)
    module = HBPLitModule(model=small_config("llama"), loss="sum")
    module.configure_model()
    run_self_check(module, [1], max_len=256)  # the model as built passes
    layer = module.model.model.layers[0]
    layer.mlp = Leaking(layer.mlp)
    with pytest.raises(SelfCheckError, match="llama"):
        run_self_check(module, [1], max_len=256)


@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_the_cli_refuses_a_stateful_model_folder_in_one_line_before_reading_the_data(
    family, tmp_path, small_demo, monkeypatch, capsys
):
    from transformers import AutoTokenizer

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIT_HBP_DEBUG", raising=False)
    tok = AutoTokenizer.from_pretrained(small_demo / "tokenizer")
    folder = tmp_path / family
    net = tiny(family)
    net.resize_token_embeddings(len(tok))
    net.save_pretrained(folder)
    tok.save_pretrained(folder)
    data = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data.write_text(json.dumps(chat) + "\n")
    args = ["fit", "--config", str(ROOT / "configs/own_model_cpu.yaml"), "--model.model", str(folder),
            "--data.sources", f"[{{path: {data}}}]", "--trainer.max_steps", "2"]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    lines = [line for line in err.splitlines() if line.startswith(("error:", "tip:"))]
    assert len(lines) == 2 and "Traceback" not in err, err
    assert f"model.model: {family}: layer 0's" in lines[0] and HYBRIDS[family] in lines[0], lines[0]
    assert not list(tmp_path.glob("**/data_cache*")) and not (tmp_path / "runs").exists()  # no data read


def test_a_frozen_stateful_model_a_module_holds_is_refused_on_a_pack_and_runs_outside_one():
    """A teacher or judge left unprepared: transformers' own packed path (``pack_inputs``) keeps its
    attention within documents but not its Mamba state, so ``HBPStrategy``'s guard refuses it on a pack,
    naming the attribute and the mixer; on an ordinary batch it runs as before."""
    from lit_hbp import pack_inputs
    from lit_hbp.strategy import guard_frozen

    holder = torch.nn.Module()
    holder.judge = tiny("bamba").requires_grad_(False).eval()
    holder.student = prepare_model(tiny("llama"))
    handles = guard_frozen(holder)
    try:
        batch = pack_samples(three_documents(holder.judge.config.vocab_size))
        with torch.no_grad():
            holder.judge(input_ids=batch.input_ids[:, :20], use_cache=False)  # an ordinary call
            with pytest.raises(
                ValueError, match=r"^self\.judge is called on a packed micro-batch, but bamba: .*BambaMixer"
            ):
                holder.judge(**pack_inputs(batch))
    finally:
        for handle in handles:
            handle.remove()
