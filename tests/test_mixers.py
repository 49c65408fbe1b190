"""Hybrid models: token mixers that carry state along the sequence (Mamba's scans, the gated delta rule,
lightning attention, RG-LRU, xLSTM, short convolutions) run document by document in a packed call, so a
pack trains like each document alone, through the public core (``prepare_model`` + ``packed_loss``)
and the command line; a mixer lit-hbp cannot run so is refused by ``prepare_model`` before anything is
done to the model and by the command line before the data is read; at Ulysses sp 2 each rank's mixers
see the documents whole, context parallelism over them is refused per level; a leaking mixer of a kind
nobody named is still stopped by the self-check.
Each family is built tiny from its default config with the mixer it is known for (``families.HYBRIDS``).
The reference is always each document alone through the unprepared model (eager attention)."""

import copy
import inspect
import json
import math
import re
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import TINY_LLAMA, separate_loss
from families import small_config
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version

from lit_hbp import pack_samples, packed_loss, prepare_model
from lit_hbp.cli.app import main
from lit_hbp.errors import ConfigError
from lit_hbp.model.mixer_heads import HEAD_SPLITS
from lit_hbp.model.packed_call import record_of
from lit_hbp.packing.levels import Level

ROOT = Path(__file__).resolve().parents[1]
# family -> the class of its stateful mixer (the ten, Qwen3-Next and Qwen3.5 text, the rest
# transformers 5.24 registers as causal LMs and builds small).
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


def tiny(family: str, nonzero_biases: bool = False, **overrides) -> torch.nn.Module:
    """``family`` built small (``families.small_config`` and ``overrides``), seeded; ``nonzero_biases``: every bias
    drawn at random too (transformers' init zeroes a linear's bias, which a share adding it twice would sum right)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {**small_config(family), **overrides}
    model_type = cfg.pop("model_type")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    if nonzero_biases:
        with torch.no_grad():
            for name, p in net.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(std=0.1)
    return net


def reference_of(net: torch.nn.Module) -> torch.nn.Module:
    """An unprepared copy with eager attention (a fresh model with the same weights where a family keeps a
    forward's result on a module, which deepcopy refuses: RecurrentGemma)."""
    try:
        ref = copy.deepcopy(net)
    except RuntimeError:
        ref = type(net)(copy.deepcopy(net.config))
        ref.load_state_dict(net.state_dict())
    try:
        ref.set_attn_implementation("eager")
    except (ValueError, KeyError):
        pass  # no attention to set (xLSTM)
    return ref.eval()


def three_documents(vocab: int, lengths=(37, 5, 70)) -> list:
    """Documents of 37, 5 and 70 tokens (one shorter than any short convolution's kernel after the first)."""
    rng = np.random.default_rng(0)
    return [(rng.integers(3, vocab, n), np.ones(n, bool)) for n in lengths]


def gradient_error(net, ref) -> tuple[float, str]:
    """The worst gradient difference over every parameter, relative to its own scale floored at 1% of the
    largest gradient (a gradient zero in exact arithmetic is rounding noise in both runs)."""
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(net.named_parameters(), ref.parameters())]
    scale = max(g.abs().max().item() for _, _, g in pairs if g is not None)
    worst, where = 0.0, ""
    for name, got, want in pairs:
        if got is None and want is None:
            continue
        assert got is not None and want is not None, f"{name} has a gradient in only one run"
        err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-2 * scale)
        if err > worst:
            worst, where = err, name
    return worst, where


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_a_pack_trains_like_each_document_alone_through_the_public_core(family):
    """CE sum to 1e-5 and every gradient (A_log, dt_bias, the convolutions, norms, attention) to 1e-4,
    each document run by each mixer once, from its first token, as a row of a batch (``mixer_share.length_batches``:
    the 70 and 37 tokens alone, the short ones and the padding segment together), never the whole pack."""
    net = tiny(family).eval()
    ref = reference_of(net)
    prepare_model(net)
    net.eval()  # dropout off in both runs
    record = record_of(net)
    assert {type(m).__name__ for m in record.mixers} == {HYBRIDS[family]}
    seen = []  # the (rows, tokens) of each call of each mixer's first linear layer
    linears = [next(x for x in m.modules() if isinstance(x, torch.nn.Linear)) for m in record.mixers]
    hooks = [x.register_forward_pre_hook(lambda mod, args: seen.append(tuple(args[0].shape[:-1]))) for x in linears]
    docs = three_documents(net.config.vocab_size, (37, 5, 70, 9, 9, 8))  # padded to 144: a segment of 6
    batch = pack_samples(docs)
    out = packed_loss(net, batch, "sum")
    for h in hooks:
        h.remove()
    assert batch.input_ids.shape[1] == 144
    assert seen == [(1, 70), (1, 37), (5, 9)] * len(record.mixers), seen  # 9, 9, 8, 6, 5 padded to 9: 45 of 37
    out.loss.backward()
    want = separate_loss(ref, dict(enumerate(docs)))
    want.backward()
    assert float(out.ce_sum) == pytest.approx(float(want), rel=1e-5)
    worst, where = gradient_error(net, ref)
    assert worst < 1e-4, f"{family}: gradient of {where} off by {worst:.1e}"


