"""A pack's documents run through a stateful mixer as the rows of a few right-padded batches
(``lit_hbp.packing.mixer_share.length_batches``), not one call a document: the batches hold every document once, each
padded within the slack, the next batch's first document one that would not fit. That such a pack trains like
each document alone, in every hybrid family, is tests/test_mixers.py's public-core test (its short documents
and the padding segment run as one batch)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from lit_hbp.packing.mixer_share import PAD_SLACK, length_batches


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), max_size=40), slack=st.sampled_from([-1.0, 0.0, PAD_SLACK, 1.0]))
def test_length_batches_hold_every_document_once_padded_within_the_slack(lengths, slack):
    batches = length_batches(lengths, slack)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for k, batch in enumerate(batches):
        longest, tokens = lengths[batch[0]], sum(lengths[i] for i in batch)
        assert all(lengths[i] <= longest for i in batch)
        assert len(batch) == 1 or len(batch) * longest <= (1 + slack) * tokens  # the padding a batch may add
        if k + 1 < len(batches):  # the next batch's first document did not fit this one
            nxt = lengths[batches[k + 1][0]]
            assert nxt <= longest and (len(batch) + 1) * longest > (1 + slack) * (tokens + nxt)
    if slack < 0:
        assert all(len(b) == 1 for b in batches)
    if lengths and len(set(lengths)) == 1 and slack >= 0:
        assert len(batches) == 1  # documents of one length: one batch, no padding
