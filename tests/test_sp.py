"""Sequence parallelism on 4 gloo processes: attention parity, whole-model parity under ZeRO 1-3,
level switches that reuse groups, and configuration errors."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import quiet_trainer
from distributed import Pool

from lit_hbp.lightning.module import HBPLitModule
from lit_hbp.packing import Level
from lit_hbp.parallel.kind import validate_sp_setup

WORLD = 4
LEVELS = [Level(96, 1, 0), Level(192, 2, 1, 2), Level(384, 4, 2)]  # sp 1 / 2 (two packs per rank) / 4
TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
STEPS, ACCUMULATE, LR = 6, 2, 0.2


@pytest.fixture(scope="module")
def pool():
    p = Pool(WORLD)
    yield p
    p.close()


# ------------------------------------------------------------------------------ attention parity


def attention_parity(sp: int, kv_heads: int, kind: str = "ulysses", compiled: bool = False) -> dict:
    """Largest errors of an SP rank's attention output and input gradients against one process over
    the whole pack; ``compiled``: the SP call under torch.compile, the reference eager."""
    import torch._dynamo
    import torch.distributed as dist

    from lit_hbp.model.attention import varlen_attention
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPGroups

    ctx = SPGroups([sp], dist.get_world_size(), dist.get_rank())[sp]
    g = torch.Generator().manual_seed(100 + ctx.ranks[0])  # each SP group gets its own pack
    total, heads, dim = 40 * sp, 4, 8
    cuts = torch.randperm(total - 1, generator=g)[: 2 * sp + 1].add(1).sort().values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([total])]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    q = torch.randn(1, heads, total, dim, generator=g)
    k, v = (torch.randn(1, kv_heads, total, dim, generator=g) for _ in range(2))
    w = torch.randn(1, total, heads, dim, generator=g)
    module = SimpleNamespace(training=False)

    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref, _ = varlen_attention(module, *ref_in, None, scaling=dim**-0.5, cu_seq_lens_q=cu, max_length_q=max_len)
    (out_ref * w).sum().backward()

    part = slice(ctx.rank * total // sp, (ctx.rank + 1) * total // sp)
    sp_in = [x[:, :, part].clone().requires_grad_() for x in (q, k, v)]
    attend = varlen_attention
    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(varlen_attention, backend="aot_eager", dynamic=True)
    sp_group = SPCall.of(ctx, kind)  # the level's group, carried by the call
    out, _ = attend(module, *sp_in, None, scaling=dim**-0.5, cu_seq_lens_q=cu, max_length_q=max_len, hbp_sp=sp_group)
    (out * w[:, part]).sum().backward()
    crossing = int(((cu[1:-1] % (total // sp)) != 0).sum())
    return dict(
        out=(out - out_ref[:, part]).abs().max().item(),
        grads=[(a.grad - b.grad[:, :, part]).abs().max().item() for a, b in zip(sp_in, ref_in)],
        crossing=crossing,
    )


@pytest.mark.slow
@pytest.mark.parametrize("sp, kv_heads", [(2, 2), (2, 4), (4, 2), (4, 4), (2, 1), (4, 1)])
def test_ulysses_attention_matches_single_process(pool, sp, kv_heads):
    for r in pool.run(attention_parity, sp, kv_heads):
        assert r["crossing"] > 0, "documents must cross shard boundaries"
        assert r["out"] < 1e-5
        assert max(r["grads"]) < 1e-5, r["grads"]


@pytest.mark.slow
@pytest.mark.parametrize("sp, kv_heads", [(2, 2), (4, 1)])
def test_compiled_ulysses_attention_matches_single_process(pool, sp, kv_heads):
    """compile=True: the all-to-alls stay eager (graph breaks by design), the attention between them
    is the compiled custom op with its LSE backward."""
    for r in pool.run(attention_parity, sp, kv_heads, "ulysses", True):
        assert r["crossing"] > 0
        assert r["out"] < 1e-5
        assert max(r["grads"]) < 1e-5, r["grads"]


@pytest.mark.slow
@pytest.mark.parametrize("sp, kv_heads", [(2, 2), (4, 1)])
def test_a_second_sp_kind_plugs_into_attention(pool, sp, kv_heads):
    """tests/sp_kinds.py: a kind written outside the library, named by class path, runs exactly."""
    for r in pool.run(attention_parity, sp, kv_heads, "sp_kinds.GatherAll"):
        assert r["crossing"] > 0
        assert r["out"] < 1e-5
        assert max(r["grads"]) < 1e-5, r["grads"]


def logged_lines() -> list[str]:
    """What ``rank_zero_info`` prints on this rank."""
    import io
    import logging

    from lightning.pytorch.utilities import rank_zero_info

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        rank_zero_info("from rank zero only")
    finally:
        logger.removeHandler(handler)
    return stream.getvalue().splitlines()


def test_spawned_workers_log_on_rank_zero_only(pool):
    """A process started with ``set_launch_env`` (the benchmarks', the measured search's, these
    tests') imported Lightning before it knew its rank; rank_zero_info still prints once."""
    assert pool.run(logged_lines) == [["from rank zero only"]] + [[]] * (WORLD - 1)


# -------------------------------------------------------------------------- whole-model parity


class SGDModule(HBPLitModule):
    """Plain SGD, no schedule: the update is the gradient, so parameters compare gradients."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.hparams.lr)


def step_size(loss: str) -> float:
    """The summed loss has gradients a few hundred times larger than the means: scale the step so
    both runs stay finite and comparable."""
    return LR / 300 if loss == "sum" else LR


def gathered_params(module) -> dict:
    import deepspeed

    params = list(module.model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().clone() for n, p in params}


def train_with_strategy(stage: int | str, data: str, tokenizer: str, cache: str, loss: str = "ave_token") -> dict:
    """``stage``: HBPStrategy's ZeRO stage, or "ddp" for HBPDDPStrategy."""
    import lightning as L
    import torch.distributed as dist

    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.lightning.strategy import HBPDDPStrategy, HBPStrategy

    class Trace(L.Callback):
        def __init__(self):
            self.rows, self.groups, self.initial, self.new_groups = [], {}, None, 0

        def on_fit_start(self, trainer, pl_module):
            self.initial = gathered_params(pl_module)
            real = dist.new_group

            def counting(*a, **kw):
                self.new_groups += 1
                return real(*a, **kw)

            dist.new_group = counting
            self.restore = real

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            group = batch.sp_group.ctx.group if batch.sp_group is not None else None  # handed over with the batch
            self.groups.setdefault(batch.sp, set()).add(id(group) if group is not None else None)
            self.rows.append((batch.micro_index, batch.sp, batch.sp_rank, batch.level, batch.sample_index.tolist()))

        def on_fit_end(self, trainer, pl_module):
            dist.new_group = self.restore

    torch.manual_seed(0)
    dm = HBPDataModule(sources=[{"path": data}], tokenizer=tokenizer, levels=LEVELS, cache_dir=cache)
    # The self-check (on_fit_start) is not what this run compares: it runs in the fits of
    # test_zero3_loads_a_local_checkpoint_exactly (ZeRO-3, sp 1/2/4) and of tests/test_cp.py and tests/test_export.py.
    module = SGDModule(model=TINY, vocab_size=dm.vocab_size, loss=loss, lr=step_size(loss), self_check=False)
    trace = Trace()
    trainer = quiet_trainer(
        devices=WORLD,
        strategy=HBPDDPStrategy() if stage == "ddp" else HBPStrategy(stage=stage),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[trace],
    )
    trainer.fit(module, dm)
    return dict(
        initial=trace.initial,
        final=gathered_params(module),
        rows=trace.rows,
        groups={k: len(v) for k, v in trace.groups.items()},
        new_groups=trace.new_groups,
        plan_steps=dm.plan_for_epoch(0).step_level[:STEPS].tolist(),
    )


def reference_update(result: dict, tokens, vocab: int, loss: str = "ave_token", model: dict = TINY) -> dict:
    """One process, HF's own attention, each normalizer by its definition: ave_token is the token
    mean over every token of the optimizer step; the others are per micro-batch of an SP group
    (its B packs), averaged over the world's N / sp groups and over the A micro-steps."""
    torch.manual_seed(0)
    module = HBPLitModule(model=model, vocab_size=vocab)
    module.configure_model()
    net = copy.deepcopy(module.model)
    net.set_attn_implementation("sdpa")
    net.load_state_dict(result["initial"])
    opt = torch.optim.SGD(net.parameters(), lr=step_size(loss))

    def sample_loss(i):
        ids, target = tokens(i)
        ids = torch.tensor(ids, dtype=torch.long)
        labels = torch.where(torch.as_tensor(np.array(target[1:])), ids[1:], -100)
        logits = net(input_ids=ids[None], use_cache=False).logits[0, :-1]
        return F.cross_entropy(logits, labels, reduction="sum", ignore_index=-100), int((labels != -100).sum())

    for step in range(STEPS):
        total = 0.0
        micro = {}  # micro-step -> list of (sp, [(ce, n) per sample]) per SP group
        for r in result["rows"]:
            if r[0] // ACCUMULATE == step and r[2] == 0:
                micro.setdefault(r[0], []).append((r[1], [sample_loss(i) for i in r[4]]))
        if loss == "ave_token":
            pairs = [x for groups in micro.values() for _, g in groups for x in g]
            total = sum(ce for ce, _ in pairs) / sum(n for _, n in pairs)
        else:
            for groups in micro.values():
                for sp, g in groups:
                    n_groups = WORLD // sp
                    n = sum(k for _, k in g)
                    if loss == "token_mean":
                        value = sum(ce for ce, _ in g) / n if n else 0.0
                    elif loss == "sample_mean":
                        kept = [(ce, k) for ce, k in g if k]
                        value = sum(ce / k for ce, k in kept) / len(kept) if kept else 0.0
                    else:
                        value = sum(ce for ce, _ in g)
                    total = total + value / n_groups / ACCUMULATE
        opt.zero_grad()
        total.backward()
        opt.step()
    return dict(net.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage, loss",
    [
        (0, "ave_token"),
        (1, "ave_token"),
        (2, "ave_token"),
        (3, "ave_token"),
        ("ddp", "ave_token"),
        (2, "token_mean"),
        (2, "sample_mean"),
        (2, "sum"),
    ],
)
def test_sp_levels_train_like_a_single_process_reference(pool, sp_data, toy_tokenizer, tmp_path, stage, loss):
    from lit_hbp.lightning.datamodule import HBPDataModule

    results = pool.run(train_with_strategy, stage, str(sp_data), toy_tokenizer, str(tmp_path / "cache"), loss)
    rank0 = results[0]
    # Every sp degree was trained, and each rank reached the same parameters.
    assert {lv.sp for lv in LEVELS} == set(rank0["groups"]), rank0["plan_steps"]
    for r in results[1:]:
        for name, p in r["final"].items():
            torch.testing.assert_close(p, rank0["final"][name], atol=0, rtol=0)
    # The ranks of an SP group trained the same samples; the groups together trained each step.
    rows = [row for r in results for row in r["rows"]]
    # The same token store in this single process (only the largest pack length matters to it).
    dm = HBPDataModule(
        sources=[{"path": str(sp_data)}],
        tokenizer=toy_tokenizer,
        levels=[LEVELS[-1].pack_len],
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup("fit")
    reference = reference_update(dict(rank0, rows=rows), dm.store.tokens, dm.vocab_size, loss)
    for name, p in rank0["final"].items():
        torch.testing.assert_close(p, reference[name].detach(), atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    moved = max((rank0["final"][n] - rank0["initial"][n]).abs().max().item() for n in rank0["final"])
    assert moved > 1e-3, "the steps must change the parameters for the comparison to mean something"
    # Switching levels built no process group and always reused one group object per degree.
    for r in results:
        assert r["new_groups"] == 0
        assert all(n == 1 for n in r["groups"].values())


def zero3_from_pretrained(checkpoint: str, data: str, tokenizer: str, cache: str) -> float:
    """ZeRO-3 partitions parameters as they are created: the checkpoint must still load exactly,
    and the module's own AdamW groups and schedule must work on partitioned parameters."""
    import lightning as L

    from lit_hbp.lightning.datamodule import HBPDataModule
    from lit_hbp.lightning.strategy import HBPStrategy

    class Grab(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.weights = gathered_params(pl_module)

    dm = HBPDataModule(sources=[{"path": data}], tokenizer=tokenizer, levels=LEVELS, cache_dir=cache)
    grab = Grab()
    trainer = quiet_trainer(devices=WORLD, strategy=HBPStrategy(stage=3), max_steps=1, callbacks=[grab])
    trainer.fit(HBPLitModule(model=checkpoint, vocab_size=dm.vocab_size, weight_decay=0.1), dm)
    from transformers import AutoModelForCausalLM

    saved = dict(AutoModelForCausalLM.from_pretrained(checkpoint).named_parameters())
    assert set(saved) == set(grab.weights)
    return max((grab.weights[n] - p).abs().max().item() for n, p in saved.items())


@pytest.mark.slow
def test_zero3_loads_a_local_checkpoint_exactly(pool, sp_data, toy_tokenizer, tmp_path):
    from lit_hbp.lightning.datamodule import load_tokenizer

    torch.manual_seed(3)
    module = HBPLitModule(model=TINY, vocab_size=len(load_tokenizer(toy_tokenizer)))
    module.configure_model()
    module.model.save_pretrained(tmp_path / "ckpt")
    diffs = pool.run(
        zero3_from_pretrained, str(tmp_path / "ckpt"), str(sp_data), toy_tokenizer, str(tmp_path / "cache")
    )
    assert max(diffs) == 0.0


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    "levels, world, heads, kv, layers, message",
    [
        ([Level(64, 3)], 4, 4, 4, 2, "world_size 4 is not divisible by sp 3 of level 0"),
        ([Level(64, 8)], 4, 8, 8, 2, "level 0 (pack_len 64) has sp 8 > world_size 4"),
        (
            [Level(32), Level(64, 4, ulysses=4)],
            4,
            6,
            6,
            2,
            "level 1 (pack_len 64, sp 4): 6 attention heads cannot be split over 4 Ulysses ranks",
        ),
        ([Level(64, 4, cp=2)], 4, 8, 3, 2, "level 0 (pack_len 64, sp 4): 3 key/value heads do not fit 2 Ulysses"),
        ([Level(64, 2, 3)], 4, 4, 4, 2, "level 0 (pack_len 64) checkpoints 3 layers but the model has 2"),
    ],
)
def test_configuration_errors_name_the_level(levels, world, heads, kv, layers, message):
    with pytest.raises(ValueError) as e:
        validate_sp_setup(levels, world, heads, kv, layers)
    assert message in str(e.value)


def test_valid_configurations_pass_and_say_how_kv_heads_are_split():
    assert validate_sp_setup([Level(64), Level(256, 4, 2)], 8, 32, 8, 32) == [1, 1]
    assert validate_sp_setup([Level(131072, 8, 28)], 32, 32, 8, 32) == [1]  # LLaMA3.1-8B: 8 kv heads over sp 8
    assert validate_sp_setup([Level(65536, 16)], 32, 32, 8, 32) == [2]  # 8 kv heads replicated twice for sp 16
    assert validate_sp_setup([Level(64, 4)], 4, 4, 1, 2) == [4]  # multi-query: the one kv head on every rank


# --------------------------------------------------------------------------------- self-check


def self_check_on_world(config: dict, broken: bool) -> dict:
    """The self-check of a family at sp 1, 2 and 4 on this 4-process world; with ``broken``, Ulysses
    hands each rank the wrong heads back (a bug only sequence parallelism can show)."""
    import torch.distributed as dist

    import lit_hbp.parallel.ulysses as ulysses_module
    from lit_hbp.model.selfcheck import SelfCheckError, run_self_check
    from lit_hbp.parallel.groups import SPGroups

    torch.manual_seed(0)
    module = HBPLitModule(model=config, vocab_size=300)
    module.configure_model()
    groups = SPGroups([2, 4], dist.get_world_size(), dist.get_rank())
    real = ulysses_module.heads_to_seq
    if broken:
        ulysses_module.heads_to_seq = lambda out, ctx: real(out.roll(1, dims=1), ctx)
    try:
        return {"errors": run_self_check(module, [1, 2, 4], groups, max_len=512)}
    except SelfCheckError as e:
        return {"refused": str(e)}
    finally:
        ulysses_module.heads_to_seq = real


SP_FAMILIES = {
    "llama": TINY,
    "mistral (sliding window)": {**TINY, "model_type": "mistral", "sliding_window": 24},
    "gemma2 (soft-capping)": {
        **TINY,
        "model_type": "gemma2",
        "head_dim": 8,
        "final_logit_softcapping": 2.0,
        "attn_logit_softcapping": 1.5,
        "sliding_window": 24,
    },
    "gpt_oss (sinks)": {**TINY, "model_type": "gpt_oss", "head_dim": 8, "num_local_experts": 4, "sliding_window": 24},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SP_FAMILIES))
def test_self_check_passes_at_every_sp_degree(pool, family):
    for r in pool.run(self_check_on_world, SP_FAMILIES[family], False):
        assert set(r["errors"]) == {1, 2, 4}, r
        for loss_err, grad_err, leak, left_out in r["errors"].values():
            assert loss_err < 1e-4 and grad_err < 1e-3 and leak == 0.0 and left_out == 0, r


@pytest.mark.slow
def test_self_check_refuses_a_sequence_parallel_bug(pool):
    results = pool.run(self_check_on_world, TINY, True)
    for r in results:  # every rank reaches the same verdict, so none waits on the others
        assert "refused" in r, r
        assert "at sp 2 differs" in r["refused"] and "sequence parallelism at sp 2 changes the result" in r["refused"]


def fit_ddp_with_sp_level(data: str, tokenizer: str, cache: str) -> str:

    from lit_hbp.lightning.datamodule import HBPDataModule

    dm = HBPDataModule(sources=[{"path": data}], tokenizer=tokenizer, levels=["96:1", "384:2"], cache_dir=cache)
    trainer = quiet_trainer(devices=WORLD, strategy="ddp", max_steps=1)
    try:
        trainer.fit(HBPLitModule(model=TINY, vocab_size=dm.vocab_size), dm)
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.slow
def test_an_sp_level_under_a_strategy_without_sp_is_refused(pool, sp_data, toy_tokenizer, tmp_path):
    for message in pool.run(fit_ddp_with_sp_level, str(sp_data), toy_tokenizer, str(tmp_path / "cache")):
        assert "level 1 (pack_len 384) uses sequence parallelism 2, which DDPStrategy cannot run" in message
