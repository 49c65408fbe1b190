"""What lit-hbp reproduces of a family's own forward: FLOPs (routed experts at top-k, families with
their own field names), the router's load-balancing loss, unknown shapes degrading to a warning;
and the self-check wired into fit."""

import copy
import re

import lightning as L
import numpy as np
import pytest
import torch
from conftest import chat_datamodule, quiet_trainer
from families import small_config
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_hbp.data.collate import collate_packs
from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.model.selfcheck import SelfCheckError


def built(family: str, **overrides) -> HBPLitModule:
    torch.manual_seed(0)
    module = HBPLitModule(model={**small_config(family), **overrides}, loss="sum")
    module.configure_model()
    return module


@pytest.mark.parametrize(
    "family", ["llama", "gpt2", "phi", "opt", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "jetmoe"]
)
def test_model_flops_match_a_flop_counter(family):
    """ModelSpec.train_flops with the layer's matmul parameters counted from the model (routed
    experts at top-k) against torch's FLOP counter on the family's eager forward and backward of one
    sample (eager attention computes the full score matrix: twice the causal half)."""
    from torch.utils.flop_counter import FlopCounterMode

    module = built(family)
    net = copy.deepcopy(module.model)
    net.set_attn_implementation("eager")
    if getattr(net.config, "_experts_implementation", None):
        net.set_experts_implementation("eager")  # torch's counter does not count grouped matmuls
    n = 48
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, 300, n))[None]
    with FlopCounterMode(display=False) as counter:
        net(input_ids=ids, use_cache=False).logits.sum().backward()
    expected = module._spec.train_flops(n, 2.0 * n * n, n)
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.02), family


class MatmulFlops:
    """Matmul FLOPs dispatched inside it (torch's FlopCounterMode registers module hooks that a tiled MLP's no-grad
    forward refuses)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        aten, counted = torch.ops.aten, self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is aten.mm.default:
                    counted.flops += 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1]
                elif func is aten.addmm.default:
                    counted.flops += 2 * args[1].shape[0] * args[1].shape[1] * args[2].shape[1]
                elif func is aten.bmm.default:
                    counted.flops += 2 * args[0].shape[0] * args[0].shape[1] * args[0].shape[2] * args[1].shape[2]
                return func(*args, **(kwargs or {}))

        self.flops, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize(
    ("family", "tiles"),
    [(f, t) for f in ("llama", "qwen3", "gpt2", "starcoder2", "gemma3_text", "olmo2") for t in (1, 2)]
    + [("mixtral", 1)],  # a mixture of experts' MLP is not tiled (mlp_tiles refuses it)
)
def test_a_checkpointed_layers_recompute_is_priced_at_what_torch_recomputes(family, tiles):
    """Torch's non-reentrant checkpoint stops recomputing a layer once it has rebuilt every tensor the backward reads:
    a plain layer's MLP output projection only feeds the residual sum, so the recompute skips it (Llama's 0.73 of
    the layer), while Gemma 3's and OLMo 2's post-MLP norms and a mixture of experts' routing weights keep it (the
    whole layer), and so does a tiled MLP. The cost model priced every recompute at the whole layer; its extra dense
    FLOPs of checkpointing every layer are now those counted in lit-hbp's packed call (matmuls dispatched)."""
    from lit_hbp import pack_samples, packed_loss
    from lit_hbp.cost.costmodel import CostModel
    from lit_hbp.cost.hardware import Hardware

    module = built(family, **({"attn_pdrop": 0.0} if family == "gpt2" else {}))  # GPT-2: its residual dropout only
    net = module.model
    if getattr(net.config, "_experts_implementation", None):
        net.set_experts_implementation("eager")  # a grouped matmul is not an aten.mm
    rng = np.random.default_rng(0)
    docs = [(rng.integers(1, 300, n), np.ones(n, bool)) for n in (20, 28)]
    counted = {}
    for ckpt in (0, len(module._layers)):
        with MatmulFlops() as counter:
            packed_loss(net, pack_samples(docs, ckpt_layers=ckpt, mlp_tiles=tiles), "sum").loss.backward()
        counted[ckpt] = counter.flops
    hardware = Hardware("test", 1e15, 80e9, intra_node_bw=400e9, inter_node_bw=50e9, gpus_per_node=8)
    cost = CostModel(module._spec, hardware, world=1)
    layers = len(module._layers)
    priced = (cost.dense_seconds(48, layers, tiles) - cost.dense_seconds(48, 0, tiles)) * hardware.peak_flops
    assert counted[layers] - counted[0] == pytest.approx(priced * hardware.eff_dense, rel=1e-6)


