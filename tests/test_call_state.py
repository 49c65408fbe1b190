"""A call's state lives in the call: threads, copies, shared configs, teachers, every pack format.

Each case is forced, not raced: another thread's call runs while the packed call is held inside its
forward (a hook on a middle layer waits for it), so the interleaving the test asserts is the one that
happens. References are independent: the unprepared model with eager attention, each document alone.
"""

import collections
import copy
import io
import pickle
import threading

import numpy as np
import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from conftest import TINY_LLAMA
from test_packed_loss import samples, tiny_model
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

from lit_hbp import HBPLitModule, pack_inputs, pack_samples, packed_loss, prepare_model
from lit_hbp.model import attention
from lit_hbp.model.packed_call import record_of

TIMEOUT = 120  # seconds a forced interleaving may wait for the other thread before the test fails


def pair():
    """(the unprepared model with eager attention, a prepared copy that had sdpa), in eval mode."""
    reference = tiny_model("eager").float().eval()
    model = prepare_model(tiny_model()).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model


def alone_logits(reference, pairs) -> torch.Tensor:
    """Each document through the reference on its own, concatenated in pack order."""
    with torch.no_grad():
        return torch.cat([reference(input_ids=torch.as_tensor(ids)[None]).logits[0] for ids, _ in pairs])


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


def alone_token_mean(reference, pairs) -> float:
    """The token-mean cross-entropy of the documents, each through the reference on its own (no gradients)."""
    ce, count = 0.0, 0
    with torch.no_grad():
        for ids, m in pairs:
            ids = torch.as_tensor(ids)
            labels = torch.where(torch.as_tensor(m[1:]), ids[1:], -100)
            ce += float(F.cross_entropy(reference(input_ids=ids[None]).logits[0, :-1], labels, reduction="sum"))
            count += int((labels != -100).sum())
    return ce / count


class Held:
    """Holds the packed call inside its forward (at layer 1's attention) until ``other`` ran on another
    thread: ``other``'s calls happen while the packed call is in flight, every time."""

    def __init__(self, model, other):
        self.inside, self.done, self.other, self.errors = threading.Event(), threading.Event(), other, []
        self.result = None
        layer = model.get_base_model().model.layers[1] if hasattr(model, "get_base_model") else model.model.layers[1]
        self.handle = layer.self_attn.register_forward_pre_hook(self._hold)
        self.thread = threading.Thread(target=self._run)

    def _hold(self, *_):
        if not self.inside.is_set():
            self.inside.set()
            assert self.done.wait(TIMEOUT), "the other thread's call did not finish"

    def _run(self):
        try:
            assert self.inside.wait(TIMEOUT), "the packed call never started"
            self.result = self.other()
        except BaseException as e:  # surfaced on the main thread
            self.errors.append(e)
        finally:
            self.done.set()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.thread.join(TIMEOUT)
        self.handle.remove()
        if self.errors:
            raise self.errors[0]
        assert self.inside.is_set(), "the packed call did not reach the held layer"


def test_another_threads_plain_calls_during_a_packed_call_are_the_unprepared_models():
    """A padded forward and greedy generate() on another thread while a packed call is held in flight:
    the unprepared model's results; the packed call's logits each document's alone."""
    reference, model = pair()
    pairs = samples()
    batch = pack_samples(pairs)
    ids = torch.randint(3, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0

    def plain():
        with torch.no_grad():
            return (
                model(input_ids=ids, attention_mask=mask).logits,
                model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0),
            )

    with torch.no_grad():
        with Held(model, plain) as held:
            packed = model(**pack_inputs(batch)).logits[0]
        want_logits = reference(input_ids=ids, attention_mask=mask).logits
        want_tokens = reference.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    logits, tokens = held.result
    real = mask.bool()
    assert max_diff(logits[real], want_logits[real]) < 1e-5
    assert torch.equal(tokens, want_tokens)
    n = sum(len(d) for d, _ in pairs)
    assert max_diff(packed[:n], alone_logits(reference, pairs)) < 1e-5


