"""Data at scale (issue 20): chunked sources, parallel tokenization into one crash-safe cache per
source, narrow ids and supervised spans, pre-tokenized sources, and set-up memory per sample."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import HANG_S, flat_tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import lit_hbp.data.sources as sources_module
import lit_hbp.data.tokenize as tokenize_module
from lit_hbp.data.cache import CacheWriter, id_dtype, is_complete, mask_spans, spans_mask
from lit_hbp.data.sources import Source, iter_chunks, iter_records
from lit_hbp.data.store import SampleStore, truncation_window
from lit_hbp.data.tokenize import _load, tokenize_source
from lit_hbp.errors import ConfigError, DataError

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "pack"]


def records(n: int, seed: int = 0) -> list:
    """Chats, prompt/response pairs, plain text and records that are skipped, in a seeded mix."""
    rng = np.random.default_rng(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))

    out = []
    for i in range(n):
        kind = i % 7
        if kind == 5:
            out.append({"messages": [{"role": "user", "content": "  "}]})  # empty conversation
        elif kind == 6:
            out.append({"messages": [{"role": "user", "content": words(1, 5)}]})  # no supervised token
        elif kind == 4:
            out.append({"text": words(1, 60)})
        elif kind == 3:
            out.append({"prompt": words(1, 30), "response": words(1, 30)})
        else:
            turns = []
            for _ in range(int(rng.integers(1, 4))):
                turns += [{"role": "user", "content": words(1, 40)}, {"role": "assistant", "content": words(1, 40)}]
            out.append({"messages": turns})
    return out


def write_jsonl(path: Path, rows: list, blank_every: int = 0) -> Path:
    with path.open("w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps(r) + "\n")
            if blank_every and i % blank_every == 0:
                f.write("\n")
    return path


def caches(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def same(a, b) -> None:
    for name in ("offsets", "rows", "supervised", "span_offsets"):
        assert np.array_equal(a.__dict__[name], b.__dict__[name]), name
    assert np.array_equal(np.asarray(a.ids), np.asarray(b.ids))
    assert np.array_equal(np.asarray(a.spans), np.asarray(b.spans))
    assert a.skipped == b.skipped and a.skipped_where == b.skipped_where


@settings(max_examples=60, deadline=None)
@given(
    lines=st.lists(
        st.one_of(st.just(""), st.text(alphabet="abcxyz", min_size=1, max_size=90)), min_size=0, max_size=30
    ),
    chunk=st.integers(1, 64),
    trailing_newline=st.booleans(),
)
def test_jsonl_chunks_cover_the_file_and_keep_line_numbers(tmp_path_factory, lines, chunk, trailing_newline):
    """Chunks at any size: their bytes are the file's, and records keep their file:line (blank lines
    skipped, a line longer than a chunk whole, a last line without a newline read)."""
    path = tmp_path_factory.mktemp("chunks") / "d.jsonl"
    body = "\n".join(json.dumps({"text": x}) if x else "" for x in lines)
    path.write_text(body + ("\n" if trailing_newline and lines else ""))
    if path.stat().st_size == 0:
        return
    chunks = list(iter_chunks(Source(str(path)), chunk_bytes=chunk))
    assert b"".join(c.lines for c in chunks) == path.read_bytes()
    assert sum(c.size for c in chunks) == path.stat().st_size
    got = [(r["text"], where) for r, where in iter_records(Source(str(path)))]
    expected = [(x, f"{path}:{i}") for i, x in enumerate(lines, 1) if x]
    monkey_chunks = [
        (r["text"], where) for c in chunks for r, where, _ in sources_module.chunk_records(Source(str(path)), c)
    ]
    assert got == expected == monkey_chunks


def test_parallel_tokenization_equals_the_main_process_over_many_chunks(tmp_path, toy_tokenizer, monkeypatch):
    """2 worker processes over 40+ chunks write the same cache as the main process alone, and both
    match a tokenization of each record on its own (a chunk of one record)."""
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    path = write_jsonl(tmp_path / "mix.jsonl", records(420), blank_every=50)
    monkeypatch.setattr(sources_module, "CHUNK_BYTES", 1500)
    alone = tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "one", progress=False, num_proc=1)
    parallel = tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "two", progress=False, num_proc=2)
    assert len(list(iter_chunks(Source(str(path))))) > 40
    assert json.loads((caches(tmp_path / "two")[0] / "meta.json").read_text())["processes"] == 2
    same(alone, parallel)
    monkeypatch.setattr(sources_module, "CHUNK_BYTES", 1)  # every line its own chunk
    single = tokenize_source(Source(str(path)), tok, progress=False, num_proc=1)
    same(alone, single)
    assert alone.skipped == {"empty conversation": 60, "no supervised token": 60}
    assert len(alone) == 300 and alone.where(0) == f"{path}:1" and alone.where(1) == f"{path}:3"


def test_narrow_ids_and_spans_on_disk(tmp_path, toy_tokenizer):
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    assert id_dtype(len(tok)) == np.uint16 and id_dtype(65536) == np.uint16 and id_dtype(65537) == np.uint32
    path = write_jsonl(tmp_path / "c.jsonl", records(70))
    t = tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "cache", progress=False)
    (folder,) = caches(tmp_path / "cache")
    tokens = int(t.offsets[-1])
    assert t.ids.dtype == np.uint16 and (folder / "ids.bin").stat().st_size == 2 * tokens
    assert (folder / "spans.bin").stat().st_size == 8 * len(t.spans) < tokens  # spans: per turn, not per token
    ids, target = flat_tokens(t)
    assert target.sum() == t.supervised.sum() and not target[t.offsets[:-1]].any()


@settings(max_examples=80, deadline=None)
@given(mask=st.lists(st.booleans(), min_size=0, max_size=40), upto=st.integers(0, 45))
def test_spans_round_trip_and_count_truncated_targets(mask, upto):
    target = np.asarray(mask, bool)
    spans = mask_spans(target)
    assert np.array_equal(spans_mask(spans, target.size), target)
    assert np.array_equal(spans_mask(spans, min(upto, target.size)), target[:upto])


def synthetic_cache(folder: Path, lengths: np.ndarray, seed: int = 0):
    """A cache of samples of ``lengths`` with random ids and 1-3 supervised runs each, written the way
    tokenization writes it, in chunks of 64 samples."""
    rng = np.random.default_rng(seed)
    writer = CacheWriter(folder, 50_000)
    masks = []
    for lo in range(0, lengths.size, 64):
        part = lengths[lo : lo + 64]
        ids, spans, counts = [], [], []
        for n in part:
            target = np.zeros(n, bool)
            for _ in range(int(rng.integers(1, 4))):
                a = int(rng.integers(1, n))
                target[a : a + int(rng.integers(1, n))] = True
            masks.append(target)
            runs = mask_spans(target)
            ids.append(rng.integers(0, 50_000, n))
            spans.append(runs)
            counts.append(len(runs))
        writer.append(np.concatenate(ids), part, np.arange(lo, lo + part.size) + 1, np.concatenate(spans), counts)
    writer.commit(dict(skipped={}, skipped_where={}, metadata={}))
    return masks


def test_set_up_memory_grows_with_samples_not_tokens(tmp_path):
    """A store over a 16M-token cache: build, truncate, hold out and read samples with a traced peak
    of < 64 bytes a sample, where a token-sized array (the old cumsum of the mask) alone is 128 MB;
    the supervised counts after truncation equal a brute-force count over the masks."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(20_000, 44_000, 500)
    masks = synthetic_cache(tmp_path / "big", lengths)
    src = Source(str(write_jsonl(tmp_path / "big.jsonl", [{"text": "x"}])))
    np.unique(np.zeros((2, 2)), axis=0)  # numpy's lazy imports, before tracing
    tracemalloc.start()
    t = _load(tmp_path / "big", src)
    store = SampleStore.build([t], max_len=32_768, over_length="truncate")
    rest, _, _ = store.hold_out(0.1, seed=0)
    ids, target = rest.tokens(0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert lengths.sum() > 15_000_000
    assert peak < 64 * lengths.size + ids.nbytes + target.nbytes + 200_000, peak
    # Brute force: the supervised targets (after the window's first token) of every window, the best one.
    best = [best_window(m, 32_768) for m in masks]
    assert store.loss_tokens.tolist() == [kept for _, kept in best]
    assert store.lengths.tolist() == np.minimum(lengths, 32_768).tolist()
    assert store.starts.tolist() == [start for start, _ in best] and store.starts.any()
    row = int(rest.row_of[0])
    start = int(rest.starts[0])
    want = masks[row][start : start + rest.lengths[0]].copy()
    want[0] = False
    assert np.array_equal(target, want) and ids.dtype == np.uint16


def best_window(mask: np.ndarray, max_len: int) -> tuple[int, int]:
    """(start, supervised targets kept) of the earliest window of ``max_len`` tokens keeping the most
    targets, by trying every start (a window's first token is no target)."""
    c = np.r_[0, np.cumsum(mask, dtype=np.int64)]  # c[j]: targets before j, so a window's count is a difference
    counts = [int(c[min(s + max_len, mask.size)] - c[s + 1]) for s in range(max(mask.size - max_len, 0) + 1)]
    start = int(np.argmax(counts))
    return start, counts[start] if mask.size > max_len else int(mask[1:].sum())


def test_loss_tokens_of_rows_with_a_cut_equal_the_masks(tmp_path):
    rng = np.random.default_rng(2)
    lengths = rng.integers(2, 300, 200)
    masks = synthetic_cache(tmp_path / "c", lengths, seed=3)
    t = _load(tmp_path / "c", Source(str(write_jsonl(tmp_path / "c.jsonl", [{"text": "x"}]))))
    rows = rng.choice(200, 50, replace=False)
    starts, length = rng.integers(0, 40, 50), 120
    want = [int(masks[r][s + 1 : s + length].sum()) for r, s in zip(rows, starts)]
    assert t.loss_tokens(rows, (starts, length)).tolist() == want
    assert t.loss_tokens().tolist() == [int(m.sum()) for m in masks]


@settings(max_examples=300)
@given(st.lists(st.booleans(), min_size=1, max_size=80), st.integers(1, 90))
def test_truncation_window_is_the_earliest_best_window(bits, max_len):
    """Against trying every start: the window keeping the most supervised targets, the earliest."""
    mask = np.array(bits)
    mask[0] = False  # a sample's first token is never a target
    start = truncation_window(mask_spans(mask), mask.size, max_len)
    assert (
        start,
        int(mask[start + 1 : start + max_len].sum()) if mask.size > max_len else int(mask.sum()),
    ) == best_window(mask, max_len)


def _tokenize_in_process(path: str, tok: str, cache: str, chunk: int) -> tuple[int, bool, int]:
    """Run in another process: count the cache writes this process makes."""
    import lit_hbp.data.sources as s
    import lit_hbp.data.tokenize as tz

    s.CHUNK_BYTES = chunk
    writes = []
    real = tz._write
    tz._write = lambda *a, **k: (writes.append(1), real(*a, **k))[1]
    from transformers import AutoTokenizer

    t = tz.tokenize_source(
        s.Source(path), AutoTokenizer.from_pretrained(tok), cache_dir=cache, progress=False, num_proc=1
    )
    return len(writes), t.from_cache, int(t.offsets[-1])


def test_two_concurrent_set_ups_tokenize_once(tmp_path, toy_tokenizer):
    """Two processes that set up the same source at once (two ranks, or two nodes on one cache_dir):
    one tokenizes, the other waits on the lock and reads its cache."""
    import multiprocessing

    # 1000 records (~300 KB): a second or so of tokenizing, which the other process, sent its task at once, waits on
    path = write_jsonl(tmp_path / "d.jsonl", records(1000))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        pool.map(abs, [1, 2])  # both started (imports done) before the race
        results = pool.starmap(_tokenize_in_process, [(str(path), toy_tokenizer, str(tmp_path / "cache"), 4096)] * 2)
    assert sorted(r[0] for r in results) == [0, 1], results
    assert sorted(r[1] for r in results) == [False, True] and results[0][2] == results[1][2]
    assert len(caches(tmp_path / "cache")) == 1 and not list((tmp_path / "cache").glob(".d-*"))


@pytest.mark.slow
def test_a_killed_writer_leaves_no_cache_and_no_stuck_lock(tmp_path, toy_tokenizer):
    """SIGKILL a process midway through writing a cache: no cache a later run accepts is left, the
    next run is not blocked by the dead writer's lock, removes its half-written folder and
    tokenizes everything again, exactly."""
    path = write_jsonl(tmp_path / "d.jsonl", records(2000))  # ~600 KB: some 300 chunks of 2 KB, killed at the first
    cache = tmp_path / "cache"
    code = (
        "import sys, lit_hbp.data.sources as s; s.CHUNK_BYTES = 2048\n"
        "from lit_hbp.data.tokenize import tokenize_source\nfrom transformers import AutoTokenizer\n"
        f"tokenize_source(s.Source({str(path)!r}), AutoTokenizer.from_pretrained({toy_tokenizer!r}), "
        f"cache_dir={str(cache)!r}, progress=False, num_proc=1)\nprint('finished')"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    deadline = time.monotonic() + HANG_S
    while not (
        partial := [p for p in cache.glob(".d-*.tmp-*") if (p / "ids.bin").is_file() and (p / "ids.bin").stat().st_size]
    ):
        assert proc.poll() is None, "the writer ended before it wrote a chunk"
        assert time.monotonic() < deadline, "the writer wrote no chunk"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL and b"finished" not in proc.stdout.read()
    assert partial and not caches(cache)
    assert not any(is_complete(p) for p in cache.glob(".d-*"))
    locks = list((cache / ".locks").glob("*.lock"))
    assert locks  # the dead writer's lock file stays, free: the next run takes it without waiting
    for lock in locks:
        with open(lock, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if still held
            fcntl.flock(f, fcntl.LOCK_UN)
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    again = tokenize_source(Source(str(path)), tok, cache_dir=cache, progress=False, num_proc=1)
    assert not again.from_cache
    assert not list(cache.glob(".d-*")) and len(caches(cache)) == 1
    same(again, tokenize_source(Source(str(path)), tok, progress=False, num_proc=1))


def pretokenized_rows(tok, n: int = 12) -> list[dict]:
    rng = np.random.default_rng(4)
    rows = []
    for _ in range(n):
        ids = rng.integers(0, len(tok), int(rng.integers(3, 40))).tolist()
        cut = int(rng.integers(1, len(ids)))
        labels = [-100] * cut + ids[cut:]
        rows.append(dict(input_ids=ids, labels=labels, assistant_masks=[0] * cut + [1] * (len(ids) - cut)))
    return rows


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "hf", "jsonl"])
@pytest.mark.parametrize("field", ["labels", "assistant_masks"])
def test_pre_tokenized_sources_are_taken_as_they_are(tmp_path, toy_tokenizer, fmt, field):
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    rows = pretokenized_rows(tok)
    keep = [{k: r[k] for k in ("input_ids", field)} for r in rows]
    table = pa.Table.from_pylist(keep)
    if fmt == "parquet":
        path = tmp_path / "d.parquet"
        pq.write_table(table, path, row_group_size=5)
    elif fmt == "arrow":
        path = tmp_path / "d.arrow"
        with pa.ipc.new_stream(path, table.schema) as w:
            w.write_table(table, max_chunksize=4)
    elif fmt == "hf":
        import datasets

        path = tmp_path / "hf"
        datasets.Dataset.from_list(keep).save_to_disk(str(path))
    else:
        path = write_jsonl(tmp_path / "d.jsonl", keep)
    t = tokenize_source(Source(str(path)), tok, progress=False, num_proc=1)
    ids, target = flat_tokens(t)
    assert ids.tolist() == sum((r["input_ids"] for r in rows), [])
    expected = np.concatenate([np.asarray(r["labels"]) != -100 for r in rows])
    expected[t.offsets[:-1]] = False  # the first token of a sample is never predicted
    assert np.array_equal(target, expected) and len(t) == len(rows)


@pytest.mark.parametrize("fmt", ["parquet", "arrow", "hf"])
@pytest.mark.parametrize("field", ["labels", "assistant_masks"])
def test_a_tables_null_labels_in_one_row_are_refused_not_trained_on_every_token(tmp_path, toy_tokenizer, fmt, field):
    """A table's column holds every row: a row whose ``labels`` (or ``assistant_masks``) cell is null read back
    without the field and trained every token of it, where its JSON twin is refused. Renamed fields too."""
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    rows = [{k: r[k] for k in ("input_ids", field)} for r in pretokenized_rows(tok)[:4]]
    rows[2][field] = None
    renamed = [{("targets" if k == field else k): v for k, v in r.items()} for r in rows]
    for written, fields in ((rows, None), (renamed, {field: "targets"})):
        table = pa.Table.from_pylist(written)
        path = tmp_path / f"{fmt}-{bool(fields)}"
        if fmt == "parquet":
            pq.write_table(table, path.with_suffix(".parquet"), row_group_size=2)
            path = path.with_suffix(".parquet")
        elif fmt == "arrow":
            path = path.with_suffix(".arrow")
            with pa.ipc.new_stream(path, table.schema) as w:
                w.write_table(table)
        else:
            import datasets

            datasets.Dataset.from_list(written).save_to_disk(str(path))
        name = "targets" if fields else field
        with pytest.raises(DataError, match=rf":row 3: {name} is null: give it .*give the input_ids as labels"):
            source = Source(str(path), format="tokens", fields=fields) if fields else Source(str(path))
            tokenize_source(source, tok, progress=False, num_proc=1)
    # A table joined from two data sets: each row gives one of the two fields, the other's cell null: read by it.
    joined = [dict(r, **{other: None}) for r in pretokenized_rows(tok)[:4]
              for other in ({"labels", "assistant_masks"} - {field})]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(joined), tmp_path / "joined.parquet")
    t = tokenize_source(Source(str(tmp_path / "joined.parquet")), tok, progress=False, num_proc=1)
    pq.write_table(
        pa.Table.from_pylist([{k: r[k] for k in ("input_ids", field)} for r in joined]), tmp_path / "one.parquet"
    )
    alone = tokenize_source(Source(str(tmp_path / "one.parquet")), tok, progress=False, num_proc=1)
    assert [t.sample(i)[1].tolist() for i in range(4)] == [alone.sample(i)[1].tolist() for i in range(4)]
    # A table with no such column at all trains every token, as a JSON record without the field does.
    whole = pa.Table.from_pylist([{"input_ids": r["input_ids"]} for r in rows])
    pq.write_table(whole, tmp_path / "whole.parquet")
    t = tokenize_source(Source(str(tmp_path / "whole.parquet")), tok, progress=False, num_proc=1)
    ids, target = flat_tokens(t)
    assert target.sum() == len(ids) - len(rows)