@pytest.mark.parametrize("family", ["mamba", "mamba2", "falcon_mamba"])  # xLSTM bf16 fails in its own chunkwise code
def test_bf16_weights_train_a_pack_as_each_document_alone(family):
    """``model.to(torch.bfloat16)`` (a bf16-true run): Mamba's, Mamba2's and FalconMamba's decoders return fp32
    hidden states, which their forward casts to the head's dtype (``packed_loss`` stopped on "expected m1 and m2
    to have the same dtype"). Reference: each document alone through the unprepared bf16 model; both against the
    fp32 model's, so the bound is bf16's own rounding (the packed run no further from fp32 than the alone one)."""
    net32 = tiny(family).eval()
    ref32, net = reference_of(net32), copy.deepcopy(net32).to(torch.bfloat16)
    ref = reference_of(net)
    docs = dict(enumerate(three_documents(net32.config.vocab_size)))
    exact, alone = separate_loss(ref32, docs), separate_loss(ref, docs)
    (exact + alone).backward()
    prepare_model(net)
    out = packed_loss(net.eval(), pack_samples(list(docs.values())), "sum")
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and out.ce_sum.dtype == torch.float32
    assert abs(float(out.ce_sum) - float(exact)) <= 2 * abs(float(alone) - float(exact)) + 1e-3 * float(exact)
    packed_off, where = gradient_error(net, ref32)
    alone_off, _ = gradient_error(ref, ref32)
    assert packed_off <= 2 * alone_off + 1e-2, f"{family}: {where} {packed_off:.2e} from fp32 (alone {alone_off:.2e})"


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_the_cost_model_prices_attention_in_the_layers_that_attend(family, monkeypatch):
    """A hybrid's quadratic work is its attention layers' only (the mixers' is linear): the layers that ran
    lit-hbp's attention in a packed call, seen by a spy on the attention function, are the layers the
    model's spec (MFU, the cost model) counts, and those its config lists, where it lists them."""
    from types import SimpleNamespace

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from lit_hbp.model.calls import ATTN_NAME
    from lit_hbp.model.causal_lm import configured_spec, model_spec
    from lit_hbp.model.mixer_heads import heads_part
    from lit_hbp.model_spec import ModelSpec

    net = prepare_model(tiny(family)).eval()
    layers = record_of(net).layers
    real, attended = ALL_ATTENTION_FUNCTIONS[ATTN_NAME], set()

    def spy(module, *args, **kwargs):
        attended.add(next(i for i, layer in enumerate(layers) if any(m is module for m in layer.modules())))
        return real(module, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, ATTN_NAME, spy)
    mixed = set()
    hooks = [m.register_forward_pre_hook(lambda m, args: mixed.add(id(m))) for m in record_of(net).mixers]
    with torch.no_grad():
        packed_loss(net, pack_samples(three_documents(net.config.vocab_size)), "sum")
    for h in hooks:
        h.remove()
    spec = model_spec(net, layers)
    assert spec.attention_layers == len(attended), (family, sorted(attended))
    configured = ModelSpec.from_config(net.config.to_dict())
    listed = configured.attention_layers
    # None: the config names no layer kind, so every layer attends (Falcon-H1's attention beside its scan in each)
    assert listed == len(attended) or (listed is None and len(attended) == len(layers)), (family, listed, attended)
    # the mixers that ran are those the spec prices (their gathers and work on SP levels), the config's too
    assert spec.mixing == configured.mixing == len(mixed), (family, spec.mixing, configured.mixing, len(mixed))
    split = HEAD_SPLITS.get(HYBRIDS[family])
    heads = None if split is None else split.heads(record_of(net).mixers[0])
    assert spec.mixer_heads == configured.mixer_heads == heads, family
    # what a split sums over the ranks, measured on a share's run (a spy for the SP kind): the values a token priced
    summed = []
    sp = SimpleNamespace(kind=SimpleNamespace(sum_ranks=lambda t, ctx: summed.append(t.shape[-1]) or t), ctx=None)
    mixer = record_of(net).mixers[0]
    if split is not None and split.spanning(mixer):
        params = list(inspect.signature(type(mixer).forward).parameters.values())[2:]
        needed = {p.name: None for p in params if p.default is inspect.Parameter.empty and p.kind != p.VAR_KEYWORD}
        with torch.no_grad():  # (MiniMax's forward requires its positions' embeddings and mask, None in a pack)
            heads_part(mixer, 0, 2, sp)(torch.randn(1, 20, net.config.hidden_size), **needed)
    assert spec.mixer_spanning == configured.mixer_spanning == sum(summed), (family, sum(summed))
    if configured.mixer_params is not None:  # the config's count of a mixer's matrices: the built mixer's
        assert configured.mixer_params == spec.mixer_params, family
    # what a run's level search prices before the model exists: the same spec, counted on the meta device
    assert configured_spec(small_config(family)) == spec, family
    tokens, sum_sq = 112.0, 37.0**2 + 5**2 + 70**2
    quadratic = spec.train_flops(tokens, sum_sq, 0) - spec.train_flops(tokens, 0, 0)
    mla = [getattr(net.config, k, None) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")]
    width = sum(mla) if all(mla) else 2 * spec.dim  # multi-head latent attention (Kimi Linear's): its own widths
    assert quadratic == pytest.approx(len(attended) * 3 * spec.heads * width * sum_sq)


def test_unprepared_hybrids_carry_state_across_documents_and_llama_does_not():
    """Why the mixers run document by document: a document after another in one sequence with its own
    positions (and, for attention, transformers' own packed-sequence masking), through the unprepared
    model, differs from that document alone in every hybrid; a Llama's last document is what it is alone."""

    def last_alone_and_after(net, docs):
        ids = [torch.as_tensor(d[0])[None] for d in docs]
        with torch.no_grad():
            alone = net(input_ids=ids[-1], use_cache=False).logits[0]
            pos = torch.cat([torch.arange(i.shape[1]) for i in ids])[None]
            after = net(input_ids=torch.cat(ids, 1), position_ids=pos, use_cache=False).logits[0, -ids[-1].shape[1] :]
        return alone, after

    for family in ("bamba", "qwen3_next", "lfm2", "mamba"):
        net = tiny(family).eval()
        alone, after = last_alone_and_after(net, three_documents(net.config.vocab_size))
        assert (alone - after).abs().max() > 1e-4, family  # rounding here is about 1e-6 (llama below: 1e-5)
    net = tiny("llama").eval()
    net.set_attn_implementation("eager")
    alone, after = last_alone_and_after(net, three_documents(net.config.vocab_size))
    torch.testing.assert_close(after, alone, rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(
    family=st.sampled_from(["lfm2", "mamba2", "qwen3_next"]),
    lengths=st.lists(st.integers(1, 24), min_size=1, max_size=6),
)
def test_each_documents_logits_are_its_own_over_random_lengths(family, lengths):
    """A property over random document lengths, length 1 included: every document's logits in a packed
    call equal that document alone through the unprepared model."""
    net, ref = MODELS[family]
    docs = three_documents(net.config.vocab_size, lengths)
    batch = pack_samples(docs)
    from lit_hbp import pack_inputs

    with torch.no_grad():  # the decoder's packed call (Mamba2's model drops the boundaries it is given)
        packed = net.get_output_embeddings()(net.get_decoder()(**pack_inputs(batch)).last_hidden_state)[0]
        start = 0
        for ids, _ in docs:
            alone = ref(input_ids=torch.as_tensor(ids)[None], use_cache=False).logits[0]
            torch.testing.assert_close(packed[start : start + len(ids)], alone, rtol=1e-4, atol=1e-5)
            start += len(ids)


MODELS = {}


@pytest.fixture(autouse=True, scope="module")
def _property_models():
    for family in ("lfm2", "mamba2", "qwen3_next"):
        net = tiny(family).eval()
        ref = reference_of(net)
        prepare_model(net)
        MODELS[family] = (net.eval(), ref)
    yield
    MODELS.clear()


@pytest.mark.parametrize("family", ["lfm2", "falcon_h1", "mamba2"])
def test_generation_and_padded_batches_are_the_unprepared_models(family):
    """Outside a pack the mixers run as before: greedy generation with the mixer's cache and a padded
    batch's logits equal the unprepared model's (its own attention, as the prepared model keeps outside
    packs)."""
    net = tiny(family).eval()
    ref = copy.deepcopy(net)
    prepare_model(net)
    net.eval()
    prompt = torch.as_tensor(three_documents(net.config.vocab_size, (9,))[0][0])[None]
    with torch.no_grad():
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(net.generate(prompt, **kw), ref.generate(prompt, **kw))
        ids = torch.zeros(2, 9, dtype=torch.long)
        ids[0], ids[1, 3:] = prompt[0], prompt[0, :6]
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, :3] = 0  # the second row left-padded
        got = net(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(got, ref(input_ids=ids, attention_mask=mask, use_cache=False).logits)


@pytest.mark.parametrize(
    "family", ["bamba", "nemotron_h", "qwen3_next", "jamba", "falcon_h1", "lfm2", "mamba", "mamba2", "falcon_mamba"]
)
def test_the_models_own_call_on_a_pack_gives_each_document_alone_with_or_without_its_cache(family):
    """The model called on a pack as Hugging Face's DataCollatorWithFlattening calls it (a copy of the ids and
    their restarting positions, the cache left to the model's default: on in eval), and on ``pack_inputs`` (a
    cache asked for is refused): each document's logits are its own alone, a 1-token document's too (with a cache made
    of the pack the family's decode path read the previous document's state), and the call leaves no cache of
    the pack. Mamba's, Mamba2's and FalconMamba's forwards pass their backbone neither positions nor
    boundaries: the model's hook hands them over."""
    from lit_hbp import pack_inputs

    net = tiny(family).eval()
    ref = reference_of(net)
    prepare_model(net)
    net.eval()
    docs = three_documents(net.config.vocab_size, (37, 1, 5))
    batch = pack_samples(docs)
    calls = {
        "flattening": dict(input_ids=batch.input_ids.clone(), position_ids=batch.position_ids),
        "pack_inputs": pack_inputs(batch),
    }
    with pytest.raises(ValueError, match="with use_cache=True: a pack's documents cannot be continued as one row"):
        net(**{**pack_inputs(batch), "use_cache": True})  # asked for, a cache is refused (the default: none made)
    with torch.no_grad():
        alone = [ref(input_ids=torch.as_tensor(ids)[None], use_cache=False).logits[0] for ids, _ in docs]
        for name, kw in calls.items():
            out = net(**kw)
            assert getattr(out, "past_key_values", None) is None and getattr(out, "cache_params", None) is None, name
            got = out.logits[0, : batch.n_tokens]  # the pack's padding segment after its documents
            torch.testing.assert_close(got, torch.cat(alone), rtol=1e-4, atol=1e-5, msg=name)


def test_a_models_forward_that_keeps_a_packs_positions_from_its_decoder_is_refused():
    """A forward that drops the positions before a decoder that takes them would number the pack as one
    sequence (rotary positions running on across documents): refused, naming both."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class Dropping(LlamaForCausalLM):
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            return self.lm_head(self.model(input_ids=input_ids).last_hidden_state)

    cfg = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    net = prepare_model(Dropping(LlamaConfig(vocab_size=64, **cfg)))
    batch = pack_samples(three_documents(64, (7, 5)))
    with pytest.raises(ValueError, match="Dropping was called on a pack .* passed LlamaModel neither"):
        net(input_ids=batch.input_ids.clone(), position_ids=batch.position_ids)


@pytest.mark.parametrize("family", ["lfm2"])  # a hybrid: its short convolution beside attention
def test_a_whole_model_its_user_compiles_runs_plain_and_packed_calls_as_before(family):
    """``model.compile()`` of a prepared model (its call hooks stay outside the graph): a plain call equals the
    unprepared model's, a packed call each document alone."""
    from lit_hbp import pack_inputs

    net = tiny(family).eval()
    ref = reference_of(net)
    prepare_model(net)
    net.eval().compile(backend="eager", dynamic=True)
    docs = three_documents(net.config.vocab_size, (9, 1, 6))
    batch = pack_samples(docs)
    with torch.no_grad():
        plain = torch.as_tensor(docs[0][0])[None]
        torch.testing.assert_close(net(input_ids=plain, use_cache=False).logits, ref(input_ids=plain).logits)
        alone = [ref(input_ids=torch.as_tensor(ids)[None], use_cache=False).logits[0] for ids, _ in docs]
        got = net(**pack_inputs(batch)).logits[0, : batch.n_tokens]
        torch.testing.assert_close(got, torch.cat(alone), rtol=1e-4, atol=1e-5)


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


class HybridHeads(torch.nn.Module):
    """Attention heads through transformers' interface beside decaying state-space heads in one module (Hymba's
    layout): the varlen call keeps the attention heads' documents apart, not the scan's."""

    def __init__(self, attn, width):
        super().__init__()
        self.attn, self.config = attn, attn.config
        self.A_log = torch.nn.Parameter(torch.zeros(width))

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        a = self.attn
        shape = (*hidden_states.shape[:-1], -1, a.head_dim)
        q, k, v = (p(hidden_states).view(shape).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, weights = attend(a, q, k, v, attention_mask, scaling=a.scaling, dropout=0.0, **kwargs)
        decay = torch.exp(-self.A_log.exp())
        state, scan = torch.zeros_like(hidden_states[:, 0]), []
        for t in range(hidden_states.shape[1]):
            state = decay * state + hidden_states[:, t]
            scan.append(state)
        return a.o_proj(out.reshape(*hidden_states.shape[:-1], -1)) + 0.1 * torch.stack(scan, 1), weights


@pytest.mark.parametrize(
    ("mixer", "where", "named"),
    [
        (Decaying, "mlp", r"`layers\.1\.mlp` \(Decaying\) is .*A_log"),
        (Convolving, "mlp", r"`layers\.1\.mlp\.conv` \(Conv1d\)"),
        (HybridHeads, "self_attn", r"`layers\.1\.self_attn` \(HybridHeads\) is .*A_log"),
    ],
)
def test_a_mixer_known_only_by_a_decay_or_a_convolution_is_refused_before_anything_is_done(mixer, where, named):
    """Found by what it holds, its calling convention unknown: refused, the model left as it was. Attention heads
    beside a scan in one module too (their attention through transformers' interface, which alone marks
    softmax attention)."""
    net = tiny("llama")
    setattr(net.model.layers[1], where, mixer(getattr(net.model.layers[1], where), net.config.hidden_size))
    attn = net.config._attn_implementation
    with pytest.raises(ValueError, match=rf"^llama: layer 1's {named}.*cannot run it document by document"):
        prepare_model(net)
    assert record_of(net) is None and net.config._attn_implementation == attn
    with pytest.raises(ValueError, match="not prepared for packs"):
        packed_loss(net, pack_samples(three_documents(net.config.vocab_size)))


def whole_row_kernel(mixer: torch.nn.Module) -> None:
    """What kernels' ``kernelize`` does to a layer it has a kernel for (``from_pretrained(..., use_kernels=True)``;
    transformers 5.25 maps Qwen3.5's Gated DeltaNet layer on some GPUs): the kernel layer's forward put on the
    module itself by kernels' own ``_replace_forward``. The kernel here is the mixer's own forward, over the whole
    row as a layer kernel runs it. Without kernels installed (transformers < 5.25), the same forward set by hand."""
    import types

    from lit_hbp.model.mixers import OWN

    own = getattr(type(mixer).forward, OWN, type(mixer).forward)  # the class's, before prepare_model wraps it
    try:
        from kernels._internals.layer.layer import _replace_forward
    except ImportError:
        mixer.forward = types.MethodType(own, mixer)
        return
    _replace_forward(mixer, type("WholeRowKernel", (torch.nn.Module,), {"forward": own}), repo="kernels-community/gdn")


@pytest.mark.parametrize("family", ["lfm2", "mamba2"])
def test_a_mixer_whose_forward_a_kernel_replaced_is_refused_before_and_after_prepare_model(family, monkeypatch):
    """A stateful mixer whose forward kernels replaced on the module never calls the class's forward, which a packed
    call runs document by document: its state crossed the documents (the loss off the documents alone, shown with
    the check taken away), silently. ``prepare_model`` refuses such a model, and a packed call a model kernelized
    after it was prepared, naming the module."""
    from lit_hbp.model import packed_call

    net = tiny(family).eval()
    ref = reference_of(net)
    path = next(n for n, m in net.named_modules() if type(m).__name__ == HYBRIDS[family])
    mixer = net.get_submodule(path)
    whole_row_kernel(mixer)
    where = rf"`{re.escape(path.split('.', 1)[1])}` \({HYBRIDS[family]}\) is a stateful token mixer"  # in its decoder
    by = "(kernels put kernels-community/gdn's forward|a forward was set)"  # kernels installed or not
    with pytest.raises(ValueError, match=rf"^{where} and {by}"):
        prepare_model(net)
    assert record_of(net) is None
    del mixer.forward
    prepare_model(net)
    net.eval()
    docs = three_documents(net.config.vocab_size)
    want = separate_loss(ref, dict(enumerate(docs)))
    want.backward()
    assert float(packed_loss(net, pack_samples(docs), "sum").ce_sum) == pytest.approx(float(want), rel=1e-5)
    whole_row_kernel(mixer)
    with pytest.raises(ValueError, match=rf"^{where} .*Load the model without use_kernels"):
        packed_loss(net, pack_samples(docs), "sum")
    monkeypatch.setattr(packed_call, "refuse_own_forwards", lambda mixers: None)
    net.zero_grad()
    packed_loss(net, pack_samples(docs), "sum").loss.backward()
    assert gradient_error(net, ref)[0] > 1e-2  # what the refusal keeps from training: the state crossed documents


def test_a_leaking_mixer_nobody_can_name_is_stopped_by_the_self_check():
    """The second line: a mixer with neither a known name nor a decay or convolution passes
    ``prepare_model``, and the self-check at the start of fit refuses it."""
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.model.selfcheck import SelfCheckError, run_self_check

    torch.manual_seed(0)
    module = HBPLitModule(model=small_config("llama"), loss="sum")
    module.configure_model()
    run_self_check(module, [1], max_len=256)  # the model as built passes
    layer = module.model.model.layers[0]
    layer.mlp = Leaking(layer.mlp)
    with pytest.raises(SelfCheckError, match="llama"):
        run_self_check(module, [1], max_len=256)


def test_the_self_checks_leak_is_each_documents_own_forward_and_backward(monkeypatch):
    """One forward serves every document's leak measure (``selfcheck._document_losses``): each document's
    gradient on the pack's embeddings equals a forward and backward of the pack through the public
    ``packed_loss`` weighted to that document, on the model as built and on a mixer that leaks; so does the
    leak measure (the largest gradient on the others' embeddings over its own)."""
    from lit_hbp.lightning.module import HBPLitModule
    from lit_hbp.model import selfcheck

    torch.manual_seed(0)
    module = HBPLitModule(model=small_config("llama"), loss="sum")
    module.configure_model()
    net = module.model
    embed = net.get_input_embeddings()
    rng = np.random.default_rng(3)
    docs = {i: (rng.integers(0, net.config.vocab_size, n), np.ones(n, bool)) for i, n in enumerate([9, 23, 1, 40, 7])}
    cpu = torch.device("cpu")
    pack = selfcheck._pack(docs, {}, 1, None, cpu, None)

    def per_document() -> list[torch.Tensor]:
        grads = []
        for j in range(len(docs)):
            leaf = []

            def as_leaf(module, args, out, leaf=leaf):  # the forward goes on from a copy of the leaf
                leaf.append(out.detach().requires_grad_())
                return leaf[-1].clone()

            hook = embed.register_forward_hook(as_leaf)
            try:
                mine = (pack["doc_of"] == j).float()
                grads.append(torch.autograd.grad(packed_loss(net, pack["batch"], weights=mine).loss, leaf)[0])
            finally:
                hook.remove()
        return grads

    def self_check(module) -> list[torch.Tensor]:
        got = {}
        for j, _, loss, leaf, retain in selfcheck._document_losses(module, embed, pack["batch"], pack, cpu):
            got[j] = torch.autograd.grad(loss, leaf, retain_graph=retain)[0]
        return [got[j] for j in range(len(docs))]

    def leak(grads: list[torch.Tensor]) -> float:
        mine = [(pack["doc_of"] == j).float()[:, None] for j in range(len(docs))]
        return max(float((g[0] * (1 - m)).abs().max() / (g[0] * m).abs().max()) for g, m in zip(grads, mine))

    monkeypatch.setattr(selfcheck, "LEAK_TOLERANCE", math.inf)  # every document, no stop at the first leak
    want = per_document()
    for got, ref in zip(self_check(module), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)
    assert selfcheck._leak(module, embed, pack, cpu) == leak(want) == 0.0
    unsupervised = {i: (ids, np.zeros(len(ids), bool)) for i, (ids, _) in docs.items()}  # a shard with no target
    assert selfcheck._leak(module, embed, selfcheck._pack(unsupervised, {}, 1, None, cpu, None), cpu) == 0.0
    layer = net.model.layers[0]
    layer.mlp = Leaking(layer.mlp)
    want = per_document()
    for got, ref in zip(self_check(module), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)
    assert leak(want) > 0.1 and selfcheck._leak(module, embed, pack, cpu) == pytest.approx(leak(want), rel=1e-5)
    # A kernel whose backward writes into what it saved (Liger's SwiGLU) cannot run a second backward over
    # one graph: with Liger's kernels on, each document runs its own forward.
    layer.mlp = Overwrites(layer.mlp)

    class WithLiger:  # HBPLitModule(liger=True)'s flag; its loss as on a CPU
        model, hparams, packed_loss = net, {"liger": True}, module.packed_loss

    for got, ref in zip(self_check(WithLiger), per_document()):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)


class _SquareSavedInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        dx = 2 * x * grad
        x.data.copy_(dx)  # as Liger's SwiGLU kernel writes its gradients over its saved inputs
        return dx


class Overwrites(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return _SquareSavedInPlace.apply(self.mlp(x))


def test_context_parallelism_over_a_document_by_document_mixer_is_refused_per_level_and_per_call():
    """Ulysses levels gather a mixer's documents whole (``test_ulysses_sp_2_...``); CP levels split a pack by
    attention area into ranges a mixer's state would have to cross: refused at set-up naming the level, and
    in a call that gets there anyway."""
    from lit_hbp import pack_inputs
    from lit_hbp.lightning.trained_model import refuse_sp_over_mixers
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPContext

    net = prepare_model(tiny("qwen3_next"))
    cp = Level(256, 4, ulysses=2, cp=2)
    with pytest.raises(
        ConfigError, match=r"^data\.levels\[1\] \(pack_len 256, sp 4\): qwen3_next's .*Qwen3NextGatedDeltaNet.*cp: 1"
    ):
        refuse_sp_over_mixers(net, [Level(128), cp])
    refuse_sp_over_mixers(net, [Level(128), Level(256, 2, ulysses=2, cp=1)])  # Ulysses: gathered whole
    refuse_sp_over_mixers(prepare_model(tiny("llama")), [Level(128), cp])  # attention only
    batch = pack_samples(three_documents(net.config.vocab_size))
    group = SPCall.of(SPContext(None, 4, 0, (0, 1, 2, 3), cp=SPContext(None, 2, 0, (0, 2))), "cp")
    with pytest.raises(ValueError, match=r"Qwen3NextGatedDeltaNet: .* cannot run on this level: context parallelism"):
        net(**pack_inputs(batch), hbp_sp=group)


def ulysses_ranks(families: list[str]) -> dict:
    """On each of 2 gloo ranks, for each family: the three documents' pack split by Ulysses at sp 2, its
    summed cross-entropy through ``packed_loss`` (weights 1) with every layer checkpointed, the gradients summed over
    the ranks (the shards' parts of the pack's gradient)."""
    import torch.distributed as dist

    from lit_hbp.data.collate import collate_packs
    from lit_hbp.model import mixers
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPGroups
    from lit_hbp.parallel.ulysses import Ulysses

    ctx = SPGroups([(2, 1)], 2, dist.get_rank())[(2, 1)]
    out = {}
    seen = set()  # the token counts this rank's mixers ran: ("heads", n) on a share of the heads, else ("whole", n)
    tokens_of = lambda x: math.prod(x.shape[:-1])  # noqa: E731  (a batch's rows each as long as its longest)
    real = mixers.heads_part

    def heads_part(mixer, part, parts, sp=None):
        run = real(mixer, part, parts, sp)
        if run is None:
            return None
        assert (part, parts) == (ctx.rank, 2)

        def counted(*args, **kwargs):
            seen.add(("heads", tokens_of(args[0] if args else kwargs["hidden_states"])))
            return run(*args, **kwargs)

        return counted

    mixers.heads_part = heads_part
    for family in families:
        net = prepare_model(tiny(family)).eval()
        docs = three_documents(net.config.vocab_size)
        whole = collate_packs([np.arange(len(docs))], docs.__getitem__, sp=2, loss_norm=1.0)
        shard = Ulysses().shard(whole, 2, ctx.rank).replace(sp_group=SPCall.of(ctx, "ulysses"))
        seen.clear()  # each mixer's first linear layer's input (the head-split runs call other modules' linears)
        linears = [next(x for x in m.modules() if isinstance(x, torch.nn.Linear)) for m in record_of(net).mixers]
        hooks = [x.register_forward_pre_hook(lambda mod, a: seen.add(("whole", tokens_of(a[0])))) for x in linears]
        loss = packed_loss(net, shard.replace(ckpt_layers=len(record_of(net).layers)), weights=1.0)
        loss.loss.backward()
        for h in hooks:
            h.remove()
        ce = loss.ce_sum.detach().clone()
        dist.all_reduce(ce)
        grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
        for g in grads.values():
            dist.all_reduce(g)
        out[family] = (float(ce), grads, sorted(seen))
    for case, (family, lengths, overrides) in LONE.items():  # fewer documents than ranks; documents that share
        net = prepare_model(tiny(family, **overrides)).eval()
        docs = three_documents(net.config.vocab_size, lengths)
        whole = collate_packs([np.arange(len(lengths))], docs.__getitem__, sp=2, loss_norm=1.0)
        shard = Ulysses().shard(whole, 2, ctx.rank).replace(sp_group=SPCall.of(ctx, "ulysses"))
        seen.clear()
        linears = [next(x for x in m.modules() if isinstance(x, torch.nn.Linear)) for m in record_of(net).mixers]
        hooks = [x.register_forward_pre_hook(lambda mod, a: seen.add(("whole", tokens_of(a[0])))) for x in linears]
        loss = packed_loss(net, shard, weights=1.0)
        loss.loss.backward()
        for h in hooks:
            h.remove()
        ce = loss.ce_sum.detach().clone()
        dist.all_reduce(ce)
        grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
        for g in grads.values():
            dist.all_reduce(g)
        out[case] = (float(ce), grads, sorted(seen))
    mixers.heads_part = real
    return out


BATCHED = ("jamba", "minimax", "bamba", "qwen3_next")  # Mamba1's x_proj, two spanning norms, the gated delta rule
TWO_PER_KEY = dict(linear_num_value_heads=8)  # a gated delta rule of two value heads per key head
LONE = {  # packs of one document (72 tokens, no padding: split by heads, each layout, or run whole), and two
    "qwen3_next alone": ("qwen3_next", (72,), TWO_PER_KEY),  # documents that share evenly (each run by one rank)
    "qwen3_5_text alone": ("qwen3_5_text", (72,), TWO_PER_KEY),
    "bamba alone": ("bamba", (72,), {}),  # one group: the gated norm spans both ranks' heads
    "nemotron_h one group": ("nemotron_h", (72,), dict(n_groups=1)),
    "jamba alone": ("jamba", (72,), {}),  # Mamba1 by channels: x_proj's partial sums summed over both ranks
    "minimax alone": ("minimax", (72,), {}),  # by heads: its norm summed over both ranks
    "xlstm one head": ("xlstm", (72,), dict(num_heads=1)),  # a mixer that does not split: run whole by both ranks
    "qwen3_next even": ("qwen3_next", (36, 36), {}),
    # short documents that run as one batch of rows: on the ranks' shares of the heads (uneven: 72 | 24), the
    # spanning sums over a batch (Jamba's x_proj, MiniMax's and Bamba's norms); or on the rank owning them (even)
    **{f"{family} batched": (family, (72, 9, 9, 6), {}) for family in BATCHED},
    "lfm2 batched even": ("lfm2", (40, 9, 9, 8, 8, 6), {}),
}
FALCON_NORM = dict(mamba_rms_norm=True)  # Falcon-H1's optional gated norm (one group: it spans the shares)
BIASED = {  # a family's flags that give its mixer's projections biases (the output projection's too: the first share's)
    "mamba": dict(use_bias=True), "falcon_mamba": dict(use_bias=True), "jamba": dict(mamba_proj_bias=True),
    "mamba2": dict(use_bias=True), "bamba": dict(mamba_proj_bias=True), "nemotron_h": dict(use_bias=True),
    "granitemoehybrid": dict(mamba_proj_bias=True), "zamba2": dict(add_bias_linear=True),
    "falcon_h1": dict(mamba_proj_bias=True, projectors_bias=True), "lfm2": dict(conv_bias=True),
    "lfm2_moe": dict(conv_bias=True), "lfm3": dict(conv_bias=True), "xlstm": dict(use_bias=True),
}  # fmt: skip
LONE.update(  # one-group Falcon-H1 with its gated norm, normalizing before the gate (its default) and after it
    {"falcon_h1 norm": ("falcon_h1", (72,), FALCON_NORM),
     "falcon_h1 norm after gate": ("falcon_h1", (72,), {**FALCON_NORM, "mamba_norm_before_gate": False})}
)  # fmt: skip
LONE.update(  # and each with its biases, drawn non-zero: a pack of one document, split by heads or channels
    {f"{family} biased": (family, (72,), {**flags, "nonzero_biases": True}) for family, flags in BIASED.items()}
)
RAN = {  # what each rank's mixers ran of each LONE pack
    "qwen3_next alone": [[("heads", 72)]] * 2, "qwen3_5_text alone": [[("heads", 72)]] * 2,
    "bamba alone": [[("heads", 72)]] * 2, "nemotron_h one group": [[("heads", 72)]] * 2,
    "jamba alone": [[("heads", 72)]] * 2, "minimax alone": [[("heads", 72)]] * 2,
    "xlstm one head": [[("whole", 72)]] * 2,
    "qwen3_next even": [[("whole", 36)]] * 2, **{f"{family} biased": [[("heads", 72)]] * 2 for family in BIASED},
    "falcon_h1 norm": [[("heads", 72)]] * 2, "falcon_h1 norm after gate": [[("heads", 72)]] * 2,
    **{f"{family} batched": [[("heads", 27), ("heads", 72)]] * 2 for family in BATCHED},
    "lfm2 batched even": [[("whole", 40)], [("whole", 45)]],  # 9, 9, 8, 8 and 6 as five rows of 9
}  # fmt: skip
SPLIT_BY_HEADS = [family for family, cls in HYBRIDS.items() if cls in HEAD_SPLITS]  # every class tested


def assert_like_alone(family: str, ce: float, grads: dict, want: torch.Tensor, ref, **overrides) -> None:
    """A rank's summed CE to 1e-5 and its all-reduced gradients to 1e-4 (``gradient_error``) of the documents
    alone through ``ref`` (whose gradients ``want.backward()`` filled; ``tiny(family, **overrides)``)."""
    assert ce == pytest.approx(want.item(), rel=1e-5), family
    net = tiny(family, **overrides)
    for name, p in net.named_parameters():
        p.grad = grads.get(name)
    worst, where = gradient_error(net, ref)
    assert worst < 1e-4, f"{family}: gradient of {where} off by {worst:.1e}"


def assert_priced_as_run(ref, lengths, ran: list) -> None:
    """The cost model's mixer work on the busiest rank (``mixer_share.mixer_tokens`` with the config's
    ``ModelSpec.mixer_heads``) is what the ranks' mixers ran: a document on half the heads counts half."""
    from lit_hbp.model_spec import ModelSpec
    from lit_hbp.packing.mixer_share import mixer_tokens

    heads = ModelSpec.from_config(ref.config.to_dict()).mixer_heads
    busiest = max(sum(n / 2 if how == "heads" else n for how, n in rank) for rank in ran)
    assert mixer_tokens(list(lengths), 2, heads) == busiest, (ref.config.model_type, lengths, ran)


@pytest.mark.slow
def test_ulysses_sp_2_trains_a_hybrid_pack_like_each_document_alone():
    """Every hybrid family, a pack split over 2 ranks (the 70-token document across both): each rank's mixers
    see every document whole, the summed cross-entropy and every gradient equal each document alone in one
    process."""
    from distributed import Pool

    families = sorted(HYBRIDS)
    pool = Pool(2)
    try:
        results = pool.run(ulysses_ranks, families)
    finally:
        pool.close()
    for family in families:
        ref = reference_of(tiny(family))
        want = separate_loss(ref, dict(enumerate(three_documents(ref.config.vocab_size))))
        want.backward()
        # the ranks share the mixer's heads, each running every document (37, 5, 70: 112 tokens, no padding) on
        # its half; or the documents: the 70 on one, the others on the other, each run whole by one rank
        ran = [[("heads", 5), ("heads", 37), ("heads", 70)]] * 2 if family in SPLIT_BY_HEADS else [
            [("whole", 70)], [("whole", 5), ("whole", 37)]
        ]  # fmt: skip
        assert [r[family][2] for r in results] == ran, family
        assert_priced_as_run(ref, (37, 5, 70), [r[family][2] for r in results])
        for ce, grads, _ in (r[family] for r in results):
            assert_like_alone(family, ce, grads, want, ref)
    for case, (family, lengths, overrides) in LONE.items():
        ref = reference_of(tiny(family, **overrides))
        want = separate_loss(ref, dict(enumerate(three_documents(ref.config.vocab_size, lengths))))
        want.backward()
        assert [r[case][2] for r in results] == RAN[case], case
        assert_priced_as_run(ref, lengths, [r[case][2] for r in results])
        for ce, grads, _ in (r[case] for r in results):
            assert_like_alone(family, ce, grads, want, ref, **overrides)


def test_packed_loss_hands_the_mixers_the_boundaries_without_reading_the_device(monkeypatch):
    """``packed_loss`` gives a hybrid's per-document runs the pack's boundaries from the batch (host ints,
    ``PackedBatch.bounds``): nothing read back from the device (on a GPU, a wait for it every micro-step). A
    call on ``pack_inputs`` (a project's own forward) has them on the device only: read once for the call."""
    import inspect

    from lit_hbp import pack_inputs

    net = prepare_model(tiny("qwen3_next")).eval()
    batch = pack_samples(three_documents(net.config.vocab_size))
    assert batch.bounds == tuple(batch.cu_seqlens.tolist())
    reads = []
    real = torch.Tensor.tolist

    def spy(self):
        reads.append(inspect.stack()[1].function)
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    packed_loss(net, batch.replace(ckpt_layers=2), "sum").loss.backward()  # the recomputations too
    assert "_bounds" not in reads
    reads.clear()
    with torch.no_grad():
        net(**pack_inputs(batch))
    assert reads.count("_bounds") == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.sampled_from([2, 4, 8]))
def test_the_ranks_of_an_sp_level_share_a_packs_documents_for_its_mixers(lengths, ranks):
    """Every document to exactly one rank, every rank at least one, no rank over an even share by more than
    the longest document (a greedy fill's bound); fewer documents than ranks: every rank runs them all."""
    from lit_hbp.packing.mixer_share import document_owners

    owners = document_owners(lengths, ranks)
    if len(lengths) < ranks:
        assert owners is None
        return
    assert len(owners) == len(lengths) and set(owners) == set(range(ranks))
    load = np.bincount(owners, weights=lengths, minlength=ranks)
    assert load.max() <= sum(lengths) / ranks + max(lengths)
    assert owners == document_owners(lengths, ranks)  # the same on every rank: from the pack alone


def lora_on_convolutions(family: str, prepared: bool = False) -> torch.nn.Module:
    """``family`` with peft LoRA adapters on every ``torch.nn.Conv1d`` (rank: the depthwise groups, as peft asks),
    added after ``prepare_model`` when ``prepared``."""
    from peft import LoraConfig, get_peft_model

    net = tiny(family).eval()
    if prepared:
        prepare_model(net).eval()
    convs = [(name, m) for name, m in net.named_modules() if isinstance(m, torch.nn.Conv1d)]
    config = LoraConfig(r=convs[0][1].groups, target_modules="|".join(re.escape(n) for n, _ in convs))
    return get_peft_model(net, replace(config, init_lora_weights=False))


@pytest.mark.parametrize("family", ["bamba", "lfm2", "qwen3_next"])
def test_a_lora_adapter_on_a_convolution_its_mixer_never_calls_is_refused(family):
    """transformers' Mamba2, short-convolution and gated-delta-rule mixers read their convolution's weight, never
    calling it: an adapter there is not in the graph of the model's own forward (a document alone), so it would
    train nothing without a word. prepare_model refuses it by name; RG-LRU calls its convolution, and trains its
    adapter as each document alone."""
    net = lora_on_convolutions(family)
    docs = three_documents(net.config.vocab_size)
    ids = torch.tensor(docs[0][0])[None]
    trained = [name for name, p in net.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in name for name in trained)
    assert not net(input_ids=ids, labels=ids, use_cache=False).loss.requires_grad  # alone: no adapter in its graph
    refused = r"conv[^`]*` \(Conv1d\) holds a LoRA adapter, but \w+ never calls it as a module"
    with pytest.raises(ValueError, match=refused):
        prepare_model(net)
    late = lora_on_convolutions(family, prepared=True)  # adapters added after prepare_model, as HBPLitModule does
    with pytest.raises(ValueError, match=refused):
        packed_loss(late, pack_samples(docs), "sum")
    served = lora_on_convolutions("recurrent_gemma")
    ref = reference_of(served)
    prepare_model(served).eval()
    out = packed_loss(served, pack_samples(docs), "sum")
    out.loss.backward()
    want = separate_loss(ref, dict(enumerate(docs)))
    want.backward()
    assert float(out.ce_sum) == pytest.approx(float(want), rel=1e-5)
    grads = {name: p.grad for name, p in served.named_parameters() if "lora_" in name and "conv_1d" in name}
    assert grads and all(grad is not None and grad.abs().max() > 0 for grad in grads.values())
    worst, where = gradient_error(served, ref)
    assert worst < 1e-4, f"gradient of {where} off by {worst:.1e}"


def test_a_frozen_stateful_model_a_module_holds_is_refused_on_a_pack_unless_prepared():
    """A teacher or judge left unprepared: transformers' own packed path (``pack_inputs``) keeps its
    attention within documents but not its Mamba state, so the strategies' guard refuses it on a pack,
    naming the attribute, the mixer and the fix; on an ordinary batch it runs as before."""
    from lit_hbp import pack_inputs
    from lit_hbp.lightning.trained_model import guard_frozen

    holder = torch.nn.Module()
    holder.judge = tiny("bamba").requires_grad_(False).eval()
    holder.student = prepare_model(tiny("llama"))
    handles = guard_frozen(holder)
    try:
        batch = pack_samples(three_documents(holder.judge.config.vocab_size))
        with torch.no_grad():
            holder.judge(input_ids=batch.input_ids[:, :20], use_cache=False)  # an ordinary call
            refused = r"^self\.judge is called on a packed micro-batch, but bamba's .*BambaMixer"
            refused += r".*prepare_model\(self\.judge\)"
            with pytest.raises(ValueError, match=refused):
                holder.judge(**pack_inputs(batch))
    finally:
        for handle in handles:
            handle.remove()


def save_folder(family: str, folder: Path, tokenizer: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    net = tiny(family)
    net.resize_token_embeddings(len(tok))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(net.config, key, getattr(tok, key))
    net.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def chats(path: Path, n: int = 60, longest: int = 30) -> Path:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "packs", "state", "scan", "conv"]
    with path.open("w") as f:
        for _ in range(n):
            q, a = (" ".join(rng.choice(words, rng.integers(2, longest))) for _ in range(2))
            f.write(
                json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            )
    return path


def run_cli(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        main(args)
    return stop.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("family", "extra", "says"),
    [
        ("zaya", [], "zaya: layer 0's `layers.0.self_attn.qkv_proj.conv_qk_depthwise` (Conv1d)"),
        ("qwen3_next", ["--data.levels", "[{pack_len: 512, sp: 2, cp: 2}]", "--trainer.devices", "2"],
         "data.levels[0] (pack_len 512, sp 2): qwen3_next's"),
        ("bamba", ["--trainer.strategy", "hbp_stage_3"], "trainer.strategy (ZeRO stage 3): bamba holds a stateful"),
        ("bloom", [], "model.model: bloom: its `h.0.self_attention` (BloomAttention) computes attention in its own"),
    ],
)  # fmt: skip
def test_the_cli_refuses_what_it_cannot_train_in_one_line_before_reading_the_data(
    family, extra, says, tmp_path, small_demo, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIT_HBP_DEBUG", raising=False)
    folder = save_folder(family, tmp_path / family, small_demo / "tokenizer")
    data = chats(tmp_path / "chats.jsonl")
    args = ["fit", "--config", str(ROOT / "configs/own_model_cpu.yaml"), "--model.model", str(folder),
            "--data.sources", f"[{{path: {data}}}]", "--trainer.max_steps", "2", *extra]  # fmt: skip
    code, err = run_cli(args, capsys)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith(("error:", "tip:"))]
    assert len(lines) == 2 and "Traceback" not in err, err
    assert says in lines[0], lines[0]
    assert not list(tmp_path.glob("**/data_cache*")) and not (tmp_path / "runs").exists()  # no data read


@pytest.mark.slow
def test_a_hybrid_folder_fine_tunes_through_the_cli_on_two_processes_at_sp_2_with_its_self_check_passed(
    tmp_path, small_demo
):
    """Qwen3-Next (the gated delta rule beside attention) from a ``save_pretrained`` folder through
    ``lit-hbp fit`` on 2 processes, its long chats on a Ulysses sp 2 level (its mixer split by heads): the
    self-check packs documents against each alone and passes, both levels train, and ``python -m
    lit_hbp.export`` (its ``main``, in this process) writes a folder that loads and generates."""
    import os
    import subprocess

    from conftest import HANG_S, console_script
    from test_train import scalars

    folder = save_folder("qwen3_next", tmp_path / "qwen3_next", small_demo / "tokenizer")
    data = chats(tmp_path / "chats.jsonl", longest=110)
    args = [console_script("lit-hbp"), "fit", "--config", str(ROOT / "configs/own_model_cpu.yaml"),
            "--model.model", str(folder), "--data.sources", f"[{{path: {data}}}]",
            "--data.levels", "[{pack_len: 256}, {pack_len: 1024, sp: 2}]", "--trainer.devices", "2",
            "--trainer.strategy", "hbp_ddp", "--trainer.max_steps", "6", "--trainer.log_every_n_steps", "1",
            "--trainer.val_check_interval", "null", "--data.val_fraction", "0",
            "--trainer.callbacks.monitor", "null",  # (no validation: the config's ModelCheckpoint keeps the latest)
            "--trainer.enable_progress_bar", "false"]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "self-check passed" in out.stdout + out.stderr
    assert "levels: 256 tokens sp 1 ckpt 0, 1024 tokens sp 2 ckpt 0" in out.stdout + out.stderr
    logged = scalars(tmp_path / "runs")
    assert {v for _, v in logged["train/sp"]} == {1.0, 2.0}
    assert all(v > 0 for _, v in logged["train/loss"])
    # exported as a user does, the folder loads in transformers with the trained weights, and serves: its
    # greedy generation with the mixer's and attention's caches is the one that recomputes every step
    from transformers import AutoModelForCausalLM

    from lit_hbp import export
    from lit_hbp.export import load_checkpoint

    (ckpt,) = tmp_path.glob("runs/**/last.ckpt")
    assert export.main([str(ckpt), str(tmp_path / "hf")]) == 0  # what ``python -m lit_hbp.export`` runs, here
    net = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    trained = {k.removeprefix("model."): v for k, v in load_checkpoint(str(ckpt))["state_dict"].items()}
    for name, w in net.state_dict().items():
        assert torch.equal(w, trained[name]), name
    prompt = torch.tensor([[3, 4, 5, 6, 7]])
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(net.generate(prompt, use_cache=True, **kw), net.generate(prompt, use_cache=False, **kw))


def test_a_batch_whose_boundaries_change_without_their_host_copy_is_refused():
    """``PackedBatch.bounds`` is what a hybrid's mixers run by: a batch given other ``cu_seqlens`` without
    new bounds stops at once, naming both, instead of running its mixers by the old ones."""
    batch = pack_samples(three_documents(100))
    moved = batch.cu_seqlens.clone()
    moved[1] += 1
    with pytest.raises(ValueError, match=r"bounds \(the host copy of cu_seqlens\) no longer match"):
        batch.replace(cu_seqlens=moved)
    assert batch.replace(cu_seqlens=moved, bounds=tuple(moved.tolist())).bounds[1] == 38
    assert batch.replace(cu_seqlens=moved, bounds=None).bounds is None


def zero3_step(family: str) -> str:
    """A hybrid under DeepSpeed ZeRO-3 on this rank (every weight partitioned), one packed step: the error."""
    import deepspeed

    net = prepare_model(tiny(family))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=net, config=config, model_parameters=net.parameters())
    try:
        packed_loss(engine.module, pack_samples(three_documents(net.config.vocab_size)), weights=1.0)
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.slow
def test_a_hybrid_under_zero3_is_refused_by_name_at_set_up_and_in_the_call():
    """ZeRO-3 gathers a module's weights only where it is called as a module; transformers' mixers read their
    convolution's weight directly (an IndexError on the partitioned, empty weight) and lit-hbp runs each mixer
    once per document: refused with the fix, by HBPStrategy at set-up and by the packed call under any DeepSpeed
    (here: 2 gloo processes, every weight partitioned)."""
    from distributed import Pool

    from lit_hbp.lightning.trained_model import refuse_mixers_under_zero3

    with pytest.raises(ConfigError, match=r"HBPStrategy stage 3: qwen3_next holds a stateful token mixer under"):
        refuse_mixers_under_zero3(prepare_model(tiny("qwen3_next")), 3)
    refuse_mixers_under_zero3(prepare_model(tiny("qwen3_next")), 2)
    refuse_mixers_under_zero3(prepare_model(tiny("llama")), 3)
    pool = Pool(2)
    try:
        errors = pool.run(zero3_step, "qwen3_next")
    finally:
        pool.close()
    for error in errors:
        assert error.startswith("Qwen3NextGatedDeltaNet: a stateful token mixer under DeepSpeed ZeRO-3"), error
        assert "ZeRO stage 0-2 (HBPStrategy stage: 2)" in error


@pytest.mark.parametrize(
    "strategy",
    [
        "hbp", "hbp_stage_3", "hbp_stage_0", "deepspeed_stage_3_offload", "deepspeed", "ddp", "hbp_ddp", "auto",
        {"class_path": "lit_hbp.lightning.strategy.HBPStrategy", "init_args": {"stage": 3}},
        {"class_path": "lit_hbp.lightning.strategy.HBPStrategy"},
        {"class_path": "lightning.pytorch.strategies.DeepSpeedStrategy",
         "init_args": {"config": {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}}},
        {"class_path": "lit_hbp.lightning.strategy.HBPDDPStrategy"},
        {"class_path": "lit_hbp.lightning.strategy.HBPStrategy", "init_args": {"config": "ZERO3_JSON"}},
    ],
)  # fmt: skip
def test_the_zero_stage_a_config_asks_for_is_the_one_its_strategy_runs(strategy, tmp_path):
    """``config_zero_stage`` reads the stage from the config alone, before anything is built (the CLI refuses a
    hybrid under ZeRO-3 before reading the data); the reference is the strategy Lightning builds from it."""
    import importlib

    from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

    from lit_hbp.lightning.strategy import config_zero_stage

    if isinstance(strategy, dict) and (strategy.get("init_args") or {}).get("config") == "ZERO3_JSON":
        path = tmp_path / "ds.json"  # a DeepSpeed config file, as users pass one
        path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}))
        strategy = {**strategy, "init_args": {"config": str(path)}}
    if isinstance(strategy, str):
        built = StrategyRegistry.get(strategy) if strategy in StrategyRegistry else None
    else:
        module, _, name = strategy["class_path"].rpartition(".")
        built = getattr(importlib.import_module(module), name)(**strategy.get("init_args", {}))
    expected = built.config["zero_optimization"]["stage"] if isinstance(built, DeepSpeedStrategy) else None
    assert config_zero_stage(strategy) == expected