def test_another_threads_training_call_keeps_the_projects_own_checkpointing_during_a_packed_call():
    """The project checkpoints every layer itself (``gradient_checkpointing_enable``); a packed call at a
    level checkpointing 1 layer is held in flight while another thread runs a plain training step: that
    step goes through the project's own checkpoint function on every layer (the layer found from what
    transformers hands the function: one function for all layers, no per-layer guard for dynamo) and its
    gradients are the unprepared model's."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    reference, model = pair()
    for m in (reference, model):
        m.train()
        m.gradient_checkpointing_enable({"use_reentrant": False})
    counted = []

    def own(fn, *args, **kwargs):
        counted.append(1)
        return partial(checkpoint, use_reentrant=False)(fn, *args, **kwargs)

    for layer in model.model.layers:
        layer._gradient_checkpointing_func = own
    ids = torch.randint(3, 64, (2, 11), generator=torch.Generator().manual_seed(3))

    def plain():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    batch = pack_samples(samples()).replace(ckpt_layers=1)
    with Held(model, plain) as held:
        packed_loss(model, batch, "sum")
    assert len(counted) == len(model.model.layers)  # each layer's forward, by the project's own function
    reference(input_ids=ids, labels=ids).loss.backward()
    for name, param in reference.named_parameters():
        assert max_diff(held.result[name], param.grad) < 1e-5, name


def test_models_sharing_the_config_see_nothing_of_a_packed_call():
    """A shallow copy of the model (its modules and config shared) and a model built from the same config
    object, called on another thread while a packed call is in flight, and built from the config during
    it: each computes what the unprepared model computes."""
    reference, model = pair()
    batch = pack_samples(samples())
    ids = torch.randint(3, 64, (1, 13), generator=torch.Generator().manual_seed(2))
    shallow = copy.copy(model)
    sibling = AutoModelForCausalLM.from_config(model.config).eval()
    sibling.load_state_dict(reference.state_dict())

    def others():
        with torch.no_grad():
            during = AutoModelForCausalLM.from_config(model.config).eval()
            during.load_state_dict(reference.state_dict())
            return [m(input_ids=ids).logits for m in (shallow, sibling, during)], during

    with torch.no_grad():
        with Held(model, others) as held:
            model(**pack_inputs(batch))
        want = reference(input_ids=ids).logits
    outs, during = held.result
    for out in outs:
        assert max_diff(out, want) < 1e-5
    assert during.config._attn_implementation == model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert max_diff(during(input_ids=ids).logits, want) < 1e-5  # after the call too


def test_a_teachers_packed_call_while_another_thread_generates_on_it():
    """A prepared, frozen teacher: its packed call held in flight while another thread runs generate()
    on the same model, and the other way round: both exact."""
    reference, teacher = pair()
    teacher.requires_grad_(False)
    pairs = samples(seed=4)
    batch = pack_samples(pairs)
    prompt = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    n = sum(len(d) for d, _ in pairs)
    want = alone_logits(reference, pairs)
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)

    def generate():
        with torch.no_grad():
            return teacher.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)

    def packed():
        with torch.no_grad():
            return teacher(**pack_inputs(batch)).logits[0]

    with torch.no_grad():
        with Held(teacher, generate) as held:
            logits = teacher(**pack_inputs(batch)).logits[0]
    assert torch.equal(held.result, expected) and max_diff(logits[:n], want) < 1e-5
    # the packed call on the other thread, held inside the generation's first forward
    with torch.no_grad(), Held(teacher, packed) as held:
        tokens = teacher.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, expected) and max_diff(held.result[:n], want) < 1e-5


def test_copies_slices_and_embeddings_of_a_pack_with_its_positions_are_exact():
    """The pack is recognised by its restarting positions: a clone, a slice of whole documents and
    ``inputs_embeds`` of its ids each give every document's logits alone; the batch's own ids (and a
    moved or deep-copied batch's) without positions are refused."""
    reference, model = pair()
    pairs = samples(seed=5)
    batch = pack_samples(pairs)
    n = sum(len(d) for d, _ in pairs)
    want = alone_logits(reference, pairs)
    first_two = len(pairs[0][0]) + len(pairs[1][0])
    with torch.no_grad():
        ids, pos = batch.input_ids.clone(), batch.position_ids.clone()
        assert max_diff(model(input_ids=ids, position_ids=pos).logits[0, :n], want) < 1e-5
        sliced = model(input_ids=batch.input_ids[:, :first_two], position_ids=batch.position_ids[:, :first_two])
        assert max_diff(sliced.logits[0], want[:first_two]) < 1e-5
        embeds = model.get_input_embeddings()(batch.input_ids)
        assert max_diff(model(inputs_embeds=embeds, position_ids=batch.position_ids).logits[0, :n], want) < 1e-5
        for marked in (batch.input_ids, copy.deepcopy(batch).input_ids, batch.to("cpu").input_ids):
            with pytest.raises(ValueError, match="without their document boundaries or positions"):
                model(input_ids=marked)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_an_unprepared_teacher_on_pack_inputs_gives_each_documents_logits(attn):
    """``teacher(**pack_inputs(batch))`` on a model lit-hbp never touched (its config builds a KV cache):
    pack_inputs turns the cache off, so transformers' own packed path keeps the documents apart."""
    reference = tiny_model("eager").float().eval()
    teacher = tiny_model(attn).eval()
    teacher.load_state_dict(reference.state_dict())
    assert teacher.config.use_cache
    pairs = samples(seed=6)
    batch = pack_samples(pairs)
    with torch.no_grad():
        logits = teacher(**pack_inputs(batch)).logits[0]
    n = sum(len(d) for d, _ in pairs)
    assert max_diff(logits[:n], alone_logits(reference, pairs)) < 1e-5


def flattened(pairs, flash: bool) -> dict:
    """Hugging Face's own packed batch of the samples (DataCollatorWithFlattening), ordinary labels."""
    features = [{"input_ids": ids.tolist(), "labels": np.where(m, ids, -100).tolist()} for ids, m in pairs]
    return DataCollatorWithFlattening(return_flash_attn_kwargs=flash)(features)


@pytest.mark.parametrize("flash", [False, True], ids=["positions", "flash_kwargs"])
def test_hugging_faces_flattened_batch_trains_exactly(flash):
    """DataCollatorWithFlattening's batch (with or without its flash keywords, ordinary labels) through a
    prepared model's own forward and loss: the token-mean cross-entropy of each sample alone (eager),
    and every gradient."""
    reference = tiny_model("eager").float()
    model = prepare_model(tiny_model())
    model.load_state_dict(reference.state_dict())
    pairs = samples(seed=7)
    ce, count = 0.0, 0
    for ids, m in pairs:
        ids = torch.as_tensor(ids)
        labels = torch.where(torch.as_tensor(m[1:]), ids[1:], -100)
        ce = ce + F.cross_entropy(reference(input_ids=ids[None]).logits[0, :-1], labels, reduction="sum")
        count += int((labels != -100).sum())
    (ce / count).backward()
    batch = flattened(pairs, flash)
    assert ("cu_seq_lens_q" in batch) == flash and "attention_mask" not in batch
    out = model(**batch)
    out.loss.backward()
    assert float(out.loss) == pytest.approx(float(ce / count), abs=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert max_diff(p.grad, q.grad) <= 1e-4 * max(q.grad.abs().max().item(), 1e-12), name


def test_labels_a_packed_call_would_train_wrong_are_refused_and_the_advice_works():
    """lit-hbp's pre-shifted labels through the model's own loss: refused, and the advice
    (``shift_labels=``) gives the packed cross-entropy; ordinary labels whose documents' first label is
    not -100 (the shift would train one document's last token on the next one's first): refused."""
    reference = tiny_model("eager").float()
    model = prepare_model(tiny_model())
    model.load_state_dict(reference.state_dict())
    pairs = samples(seed=8)
    batch = pack_samples(pairs)
    with pytest.raises(ValueError, match=r"pre-shifted .* pass shift_labels=batch.labels too"):
        model(**pack_inputs(batch), labels=batch.labels)
    out = model(**pack_inputs(batch), labels=batch.labels, shift_labels=batch.labels)
    assert float(out.loss) == pytest.approx(alone_token_mean(reference, pairs), rel=1e-5)
    hf = flattened(pairs, flash=True)
    bad = hf["labels"].clone()
    second = int(hf["cu_seq_lens_q"][1])
    bad[0, second] = hf["input_ids"][0, second]
    with pytest.raises(ValueError, match="a document's first label is not the ignore index -100"):
        model(**{**hf, "labels": bad})


@pytest.mark.parametrize("flash", [False, True], ids=["positions", "flash_kwargs"])
def test_the_models_own_loss_with_another_ignore_index_trains_a_flattened_batch_exactly(flash):
    """transformers' loss takes ``ignore_index=``: a flattened batch whose first labels are that index (the collator's
    ``separator_id``) was refused, the check reading -100 as the only index a document's first label may have. It
    trains as each document alone now, and a first label that is a target is refused naming the index."""
    reference, model = pair()
    pairs = samples(seed=9)
    features = [{"input_ids": ids.tolist(), "labels": np.where(m, ids, -1).tolist()} for ids, m in pairs]
    batch = DataCollatorWithFlattening(separator_id=-1, return_flash_attn_kwargs=flash)(features)
    with torch.no_grad():
        want = alone_token_mean(reference, pairs)
        assert float(model(**batch, ignore_index=-1).loss) == pytest.approx(want, rel=1e-5)
        bad = batch["labels"].clone()
        second = int(np.cumsum([len(ids) for ids, _ in pairs])[0])
        bad[0, second] = batch["input_ids"][0, second]
        with pytest.raises(ValueError, match="a document's first label is not the ignore index -1"):
            model(**{**batch, "labels": bad}, ignore_index=-1)


def test_a_pack_with_a_mask_that_pads_or_a_cache_is_refused():
    _, model = pair()
    batch = pack_samples(samples())
    mask = torch.ones_like(batch.input_ids)
    mask[0, 3] = 0
    with pytest.raises(ValueError, match="attention_mask that has zeros"):
        model(**pack_inputs(batch), attention_mask=mask)
    model(**pack_inputs(batch), attention_mask=torch.ones_like(batch.input_ids))  # all ones: nothing to pad
    prefix = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True).past_key_values
    with pytest.raises(ValueError, match="with a KV cache of earlier tokens"):
        model(**pack_inputs(batch), past_key_values=prefix)


def test_a_packed_call_given_an_empty_cache_is_refused():
    """An empty ``DynamicCache`` handed to a packed call was filled from the pack (the decoder writes into a cache it
    is given): decoding on from it continued the pack as one row, 0.033 off the unprepared model, without a word."""
    from transformers import DynamicCache

    _, model = pair()
    batch = pack_samples(samples())
    cache = DynamicCache(config=model.config)
    with pytest.raises(ValueError, match="a packed call .*with a KV cache: a pack's documents start from nothing"):
        model(**{**pack_inputs(batch), "use_cache": None}, past_key_values=cache)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize(
    "cu, longest, says",
    [
        ([0, 4, 8], 6, r"cu_seq_lens_q \[0, 4, 8\] must rise from 0 to the row's 10 tokens"),  # short of the end
        ([0, 4, 12], 8, r"cu_seq_lens_q \[0, 4, 12\] must rise from 0 to the row's 10 tokens"),  # past it: silent
        ([2, 4, 10], 6, r"must rise from 0"),
        ([0, 6, 4, 10], 6, r"must rise from 0"),
        ([0, 4, 10], 2, r"max_length_q 2 is below the longest document's 6 tokens"),  # silent on CPU
        ("list", 6, r"cu_seq_lens_q must be a 1-D int32 tensor of boundaries \[0, ..., tokens\], got a list"),
        ("k", 6, r"cu_seq_lens_k \[0, 10\] differs from cu_seq_lens_q: give the same boundaries"),  # silently ignored
    ],
)
def test_boundaries_a_caller_gives_are_checked(cu, longest, says):
    """A caller's own ``cu_seq_lens_q`` was taken as given: most wrong ones failed in the model's view to a shape
    (``RuntimeError: shape '[1, 10, -1]' is invalid``), naming nothing; one past the row's end, a small
    ``max_length_q`` and another ``cu_seq_lens_k`` passed. The right ones give each document as alone."""
    reference, model = pair()
    ids = torch.randint(1, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    right = torch.tensor([0, 4, 10], dtype=torch.int32)
    given = [0, 4, 10] if cu == "list" else right if cu == "k" else torch.tensor(cu, dtype=torch.int32)
    k = torch.tensor([0, 10], dtype=torch.int32) if cu == "k" else given
    call = dict(input_ids=ids, cu_seq_lens_q=given, cu_seq_lens_k=k, max_length_q=longest, max_length_k=longest)
    with pytest.raises(ValueError, match=says):
        model(**call)
    with torch.no_grad():
        got = model(input_ids=ids, cu_seq_lens_q=right, cu_seq_lens_k=right, max_length_q=6, max_length_k=6).logits
        alone = torch.cat([reference(input_ids=ids[:, a:b]).logits for a, b in ((0, 4), (4, 10))], 1)
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama"])
def test_boundaries_given_without_positions_number_each_document_from_zero(family):
    """A caller's ``cu_seq_lens_q`` without ``position_ids``: the decoder numbered the row as one sequence, so a
    model with learned absolute positions read the second document at positions 4-9 (GPT-2's logits 0.46 off the
    document alone, without a word). Each document is numbered from 0, as alone; rotary models too."""
    from transformers import AutoConfig

    sizes = dict(vocab_size=64, max_position_embeddings=64, n_positions=64)
    shapes = {
        "gpt2": dict(n_embd=32, n_layer=2, n_head=2),
        "opt": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64, word_embed_proj_dim=32),
        "llama": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
    }
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **sizes, **shapes[family], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    reference = AutoModelForCausalLM.from_config(config).eval()
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(reference.state_dict())
    model = prepare_model(model).eval()
    ids = torch.randint(3, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with torch.no_grad():
        got = model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6).logits
        alone = torch.cat([reference(input_ids=ids[:, a:b]).logits for a, b in ((0, 4), (4, 10))], 1)
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


def test_a_packed_call_that_asks_for_a_cache_is_refused():
    """``use_cache=True`` asked in a packed call (restarting positions, or the pack's boundaries) was set off without a
    word, the call attending per document; the unprepared model, asked for a cache, makes one and attends over the row
    as one (its logits 0.15 off the prepared model's in an audit). Refused; the default (no use_cache given), the
    model's config, is set off as before."""
    reference, model = pair()
    batch = pack_samples(samples())
    restart = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    for call in (restart, pack_inputs(batch)):
        with pytest.raises(ValueError, match="a packed call .*with use_cache=True: a pack's documents cannot be cont"):
            model(**{**call, "use_cache": True})
        assert model(**call).past_key_values is None
    with torch.no_grad():  # asked for a cache, transformers attends over the row as one: not what a pack is
        one_row = reference(**restart, use_cache=True).logits
        assert not torch.allclose(one_row, model(**restart).logits, atol=1e-4)


def test_two_modules_keep_their_own_attention_backends():
    """``HBPLitModule(attn_backend="eager")`` then a module with the default: the first still runs eager
    (observed at the kernel), its hyperparameters say so, and ``choices`` answers per model."""
    ran = []
    real = {name: attention.REGISTRY[name] for name in ("eager", "sdpa")}

    def spy(name):
        backend = real[name]

        def run(*args, **kwargs):
            ran.append(name)
            return backend.run(*args, **kwargs)

        return type(backend)(**{**backend.__dict__, "run": run})

    first = HBPLitModule(model=TINY_LLAMA, vocab_size=64, attn_backend="eager", self_check=False)
    first.configure_model()
    second = HBPLitModule(model=TINY_LLAMA, vocab_size=64, self_check=False)
    second.configure_model()
    batch = pack_samples(samples(), loss_norm=20.0)
    saved = dict(attention.REGISTRY)
    try:
        attention.REGISTRY.update({name: spy(name) for name in real})
        packed_loss(first.model, batch)
        assert set(ran) == {"eager"}
        ran.clear()
        packed_loss(second.model, batch)
        assert set(ran) == {"sdpa"}
    finally:
        attention.REGISTRY.clear()
        attention.REGISTRY.update(saved)
    assert first.hparams.attn_backend == "eager"
    assert {c["backend"] for c in attention.choices(first.model)} == {"eager"}
    assert {c["backend"] for c in attention.choices(second.model)} == {"sdpa"}


@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_trains_packed_and_actually_compiles(how):
    """``packed_loss`` on ``torch.compile(model)`` and on a model after ``model.compile()``: accepted,
    the decoder runs compiled with the model's compile settings (frames counted by its backend), loss
    and gradients as eager."""
    reference, model = pair()
    eager_model = copy.deepcopy(model).train()
    model.train()
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    if how == "torch.compile(model)":
        compiled = torch.compile(model, backend=counter)
    else:
        model.compile(backend=counter)
        compiled = model
    batch = pack_samples(samples(seed=9), loss_norm=20.0)
    got = packed_loss(compiled, batch)
    got.loss.backward()
    want = packed_loss(eager_model, batch)
    want.loss.backward()
    assert counter.frame_count > 0
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        assert max_diff(p.grad, q.grad) <= 1e-5 * max(q.grad.abs().max().item(), 1e-12), name
    torch._dynamo.reset()


def test_a_prepared_model_pickles_and_comes_back_prepared():
    """``torch.save(model)`` / ``pickle`` (what ``ddp_spawn`` does with a module): the loaded model is
    prepared on its own (its record, hooks and offload), its packed calls exact, its plain calls the
    unprepared model's."""
    reference, model = pair()
    pairs = samples(seed=10)
    batch = pack_samples(pairs)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    restored = pickle.loads(pickle.dumps(model))
    n = sum(len(d) for d, _ in pairs)
    want = alone_logits(reference, pairs)
    ids = torch.randint(3, 64, (1, 9), generator=torch.Generator().manual_seed(4))
    for m in (loaded, restored):
        assert record_of(m) is not None and record_of(m) is not record_of(model)
        assert record_of(m).decoder is m.model
        with torch.no_grad():
            assert max_diff(m(**pack_inputs(batch)).logits[0, :n], want) < 1e-5
            assert max_diff(m(input_ids=ids).logits, reference(input_ids=ids).logits) < 1e-5
        with pytest.raises(ValueError, match="without their document boundaries"):
            m(input_ids=batch.input_ids)
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=64, self_check=False)
    module.configure_model()
    assert record_of(pickle.loads(pickle.dumps(module)).model) is not None


