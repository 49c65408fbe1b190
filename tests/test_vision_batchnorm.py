"""A vision model that normalizes by its batch's statistics (Emu3's VQ image tokenizer: BatchNorm3d, frozen in eval
by transformers, switched back by ``train()``): a pack's images encoded together would change each other's
encodings, so a packed call with images is refused while such a layer trains; kept in eval, the pack trains like
each record alone (loss and every gradient)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForImageTextToText

from lit_hbp import pack_inputs, pack_samples, packed_loss, prepare_model

IMAGE_TOKEN = 401
VOCAB = {**{f"<|visual token {i:06d}|>": 300 + i for i in range(64)}, "<|extra_200|>": 400, "<image>": IMAGE_TOKEN}


def emu3():
    config = AutoConfig.for_model(
        "emu3",
        vq_config=dict(codebook_size=64, embed_dim=4, latent_channels=4, base_channels=32, channel_multiplier=[1, 2],
                       num_res_blocks=1, attn_resolutions=[], temporal_downsample_factor=4, hidden_size=64,
                       num_attention_heads=1),
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        vocabulary_map=VOCAB,
    )  # fmt: skip
    torch.manual_seed(0)
    net = AutoModelForImageTextToText.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # running statistics as a trained tokenizer has them (not 0 and 1)
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm3d):
                m.running_mean.normal_(0, 0.5), m.running_var.uniform_(0.5, 2.0)
                m.weight.normal_(1, 0.2), m.bias.normal_(0, 0.2)
    return net


def record(reference, seed: int, images: int) -> dict:
    """A chat record as transformers' processor would give it: one image token per VQ code of each image."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 200, (20,), generator=g).tolist()
    rec, out = {}, ids[:5]
    if images:
        pixels = torch.randn(images, 3, 16, 16, generator=g)
        sizes = torch.tensor([[16, 16]] * images)
        with torch.no_grad():
            codes = reference.model.get_image_features(pixels, sizes).pooler_output
        for c in codes:
            out += [IMAGE_TOKEN] * c.shape[0] + ids[5:8]
        rec.update(pixel_values=pixels, image_sizes=sizes)
    out += ids[8:]
    rec["input_ids"] = torch.tensor([out])
    rec["labels"] = torch.where(rec["input_ids"] == IMAGE_TOKEN, -100, rec["input_ids"])
    return rec


def test_a_pack_of_images_is_refused_while_a_batch_norm_trains_and_exact_in_eval():
    reference = emu3()
    assert not reference.model.vqmodel.training  # transformers freezes it
    model = prepare_model(copy.deepcopy(reference))
    records = [record(reference, 1, 1), record(reference, 2, 2), record(reference, 3, 0)]
    assert model.model.vqmodel.training  # train() switched it back
    refusal = r"its model\.vqmodel\..* \(BatchNorm3d\) normalizes by the batch's statistics"
    with pytest.raises(ValueError, match=refusal):
        packed_loss(model, pack_samples(records, model=model), "sum")
    with pytest.raises(ValueError, match=refusal):  # a project's own call of the pack
        model(**pack_inputs(pack_samples(records, model=model)))
    model.model.vqmodel.eval()
    out = packed_loss(model, pack_samples(records, model=model), "sum")
    out.loss.backward()
    want = 0.0
    for rec in records:
        logits = reference(**{k: v for k, v in rec.items() if k != "labels"}, use_cache=False).logits[0, :-1]
        want = want + F.cross_entropy(logits.float(), rec["labels"][0, 1:], reduction="sum", ignore_index=-100)
    want.backward()
    assert float(out.ce_sum) == pytest.approx(float(want), rel=1e-5)
    scale = max(q.grad.abs().max().item() for q in reference.parameters() if q.grad is not None)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4 * scale, rtol=1e-4, msg=name)
    # A text-only pack never meets the tokenizer: it trains with the batch norms as they are.
    model.model.vqmodel.train()
    packed_loss(model, pack_samples([record(reference, 4, 0)], model=model), "sum")


def test_at_set_up_a_batch_norm_in_eval_is_refused_as_the_run_will_train_it():
    """``HBPLitModule``'s set-up asks as the run will train (Lightning calls ``train()`` at the start of fit): a
    BatchNorm frozen in eval now is refused all the same (exit 2 from the CLI), before the first step with images."""
    from lit_hbp.model.vision import refuse_batch_statistics

    net = emu3()
    assert not net.model.vqmodel.training
    refuse_batch_statistics(net, {"pixel_values": torch.ones(1)})  # eval now: a pack now encodes each image alone
    with pytest.raises(ValueError, match=r"the batch's statistics in training, .*; train it on text only"):
        refuse_batch_statistics(net, {"pixel_values": torch.ones(1)}, trained=True)
    refuse_batch_statistics(net, {"input_ids": torch.ones(1)}, trained=True)  # text only: nothing to refuse
