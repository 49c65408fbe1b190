"""A prepared model stays a normal model wherever a project's own code calls it.

The reference is always independent: the unprepared model with eager attention, call by call (a
padded batch with a mask and ordinary labels, greedy ``generate()`` with and without the KV cache,
KV-cache decode steps), each document alone for a pack, one process for two. A pack's state lives
as long as its call; what cannot be exact (a pack without its boundaries, the model's own loss under
sequence parallelism, an unprepared model called on a pack) is refused, naming what to do.
"""

import copy
import gc
import math
import weakref

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import TINY_LLAMA, quiet_trainer
from test_packed_loss import alone, assert_logits_alone, samples, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache

from lit_hbp import (
    HBPStrategy,
    Level,
    calls,
    pack_inputs,
    pack_samples,
    packed_loss,
    prepare_model,
    prepared,
    step_loss_norm,
    unprepare_model,
)
from lit_hbp.data.collate import collate_packs
from lit_hbp.lightning.trained_model import guard_frozen, trained_model
from lit_hbp.model.packed_call import PREPARED, current_tiles, record_of
from lit_hbp.parallel.ulysses import Ulysses

PAD = 0


def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the unprepared model with eager attention, a prepared copy of it that had sdpa)."""
    reference = tiny_model("eager").float().eval()
    model = prepare_model(tiny_model())
    model.load_state_dict(reference.state_dict())
    return reference, model.eval()


def padded(lengths: list[int], length: int, seed: int = 0, left: bool = False):
    """A padded batch: token ids, attention mask and ordinary (unshifted) labels, -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), length), PAD)
    mask = torch.zeros(len(lengths), length, dtype=torch.long)
    for row, n in enumerate(lengths):
        span = slice(length - n, length) if left else slice(0, n)
        ids[row, span] = torch.randint(3, 64, (n,), generator=g)
        mask[row, span] = 1
    return ids, mask, torch.where(mask.bool(), ids, -100)


def decode_steps(model, prompt: torch.Tensor, steps: int = 5) -> list[torch.Tensor]:
    """Logits of a prefill and ``steps`` single-token decode steps through a DynamicCache (greedy)."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[:, -1])
    return logits


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * scale)


@pytest.mark.parametrize("after_a_pack", [False, True], ids=["fresh", "after_a_packed_step"])
def test_calls_outside_a_pack_compute_what_the_unprepared_model_computes(after_a_pack):
    """Padded forward with a mask and ordinary labels, greedy generate() with and without the cache,
    five KV-cache decode steps: the unprepared eager model's results, also right after a packed training
    step (checkpointed, tiled) whose pack has the length of the calls that follow."""
    reference, model = pair()
    ids, mask, labels = padded([24, 21, 17, 5], 24)
    if after_a_pack:
        batch = pack_samples([(np.arange(3, 15), np.ones(12)), (np.arange(5, 17), np.ones(12))], loss_norm=10.0)
        assert batch.input_ids.shape[1] == ids.shape[1]  # the same length: nothing of the pack may be picked up
        model.train()
        packed_loss(model, batch.replace(ckpt_layers=1, mlp_tiles=2)).loss.backward()
        model.eval()
    with torch.no_grad():
        got, want = (
            model(input_ids=ids, attention_mask=mask, labels=labels),
            reference(ids, attention_mask=mask, labels=labels),
        )
        real = mask.bool()
        close(got.logits[real], want.logits[real])
        assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-5)
        prompts, prompt_mask, _ = padded([9, 6], 9, seed=1, left=True)
        greedy = dict(attention_mask=prompt_mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
        expected = reference.generate(prompts, **greedy)
        assert torch.equal(model.generate(prompts, **greedy), expected)
        assert torch.equal(model.generate(prompts, use_cache=False, **greedy), expected)
        for a, b in zip(decode_steps(model, prompts[:1, 3:]), decode_steps(reference, prompts[:1, 3:])):
            close(a, b)


def test_no_state_of_a_pack_outlives_its_call():
    """After a packed step nothing holds the pack (its tensors are freed once the batch and graph are
    dropped), the model's attention, checkpointing and tiles are as before, also when the call raised."""
    _, model = pair()
    model.train()
    layers = record_of(model).layers
    batch = pack_samples(samples(), loss_norm=20.0).replace(ckpt_layers=2, offload=True, mlp_tiles=2)
    out = packed_loss(model, batch)
    out.loss.backward()
    cu = weakref.ref(batch.cu_seqlens)
    del batch, out
    gc.collect()
    assert cu() is None, "something outside the call kept the pack's boundaries"
    assert model.config._attn_implementation == "sdpa"
    assert [layer.gradient_checkpointing for layer in layers] == [False, False]
    assert current_tiles(record_of(model)) == 1 and record_of(model).active == 0 and calls.running() is None

    def fail(*_):
        raise RuntimeError("boom")

    handle = layers[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        packed_loss(model, pack_samples(samples(), loss_norm=20.0).replace(ckpt_layers=1))
    handle.remove()
    assert model.config._attn_implementation == "sdpa" and not layers[0].gradient_checkpointing
    assert record_of(model).active == 0 and calls.running() is None


def count_forwards(layers) -> list[int]:
    counts = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def test_a_projects_own_gradient_checkpointing_is_kept():
    """gradient_checkpointing_enable() before or after prepare_model: packed calls checkpoint every layer
    (not only the level's first), the model still says it checkpoints, gradients are unchanged; without
    it only the level's layers recompute."""
    _, plain = pair()
    own = copy.deepcopy(plain)
    own.gradient_checkpointing_enable()
    batch = pack_samples(samples(), loss_norm=20.0).replace(ckpt_layers=1)
    grads = []
    for model, recomputed in ((plain, [2, 1]), (own, [2, 2])):
        model.train()
        counts = count_forwards(record_of(model).layers)
        packed_loss(model, batch).loss.backward()
        assert counts == recomputed
        grads.append([p.grad for p in model.parameters()])
    assert own.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    for a, b in zip(*grads):
        close(a, b)


def test_prepared_hands_the_model_back_as_it_was():
    """``with prepared(model):`` trains on packs inside; after it the model has its own attention, loss,
    MLP forwards and mode, no hooks or attributes of lit-hbp, and computes what it computed before."""
    model = tiny_model().eval()
    before = copy.deepcopy(model)
    ids, mask, labels = padded([10, 7], 10)
    with prepared(model):
        assert model.training and record_of(model) is not None
        packed_loss(model, pack_samples(samples(), loss_norm=20.0)).loss.backward()
    assert not model.training and record_of(model) is None
    assert model.config._attn_implementation == "sdpa" and "_loss_function" not in model.__dict__
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks
    assert PREPARED not in model.model.__dict__
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)
    with torch.no_grad():
        assert torch.equal(
            model(ids, attention_mask=mask, labels=labels).logits,
            before(ids, attention_mask=mask, labels=labels).logits,
        )
    assert unprepare_model(prepare_model(model)) is model and record_of(model) is None
    prepare_model(model).set_attn_implementation("eager")  # the project's choice since prepare_model: it stays
    assert unprepare_model(model).config._attn_implementation == "eager"  # (it was put back to sdpa)