def test_the_public_names_are_the_functions():
    import lit_hbp
    from lit_hbp import pack_scope

    assert callable(pack_scope) and pack_scope is lit_hbp.model.packed_call.pack_scope


def test_a_prefix_that_attends_both_ways_is_refused_in_a_pack():
    """hrm_text sets prefix_lm by default: tokens whose token_type_ids are 1 attend to each other both
    ways, which a causal kernel per document does not compute, so a packed call carrying them is refused;
    without them the family packs exactly (tests/test_families.py)."""
    from families import small_config
    from transformers import AutoConfig

    cfg = small_config("hrm_text")
    config = AutoConfig.for_model(cfg.pop("model_type"), **{**cfg, "vocab_size": 64})
    assert config.prefix_lm
    model = prepare_model(AutoModelForCausalLM.from_config(config))
    batch = pack_samples(samples(seed=11))
    prefix = torch.zeros_like(batch.input_ids)
    prefix[0, :3] = 1
    with pytest.raises(ValueError, match="prefix_lm, so tokens whose token_type_ids are 1 attend"):
        model(**pack_inputs(batch), token_type_ids=prefix)
    model(**pack_inputs(batch), token_type_ids=torch.zeros_like(batch.input_ids))  # no prefix: causal, exact


def test_a_mask_given_by_position_is_read_as_a_mask():
    """``model(ids, mask, position_ids=...)``: the mask given second is the attention mask it is. An all-ones mask
    with restarting positions is refused, given by name or by position (the unprepared model attends over the row as
    one, so the documents the positions mark would attend to each other; read as no mask, it was split at the
    restarts); a left-padded row with generate's positions is the unprepared model's call, not refused as a pack
    that pads."""
    reference, model = pair()
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    restarting = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]])
    ones = torch.ones_like(ids)
    padded = torch.tensor([[0, 0, 0] + [1] * 9])
    generating = (padded.cumsum(-1) - 1).masked_fill(padded == 0, 1)
    with torch.no_grad():
        want = reference(ids, padded, position_ids=generating).logits[padded.bool()]
        assert max_diff(model(ids, padded, position_ids=generating).logits[padded.bool()], want) < 1e-5
        assert max_diff(model(ids, attention_mask=padded, position_ids=generating).logits[padded.bool()], want) < 1e-5
        for call in (
            lambda: model(ids, ones, position_ids=restarting),
            lambda: model(ids, attention_mask=ones, position_ids=restarting),
        ):
            with pytest.raises(ValueError, match="restart .* beside an all-ones attention_mask"):
                call()
        split = model(input_ids=ids, position_ids=restarting).logits  # no mask: a pack of three documents
        assert max_diff(split, reference(ids, ones, position_ids=restarting).logits) > 1e-2


