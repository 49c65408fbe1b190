"""xLSTM's own switches in a packed call: out of training its forward runs a row longer than
``max_inference_chunksize`` in chunks (a packed call runs the pack whole, for the call); its ``mode`` "train"
kernels take only some lengths (refused before anything is done, pointing to mode "inference"). The reference is
the unprepared model, each document alone."""

import torch
from conftest import separate_loss
from test_mixers import reference_of, three_documents, tiny

from lit_hbp import pack_inputs, pack_samples, packed_loss, prepare_model


def test_a_pack_longer_than_xlstms_inference_chunk_runs_whole_out_of_training():
    """At max_inference_chunksize 32 (16,384 by default: a validation pack of a 32K level), a 66-token pack in
    eval mode through ``packed_loss`` and ``model(**pack_inputs(batch))`` gives each document's loss and logits
    as it alone gives them (each within the chunk); transformers' chunks had handed the mixers a 32-token slice
    of the pack. The config's chunk size is its own again after the call."""
    net = tiny("xlstm", max_inference_chunksize=32).eval()
    reference = reference_of(net)
    docs = three_documents(net.config.vocab_size, (30, 5, 31))
    with torch.no_grad():
        want = float(separate_loss(reference, dict(enumerate(docs))))
        alone = [reference(input_ids=torch.as_tensor(ids)[None], use_cache=False).logits[0] for ids, _ in docs]
    prepare_model(net).eval()
    batch = pack_samples(docs)
    assert batch.input_ids.shape[1] > 32
    with torch.no_grad():
        got = float(packed_loss(net, batch, "sum").ce_sum)
        logits = net(**pack_inputs(batch)).logits[0]
    assert abs(got - want) <= 1e-5 * abs(want)
    assert (logits[: sum(len(ids) for ids, _ in docs)] - torch.cat(alone)).abs().max().item() < 1e-4
    assert net.config.max_inference_chunksize == 32