def test_unprepare_model_hands_back_the_eval_mode_prepare_model_left():
    """``prepare_model`` puts a model wholly in eval mode (as ``from_pretrained`` returns it) in train mode;
    ``unprepare_model`` left it there, so a project evaluating the model it handed back ran its dropout (GPT-2's
    0.1: logits 0.12 off). Now it is in eval mode again, unless the project set a mode since (kept); a model in
    train mode before stays so."""
    model = tiny_model().eval()
    assert prepare_model(model).training
    assert not any(m.training for m in unprepare_model(model).modules())
    prepare_model(model).model.layers[0].eval()  # a part the project froze since: every mode as it set them
    unprepare_model(model)
    assert model.training and not model.model.layers[0].training
    model.train()
    assert all(m.training for m in unprepare_model(prepare_model(model)).modules())


def test_a_part_its_project_put_in_eval_keeps_its_mode_and_trains_like_each_document_alone():
    """A project's model in train mode with one decoder layer in eval (its dropout off): prepare_model put every
    module in train mode, turning that layer's dropout back on (its attention gradients 100% off each document
    alone). Each module's mode is kept now, and ``with prepared(model):`` hands each back as it was."""
    from transformers import AutoConfig

    cfg = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=64, attention_dropout=1.0, **cfg)  # p = 1: no randomness
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()
    model.model.layers[0].eval()
    reference = copy.deepcopy(model)
    modes = [m.training for m in model.modules()]
    with prepared(model):
        assert [m.training for m in model.modules()] == modes
        out = packed_loss(model, pack_samples(samples(), loss_norm=1.0))
        out.loss.backward()
        want, _ = alone(reference, samples())
        want.backward()
        close(out.ce_sum, want)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                close(p.grad, q.grad, rel=1e-4)
        model.eval()  # the block hands back each module's mode as it was before it, whatever ran inside
    assert [m.training for m in model.modules()] == modes
    fresh = AutoModelForCausalLM.from_config(config).eval()  # wholly in eval, as from_pretrained gives it
    assert all(m.training for m in prepare_model(fresh).modules())