def test_a_lora_runs_dense_time_is_priced_at_its_frozen_backwards_flops():
    """Under LoRA (``trainable`` 0) the weights take no gradient: the cost model's dense time is torch's FLOP
    count of a forward and backward with every weight frozen (input gradients only, attention's counted apart),
    and the gradient sync moves nothing; full fine-tuning's at its own count."""
    from torch.utils.flop_counter import FlopCounterMode

    from lit_hbp.cost.costmodel import CostModel
    from lit_hbp.cost.hardware import Hardware

    module = built("llama")
    net = copy.deepcopy(module.model)
    net.set_attn_implementation("eager")
    n = 48
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, 300, n))[None]
    spec = module._spec
    attention = spec.train_flops(n, 2.0 * n * n, n) - spec.train_flops(n, 0.0, n)  # eager: the full score matrix
    hardware = Hardware("test", 1e15, 80e9, intra_node_bw=400e9, inter_node_bw=50e9, gpus_per_node=8)
    per_flop = hardware.peak_flops * hardware.eff_dense
    for trainable in (1.0, 0.0):
        net.requires_grad_(bool(trainable))
        embeds = net.get_input_embeddings()(ids).detach().requires_grad_()
        with FlopCounterMode(display=False) as counter:
            net(inputs_embeds=embeds, use_cache=False).logits.sum().backward()
        cost = CostModel(spec, hardware, world=8, trainable=trainable)
        # the first layer's input gradient: counted by both (the embedding's output takes one here)
        assert cost.dense_seconds(n, 0) * per_flop == pytest.approx(counter.get_total_flops() - attention, rel=0.02)
        assert (cost.grad_sync_seconds() > 0) == bool(trainable)