GROUPS = {  # shares of whole groups
    "bamba": dict(mamba_n_groups=4), "granitemoehybrid": dict(mamba_n_groups=4), "zamba2": dict(mamba_ngroups=4),
    "mamba2": dict(n_groups=4),
}  # fmt: skip


FUSED = {  # a family whose mixer in training takes a fused mamba_ssm kernel on a GPU: the kernel's name in its module
    "bamba": "mamba2_split_conv1d_scan_combined", "mamba": "mamba_inner_fn", "falcon_mamba": "mamba_inner_fn",
    "falcon_h1": "mamba2_split_conv1d_scan_combined",
}  # fmt: skip
ACROSS = {"mamba", "falcon_mamba", "jamba", "minimax"}  # every split sums over the ranks (one process cannot): Mamba1's
# x_proj, MiniMax's norm


@pytest.mark.parametrize("family", sorted(FUSED))
def test_a_share_that_spans_the_ranks_sums_over_them_and_never_calls_the_fused_kernel(family, monkeypatch):
    """With mamba_ssm installed (on a GPU) a Mamba2 or Mamba1 mixer in training runs its fused kernel, which takes
    the gated norm (one group) or x_proj's weights itself, within the share: a share whose work spans the ranks
    runs the unfused path, that work handed to the call's SP kind (``sum_ranks``; the 2-process test checks the
    numbers)."""
    import importlib
    from types import SimpleNamespace

    from lit_hbp.model.mixer_heads import heads_part

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    fused, summed = [], []
    kernel = hasattr(module, FUSED[family])
    # transformers 5.25 took FalconMamba's fused path away (it normalizes dt before dt_proj, which the kernel cannot)
    assert kernel or (family == "falcon_mamba" and Version(transformers.__version__) >= Version("5.25")), family
    if kernel:
        monkeypatch.setattr(module, FUSED[family], lambda *a, **k: fused.append(1))
    mixer = record_of(prepare_model(tiny(family, **(FALCON_NORM if family == "falcon_h1" else {})))).mixers[0].train()
    x = torch.randn(1, 20, mixer.hidden_size)
    mixer(x)
    assert bool(fused) == kernel  # the patch reaches the mixer's forward: the whole mixer in training calls the kernel
    fused.clear()
    sp = SimpleNamespace(kind=SimpleNamespace(sum_ranks=lambda t, ctx: summed.append(t.shape) or 2 * t), ctx=None)
    heads_part(mixer, 0, 2, sp)(x)
    width = 1 if family in ("bamba", "falcon_h1") else mixer.time_step_rank + 2 * mixer.ssm_state_size  # norm: a sum
    assert not fused and summed == [torch.Size([1, 20, width])]