@pytest.mark.parametrize(
    "record, message",
    [
        (dict(input_ids=[1, 2, 10**6], labels=[1, 2, 10**6]), r"row 2: input_ids holds token id 1000000, outside"),
        (dict(input_ids=[1, 2, 3], labels=[1, 2]), r"row 2: labels has 2 entries for 3 input_ids"),
        (dict(input_ids=[1, 2, 3], labels=[-100, 5, 3]), r"row 2: labels\[1\] = 5 is neither -100 nor input_ids"),
        (dict(input_ids=[1, 2, 3], assistant_masks=[0, 1]), r"row 2: assistant_masks has 2 entries for 3"),
        (dict(input_ids=[1, -2, 3], labels=[-100, -2, 3]), r"row 2: input_ids holds token id -2"),
    ],
)
def test_bad_pre_tokenized_records_name_the_row_and_the_problem(tmp_path, toy_tokenizer, record, message):
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    good = dict(input_ids=[1, 2, 3], labels=[-100, 2, 3])
    path = tmp_path / "d.parquet"
    if "assistant_masks" in record:
        good = dict(input_ids=[1, 2, 3], assistant_masks=[0, 1, 1])
    pq.write_table(pa.Table.from_pylist([good, record]), path)
    with pytest.raises(DataError, match=f"{path}:{message}"):
        tokenize_source(Source(str(path)), tok, progress=False, num_proc=2)