def test_router_loss_is_added_when_the_config_asks_for_it():
    module = built("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    rng = np.random.default_rng(0)
    samples = {i: (rng.integers(0, 300, n), np.ones(n, bool)) for i, n in enumerate([20, 13, 31])}  # 64: no padding
    batch = collate_packs([np.arange(3)], samples.__getitem__, loss_norm=1.0)
    assert batch.n_tokens == batch.input_ids.shape[1]
    loss, ce_sum, _ = module(batch)
    # The family's own forward on the same packed row (same attention) computes the aux loss.
    out = module.model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        cu_seq_lens_q=batch.cu_seqlens,
        cu_seq_lens_k=batch.cu_seqlens,
        max_length_q=batch.max_seqlen,
        max_length_k=batch.max_seqlen,
        output_router_logits=True,
        use_cache=False,
    )
    assert out.aux_loss.item() > 0
    torch.testing.assert_close(loss, ce_sum + 0.5 * out.aux_loss, rtol=1e-6, atol=1e-6)
    plain = built("mixtral")
    plain.model.load_state_dict(module.model.state_dict())
    torch.testing.assert_close(plain(batch)[0], ce_sum, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_completion_pack_adds_nothing_to_a_router_loss_step(family):
    """A level's completion pack (no real token: the planner's filler, so every rank runs a micro-step) put the
    family's load-balancing loss at 0 / 0: a NaN loss and NaN gradients, which the step's all-reduce spread to
    every rank (DDP trained NaN weights from there on; DeepSpeed skipped the step as an overflow). The step of a
    real pack and an empty one has the real pack's loss and gradients alone (the reference: that pack alone)."""
    from lit_hbp import packed_loss

    module = built(family, output_router_logits=True, router_aux_loss_coef=0.5)
    net = module.model
    rng = np.random.default_rng(0)
    samples = {i: (rng.integers(0, 300, n), np.ones(n, bool)) for i, n in enumerate([20, 13, 31])}
    real = collate_packs([np.arange(3)], samples.__getitem__, loss_norm=1.0)
    empty = collate_packs([np.zeros(0, np.int64)], samples.__getitem__, loss_norm=1.0)
    assert empty.n_tokens == 0 and empty.input_ids.shape[1] > 0
    alone = packed_loss(net, real, "sum").loss
    alone.backward()
    want = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad()
    step = [packed_loss(net, b, "sum").loss for b in (real, empty)]
    assert step[1].item() == 0.0 and step[0].item() == alone.item() > 0
    sum(step).backward()
    for name, p in net.named_parameters():
        if name in want:
            torch.testing.assert_close(p.grad, want[name], rtol=0, atol=0, msg=name)
        else:
            assert p.grad is None or not p.grad.any(), name


def router_pack(module):
    rng = np.random.default_rng(1)
    samples = {i: (rng.integers(0, 300, n), np.ones(n, bool)) for i, n in enumerate([20, 13, 25])}  # 58: padded
    return collate_packs([np.arange(3)], samples.__getitem__, loss_norm=1.0, sp=2)


def router_loss_at_sp_2() -> tuple[float, dict]:
    """On each of 2 gloo ranks: a Mixtral pack (the padding segment included) split by Ulysses, its ``sum`` loss
    with the router loss through ``packed_loss``, and the gradients averaged over the ranks, as DDP averages them."""
    from datetime import timedelta

    import torch.distributed as dist

    from lit_hbp import packed_loss
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPGroups
    from lit_hbp.parallel.ulysses import Ulysses

    module = built("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    module.model.eval()
    ctx = SPGroups([(2, 1)], 2, dist.get_rank(), timedelta(seconds=91))[(2, 1)]
    # the strategy's timeout reaches the SP groups, where the Ulysses and CP collectives wait (torch's 30 min before)
    assert ctx.group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=91)
    shard = Ulysses().shard(router_pack(module), 2, ctx.rank).replace(sp_group=SPCall.of(ctx, "ulysses"))
    loss = packed_loss(module.model, shard, "sum").loss
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: p.grad for n, p in module.model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g)
        g /= 2
    return float(total) / 2, grads