def assert_shares_sum_to_the_mixer(mixer: torch.nn.Module, hidden: int, shares=(2, 4)) -> None:
    """``shares`` shares of ``mixer``'s heads summed: its output on a document and its every weight's gradient."""
    from lit_hbp.model.mixer_heads import heads_part
    from lit_hbp.model.mixers import OWN

    own = getattr(type(mixer).forward, OWN)
    x = torch.randn(1, 45, hidden, generator=torch.Generator().manual_seed(0))
    args = (x, torch.arange(45)[None], None) if "position_ids" in inspect.signature(own).parameters else (x,)

    def first(out):  # RecurrentGemma's block returns (hidden states, None)
        return out[0] if isinstance(out, tuple) else out

    want = first(own(mixer, *args))
    want.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in mixer.named_parameters()}
    for parts in shares:
        mixer.zero_grad()
        got = sum(first(heads_part(mixer, part, parts)(*args)) for part in range(parts))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got.square().sum().backward()
        for name, p in mixer.named_parameters():
            floor = 1e-5 * max(1.0, grads[name].abs().max().item())  # rounding, in a weight's large gradient
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=floor, msg=f"{parts} parts: {name}")


@pytest.mark.parametrize("family", SPLIT_BY_HEADS)
def test_a_mixers_heads_split_sum_to_the_mixer_and_leave_no_weight_out(family):
    """On one process: each share of the heads (``mixer_heads.heads_part``, 2 and 4 shares, two value heads per key
    head; a short convolution's channels) through the mixer's own forward on its twin, summed, is the mixer's
    output on a document, with the same gradients of every weight (a Mamba1 scan's shares need an SP group to sum
    x_proj over: without one it is not split); a mixer holding a weight the split does not know (LoRA's adapters on a
    projection) or a degree that does not divide its heads is not split. Every class that splits is tested."""
    assert {HYBRIDS[f] for f in SPLIT_BY_HEADS} == set(HEAD_SPLITS)
    from peft import LoraConfig, get_peft_model

    from lit_hbp.model.mixer_heads import heads_part, split_heads

    net = prepare_model(tiny(family, **TWO_PER_KEY, **GROUPS.get(family, {})))
    mixer = record_of(net).mixers[0]
    if family in ACROSS:  # its shares' work spans the ranks, which one process cannot sum (2 processes do)
        assert split_heads(mixer) and heads_part(mixer, 0, 2) is None
        assert heads_part(mixer, 0, 2, sp=object()) is not None
    else:
        assert_shares_sum_to_the_mixer(mixer, net.config.hidden_size)
        assert heads_part(mixer, 0, 3) is None  # 4 key heads (groups); 64 channels
    if family in GROUPS:  # one group: its norm spans the shares, which one process cannot sum (2 processes do)
        one = record_of(prepare_model(tiny(family))).mixers[0]
        assert split_heads(one) == one.num_heads and heads_part(one, 0, 2) is None
    plain = tiny(family)
    first = next(m for m in plain.modules() if type(m).__name__ == HYBRIDS[family])
    path = next(n for n, x in first.named_modules() if isinstance(x, torch.nn.Linear))  # its first projection
    adapted = prepare_model(get_peft_model(plain, LoraConfig(r=2, target_modules=[path])))
    assert heads_part(record_of(adapted).mixers[0], 0, 2) is None