def test_num_proc_is_checked_and_small_sources_stay_in_process(tmp_path, toy_tokenizer, monkeypatch):
    from lit_hbp.lightning.datamodule import HBPDataModule

    path = write_jsonl(tmp_path / "d.jsonl", records(20))
    with pytest.raises(ConfigError, match="data.num_proc must be >= 1"):
        HBPDataModule(sources=[str(path)], tokenizer=toy_tokenizer, levels=["256:1"], num_proc=0)
    assert tokenize_module.worker_count(Source(str(path)), None) == 1
    assert tokenize_module.worker_count(Source(str(path)), 3) == 3
    size = path.stat().st_size  # with a processor (records with images) a source this size has workers
    monkeypatch.setattr(tokenize_module, "PARALLEL_MIN_BYTES", size * tokenize_module.MEDIA_COST)
    assert tokenize_module.worker_count(Source(str(path)), None) == 1
    assert tokenize_module.worker_count(Source(str(path)), None, media=True) == len(os.sched_getaffinity(0))
    monkeypatch.setattr(tokenize_module, "PARALLEL_MIN_BYTES", 10)
    assert tokenize_module.worker_count(Source(str(path)), None) == len(os.sched_getaffinity(0))


def test_a_pickled_source_maps_its_tokens_again_instead_of_copying_them(tmp_path, toy_tokenizer):
    """What a DataLoader worker started by spawn or forkserver receives: the arrays map the cache."""
    import pickle

    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    path = write_jsonl(tmp_path / "d.jsonl", records(300))
    t = tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "cache", progress=False)
    blob = pickle.dumps(t)
    assert len(blob) < t.ids.nbytes
    copy = pickle.loads(blob)
    assert isinstance(copy.ids, np.memmap) and isinstance(copy.spans, np.memmap)
    same(t, copy)