@pytest.mark.slow
def test_the_router_loss_of_a_sequence_parallel_pack_is_the_packs(shared_pool2):
    """The load-balancing loss is a product of two means over a micro-batch's tokens: each Ulysses rank computed
    it over its own shard, and the group trained on the mean of the shards' losses. Every rank now takes it over
    the whole pack's router logits; the ranks' mean loss and gradients are the pack's in one process."""
    from lit_hbp import packed_loss

    ranks = shared_pool2.run(router_loss_at_sp_2)
    module = built("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    module.model.eval()
    whole = router_pack(module).replace(sp=1, sp_kind="ulysses")
    assert whole.n_tokens < whole.input_ids.shape[1]  # a padding segment, left out of the router loss
    want = packed_loss(module.model, whole, "sum").loss
    want.backward()
    no_aux = packed_loss(module.model, whole, "sum", router_loss=False).loss
    assert want.item() - no_aux.item() > 0.1  # the router loss is there to be compared
    for total, grads in ranks:
        assert total == pytest.approx(want.item(), rel=1e-5)
        for name, p in module.model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_router_loss_on_a_context_parallel_level_is_refused_at_set_up_naming_the_level():
    """The router loss is a mean over the whole pack, which context parallelism does not gather: a fit with such a
    level passed the self-check (its calls take no router loss), trained the levels before it and stopped at the
    CP level's first micro-batch, saying a token mixer's documents were not built (Mixtral has none); the level
    search could choose such a level. Refused at set-up, naming the level and the way out; a Ulysses level and a
    model without the router loss pass; a call that gets there anyway says the same."""
    from lit_hbp.errors import ConfigError
    from lit_hbp.lightning.trained_model import refuse_cp_under_router_loss
    from lit_hbp.model.router_loss import router_aux_loss
    from lit_hbp.model_spec import ModelSpec
    from lit_hbp.packing import Level
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPContext

    module = built("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    cp = Level(256, 4, ulysses=2, cp=2)
    says = r"mixtral: its router loss \(output_router_logits\) is a mean over the whole pack's tokens, .* \(cp, cp 2\)"
    with pytest.raises(ConfigError, match=r"^data\.levels\[1\] \(pack_len 256, sp 4\): " + says + " does not gather"):
        refuse_cp_under_router_loss(module.model, [Level(128), cp])
    refuse_cp_under_router_loss(module.model, [Level(128), Level(256, 2, ulysses=2, cp=1)])
    refuse_cp_under_router_loss(built("mixtral").model, [Level(128), cp])
    group = SPCall.of(SPContext(None, 4, 0, (0, 1, 2, 3), cp=SPContext(None, 2, 0, (0, 2))), "cp")
    shard = router_pack(module).replace(sp=4, sp_kind="cp", sp_group=group)
    local = shard.input_ids.shape[1]
    with pytest.raises(ValueError, match=r"^" + says + r" does not gather: give the level cp: 1"):
        router_aux_loss(module.model, (torch.zeros(local, 4),), shard)  # where packed_loss takes it
    spec = ModelSpec.from_config(module.model.config.to_dict())
    assert spec.router_loss and not ModelSpec.from_config(built("mixtral").model.config.to_dict()).router_loss


def test_a_router_loss_for_a_family_without_one_is_refused():
    with pytest.raises(ValueError, match="llama: output_router_logits is set but lit-hbp does not know"):
        built("llama", output_router_logits=True)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "mixtral"])