def test_lit_hbps_labels_are_refused_without_token_ids_and_through_forward():
    """A PackedBatch's pre-shifted labels through the model's own loss are refused also where no token ids
    show them pre-shifted (``inputs_embeds``), and through ``model.forward(...)``, which PyTorch runs without
    the model's hooks; a flattened batch's ordinary labels through ``model.forward`` still train as each
    document alone (eager, token mean)."""
    reference, model = pair()
    pairs = samples(seed=10)
    batch = pack_samples(pairs)
    inputs = pack_inputs(batch)
    embeds = model.get_input_embeddings()(inputs.pop("input_ids"))
    with pytest.raises(ValueError, match="pre-shifted"):
        model(inputs_embeds=embeds, **inputs, labels=batch.labels)
    with pytest.raises(ValueError, match="pre-shifted"):
        model(inputs_embeds=embeds, position_ids=batch.position_ids, labels=batch.labels)
    with pytest.raises(ValueError, match="pre-shifted"):
        model.forward(**pack_inputs(batch), labels=batch.labels)
    with torch.no_grad():
        want = alone_token_mean(reference, pairs)
        assert float(model.forward(**flattened(pairs, flash=True)).loss) == pytest.approx(want, rel=1e-5)
        hf = flattened(pairs, flash=True)
        bad = hf["labels"].clone()
        second = int(hf["cu_seq_lens_q"][1])
        bad[0, second] = hf["input_ids"][0, second]
        with pytest.raises(ValueError, match="a document's first label is not the ignore index"):
            model.forward(**{**hf, "labels": bad})