def _qwen_folder_with(tmp_path: Path, name: str, edit) -> Path:
    """A copy of the toy Qwen tokenizer folder with ``edit(tokenizer_json, tokenizer_config)`` applied."""
    from chat_formats import build_qwen_tokenizer

    base = tmp_path / "qwen"
    if not (base / "tokenizer.json").exists():
        build_qwen_tokenizer(base)
    folder = tmp_path / name
    shutil.copytree(base, folder)
    files = {f: json.loads((base / f).read_text()) for f in ("tokenizer.json", "tokenizer_config.json")}
    edit(*files.values())
    for f, content in files.items():
        (folder / f).write_text(json.dumps(content))
    return folder


CHAT = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]


def test_ids_past_the_tokenizers_length_are_cached_as_they_are(tmp_path):
    """A vocabulary with a gap in its ids (an added token numbered 70,000 in a 470-token vocabulary): the cache's
    ids are the chat template's own, not wrapped to 16 bits by a width chosen from ``len(tokenizer)``."""

    def renumber(tj, _):
        end = next(t for t in tj["added_tokens"] if t["content"] == "<|im_end|>")
        old, end["id"] = end["id"], 70_000
        tj["model"]["vocab"] = {k: (70_000 if v == old else v) for k, v in tj["model"]["vocab"].items()}

    tok = AutoTokenizer.from_pretrained(_qwen_folder_with(tmp_path, "gap", renumber))
    assert len(tok) < 1 << 16 and tok.convert_tokens_to_ids("<|im_end|>") == 70_000
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])
    t = tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "cache", progress=False)
    assert t.sample(0)[0].tolist() == list(tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"])


def test_a_tokenizer_that_splits_special_tokens_gets_its_own_cache(tmp_path):
    """``split_special_tokens`` changes the ids of every chat (its special tokens read as text): a folder that
    differs only there must not take the other's cached ids."""
    plain = _qwen_folder_with(tmp_path, "plain", lambda tj, cfg: None)
    split = _qwen_folder_with(tmp_path, "split", lambda tj, cfg: cfg.update(split_special_tokens=True))
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])
    cache = tmp_path / "cache"
    first = tokenize_source(Source(str(path)), AutoTokenizer.from_pretrained(plain), cache_dir=cache, progress=False)
    tok = AutoTokenizer.from_pretrained(split)
    second = tokenize_source(Source(str(path)), tok, cache_dir=cache, progress=False)
    fresh = tokenize_source(Source(str(path)), tok, progress=False)
    assert not second.from_cache and first.sample(0)[0].tolist() != fresh.sample(0)[0].tolist()
    assert second.sample(0)[0].tolist() == fresh.sample(0)[0].tolist()