def test_a_router_flag_set_after_prepare_model_is_used_exactly_or_refused(family):
    """``config.output_router_logits = True`` after prepare_model: packed_loss died of an AttributeError (a family
    without a router loss lit-hbp knows: no router logits, no load_balancing_loss_func). It is refused as
    prepare_model refuses it, or, where lit-hbp knows the loss, the pack's loss is the model's own."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_hbp import pack_samples, packed_loss, prepare_model

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**small_config(family), "router_aux_loss_coef": 0.5})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ids = np.arange(3, 40)
    model.config.output_router_logits = True
    with torch.no_grad():
        own = model(input_ids=torch.as_tensor(ids)[None], labels=torch.as_tensor(ids)[None], use_cache=False).loss
    model.config.output_router_logits = False
    prepare_model(model).eval()
    model.config.output_router_logits = True
    pack = pack_samples([(ids, np.ones(len(ids), bool))])
    if family == "mixtral":
        assert packed_loss(model, pack, "token_mean").loss.item() == pytest.approx(own.item(), rel=1e-5)
        assert packed_loss(model, pack, "token_mean", router_loss=False).loss.item() < own.item() - 0.1
        return
    with pytest.raises(ValueError, match=f"^{family}: output_router_logits is set but lit-hbp does not know"):
        packed_loss(model, pack, "token_mean")


def test_an_unknown_model_shape_only_turns_flops_off(monkeypatch):
    """A config that does not say its shape (BART's: an encoder and a decoder, no layers or heads of its
    own) leaves MFU and FLOP/s unlogged, saying why; the model still trains."""
    from transformers import AutoConfig

    from lit_hbp.lightning import module as module_file
    from lit_hbp.model_spec import ModelSpec

    bart = AutoConfig.for_model("bart").to_dict()
    with pytest.raises(ValueError, match="the bart config has no layers") as why:
        ModelSpec.from_config(bart)
    monkeypatch.setattr(module_file, "model_spec", lambda net, layers: ModelSpec.from_config(bart))
    with pytest.warns(UserWarning, match=re.escape(f"model FLOPs unknown, MFU and FLOP/s are not logged: {why.value}")):
        module = built("llama")
    batch = collate_packs([np.arange(1)], lambda i: (np.arange(10), np.ones(10, bool)), loss_norm=1.0)
    assert module.micro_batch_flops(batch) is None


def test_a_state_space_models_flops_have_no_attention_term():
    """Mamba (no attention heads, a scan in every layer): its FLOPs are its matmuls', linear in the tokens,
    the same for one document of 12 tokens as for three of 4 (the same supervised tokens)."""
    module = built("mamba")
    batch = collate_packs([np.arange(1)], lambda i: (np.arange(12), np.ones(12, bool)), loss_norm=1.0)
    assert module.micro_batch_flops(batch) > 0
    spec = module._spec
    assert spec.attention_layers == 0
    assert spec.train_flops(12, 12**2, 11) == spec.train_flops(12, 3 * 4**2, 11) == spec.train_flops(12, 0, 11)


def fit(module, tmp_path, toy_tokenizer, small_demo):
    from lit_hbp.callbacks import HBPThroughputMonitor

    dm = chat_datamodule(small_demo, toy_tokenizer, tmp_path / "cache")
    steps = []

    class Steps(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            steps.append(trainer.global_step)

    trainer = quiet_trainer(max_steps=2, callbacks=[Steps(), HBPThroughputMonitor()])
    trainer.fit(module, dm)
    return steps


def test_fit_runs_the_self_check_and_trains(tmp_path, toy_tokenizer, small_demo, caplog):
    config = {**small_config("mistral"), "vocab_size": None}
    config.pop("vocab_size")
    module = HBPLitModule(model=config)
    with caplog.at_level("INFO"):
        assert fit(module, tmp_path, toy_tokenizer, small_demo) == [0, 1]
    assert "self-check passed (a pack equals its documents alone): sp 1: loss" in caplog.text


def test_fit_refuses_a_family_before_any_step_and_the_self_check_catches_what_prepare_model_misses(
    tmp_path, toy_tokenizer, small_demo, monkeypatch
):
    """Bloom computes its ALiBi attention in its own code: ``prepare_model`` refuses it (the public core too);
    were that check to miss it (a family's code read wrong), the self-check at the start of fit is the second line."""
    from lit_hbp.model import causal_lm

    config = small_config("bloom")
    config.pop("vocab_size")
    steps = []
    with pytest.raises(ValueError, match="^bloom: its `h.0.self_attention` .* computes attention in its own code"):
        steps = fit(HBPLitModule(model=config), tmp_path, toy_tokenizer, small_demo)
    assert steps == []
    monkeypatch.setattr(causal_lm, "refuse_unseen", lambda *a: None)
    with pytest.raises(SelfCheckError, match="self-check failed for model family 'bloom'"):
        steps = fit(HBPLitModule(model=config), tmp_path / "second", toy_tokenizer, small_demo)
    assert steps == []


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "minicpm3"])
def test_the_attention_flops_are_what_the_familys_eager_attention_computes(family):
    """The model FLOPs' attention term against ``FlopCounterMode`` around the family's own eager attention on one
    document: its two batched matmuls compute the whole score matrix, twice the causal half the spec counts. Multi-
    head latent attention (DeepSeek-V3, MiniCPM3) takes its query-key width (rotary and plain parts) and its value
    width, not ``head_dim`` twice (its attention was counted at half)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_hbp.model_spec import ModelSpec

    config = small_config(family)
    net = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="eager").eval()
    n = 24
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        net(input_ids=torch.arange(3, 3 + n)[None], use_cache=False)
    eager = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "bmm" in str(op))
    spec = ModelSpec.from_config(net.config.to_dict())
    assert eager > 0 and spec.train_flops(0, n**2, 0) / 3 == pytest.approx(eager / 2, rel=1e-9)


LLAMA4 = dict(vocab_size=96, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
              no_rope_layer_interval=2, attention_chunk_size=16, pad_token_id=0)  # fmt: skip
BOUNDED = {  # each family's layers whose keys a window or a chunk bounds, small enough for the documents below
    "mistral": lambda: {**small_config("mistral"), "sliding_window": 8},
    "gemma3_text": lambda: {**small_config("gemma3_text"), "sliding_window": 8, "num_hidden_layers": 3,
                            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "gpt_oss": lambda: {**small_config("gpt_oss"), "sliding_window": 8},
    "llama4_text": lambda: {"model_type": "llama4_text", **LLAMA4},
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(BOUNDED))
def test_windowed_and_chunked_layers_are_priced_at_the_query_key_pairs_their_masks_allow(family):
    """A sliding window or a chunk bounds a layer's attention work: the FLOPs a run reports (``micro_batch_flops``,
    through ``PackedBatch.attention_sq``) count, in every layer, the query-key pairs the family's own mask allows
    (transformers builds it per layer kind, each document run alone: a full layer's ``L^2`` is twice its pairs less
    the diagonal's half). Before, Gemma 3's MFU at 64K read twice what it was."""
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    from lit_hbp.model_spec import ModelSpec

    areas: list[float] = []

    def counting(module, query, key, value, attention_mask, **kw):
        n = query.shape[-2]
        areas.append(2.0 * float((attention_mask[0, 0] == 0).sum()) - n)  # eager_mask: 0 where a key is seen
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("hbp_count", counting)
    AttentionMaskInterface.register("hbp_count", eager_mask)
    config = dict(BOUNDED[family]())
    net = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="hbp_count").eval()
    spec = ModelSpec.from_config(net.config.to_dict())
    assert spec.attention_windows, "the config bounds some layer's keys"
    lengths = [40, 5, 23, 1]  # longer than the window and two chunks, shorter than both, one token
    with torch.no_grad():
        for n in lengths:
            net(input_ids=torch.arange(3, 3 + n)[None] % 90 + 3, use_cache=False)
    assert len(areas) == spec.attending * len(lengths)
    assert spec.attending * spec.attention_sq(lengths) == pytest.approx(sum(areas), rel=1e-12)

    rng = np.random.default_rng(0)
    samples = {i: (rng.integers(3, 90, n), np.ones(n, bool)) for i, n in enumerate(lengths)}
    batch = collate_packs([np.arange(len(lengths))], samples.__getitem__, sp=2, loss_norm=1.0)
    assert batch.pack_len > sum(lengths), "the pack ends in padding, which attends to nothing"
    assert batch.attention_sq(spec) == pytest.approx(sum(areas) / spec.attending, rel=1e-12)
    assert batch.attention_sq(spec) < batch.doc_sq


@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    reach=st.lists(st.tuples(st.sampled_from(["sliding", "chunked", "full"]), st.integers(1, 30)), min_size=1),
)
@settings(max_examples=60, deadline=None)
def test_a_documents_attention_weight_is_its_allowed_query_key_pairs_counted_one_by_one(lengths, reach):
    """``ModelSpec.document_sq`` against the pairs counted one query at a time (a sliding window of w keys: the
    last w positions; a chunk: the positions of its own chunk so far), twice less the diagonal's half, averaged
    over the layers; the simulator and the level search price packs with it."""
    from lit_hbp.model_spec import ModelSpec

    windows = tuple((kind, 0 if kind == "full" else size) for kind, size in reach)
    spec = ModelSpec("m", len(windows), 64, 4, 4, 128, 100, attention_windows=windows)
    want = []
    for n in lengths:
        pairs = 0
        for kind, size in windows:
            for q in range(n):
                first = max(0, q - size + 1) if kind == "sliding" else q - q % size if kind == "chunked" else 0
                pairs += 2 * (q - first + 1) - 1
        want.append(pairs / len(windows))
    assert spec.document_sq(lengths).tolist() == pytest.approx(want, rel=1e-12)