def test_neftune_noise_scaled_by_the_row_is_refused_in_a_packed_call_and_eval_calls_run():
    """transformers' NEFTune hook scales its noise by 1 / sqrt(row length x width): a packed call's row is the pack,
    so each document got the pack's noise, not its own (the hook's own bounds differ, below), without a word.
    Refused while it acts (train mode); in eval it adds nothing, and the pack equals each document alone."""
    try:
        from transformers.integrations.neftune import neftune_post_forward_hook
    except ImportError:  # transformers before 5.x kept it with its Trainer
        from transformers.trainer_utils import neftune_post_forward_hook

    bounds = []

    def noisy(module, args, output):
        bounds.append(module.neftune_noise_alpha / math.sqrt(output.size(1) * output.size(2)))
        return neftune_post_forward_hook(module, args, output)

    model = tiny_model("eager").train()
    reference = copy.deepcopy(model)
    for net in (model, reference):
        net.get_input_embeddings().neftune_noise_alpha = 5.0
        net.get_input_embeddings().register_forward_hook(neftune_post_forward_hook)
    batch = pack_samples(samples(), loss_norm=1.0)
    with torch.no_grad():
        alone(reference, samples())
    prepare_model(model)
    with pytest.raises(ValueError, match=r"^Embedding holds transformers' NEFTune hook \(neftune_noise_alpha 5.0\)"):
        packed_loss(model, batch)
    probe = tiny_model("eager").train()  # the hook's own noise bounds: each document alone, and the pack as a row
    probe.get_input_embeddings().neftune_noise_alpha = 5.0
    probe.get_input_embeddings().register_forward_hook(noisy)
    with torch.no_grad():
        alone(probe, samples())
        probe(input_ids=batch.input_ids)
    assert bounds[-1] not in bounds[:-1] and len(bounds) == len(samples()) + 1  # the pack's noise is no document's
    model.eval(), reference.eval()
    with torch.no_grad():
        close(packed_loss(model, batch).ce_sum, alone(reference, samples())[0])


def test_a_deep_copy_is_prepared_on_its_own():
    """A deep copy (EMA, a reference) has its own record and hooks: unpreparing it leaves the original
    prepared, and the copy's packed calls train the copy."""
    _, model = pair()
    twin = copy.deepcopy(model)
    assert record_of(twin) is not record_of(model) and record_of(twin).decoder is twin.model
    unprepare_model(twin)
    assert record_of(model) is not None
    with pytest.raises(ValueError, match="without their document boundaries or positions"):
        model(input_ids=pack_samples(samples()).input_ids)
    twin(input_ids=pack_samples(samples()).input_ids)  # unprepared: no guard of lit-hbp's left on it


def test_pack_samples_takes_hugging_face_records_and_level_settings():
    pairs = samples(seed=3)
    records = [{"input_ids": ids.tolist(), "labels": np.where(m, ids, -100).tolist(), "attention_mask": [1] * len(ids)}
               for ids, m in pairs]  # fmt: skip
    a, b = pack_samples(pairs), pack_samples(records, ckpt_layers=1, mlp_tiles=2)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.position_ids, b.position_ids)
    assert (b.ckpt_layers, b.mlp_tiles) == (1, 2)
    _, model = pair()
    model.train()
    counts = count_forwards(record_of(model).layers)
    packed_loss(model, b, "token_mean").loss.backward()
    assert counts == [2, 1]
    bad = dict(records[1], labels=[7] + records[1]["labels"][1:])
    with pytest.raises(ValueError, match=r"sample 1: labels\[0\] is 7, not -100 and not the token"):
        pack_samples([records[0], bad])
    with pytest.raises(ValueError, match="sample 1 has no tokens: an empty sample trains nothing"):
        pack_samples([pairs[0], ([], []), pairs[1]])  # its loss would count a document that is not there
    with pytest.raises(ValueError, match="sample 2 has no tokens"):
        pack_samples([pairs[0], pairs[1], {"input_ids": [], "labels": []}])
    ids, mask = (torch.as_tensor(x)[None] for x in pairs[0])  # [1, L], as a tokenizer returns them
    for given in ((ids, mask), {"input_ids": ids, "supervised": mask}):
        assert torch.equal(pack_samples([given]).labels, pack_samples([pairs[0]]).labels)
    for flat in (ids[0], ids[0].tolist(), (ids[0], mask[0], mask[0])):  # token ids alone, or a triple
        with pytest.raises(ValueError, match=r"sample 1: pack_samples takes \(input_ids, supervised\) pairs, mapp"):
            pack_samples([pairs[0], flat])
    with pytest.raises(ValueError, match="sample 0: its attention_mask has zeros"):
        pack_samples([dict(records[0], attention_mask=[1] * (len(records[0]["input_ids"]) - 1) + [0])])
    n = len(records[0]["input_ids"])
    for wrong in ([1] * (n - 1), [1] * (n + 1), [[1] * n] * 2):  # the mask of another sample, or a batch's
        with pytest.raises(
            ValueError, match=rf"sample 0: its attention_mask must hold one value per token \(\d+ for {n}\)"
        ):
            pack_samples([dict(records[0], attention_mask=wrong)])
    vocab = model.config.vocab_size
    for pad_id, given, bound in ((-1, None, "vocabulary size"), (1.0, None, "vocabulary size"), (vocab, model, vocab)):
        with pytest.raises(ValueError, match=rf"pad_id must be a token id in \[0, {bound}\), got {pad_id}"):
            pack_samples([records[0]], pad_id=pad_id, model=given)
    # None is no value, as the model's forward reads it: no mask (all attended), or no labels (then none given)
    unmasked = pack_samples([dict(records[0], attention_mask=None)])
    assert torch.equal(unmasked.labels, pack_samples([records[0]]).labels)
    with pytest.raises(ValueError, match=r"sample 0: give input_ids and one of supervised or labels, got \['inpu"):
        pack_samples([{"input_ids": records[0]["input_ids"], "labels": None}])
    with pytest.raises(ValueError, match=r"sample 0: pack_samples does not use \['cross_attention_mask'\]"):
        pack_samples([dict(records[0], cross_attention_mask=[0])])  # mllama's: its images are cross-attended
    with pytest.raises(ValueError, match=r"sample 0: token_type_ids must hold one value per token \(1 for 33\)"):
        pack_samples([dict(records[0], token_type_ids=[0])])


