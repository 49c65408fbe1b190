"""The public packed loss (``prepare_model``, ``packed_loss``, ``pack_samples``) in a module of one's own,
and the guards that refuse what would train wrong without them: a model called on a pack without its
document boundaries or positions, transformers' loss shifting lit-hbp's pre-shifted labels again, a batch
that is no PackedBatch."""

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_LLAMA, quiet_trainer
from transformers import AutoConfig, AutoModelForCausalLM

from lit_hbp import HBPLitModule, pack_inputs, pack_samples, packed_loss, prepare_model


def tiny_model(attn: str = "sdpa"):
    cfg = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    config = AutoConfig.for_model("llama", vocab_size=64, **cfg)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def samples(n: int = 5, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids, supervised mask) pairs of 3-40 tokens, each supervised on its second half."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(3, 40))
        mask = np.zeros(length, bool)
        mask[length // 2 :] = True
        out.append((rng.integers(0, 64, length), mask))
    return out


def alone(model, pairs) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of each sample alone (its own forward, eager attention) and the targets."""
    ce, n = 0.0, 0
    for ids, mask in pairs:
        ids = torch.as_tensor(ids)
        labels = torch.where(torch.as_tensor(mask[1:]), ids[1:], -100)
        ce = ce + F.cross_entropy(model(input_ids=ids[None]).logits[0, :-1].float(), labels, reduction="sum")
        n += int((labels != -100).sum())
    return ce, n


def assert_logits_alone(logits: torch.Tensor, reference, pairs, tol: float = 1e-5) -> None:
    """A pack's logits (one row: [T, V]) against each document's alone through ``reference`` (unprepared)."""
    start = 0
    for ids, _ in pairs:
        want = reference(input_ids=torch.as_tensor(ids)[None]).logits[0]
        torch.testing.assert_close(logits[start : start + len(ids)], want, rtol=tol, atol=tol)
        start += len(ids)


def test_a_float64_model_computes_its_packed_loss_in_float64():
    """The loss is taken in fp32 at least, never narrowed: a float64 model's loss and CE sum are float64 and
    equal each sample alone (eager, float64) far below fp32's precision."""
    reference = tiny_model("eager").double()
    ce = 0.0
    for ids, mask in (pairs := samples()):  # each alone, its cross-entropy in float64
        ids = torch.as_tensor(ids)
        labels = torch.where(torch.as_tensor(mask[1:]), ids[1:], -100)
        ce += float(F.cross_entropy(reference(input_ids=ids[None]).logits[0, :-1], labels, reduction="sum"))
    model = prepare_model(tiny_model().double())
    model.load_state_dict(reference.state_dict())
    out = packed_loss(model, pack_samples(pairs), "token_mean")
    assert out.loss.dtype == out.ce_sum.dtype == torch.float64
    assert float(out.ce_sum) == pytest.approx(ce, rel=1e-9)


def test_packed_loss_of_your_own_samples_equals_each_sample_alone():
    reference = tiny_model("eager").float()
    ce, n = alone(reference, pairs := samples())
    ce.backward()
    model = prepare_model(tiny_model())
    model.load_state_dict(reference.state_dict())
    batch = pack_samples(pairs)  # as the collate_fn of a plain DataLoader over (ids, mask) pairs
    out = packed_loss(model, batch, "token_mean")
    out.loss.backward()
    assert out.n_targets == n and float(out.ce_sum) == pytest.approx(float(ce), rel=1e-5)
    assert float(out.loss) == pytest.approx(float(ce) / n, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(
            p.grad, q.grad / n, rtol=1e-5, atol=1e-5 * scale / n, msg=lambda m, k=name: f"{k}: {m}"
        )
    # The same samples as dicts, as `lit-hbp preview --json` prints them, and through a DataLoader.
    rows = [{"input_ids": ids.tolist(), "supervised": mask.astype(int).tolist()} for ids, mask in pairs]
    loader = torch.utils.data.DataLoader(rows, batch_size=len(rows), collate_fn=pack_samples)
    assert torch.equal(next(iter(loader)).labels, batch.labels)


def test_ave_token_without_the_plan_names_the_alternatives():
    model = prepare_model(tiny_model())
    with pytest.raises(ValueError, match="use the token_mean or sum loss, or pass loss_norm to pack_samples"):
        packed_loss(model, pack_samples(samples()))
    out = packed_loss(model, pack_samples(samples(), loss_norm=10.0))  # the step's tokens / (N x A), given
    assert float(out.loss) == pytest.approx(float(out.ce_sum) / 10.0, rel=1e-6)


def test_an_unprepared_model_or_a_foreign_batch_is_refused():
    with pytest.raises(ValueError, match=r"is not prepared for packs.*call lit_hbp.prepare_model\(model\) first"):
        packed_loss(tiny_model(), pack_samples(samples()))
    with pytest.raises(TypeError, match="packed_loss takes a PackedBatch .* got dict"):
        packed_loss(prepare_model(tiny_model()), {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=64, self_check=False)

    class Padded(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"input_ids": torch.arange(8)}

    with pytest.raises(TypeError, match="HBPLitModule trains on PackedBatch micro-batches .* got dict"):
        quiet_trainer(max_steps=1).fit(module, torch.utils.data.DataLoader(Padded(), batch_size=2))
    with pytest.raises(TypeError, match="HBPLitModule trains on PackedBatch micro-batches .* got dict"):
        quiet_trainer().validate(module, torch.utils.data.DataLoader(Padded(), batch_size=2))


def ddp_packed_loss() -> str:
    """packed_loss of a prepared model inside torch's DistributedDataParallel, on this rank: its refusal."""
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(prepare_model(tiny_model()))
    try:
        packed_loss(ddp, pack_samples(samples()))
    except ValueError as e:
        return str(e)
    return "ran"


def test_packed_loss_of_a_ddp_wrapped_model_says_why_and_what_to_call(shared_pool2):
    """``packed_loss(DistributedDataParallel(model))`` said the model was not prepared (it was), and the call that ran,
    ``packed_loss(ddp.module)``, bypasses DDP's forward, so no gradient is averaged (the ranks' gradients 3.9 apart):
    the refusal names the wrapper and the calls that do average."""
    for message in shared_pool2.run(ddp_packed_loss):
        assert message.startswith(
            "DistributedDataParallel wraps a prepared model: packed_loss runs the model's decoder"
        )
        assert "training_step" in message and "**lit_hbp.pack_inputs(batch)" in message


def test_a_pack_is_recognised_by_its_boundaries_or_its_positions():
    """The model called on a pack's token ids with its positions but no boundaries (``cu_seq_lens``):
    the positions restart at each document, which says where the documents are, so each gets its
    logits alone. Without positions too, or with an attention mask and no boundaries, its documents would
    attend to each other: refused, for pack_samples' batches as for the data module's; a row of other token ids
    runs as always."""
    reference = tiny_model("eager").float()
    model = prepare_model(tiny_model())
    model.load_state_dict(reference.state_dict())
    pairs = samples()
    batch = pack_samples(pairs)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits[0]
    start = 0
    for ids, _ in pairs:
        want = reference(input_ids=torch.as_tensor(ids)[None]).logits[0]
        torch.testing.assert_close(logits[start : start + len(ids)], want, rtol=1e-5, atol=1e-5)
        start += len(ids)
    with pytest.raises(ValueError, match=r"on a packed micro-batch of \d+ segments without their .*pack_inputs"):
        model(input_ids=batch.input_ids)
    with pytest.raises(ValueError, match=r"without their document boundaries"):
        model.model(batch.input_ids)  # the decoder, positionally
    model(input_ids=batch.input_ids[:, :7])
    moved = batch.to("cpu").replace(level=1)  # a batch Lightning moved: still marked
    with pytest.raises(ValueError, match="without their document boundaries"):
        model(input_ids=moved.input_ids)
    # An attention mask (all ones) beside the positions: transformers reads the masked row as one sequence.
    ones = torch.ones_like(batch.input_ids)
    with pytest.raises(ValueError, match=r"segments with an attention_mask but without their document boundaries"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=ones)
    with_mask = model(**pack_inputs(batch), attention_mask=ones).logits[0]  # the boundaries decide
    torch.testing.assert_close(with_mask, logits, rtol=0, atol=0)


ROWS = [{"input_ids": ids.tolist(), "supervised": mask.astype(int).tolist()} for ids, mask in samples()]


def test_a_batch_from_a_dataloader_worker_keeps_its_marks():
    """A plain DataLoader with workers hands each batch over pickled, and its tensors lost the marks that say
    they are a pack: the prepared model ran the pack as one document (its documents attending to each other),
    and its own loss shifted the pre-shifted labels again, both without a word. The marks are set again."""
    model = prepare_model(tiny_model())
    loader = torch.utils.data.DataLoader(ROWS, batch_size=len(ROWS), collate_fn=pack_samples, num_workers=1)
    batch = next(iter(loader))
    with pytest.raises(ValueError, match=r"on a packed micro-batch of \d+ segments without their"):
        model(input_ids=batch.input_ids)
    with pytest.raises(ValueError, match="pre-shifted"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, labels=batch.labels)
    here = pack_samples(ROWS)
    want = float(packed_loss(model, here, "token_mean").loss)
    assert float(packed_loss(model, batch, "token_mean").loss) == want
    assert float(packed_loss(model, copy.deepcopy(here), "token_mean").loss) == want  # a copy is not a change


@pytest.mark.parametrize("field", ["labels", "target_index", "sample_targets"])
def test_labels_changed_in_place_after_packing_are_refused(field):
    """A token's label set to -100 in place (a user's own training_step masking it) was still counted in the
    normalizer (the collation's counts) and one set from -100 was never trained (the LM head runs on the
    collation's positions only): refused wherever the batch goes next, a packed loss or a copy to a device.
    The same samples packed with the new mask equal each sample alone."""
    model = prepare_model(tiny_model())
    pairs = samples()
    batch = pack_samples(pairs)
    packed_loss(model, batch, "token_mean")  # untouched: runs
    getattr(batch, field)[0 if field == "target_index" else (0, int(batch.target_index[0]))] = (
        -100 if field == "labels" else 1
    )
    with pytest.raises(ValueError, match=rf"PackedBatch.{field} was changed in place after packing"):
        packed_loss(model, batch, "token_mean")
    for move in (lambda b: b.to("cpu").replace(level=1), lambda b: b.to("meta")):
        with pytest.raises(ValueError, match=rf"PackedBatch.{field} was changed in place"):
            move(batch)
    # The fix the message names: the new supervised mask packed.
    (ids, mask), rest = pairs[0], pairs[1:]
    mask = mask.copy()
    mask[int(np.flatnonzero(mask)[0])] = False  # the first supervised position of the first sample's mask...
    reference = tiny_model("eager").float()
    model.load_state_dict(reference.state_dict())
    ce, n = alone(reference, [(ids, mask), *rest])
    out = packed_loss(model, pack_samples([(ids, mask), *rest]), "token_mean")
    assert out.n_targets == n and float(out.loss) == pytest.approx(float(ce) / n, rel=1e-5)


def test_transformers_loss_takes_the_labels_pre_shifted_or_refuses():
    """A prepared model's own loss: ``labels=batch.labels`` alone would be shifted a second time
    (refused); with ``shift_labels=batch.labels`` it is the packed cross-entropy, and the loss's
    keywords reach the attention without breaking it."""
    reference = tiny_model("eager").float()
    ce, n = alone(reference, pairs := samples(seed=1))
    model = prepare_model(tiny_model())
    model.load_state_dict(reference.state_dict())
    batch = pack_samples(pairs)
    with pytest.raises(ValueError, match="are pre-shifted .* would shift them again"):
        model(**pack_inputs(batch), labels=batch.labels)
    out = model(**pack_inputs(batch), labels=batch.labels, shift_labels=batch.labels)
    assert float(out.loss) == pytest.approx(float(ce) / n, rel=1e-5)
    out = model(
        **pack_inputs(batch), labels=batch.labels, shift_labels=batch.labels, num_items_in_batch=torch.tensor(n)
    )
    assert float(out.loss) == pytest.approx(float(ce) / n, rel=1e-5)


def test_what_packed_loss_cannot_use_is_refused_by_name():
    """Each of these trained something else without a word (or stopped on a message about something else): a
    loss_norm of 0, a negative or NaN one, a tensor; weights of another length than the pack; a loss name beside
    weights; labels replaced without their targets' positions; checkpointing a negative or fractional number of
    layers; liger on a machine without CUDA."""
    model = prepare_model(tiny_model())
    batch = pack_samples(samples())
    for norm in (0.0, -10.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"loss_norm must be a finite number > 0 .* got"):
            packed_loss(model, batch.replace(loss_norm=norm))
    assert float(packed_loss(model, batch.replace(loss_norm=np.float32(4.0))).loss) > 0  # numpy numbers are numbers
    with pytest.raises(TypeError, match=r"loss_norm must be a Python number \(float\(\.\.\.\) of it.* got a tensor"):
        packed_loss(model, batch.replace(loss_norm=torch.tensor(4.0)))
    length = batch.input_ids.shape[1]
    for shape in ((length + 1,), (length - 1,), (), (2, length)):
        with pytest.raises(
            ValueError, match=rf"weights: one per position of the pack .*got shape {re.escape(str(shape))}"
        ):
            packed_loss(model, batch, weights=torch.ones(shape))
    one_per = packed_loss(model, batch, weights=torch.ones(length)).loss
    torch.testing.assert_close(packed_loss(model, batch, weights=torch.ones(1, length)).loss, one_per)  # labels'
    for weights in (True, float("nan")):  # True trained as weight 1.0
        with pytest.raises(ValueError, match=r"weights: a finite number or a tensor of one per position, got"):
            packed_loss(model, batch, weights=weights)
    with pytest.raises(ValueError, match=r"weights: a finite number or a tensor of one per position, got a ndarray"):
        packed_loss(model, batch, weights=np.ones(length))  # (a bare TypeError before)
    chunked = packed_loss(model, batch, weights=torch.ones(length), ce_chunk_size=np.int64(3)).loss  # numpy's int
    torch.testing.assert_close(chunked, one_per)
    torch.testing.assert_close(packed_loss(model, batch, weights=np.float32(1.0)).loss, one_per)  # numbers are
    with pytest.raises(ValueError, match="packed_loss's loss must be one of"):
        packed_loss(model, batch, "tokenmean")
    with pytest.raises(ValueError, match="a normalizer \\(loss='sum'\\) or weights, not both"):
        packed_loss(model, batch, "sum", weights=1.0)
    with pytest.raises(ValueError, match=r"replace\(labels=...\) without target_index"):
        batch.replace(labels=torch.full_like(batch.labels, -100))
    for ckpt in (-1, 1.5, True):
        with pytest.raises(ValueError, match="ckpt_layers must be a whole number of decoder layers >= 0"):
            packed_loss(model, batch.replace(ckpt_layers=ckpt), "sum")
    assert float(packed_loss(model, batch.replace(ckpt_layers=np.int64(1)), "sum").loss) > 0  # the plan's numbers
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="liger=True needs a CUDA GPU"):
            packed_loss(model, batch, "sum", liger=True)


def test_a_text_models_token_type_ids_reach_its_decoder_in_a_packed_loss():
    """GPT-2 embeds token_type_ids (segments): a pack of records with them equals each record alone with its own,
    through packed_loss as through ``model(**pack_inputs(batch))`` (the image path refused them before)."""
    config = AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model = prepare_model(AutoModelForCausalLM.from_config(config)).eval()
    model.load_state_dict(reference.state_dict())
    records = [
        {"input_ids": ids, "supervised": mask, "token_type_ids": np.arange(len(ids)) % 2} for ids, mask in samples()
    ]
    want = 0.0
    for r in records:
        ids = torch.as_tensor(r["input_ids"])
        logits = reference(input_ids=ids[None], token_type_ids=torch.as_tensor(r["token_type_ids"])[None]).logits[0]
        labels = torch.where(torch.as_tensor(r["supervised"][1:]), ids[1:], -100)
        want = want + F.cross_entropy(logits[:-1], labels, reduction="sum")
    got = packed_loss(model, pack_samples(records), "sum")
    assert float(got.ce_sum) == pytest.approx(float(want), rel=1e-5)
    assert float(got.ce_sum) != pytest.approx(
        float(packed_loss(model, pack_samples(samples()), "sum").ce_sum), rel=1e-3
    )


def test_a_router_loss_prepare_model_cannot_compute_is_refused_there():
    """A mixture-of-experts family whose modeling code has no load-balancing loss (afmoe) asked for one: refused
    by prepare_model on a project's own path too (its first packed call raised an AttributeError)."""
    config = AutoConfig.for_model("afmoe", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1,
                                  num_shared_experts=1, layer_types=["full_attention"] * 2,
                                  output_router_logits=True)  # fmt: skip
    with pytest.raises(ValueError, match="afmoe: output_router_logits is set but lit-hbp does not know"):
        prepare_model(AutoModelForCausalLM.from_config(config))


def test_a_z_loss_the_models_own_loss_adds_is_refused_by_prepare_model():
    """Bamba's own loss adds ``z_loss_coefficient`` times the mean square log-sum-exp of every position's logits:
    packed_loss computes the supervised cross-entropy only, so a prepared Bamba with a coefficient trained without
    it, without a word. The model's own ``labels=`` loss shows the term is there to lose."""
    from families import small_config

    config = small_config("bamba")
    config = AutoConfig.for_model(config.pop("model_type"), **{**config, "z_loss_coefficient": 0.5})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ids = torch.as_tensor(samples(1)[0][0])[None]
    with torch.no_grad():
        with_z = model(input_ids=ids, labels=ids).loss.item()
        model.z_loss_coefficient = 0.0
        assert with_z > model(input_ids=ids, labels=ids).loss.item() + 1.0
    model.z_loss_coefficient = 0.5
    with pytest.raises(ValueError, match="^bamba: z_loss_coefficient 0.5 adds a z-loss of every position's logits"):
        prepare_model(model)
    model.z_loss_coefficient = 0.0  # the forward reads the model's own (its config still says 0.5)
    prepare_model(model)


def summed_loss(logits, labels, vocab_size, **kwargs):
    """A project's own loss (summed over the targets, label smoothing) put on with transformers' setter."""
    logits = logits[:, :-1].float().reshape(-1, vocab_size)
    return F.cross_entropy(logits, labels[:, 1:].reshape(-1), reduction="sum", label_smoothing=0.1)


def test_a_model_whose_own_loss_was_replaced_is_refused():
    """``model.loss_function = fn`` (or a ``loss_type`` of another task) changes the model's own loss; packed_loss
    computes the cross-entropy and trained such a model on it without a word. Refused by prepare_model, and by
    packed_loss when replaced after it; the model's own loss restored, the pack trains on the model's own loss."""
    reference = tiny_model("eager").float().eval()
    ids = torch.as_tensor(samples(1)[0][0])[None]
    with torch.no_grad():
        plain = reference(input_ids=ids, labels=ids).loss.item()
        reference.loss_function = summed_loss
        assert abs(reference(input_ids=ids, labels=ids).loss.item() - plain) > 1.0  # a loss of its own to lose
    model = tiny_model()
    model.loss_function = summed_loss
    says = r"^LlamaForCausalLM: its own loss is replaced \(loss_function = summed_loss\)"
    with pytest.raises(ValueError, match=says):
        prepare_model(model)
    del model._loss_function
    model.loss_type = "ForMaskedLM"
    with pytest.raises(ValueError, match=r"its own loss is replaced \(loss_type 'ForMaskedLM'\)"):
        prepare_model(model)
    model.loss_type = "ForCausalLM"
    prepare_model(model).eval()
    one = [(ids[0].numpy(), np.ones(ids.shape[1], bool))]
    with torch.no_grad():
        assert packed_loss(model, pack_samples(one), "token_mean").loss.item() == pytest.approx(plain, rel=1e-5)
        model.loss_function = summed_loss
        with pytest.raises(ValueError, match=says):
            packed_loss(model, pack_samples(one), "token_mean")


@pytest.mark.parametrize("kind", ["PromptTuningConfig", "PrefixTuningConfig"])
def test_a_peft_prompt_learning_adapter_is_refused_before_or_after_prepare_model(kind):
    """peft's prompt, prefix and p-tuning adapters add their virtual tokens in the wrapper's own forward, which a
    packed call (of the model inside) never runs: packed_loss trained the bare model, the prompt never trained."""
    import peft

    config = getattr(peft, kind)(task_type="CAUSAL_LM", num_virtual_tokens=4)
    says = f"^PeftModelForCausalLM: peft's {config.peft_type.value} adds virtual tokens in the wrapper's own forward"
    with pytest.raises(ValueError, match=says):
        prepare_model(peft.get_peft_model(tiny_model(), config))
    wrapped = peft.get_peft_model(prepare_model(tiny_model()), config)
    with pytest.raises(ValueError, match=says):
        packed_loss(wrapped, pack_samples(samples()), "sum")
    lora = peft.get_peft_model(prepare_model(tiny_model()), peft.LoraConfig(task_type="CAUSAL_LM", r=2))
    assert packed_loss(lora, pack_samples(samples()), "sum").ce_sum > 0


def test_a_packed_call_gives_each_documents_hidden_states_as_it_alone():
    """``output_hidden_states=True`` in a packed call (a distillation's or a probe's): every layer's states of each
    document equal its own forward's (transformers records them itself; the attention was refusing the keyword)."""
    reference = tiny_model("eager").float().eval()
    model = prepare_model(tiny_model()).eval()
    model.load_state_dict(reference.state_dict())
    pairs = samples()
    states = model(**pack_inputs(pack_samples(pairs)), output_hidden_states=True).hidden_states
    start = 0
    for ids, _ in pairs:
        alone = reference(input_ids=torch.as_tensor(ids)[None], output_hidden_states=True).hidden_states
        assert len(alone) == len(states)
        for packed, own in zip(states, alone):
            torch.testing.assert_close(packed[0, start : start + len(ids)], own[0], rtol=1e-5, atol=1e-5)
        start += len(ids)


def test_a_model_built_with_hbp_varlen_but_not_prepared_is_told_to_prepare():
    """``attn_implementation="hbp_varlen"`` set by hand on a Llama: its plain calls and generate() were refused
    with "this family's layers do not pass the attention keywords on, lit-hbp cannot train it packed" (Llama
    trains packed); they name prepare_model, and its packed call still gives each document alone."""
    model = tiny_model("hbp_varlen")
    for call in (lambda: model(input_ids=torch.tensor([[1, 2, 3]])), lambda: model.generate(torch.tensor([[1, 2]]))):
        with pytest.raises(ValueError, match=r"a model lit_hbp.prepare_model did not prepare .*prepare_model\(model\)"):
            call()
    with pytest.raises(ValueError, match=r"is not prepared for packs.*call lit_hbp.prepare_model\(model\) first"):
        packed_loss(model, pack_samples(samples()), "sum")
    reference = tiny_model("eager")
    pairs = samples()
    assert_logits_alone(model(**pack_inputs(pack_samples(pairs))).logits[0], reference, pairs)