def test_an_upgrade_of_the_rendering_libraries_tokenizes_again(tmp_path, monkeypatch):
    """The chat template's jinja, transformers' rendering and the tokenizers pipeline decide the ids of a record:
    after an upgrade the cache is not read (it may hold what the old versions rendered); with the same ones it is."""
    folder = _qwen_folder_with(tmp_path, "plain", lambda tj, cfg: None)
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])
    cache = tmp_path / "cache"
    tok = AutoTokenizer.from_pretrained(folder)
    assert not tokenize_source(Source(str(path)), tok, cache_dir=cache, progress=False).from_cache
    assert tokenize_source(Source(str(path)), tok, cache_dir=cache, progress=False).from_cache
    real = tokenize_module.version
    for library in ("jinja2", "tokenizers", "transformers"):
        monkeypatch.setattr(tokenize_module, "version", lambda name, new=library: "99.0" if name == new else real(name))
        again = tokenize_source(Source(str(path)), tok, cache_dir=cache, progress=False)
        assert not again.from_cache, library
        monkeypatch.undo()


def test_a_roles_mapping_is_used_by_some_record_in_some_worker_or_refused(tmp_path, toy_tokenizer, monkeypatch):
    """``roles`` keys are met across all the workers' chunks (one record alone uses ``agent``); a key no record
    has (a typo, another data set's name) would rename nothing: refused, naming it and the roles the records use,
    with no cache left behind."""
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    turns = [{"from": "customer", "value": "hi"}, {"from": "bot", "value": "hello there"}]
    rows = [{"conversations": turns}] * 30 + [{"conversations": [turns[0], {"from": "agent", "value": "hey"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    monkeypatch.setattr(sources_module, "CHUNK_BYTES", 1)  # every line its own chunk
    roles = {"customer": "user", "bot": "assistant", "agent": "assistant"}
    fine = tokenize_source(Source(str(path), format="sharegpt", roles=roles), tok, progress=False, num_proc=2)
    assert len(fine) == 31
    cache = tmp_path / "cache"
    source = Source(str(path), format="sharegpt", roles={**roles, "robot": "assistant"})
    with pytest.raises(ConfigError) as e:
        tokenize_source(source, tok, cache_dir=cache, progress=False, num_proc=2)
    assert "roles maps 'robot', a role no record has (its records' roles: agent, bot, customer)" in str(e.value)
    assert not caches(cache)


def test_a_new_version_with_the_same_size_and_mtime_tokenizes_again(tmp_path, toy_tokenizer):
    """A new version of a source that keeps the old one's size and mtime (``cp -p``, ``rsync -a``, a tarball with
    fixed mtimes, rewritten in place or put in place by a rename) is tokenized again: the reference is its records
    read now with json and rendered by ``apply_chat_template``."""
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    path, cache = tmp_path / "d.jsonl", tmp_path / "cache"

    def chat(answer: str) -> dict:
        return {"messages": [{"role": "user", "content": "what is 2+2?"}, {"role": "assistant", "content": answer}]}

    def check() -> None:
        got = tokenize_source(Source(str(path)), tok, cache_dir=cache, progress=False)
        want = tok.apply_chat_template(json.loads(path.read_text())["messages"], tokenize=True, return_dict=True)
        assert not got.from_cache and got.sample(0)[0].tolist() == want["input_ids"]

    write_jsonl(path, [chat("four")])
    check()
    stamp = (path.stat().st_atime_ns, path.stat().st_mtime_ns)
    write_jsonl(path, [chat("five")])  # in place: same inode, same size, the old mtime put back
    os.utime(path, ns=stamp)
    check()
    new = write_jsonl(tmp_path / "new.jsonl", [chat("nine")])  # a rename over it: another inode, same size and mtime
    os.utime(new, ns=stamp)
    os.replace(new, path)
    check()


def test_a_cache_read_under_another_name_of_its_file_reports_the_skipped_records_by_that_name(
    tmp_path, toy_tokenizer, monkeypatch
):
    """The cache is keyed by the file (its resolved path), so a run naming it otherwise (relative, then absolute)
    reads the first run's cache: its skipped records were reported under the first run's name, a relative path
    that points elsewhere from another folder, while its kept samples used the run's own."""
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "a.jsonl", [good, {"messages": []}, good])
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "cache"
    for name in ("data/a.jsonl", str(tmp_path / "data" / "a.jsonl")):
        t = tokenize_source(Source(name), tok, cache_dir=cache, progress=False, num_proc=1)
        assert t.skipped_where["empty conversation"] == [f"{name}:2"]
    assert t.from_cache and len(list(cache.glob("a*"))) == 1


def test_a_sources_content_digest_is_what_its_samples_hold_not_how_it_was_read(tmp_path, toy_tokenizer, monkeypatch):
    """The digest a resume compares (``CacheWriter``'s ``content``): the same records read in other chunks or by
    two processes give the same one; one record's answer changed to another of the same length gives another."""
    import lit_hbp.data.sources as sources

    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    rows = records(40)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    digests = [tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "a", progress=False, num_proc=1).content]
    monkeypatch.setattr(sources, "CHUNK_BYTES", 300)
    digests.append(
        tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "b", progress=False, num_proc=1).content
    )
    digests.append(
        tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "c", progress=False, num_proc=2).content
    )
    assert digests[0] and len(set(digests)) == 1, digests
    answer = rows[0]["messages"][1]["content"]
    rows[0]["messages"][1]["content"] = " ".join(reversed(answer.split()))  # the same words, another order
    edited = tokenize_source(Source(str(write_jsonl(path, rows))), tok, cache_dir=tmp_path / "d", progress=False)
    assert np.array_equal(edited.lengths, tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "a",
                                                          progress=False).lengths)  # fmt: skip
    assert edited.content != digests[0] or answer == rows[0]["messages"][1]["content"]