class Distill(L.LightningModule):
    """A module of one's own with a student, a frozen prepared teacher called on the packs, and a frozen
    unprepared judge that only ever sees a padded batch."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder
        self.student = self.teacher = self.judge = None
        self.seen = []

    def configure_model(self):
        if self.student is None:
            self.student = prepare_model(AutoModelForCausalLM.from_pretrained(self.folder))
            self.teacher = prepare_model(AutoModelForCausalLM.from_pretrained(self.folder)).requires_grad_(False).eval()
            self.judge = AutoModelForCausalLM.from_pretrained(self.folder).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        out = packed_loss(self.student, batch, "token_mean")
        assert self.student.training and not any(m.training for m in self.teacher.modules())  # as docs/lightning.md
        with torch.no_grad():
            teacher = self.teacher(**pack_inputs(batch)).logits
            ids, mask, labels = padded([8, 5], 8)
            judged = self.judge(ids, attention_mask=mask, labels=labels).loss
        self.seen.append((float(out.ce_sum), teacher.float(), float(judged)))
        self.linear = torch.nn.functional.linear
        return out.loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.student.parameters() if p.requires_grad], lr=0.0)


@pytest.mark.slow
def test_zero3_loads_an_own_modules_models_from_a_folder_with_a_frozen_teacher(pretrained_llama, tmp_path):
    """HBPStrategy at ZeRO-3 and a module that calls from_pretrained in configure_model (no helper): the
    first step's loss is the checkpoint's (each sample alone, eager), the frozen teacher's logits on the
    pack are each document's alone, the unprepared judge runs its own padded batch. DeepSpeed's linear, which its
    ``zero.Init`` puts in torch for the whole process, trains the run and is torch's own again after it."""
    rng = np.random.default_rng(0)
    docs = [(rng.integers(3, 60, n), rng.random(n) < 0.7) for n in (11, 23, 6, 17)]
    loader = torch.utils.data.DataLoader(docs, batch_size=4, collate_fn=pack_samples)
    module = Distill(pretrained_llama)
    trainer = quiet_trainer(strategy=HBPStrategy(stage=3, levels=[Level(64)]), max_steps=1, devices=1)
    linear = torch.nn.functional.linear
    trainer.fit(module, loader)
    assert module.linear.__module__ == "deepspeed.runtime.zero.linear" and torch.nn.functional.linear is linear
    reference = AutoModelForCausalLM.from_pretrained(pretrained_llama, attn_implementation="eager").float().eval()
    with torch.no_grad():
        ce, _ = alone(reference, docs)
        ids, mask, labels = padded([8, 5], 8)
        judged = float(reference(ids, attention_mask=mask, labels=labels).loss)
        ce_sum, teacher, judge_loss = module.seen[0]
        assert ce_sum == pytest.approx(float(ce), rel=1e-5)
        assert judge_loss == pytest.approx(judged, rel=1e-5)
        start = 0
        for ids_doc, _ in docs:
            n = len(ids_doc)
            close(teacher[0, start : start + n], reference(torch.as_tensor(ids_doc)[None]).logits[0].float())
            start += n