@pytest.mark.parametrize("ckpt_layers, tiles", [(0, 1), (1, 2), (2, 3)])
def test_a_call_on_pack_inputs_runs_the_batchs_level_as_packed_loss_does(ckpt_layers, tiles):
    """``model(**pack_inputs(batch))`` with gradients: the batch's level checkpoints (its layers run again in the
    backward) and tiles (its MLPs' down projections run once a tile) as ``packed_loss`` on the batch does;
    counted on calls inside each layer (transformers checkpoints a layer's forward, its hooks outside),
    ``packed_loss`` the reference. The logits are the same either way."""
    _, model = pair()
    model.train()
    batch = pack_samples(samples(seed=11), ckpt_layers=ckpt_layers, mlp_tiles=tiles)
    layers = record_of(model).layers
    seen = collections.Counter()
    watched = {f"layer {i}": layer.input_layernorm for i, layer in enumerate(layers)} | {
        "down": layers[0].mlp.down_proj
    }
    handles = [m.register_forward_pre_hook(lambda *_, name=name: seen.update([name])) for name, m in watched.items()]

    def run(step) -> dict:
        seen.clear()
        step()
        return dict(seen)

    want = run(lambda: packed_loss(model, batch, "sum").loss.backward())
    got = run(lambda: model(**pack_inputs(batch)).logits.float().pow(2).mean().backward())
    for h in handles:
        h.remove()
    assert got == want
    assert [want[f"layer {i}"] for i in range(len(layers))] == [2 if i < ckpt_layers else 1 for i in range(len(layers))]
    assert want["down"] >= tiles * (2 if ckpt_layers else 1)  # a tile a call (and a tiled MLP recomputes a tile)