@pytest.mark.parametrize("family", sorted(BIASED))
def test_a_mixer_with_biased_projections_splits_and_its_shares_sum_to_it(family):
    """A mixer built with its family's bias flags (``BIASED``) splits by heads or channels, not falling back to the
    ranks sharing the documents: the input projection's and the convolution's biases go with their rows, the output
    projection's is added by the first share alone (``mixer_heads._first_share``); its shares sum to the mixer with
    every gradient on one process (2 shares: each other share would add it once more), and the config prices the
    split (``ModelSpec.mixer_heads``).
    A Mamba1 scan's shares sum its ``x_proj`` over the ranks: the sp 2 test runs them (``LONE``, on 2 processes)."""
    from lit_hbp.model.mixer_heads import heads_part, split_heads
    from lit_hbp.model_spec import ModelSpec

    net = prepare_model(tiny(family, True, **TWO_PER_KEY, **GROUPS.get(family, {}), **BIASED[family]))
    mixer = record_of(net).mixers[0]
    biases = {n for n, _ in mixer.named_parameters() if n.endswith(".bias")}
    assert "out_proj.bias" in biases and len(biases) > 2, biases  # the flags give the projections biases
    heads = split_heads(mixer)
    assert heads is not None and heads == ModelSpec.from_config(net.config.to_dict()).mixer_heads
    if family in ACROSS:
        assert heads_part(mixer, 0, 2, sp=object()) is not None
    else:
        assert_shares_sum_to_the_mixer(mixer, net.config.hidden_size, shares=(2,))


@pytest.mark.parametrize("bias", [False, True])
def test_an_xlstm_layers_fused_projections_split_by_heads(bias):
    """xLSTM's ``weight_mode`` "fused" (q, k, v and the output gate in one projection, the input and forget gates
    in another) splits by heads as its separate projections do: 2 and 4 shares sum to the layer with every
    gradient. Built alone, weights drawn at random: transformers 5.24's model init fails on a fused config."""
    from transformers import xLSTMConfig
    from transformers.models.xlstm.modeling_xlstm import xLSTMLayer

    from lit_hbp.model.mixer_heads import split_heads
    from lit_hbp.model.mixers import install_per_document

    cfg = {k: v for k, v in small_config("xlstm").items() if k != "model_type"}
    torch.manual_seed(0)
    layer = xLSTMLayer(xLSTMConfig(**{**cfg, "weight_mode": "fused", "use_bias": bias}))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.2)
    install_per_document(layer, lambda: None)  # its own forward outside a pack
    assert split_heads(layer) == cfg["num_heads"]
    assert_shares_sum_to_the_mixer(layer, cfg["hidden_size"])