def test_frozen_models_that_see_a_pack_must_be_prepared():
    """The strategy's check: a frozen model held unprepared may run outside packs, and on ``pack_inputs`` at sp 1
    (transformers' own packed path: each document's logits alone); called on a pack it would compute wrong (the
    ids without boundaries or positions, the boundaries or positions with its cache on, a rank's shard without its
    SP group: prepared or not) it is refused naming its attribute; an unprepared trainable model at a level with
    sp > 1 is refused at set-up naming its attribute; the trained model is the trainable one."""

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.judge = tiny_model().requires_grad_(False)
            self.student = prepare_model(tiny_model())

    holder = Holder()
    assert trained_model(holder, [Level(64, 2)]) is holder.student
    handles = guard_frozen(holder)
    try:
        ids, mask, _ = padded([6, 4], 6)
        holder.judge(ids, attention_mask=mask)
        pairs = samples()
        batch = pack_samples(pairs)
        with torch.no_grad():
            logits = holder.judge(**pack_inputs(batch)).logits[0]
            start = 0
            for doc, _ in pairs:
                close(logits[start : start + len(doc)], holder.judge(torch.as_tensor(doc)[None]).logits[0])
                start += len(doc)
        with pytest.raises(ValueError, match=r"self\.judge \(LlamaForCausalLM\) is called on a packed micro-batch.*"
                           "without boundaries or positions"):  # fmt: skip
            holder.judge(input_ids=batch.input_ids)
        with pytest.raises(ValueError, match="with its KV cache on"):
            holder.judge(**{**pack_inputs(batch), "use_cache": True})
        # The ids and positions alone: transformers reads the documents from the positions only with the cache off
        with pytest.raises(ValueError, match="with its KV cache on"):
            holder.judge(input_ids=batch.input_ids, position_ids=batch.position_ids)
        with torch.no_grad():
            alone = holder.judge(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        close(alone[0], logits)
        # One rank's shard of an sp 2 pack, called without its SP group: it would attend within the shard alone
        shard = Ulysses().shard(collate_packs([np.arange(len(pairs))], pairs.__getitem__, sp=2, loss_norm=1.0), 2, 1)
        with pytest.raises(ValueError, match=r"self\.judge .* under sequence parallelism its ranks' shards would"):
            holder.judge(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False)
        with pytest.raises(ValueError, match="called on one rank's shard of a pack of sequence parallelism 2 without"):
            holder.student(input_ids=shard.input_ids, position_ids=shard.position_ids)
        # ... also a shard inside one document, whose positions do not restart
        long = [(np.arange(30) % 64, np.ones(30, bool)), (np.arange(10), np.ones(10, bool))]
        inside = Ulysses().shard(collate_packs([np.arange(2)], long.__getitem__, sp=2, loss_norm=1.0), 2, 0)
        assert bool((inside.position_ids[0].diff() == 1).all())
        with pytest.raises(ValueError, match="called on one rank's shard of a pack of sequence parallelism 2 without"):
            holder.student(input_ids=inside.input_ids, position_ids=inside.position_ids)
        # An attention mask beside the positions: transformers attends over the masked row as one sequence
        with pytest.raises(ValueError, match=r"self\.judge .* with an attention mask and no boundaries"):
            holder.judge(input_ids=batch.input_ids, position_ids=batch.position_ids,
                         attention_mask=torch.ones_like(batch.input_ids), use_cache=False)  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    holder.student = tiny_model()
    with pytest.raises(
        ValueError, match=r"self\.student \(LlamaForCausalLM\) is not prepared .*prepare_model\(self\.student\)"
    ):
        trained_model(holder, [Level(64, 2)])


# ----------------------------------------------------------------------------- two processes


def two_ranks(docs, sp_docs):
    """On each of 2 gloo ranks: (a) data parallel over own packs, 2 micro-batches per rank, normalized by
    step_loss_norm; (b) at sp 2 over one pack: the model's own loss refused, the pack's ids without
    boundaries refused, a prepared teacher's logits of this rank's shard; (c) the sp 2 pack's summed
    cross-entropy with every layer checkpointed, backpropagated only after another micro-batch (sp 1,
    no group) ran its forward and backward: the recomputation runs in its own call's group."""
    from lit_hbp.parallel.context import SPCall
    from lit_hbp.parallel.groups import SPGroups
    from lit_hbp.parallel.ulysses import Ulysses

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = prepare_model(tiny_model()).float()
    micro = [pack_samples(docs[rank][i : i + 2]) for i in (0, 2)]
    norm = step_loss_norm(micro)
    for batch in micro:
        (packed_loss(model, batch.replace(loss_norm=norm)).loss / len(micro)).backward()  # Lightning's 1/A
    grads = [p.grad.clone() for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g /= dist.get_world_size()

    ctx = SPGroups([(2, 1)], 2, rank)[(2, 1)]
    whole = collate_packs([np.arange(len(sp_docs))], sp_docs.__getitem__, sp=2, loss_norm=1.0)
    shard = Ulysses().shard(whole, 2, ctx.rank).replace(sp_group=SPCall.of(ctx, "ulysses"))
    refusals = []
    for call in (
        lambda: model(**pack_inputs(shard), labels=shard.labels, shift_labels=shard.labels),
        lambda: model(input_ids=shard.input_ids),
    ):
        try:
            call()
        except ValueError as e:
            refusals.append(str(e))
    with torch.no_grad():
        logits = model(**pack_inputs(shard)).logits
    gathered = [torch.empty_like(logits) for _ in range(2)]
    dist.all_gather(gathered, logits.contiguous())

    sp_loss = packed_loss(model, shard.replace(ckpt_layers=2), weights=1.0).loss
    packed_loss(model, micro[0].replace(loss_norm=norm)).loss.backward()  # another call in between
    sp_grads = list(torch.autograd.grad(sp_loss, list(model.parameters())))
    for g in sp_grads:
        dist.all_reduce(g)  # the shards' parts of the pack's gradient
    return grads, norm, refusals, torch.cat(gathered, dim=1), sp_grads


@pytest.mark.slow
def test_two_processes_give_one_processs_update_and_refuse_what_sp_cannot_do(shared_pool2):
    rng = np.random.default_rng(5)
    docs = {r: [(rng.integers(0, 64, n), rng.random(n) < 0.6) for n in rng.integers(4, 30, 4)] for r in (0, 1)}
    sp_docs = {i: (rng.integers(0, 64, n), np.ones(n, bool)) for i, n in enumerate([9, 14, 5, 4])}
    results = shared_pool2.run(two_ranks, docs, sp_docs)
    reference = tiny_model("eager").float()
    torch.manual_seed(0)
    reference.load_state_dict(prepare_model(tiny_model()).float().state_dict())
    ce, n = alone(reference, docs[0] + docs[1])
    (ce / n).backward()
    (grads, norm, refusals, logits, sp_grads), (grads1, norm1, refusals1, _, sp_grads1) = results
    assert norm == norm1 == pytest.approx(n / 4)
    for got, other, want in zip(grads, grads1, reference.parameters()):
        torch.testing.assert_close(got, other)
        close(got, want.grad)
    for messages in (refusals, refusals1):
        assert len(messages) == 2
        assert "would average each rank's shard" in messages[0] and "packed_loss" in messages[0]
        assert "one rank's shard of a pack of sequence parallelism 2 without its SP group" in messages[1]
    with torch.no_grad():
        start = 0
        for ids, _ in sp_docs.values():
            want = reference(torch.as_tensor(ids)[None]).logits[0]
            close(logits[0, start : start + len(ids)], want)
            start += len(ids)
    ce_sp, _ = alone(reference, list(sp_docs.values()))
    for got, other, want in zip(sp_grads, sp_grads1, torch.autograd.grad(ce_sp, list(reference.parameters()))):
        torch.testing.assert_close(got, other)
        close(got, want)


DDP_SCRIPT = """
import lightning as L, sys, torch
sys.path.insert(0, sys.argv[1])
from test_packed_loss import samples, tiny_model
from lit_hbp import HBPStrategy, pack_samples, packed_loss, prepare_model  # the strategy's exit hook registered

class Own(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = prepare_model(tiny_model())
    def training_step(self, batch, batch_idx):
        return packed_loss(self.model, batch, "token_mean").loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

loader = torch.utils.data.DataLoader(samples(8), batch_size=4, collate_fn=pack_samples)
L.Trainer(accelerator="cpu", devices=1, strategy="ddp", max_steps=1, logger=False, enable_checkpointing=False,
          enable_progress_bar=False, enable_model_summary=False).fit(Own(), loader)
"""


@pytest.mark.slow
def test_a_ddp_run_exits_cleanly(tmp_path):
    """A strategy="ddp" run of an own module ends without "Exception ignored in atexit callback": the exit
    hook that destroys the process groups must not import DeepSpeed (whose import registers atexit
    callbacks, which Python refuses during shutdown) when the run never used it."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "run.py").write_text(DDP_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), str(Path(__file__).parent)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Exception ignored" not in out.stderr and "atexit" not in out.stderr, out.stderr[-2000:]
    assert "max_steps=1` reached" in out.stderr + out.stdout


def rope_model(kind: str, attn: str):
    """A tiny model whose rotary embedding is ``kind``, rescaling past 16 positions where it does."""
    from transformers import AutoConfig

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    if kind == "longrope":  # Phi-3's: short factors within 16 positions, long ones past them
        rope = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 2.0, 4.0, 9.0]}
        config = AutoConfig.for_model(
            "phi3", original_max_position_embeddings=16, rope_scaling=rope, pad_token_id=0, **shape
        )
    else:
        shape["max_position_embeddings"] = 16
        config = AutoConfig.for_model("llama", rope_scaling={"rope_type": kind, "factor": 4.0}, **shape)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()


def doc_pairs(lengths: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(len(lengths))
    return [(rng.integers(0, 64, n), np.arange(n) >= 1) for n in lengths]


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "linear"])
@pytest.mark.parametrize(
    "lengths", [[12, 10, 15], [30], [12, 30], [20, 5, 17, 16, 33]], ids=["within", "one-long", "mixed", "mixed-many"]
)
def test_a_rotary_embedding_scaled_by_the_calls_longest_position_packs_exactly_or_is_refused(kind, lengths):
    """transformers' dynamic and longrope rotary embeddings choose their frequencies from the call's longest
    position: a pack trains as each document alone (a fresh unprepared model, eager) while its documents stay
    within the rescaling length or it holds one. A longrope pack mixing longer documents with others gives each
    token its own document's factors (``rope.per_document_longrope``: 17 and 33 long, 16 and 5 short); a dynamic
    one is refused through packed_loss and the model's own packed call. A static rope type (linear) packs any mix."""
    pairs = doc_pairs(lengths)
    refs = [rope_model(kind, "eager") for _ in pairs]  # each alone from a fresh model: dynamic's state is per call
    ce = sum(alone(ref, [p])[0] for ref, p in zip(refs, pairs))
    model = prepare_model(rope_model(kind, "sdpa"))
    batch = pack_samples(pairs)
    if kind == "dynamic" and len(lengths) > 1 and max(lengths) > 16:
        with pytest.raises(ValueError, match=rf"rope_type '{kind}': a pack of {len(lengths)} documents whose longest"):
            packed_loss(model, batch, "sum")
        with pytest.raises(ValueError, match=rf"rope_type '{kind}'.* at pack_len <= 16"):
            model(**pack_inputs(batch))
        return
    ce.backward()
    out = packed_loss(model, batch, "sum")
    out.loss.backward()
    assert float(out.ce_sum) == pytest.approx(float(ce), rel=1e-5)
    for name, p in model.named_parameters():
        want = sum(dict(ref.named_parameters())[name].grad for ref in refs)
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # the model's own packed call: each document's logits as it alone gives them
        logits = model(**pack_inputs(batch)).logits[0]
        cu = batch.cu_seqlens.tolist()
        for i, (ref, (ids, _)) in enumerate(zip(refs, pairs)):
            alone_logits = ref(input_ids=torch.as_tensor(ids)[None]).logits[0]
            close(logits[cu[i] : cu[i + 1]], alone_logits)


def test_a_longrope_pack_split_over_an_sp_group_past_its_length_is_refused():
    """On an SP level each rank's shard would choose the long or short factors by its own longest position: a
    longrope pack past the length there is refused by name (sp 1 packs it exactly, the test above)."""
    from lit_hbp.model.rope import rope_scope

    model = prepare_model(rope_model("longrope", "sdpa"))
    batch = pack_samples(doc_pairs([12, 30]))
    pack = {**pack_inputs(batch), "hbp_sp": object()}
    with pytest.raises(ValueError, match="rope_type 'longrope': a pack of a document split over an SP group.*at sp 1"):
        rope_scope(model.model, record_of(model).rope_limit, pack)


def test_per_document_longrope_changes_only_the_calling_threads_rotary_calls():
    """The longrope hook sits on the rotary module for the duration of one packed call: a call of the same module
    from another thread meanwhile (another length, no pack) gets what the module alone gives."""
    import threading

    from lit_hbp.model.rope import per_document_longrope

    model = rope_model("longrope", "eager")
    rotary = model.model.rotary_emb
    x, positions = torch.zeros(1, 40, 8), torch.arange(40)[None]
    want = rotary(x, positions)
    got = {}
    cu = torch.tensor([0, 12, 42])
    with per_document_longrope(rotary, cu, 16):
        worker = threading.Thread(target=lambda: got.update(out=rotary(x, positions)))
        worker.start()
        worker.join()
        mine = rotary(torch.zeros(1, 42, 8), torch.cat([torch.arange(12), torch.arange(30)])[None])
    for a, b in zip(got["out"], want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    short = rotary(torch.zeros(1, 12, 8), torch.arange(12)[None])  # the 12-token document alone: short factors
    torch.testing.assert_close(mine[0][:, :12], short[0], rtol=1e-6, atol=1e-6)


def test_a_packed_call_refuses_a_mask_of_its_own_and_attention_weights_asked_by_the_config():
    """A 4-D (or per-layer) attention_mask beside a pack's boundaries, and ``config.output_attentions`` (which
    transformers reads without passing it to the attention), would be ignored by lit-hbp's attention: refused.
    An all-ones 2-D mask is what the unprepared model computes without one, and is taken."""
    reference = tiny_model("eager").float().eval()
    model = prepare_model(tiny_model("eager")).eval()  # eager outside a pack: its config may ask for weights
    batch = pack_samples(pairs := samples(3))
    kw = pack_inputs(batch)
    total = int(batch.input_ids.shape[1])
    block = torch.zeros(1, 1, total, total, dtype=torch.bool)
    cu = batch.cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        block[0, 0, a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    for mask, said in ((block, "a 4-D tensor"), ({"full_attention": block}, "a dict")):
        with pytest.raises(ValueError, match=f"attention_mask of its own \\({said}\\)"):
            model(**kw, attention_mask=mask)
    with torch.no_grad():
        ones = model(**kw, attention_mask=torch.ones(1, total, dtype=torch.long)).logits
        close(ones, model(**kw).logits)
    model.config.output_attentions = True
    with pytest.raises(NotImplementedError, match="asks for attention weights"):
        packed_loss(model, batch, "sum")
    with pytest.raises(NotImplementedError, match="asks for attention weights"):
        model(**kw)
    model.config.output_attentions = False
    reference.config.output_attentions = True  # outside a pack the prepared model gives what the unprepared does
    assert len(reference(input_ids=torch.as_tensor(pairs[0][0])[None]).attentions) == 2


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "falcon", "gpt_bigcode", "stablelm"])
def test_attention_weights_asked_in_a_packed_call_are_refused_in_families_that_take_the_keyword_themselves(family):
    """``model(**pack_inputs(batch), output_attentions=True)``: GPT-2, OPT, Falcon, GPTBigCode and StableLM take the
    keyword as their own argument and never pass it to the attention, which computes no weights in a pack: they gave
    back empty or None weights without a word. The unprepared model returns one tensor a layer."""
    from transformers import AutoConfig

    shape = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if family in ("gpt2", "gpt_bigcode"):
        shape = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4)
    elif family == "opt":
        shape = {**shape, "ffn_dim": 64, "word_embed_proj_dim": 32}
        shape.pop("intermediate_size")
    elif family == "falcon":
        shape.pop("intermediate_size")
    elif family == "stablelm":
        shape["num_key_value_heads"] = 4
    config = AutoConfig.for_model(family, **shape)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model = prepare_model(copy.deepcopy(reference)).eval()
    batch = pack_samples(pairs := samples(3))
    with pytest.raises(ValueError, match="a packed call with output_attentions=True"), torch.no_grad():
        model(**pack_inputs(batch), output_attentions=True)
    one = torch.as_tensor(pairs[0][0])[None]
    with torch.no_grad():  # outside a pack: what the unprepared model gives
        got, want = (m(input_ids=one, output_attentions=True).attentions for m in (model, reference))
    assert len(got) == len(want) == 2 and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


def test_restarting_positions_in_rows_the_call_runs_whole_are_refused():
    """Positions that restart inside a row mark a pack's documents, but beside an all-ones attention_mask (a pack the
    user flattened, a copy of its ids) or in a batch of several rows (packs as padded rows, TRL's ``packing`` without
    padding-free) the call runs each row as one sequence, as transformers does: the documents attended to each other
    (logits 0.46 off each document alone). Refused; a row a mask pads, generation, and a pack called as one row without
    a mask are unchanged (each against the unprepared model or each document alone)."""
    reference = tiny_model("eager").float().eval()
    model = prepare_model(copy.deepcopy(reference)).eval()
    first, second = pack_samples(a := samples(2, seed=1)), pack_samples(samples(2, seed=2))
    one, two = pack_inputs(first), pack_inputs(second)
    ids, pos = one["input_ids"].clone(), one["position_ids"]
    ones = torch.ones_like(ids)
    with pytest.raises(ValueError, match="position_ids of a row restart .* beside an all-ones attention_mask"):
        model(input_ids=ids, position_ids=pos, attention_mask=ones)
    width = min(ids.shape[1], two["input_ids"].shape[1])
    rows = {k: torch.cat([one[k][:, :width], two[k][:, :width]]) for k in ("input_ids", "position_ids")}
    with pytest.raises(ValueError, match="position_ids of rows of a batch of 2 restart"):
        model(**rows)
    with pytest.raises(ValueError, match="position_ids of rows of a batch of 2 restart"):
        model(**rows, attention_mask=torch.ones_like(rows["input_ids"]))
    with torch.no_grad():
        assert_logits_alone(model(input_ids=ids, position_ids=pos).logits[0], reference, a)  # one row, no mask
        prompt = torch.tensor([[0, 0, 0, 5, 9, 11, 13, 4]])
        mask = (prompt != 0).long()
        left = mask.cumsum(-1) - 1
        left.masked_fill_(mask == 0, 1)  # generation's positions of a left-padded row: they step back, padded
        got, want = (m(input_ids=prompt, attention_mask=mask, position_ids=left).logits for m in (model, reference))
        close(got[mask.bool()], want[mask.bool()])
        kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(prompt, **kw), reference.generate(prompt, **kw))
