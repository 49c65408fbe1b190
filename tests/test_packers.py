"""Every packer against a brute-force implementation of its definition."""

import numpy as np
import packing_reference as ref
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lit_hbp.packing import PACKERS, pack
from lit_hbp.packing.packers import fit_decreasing


@st.composite
def workloads(draw, max_n=120):
    capacity = draw(st.integers(1, 400))
    n = draw(st.integers(0, max_n))
    # Mix of tiny, mid and near-capacity items, with many repeats so equal-size runs are exercised.
    sizes = st.one_of(st.integers(1, capacity), st.sampled_from(sorted({1, capacity, max(1, capacity // 2)})))
    lengths = np.array(draw(st.lists(sizes, min_size=n, max_size=n)), dtype=np.int64)
    return lengths, capacity


def as_sorted_lists(bins):
    return [sorted(int(i) for i in b) for b in bins]


def check_partition(bins, lengths, capacity):
    flat = np.concatenate([np.asarray(b, dtype=np.int64) for b in bins]) if bins else np.zeros(0, np.int64)
    assert np.array_equal(np.sort(flat), np.arange(len(lengths))), "every item in exactly one bin"
    for b in bins:
        assert len(b) > 0
        assert lengths[np.asarray(b, dtype=np.int64)].sum() <= capacity


@given(workloads())
def test_ffd_bfd_match_brute_force_exactly(w):
    lengths, capacity = w
    for name, reference in (("ffd", ref.ffd), ("bfd", ref.bfd)):
        got = pack(lengths, capacity, name)
        check_partition(got, lengths, capacity)
        assert as_sorted_lists(got) == as_sorted_lists(reference(lengths, capacity)), name


@given(workloads(), st.integers(0, 2**31 - 1))
def test_shuffled_packers_match_brute_force_exactly(w, seed):
    lengths, capacity = w
    cases = {
        "ffs": ref.ffs(lengths, capacity, seed),
        "random": ref.random(lengths, capacity, seed),
        "greedy": ref.greedy(lengths, capacity),
    }
    for name, expected in cases.items():
        got = pack(lengths, capacity, name, seed)
        check_partition(got, lengths, capacity)
        assert as_sorted_lists(got) == as_sorted_lists(expected), name


@given(workloads(), st.integers(0, 1000), st.integers(1, 6), st.sampled_from([0.5, 0.9, 0.99]))
def test_isf_matches_brute_force_exactly(w, seed, iterations, threshold):
    lengths, capacity = w
    got = pack(lengths, capacity, "isf", seed, iterations=iterations, threshold=threshold)
    check_partition(got, lengths, capacity)
    assert as_sorted_lists(got) == as_sorted_lists(ref.isf(lengths, capacity, seed, iterations, threshold))


def test_isf_with_one_round_is_random_packing():
    lengths = np.random.default_rng(1).integers(1, 500, 300)
    assert as_sorted_lists(pack(lengths, 1000, "isf", 7, iterations=1)) == as_sorted_lists(
        pack(lengths, 1000, "random", 7)
    )


@given(workloads(max_n=80))
def test_mffd_matches_brute_force(w):
    lengths, capacity = w
    got = pack(lengths, capacity, "mffd")
    check_partition(got, lengths, capacity)
    assert ref.length_multisets(got, lengths) == ref.length_multisets(ref.mffd(lengths, capacity), lengths)


@given(workloads(max_n=80), st.sampled_from([None, 1, 2, 3]))
def test_spfhp_matches_brute_force(w, max_per_pack):
    lengths, capacity = w
    got = pack(lengths, capacity, "spfhp", max_per_pack=max_per_pack)
    check_partition(got, lengths, capacity)
    if max_per_pack is not None:
        assert max(len(b) for b in got) <= max_per_pack if got else True
    expected = ref.spfhp(lengths, capacity, max_per_pack)
    assert ref.length_multisets(got, lengths) == sorted(tuple(sorted(b)) for b in expected)


@given(workloads(), st.data())
def test_greedy_fill_into_existing_bins_matches_brute_force(w, data):
    lengths, capacity = w
    n_bins = data.draw(st.integers(0, 8))
    free = np.array(data.draw(st.lists(st.integers(0, capacity), min_size=n_bins, max_size=n_bins)), np.int64)
    bin_of, free_after = fit_decreasing(lengths, capacity, best=True, free=free, open_new=False)
    expected, unplaced = ref.greedy_fill(lengths, range(len(lengths)), free, capacity)
    got = [sorted(np.flatnonzero(bin_of == b).tolist()) for b in range(n_bins)]
    assert got == [sorted(b) for b in expected]
    assert sorted(np.flatnonzero(bin_of < 0).tolist()) == sorted(unplaced)
    used = np.bincount(bin_of[bin_of >= 0], weights=lengths[bin_of >= 0], minlength=n_bins)
    assert np.array_equal(free_after, free - used.astype(np.int64))


def test_every_packer_registered_and_deterministic():
    assert set(PACKERS) == {"isf", "ffd", "bfd", "ffs", "mffd", "spfhp", "greedy", "random"}
    lengths = np.random.default_rng(0).integers(1, 2000, 500)
    for name in PACKERS:
        a, b = pack(lengths, 4096, name, seed=3), pack(lengths, 4096, name, seed=3)
        assert as_sorted_lists(a) == as_sorted_lists(b), name
        check_partition(a, lengths, 4096)


@given(w=workloads(), seeds=st.tuples(st.integers(0, 2**31), st.integers(0, 2**31)))
def test_only_the_seeded_packers_pack_otherwise_for_another_seed(w, seeds):
    """``SEEDED_PACKERS`` decides which runs of several epochs must rebuild their loader each epoch (another seed +
    epoch, another number of packs): every other packer packs the same bins whatever the seed."""
    from lit_hbp.packing.packers import SEEDED_PACKERS

    lengths, capacity = w
    for name in set(PACKERS) - set(SEEDED_PACKERS):
        a, b = (pack(lengths, capacity, name, seed=seed) for seed in seeds)
        assert as_sorted_lists(a) == as_sorted_lists(b), name


def test_the_seeded_packers_draw():
    """Each of ``SEEDED_PACKERS`` gives another number of packs for some seed (so it belongs in the list)."""
    from lit_hbp.packing.packers import SEEDED_PACKERS

    lengths = np.random.default_rng(0).integers(1, 3000, 400)
    for name in SEEDED_PACKERS:
        assert len({len(pack(lengths, 4096, name, seed=seed)) for seed in range(20)}) > 1, name


def test_decreasing_packers_reach_near_optimal_fill_on_short_data():
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(np.log(700), 1.1, 20000)), 32, 16384).astype(np.int64)
    lower_bound = -(-lengths.sum() // 16384)
    for name in ("ffd", "bfd", "mffd"):
        assert len(pack(lengths, 16384, name)) <= lower_bound + 2, name


@pytest.mark.parametrize(
    "lengths, capacity, message",
    [
        ([3, -1, 2], 10, "negative at index 1 = -1"),
        ([1.5, 2], 10, "must be integers: index 0 = 1.5"),
        ([["a"]], 10, "1-D array"),
        ([4, 11], 10, "longer than the capacity 10: index 1 = 11"),
        ([4, 0], 10, "zero-length sample(s) cannot be packed: index 1 = 0"),
        ([4], 0, "capacity must be a positive int"),
    ],
)
def test_bad_input_errors_name_the_problem(lengths, capacity, message):
    with pytest.raises((ValueError, TypeError)) as e:
        pack(lengths, capacity)
    assert message in str(e.value)


def test_unknown_packer():
    with pytest.raises(ValueError, match="unknown packer 'nope'"):
        pack([1, 2], 4, "nope")
