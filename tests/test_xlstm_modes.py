"""xLSTM's own switches in a packed call: out of training its forward runs a row longer than
``max_inference_chunksize`` in chunks (a packed call runs the pack whole, for the call); its ``mode`` "train"
kernels take only some lengths (refused before anything is done, pointing to mode "inference"). The reference is
the unprepared model, each document alone."""

import pytest
import torch
from conftest import separate_loss
from families import small_config
from test_mixers import reference_of, three_documents, tiny

from lit_hbp import pack_inputs, pack_samples, packed_loss, prepare_model
from lit_hbp.errors import ConfigError
from lit_hbp.model.build import check_model_before_data
from lit_hbp.model.packed_call import record_of


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


@pytest.mark.parametrize("mode", ["train", "train_with_padding"])
def test_xlstms_training_kernel_modes_are_refused_before_anything_is_done(mode):
    """The unprepared model in mode "train" refuses a 30-token document alone (chunk_size 16; "train_with_padding"
    any document), so a pack's fate hung on how its documents batched: ``prepare_model`` refuses the mode in one
    line pointing to mode "inference" (the model left unprepared), and so does the command line's check before the
    data; mode "inference", the same weights, gives a 32-token document alone what mode "train" gives it."""
    net = tiny("xlstm", mode=mode, chunk_size=16)
    reference = reference_of(net)
    docs = three_documents(net.config.vocab_size, (32, 30))
    with torch.no_grad(), pytest.raises(ValueError):
        separate_loss(reference, {1: docs[1]})
    with pytest.raises(ValueError, match=rf"config mode '{mode}' runs xLSTM's chunkwise training kernel.*mode: inf"):
        prepare_model(net)
    assert record_of(net) is None
    with pytest.raises(ConfigError, match=rf"model\.model: xlstm: config mode '{mode}'"):
        check_model_before_data({**small_config("xlstm"), "mode": mode, "chunk_size": 16})
    inference = tiny("xlstm", mode="inference", chunk_size=16).eval()
    inference.load_state_dict(net.state_dict())
    if mode == "train":
        with torch.no_grad():
            want = float(separate_loss(reference, {0: docs[0]}))
            got = float(separate_loss(inference, {0: docs[0]}))
        assert abs(got - want) <= 1e-4 * abs(want)
    prepare_model(inference).eval()
    with torch.no_grad():
        got = float(packed_loss(inference, pack_samples(docs), "sum").ce_sum)
        want = float(separate_loss(reference_of(inference), dict(enumerate(docs))))
    assert abs(got - want) <= 1e-5 * abs(want)
