"""Data pipeline: sources, tokenization with label masks, caching, mixing, over-length, collation."""

import json

import numpy as np
import pytest
import torch
from conftest import flat_tokens
from transformers import AutoTokenizer

from lit_hbp.data.collate import collate_packs
from lit_hbp.data.sources import DataError, Source, iter_records
from lit_hbp.data.store import SampleStore, mixture_repeats
from lit_hbp.data.tokenize import tokenize_source
from lit_hbp.errors import ConfigError
from lit_hbp.parallel.ulysses import Ulysses


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def caches(folder):
    """The cache folders in ``folder`` (not its lock files, report or hidden work folders)."""
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def chat(user, assistant):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


# ----------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": [', "bad.jsonl:2: malformed JSON"),
        ("[1, 2]", "bad.jsonl:2: expected a JSON object, got list"),
        ('{"messages": "hi"}', "bad.jsonl:2: field 'messages' must be list, got str"),
        ('{"messages": [{"role": "user"}]}', "bad.jsonl:2: messages[0] has no 'content' field"),
        (
            '{"messages": [{"role": "user", "content": 5}]}',
            "bad.jsonl:2: messages[0].content must be str or a list of text parts, got int",
        ),
        ('{"messages": ["hi"]}', "bad.jsonl:2: messages[0] must be an object with role and content"),
        ('{"prompt": "hi"}', "bad.jsonl:2: record has 'prompt' but no 'response'"),
        ('{"prompt": "hi", "response": 3}', "bad.jsonl:2: field 'response' must be str, got int"),
        ('{"text": null}', "bad.jsonl:2: field 'text' must be str, got NoneType"),
        ('{"question": "hi"}', "bad.jsonl:2: record has none of the fields 'messages', 'conversations'"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, toy_tokenizer, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [chat("a", "b"), line])
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    with pytest.raises(DataError) as e:
        tokenize_source(Source(str(path)), tok, progress=False)
    assert message in str(e.value)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(DataError, match="data source not found"):
        list(iter_records(Source(str(tmp_path / "nope.jsonl"))))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="cannot tell the file type"):
        list(iter_records(Source(str(tmp_path / "data.csv"))))
    with pytest.raises(ValueError, match="give repeat or weight, not both"):
        Source("x.jsonl", repeat=2, weight=1)


# ------------------------------------------------------------------------- tokenization + masks


def test_assistant_turns_are_the_only_targets(tmp_path, toy_tokenizer):
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    conv = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "the quick fox"},
            {"role": "user", "content": "what is packing?"},
            {"role": "assistant", "content": "lazy dog"},
        ]
    }
    path = write_jsonl(tmp_path / "c.jsonl", [conv])
    t = tokenize_source(Source(str(path)), tok, progress=False)
    ids, target = flat_tokens(t)
    supervised = tok.decode(ids[target].tolist())
    assert supervised == "the quick fox<|end|>\nlazy dog<|end|>\n"
    # Reference: the rendered text, and the assistant spans located by hand.
    text = tok.apply_chat_template(conv["messages"], tokenize=False)
    assert tok.decode(ids.tolist()) == text
    assert t.loss_tokens().tolist() == [int(target.sum())]

    everything = tokenize_source(Source(str(path)), tok, train_on="all", progress=False)
    assert flat_tokens(everything)[1].sum() == len(ids) - 1  # all but the first token


def test_text_prompt_response_and_skips(tmp_path, toy_tokenizer):
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    path = write_jsonl(
        tmp_path / "mix.jsonl",
        [
            {"text": "the lazy dog"},
            {"prompt": "hello", "response": "world"},
            {"messages": []},
            {"text": "   "},
            {"messages": [{"role": "user", "content": "no answer"}]},
            chat("fox", "dog"),
        ],
    )
    t = tokenize_source(Source(str(path)), tok, progress=False)
    assert len(t) == 3
    assert t.skipped == {"empty conversation": 2, "no supervised token": 1}
    assert t.skipped_where["no supervised token"] == [f"{path}:5"]
    assert [t.where(i) for i in range(3)] == [f"{path}:1", f"{path}:2", f"{path}:6"]
    text_ids = np.asarray(t.ids[t.offsets[0] : t.offsets[1]])
    assert text_ids[-1] == tok.eos_token_id and tok.decode(text_ids[:-1].tolist()) == "the lazy dog"


def test_a_chat_without_any_template_is_an_error_naming_its_line_and_the_fix(tmp_path):
    from conftest import build_toy_tokenizer

    from lit_hbp.lightning.datamodule import HBPDataModule

    tok = build_toy_tokenizer(tmp_path / "tok", chat_template=None)
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "the lazy dog"}])
    chats = write_jsonl(tmp_path / "c.jsonl", [{"text": "the lazy dog"}, {"messages": []}, chat("hello", "world")])
    kw = dict(tokenizer=str(tok), levels=["64"], cache_dir=str(tmp_path / "cache"))
    dm = HBPDataModule(sources=[{"path": str(text)}], **kw)
    dm.setup("fit")  # plain text needs no template
    assert dm.store.lengths.size == 1 and dm.tokenizer.chat_template is None
    with pytest.raises(DataError) as e:
        HBPDataModule(sources=[{"path": str(chats)}], **kw).setup("fit")
    assert f"{chats}:3: this chat record needs a chat template and the tokenizer has none" in str(e.value)
    assert "set data.chat_template to a Jinja template string, a template file, or a built-in (tags, plain)" in str(
        e.value
    )


TAGS = "<|user|>\nhello<|endoftext|><|assistant|>\nworld<|endoftext|>"  # what the built-in "tags" renders here


@pytest.mark.parametrize("kind", ["name", "string", "file"])
def test_chat_template_option_overrides_the_tokenizers_and_is_saved_with_it(tmp_path, toy_tokenizer, kind):
    from lit_hbp.data.tokenize import CHAT_TEMPLATES
    from lit_hbp.lightning.datamodule import HBPDataModule

    (tmp_path / "t.jinja").write_text(CHAT_TEMPLATES["tags"])
    option = {"name": "tags", "string": CHAT_TEMPLATES["tags"], "file": str(tmp_path / "t.jinja")}[kind]
    path = write_jsonl(tmp_path / "c.jsonl", [chat("hello", "world")])
    dm = HBPDataModule(
        sources=[{"path": str(path)}], tokenizer=toy_tokenizer, levels=["64"], cache_dir=str(tmp_path / "cache"),
        chat_template=option,
    )  # fmt: skip
    assert dm.tokenizer.chat_template == CHAT_TEMPLATES["tags"]  # the toy tokenizer's own is replaced
    dm.setup("fit")
    ids, target = dm.store.tokens(0)
    assert dm.tokenizer.decode(ids.tolist()) == TAGS
    assert dm.tokenizer.decode(ids[target].tolist()) == "world<|endoftext|>"
    dm.tokenizer.save_pretrained(tmp_path / "saved")
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == CHAT_TEMPLATES["tags"]


def test_unknown_chat_template_is_a_short_config_error(tmp_path, toy_tokenizer):
    from lit_hbp.errors import ConfigError
    from lit_hbp.lightning.datamodule import HBPDataModule

    path = str(write_jsonl(tmp_path / "c.jsonl", [chat("hello", "world")]))
    for option in ("chatml", str(tmp_path / "missing.jinja")):
        with pytest.raises(ConfigError, match=r"data.chat_template .* is no built-in template \(tags, plain\)"):
            HBPDataModule(sources=[{"path": path}], tokenizer=toy_tokenizer, levels=["64"], chat_template=option)


@pytest.mark.parametrize("name", ["tags", "plain"])
def test_built_in_templates_are_prefix_stable_and_end_the_answer_with_eos(toy_tokenizer, name):
    from lit_hbp.data.tokenize import CHAT_TEMPLATES

    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": "fox?"},
        {"role": "assistant", "content": "dog"},
    ]

    def render(upto, prompt=False):
        return tok.apply_chat_template(
            msgs[:upto], tokenize=False, add_generation_prompt=prompt, chat_template=CHAT_TEMPLATES[name]
        )

    full = render(5)
    for i in (2, 4):  # each assistant turn: its prompt, then exactly its content and EOS
        assert full.startswith(render(i, True)) and full.startswith(render(i + 1))
        assert render(i + 1)[len(render(i, True)) :] == msgs[i]["content"] + tok.eos_token


def test_cache_follows_the_chat_template_option(tmp_path, toy_tokenizer):
    from lit_hbp.lightning.datamodule import HBPDataModule

    path = write_jsonl(tmp_path / "c.jsonl", [chat("hello", "world")])
    decoded = []
    for option in (None, "tags", "plain"):
        dm = HBPDataModule(
            sources=[{"path": str(path)}], tokenizer=toy_tokenizer, levels=["64"], cache_dir=str(tmp_path / "cache"),
            chat_template=option,
        )  # fmt: skip
        dm.setup("fit")
        decoded.append(dm.tokenizer.decode(dm.store.tokens(0)[0].tolist()))
    assert len(set(decoded)) == 3 and len(caches(tmp_path / "cache")) == 3
    assert decoded[1] == TAGS


def test_cache_is_reused_and_invalidated(tmp_path, toy_tokenizer):
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    path = write_jsonl(tmp_path / "c.jsonl", [chat("hello", "world")] * 3)
    first = tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "cache", progress=False)
    (cache,) = caches(tmp_path / "cache")
    again = tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "cache", progress=False)
    assert not first.from_cache and again.from_cache
    assert isinstance(again.ids, np.memmap) and np.array_equal(again.ids, first.ids)
    write_jsonl(path, [chat("hello", "world")] * 4)  # the file changed: a new cache entry
    changed = tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "cache", progress=False)
    assert len(changed) == 4 and len(caches(tmp_path / "cache")) == 2
    other = tokenize_source(Source(str(path)), tok, "all", cache_dir=tmp_path / "cache", progress=False)
    assert len(caches(tmp_path / "cache")) == 3
    assert flat_tokens(other)[1].sum() > flat_tokens(changed)[1].sum()
    assert cache.exists()


def test_cache_follows_the_tokenizer_pipeline(tmp_path):
    """A change anywhere in the tokenizer (here a lowercasing normalizer) must re-tokenize."""
    from conftest import build_toy_tokenizer
    from tokenizers import normalizers

    path = write_jsonl(tmp_path / "c.jsonl", [chat("Hello", "World")])
    tok = AutoTokenizer.from_pretrained(build_toy_tokenizer(tmp_path / "tok"))
    before = tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "cache", progress=False)
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    after = tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / "cache", progress=False)
    assert len(caches(tmp_path / "cache")) == 2
    assert not np.array_equal(np.asarray(before.ids), np.asarray(after.ids))


def test_parquet_and_hf_disk_sources(tmp_path, toy_tokenizer):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    rows = [{"prompt": "hello", "response": "world"}, {"prompt": "fox", "response": "dog"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "hf"))
    a = tokenize_source(Source(str(tmp_path / "d.parquet")), tok, progress=False)
    b = tokenize_source(Source(str(tmp_path / "hf")), tok, progress=False)
    assert np.array_equal(a.ids, b.ids) and len(a) == 2
    assert a.where(1) == f"{tmp_path / 'd.parquet'}:row 2"
    with pytest.raises(DataError, match="split 'test' not found"):
        tokenize_source(Source(str(tmp_path / "hf"), split="test"), tok, progress=False)


@pytest.mark.parametrize("fmt", ["numpy", "torch", "pandas", "arrow"])
def test_a_disk_data_set_saved_with_a_format_reads_as_the_plain_one(tmp_path, toy_tokenizer, fmt):
    """``load_from_disk`` restores the format ``save_to_disk`` kept: rows arrived as arrays, so TRL's per-token
    ``completion_mask`` passed as metadata (every token trained, silent), chats were refused as not a list, and
    pandas / arrow rows raised. Reference: the same rows saved without a format (records and refusals alike)."""
    import datasets

    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    ids = tok("hello world the quick fox")["input_ids"]
    sets = {
        "tokens": {"input_ids": [ids, ids[:4]], "labels": [[-100, -100] + ids[2:], [-100, *ids[1:4]]]},
        "chats": {"messages": [chat("hello", "world")["messages"], chat("fox", "dog")["messages"]]},
        "completion_mask": {
            "input_ids": [ids, ids[:4]],
            "completion_mask": [[0, 0] + [1] * (len(ids) - 2), [0, 1, 1, 1]],
        },
    }
    for name, rows in sets.items():
        results = []
        for f in (None, fmt):
            data = datasets.Dataset.from_dict(rows)
            folder = tmp_path / f"{name}_{f}"
            (data.with_format(f) if f else data).save_to_disk(str(folder))
            try:
                got = tokenize_source(
                    Source(str(folder)), tok, cache_dir=tmp_path / "cache", progress=False, num_proc=1
                )
                results.append((np.asarray(got.ids).tolist(), [got.sample(i)[1].tolist() for i in range(len(got))]))
            except DataError as e:
                results.append(str(e).split(": ", 1)[1])  # the refusal, without the folder's name
        assert results[0] == results[1], name
    assert "has a value per token" in results[0]


# ----------------------------------------------------------------------------- mixing, lengths


def tokenized(tmp_path, tok, name, records, **source_kw):
    return tokenize_source(Source(str(write_jsonl(tmp_path / name, records)), **source_kw), tok, progress=False)


def test_mixing_by_repeat_and_weight(tmp_path, toy_tokenizer):
    assert mixture_repeats([100, 10], [None, 3.0], [None, None]) == [1.0, 3.0]
    assert mixture_repeats([100, 10], [None, None], [1.0, 1.0]) == pytest.approx([0.55, 5.5])
    # a weighted source all of whose records were skipped would leave half of the other out of every epoch
    with pytest.raises(ConfigError, match=r"data.sources\[1\] has weight 0.5 but no sample"):
        mixture_repeats([10, 0], [None, None], [0.5, 0.5])
    assert mixture_repeats([10, 0], [None, None], [1.0, 0.0]) == [1.0, 0.0]  # weight 0: left out, as asked
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    a = tokenized(tmp_path, tok, "a.jsonl", [chat(f"hello {i}", "world") for i in range(10)])
    b = tokenized(tmp_path, tok, "b.jsonl", [chat("fox", "dog " * i) for i in range(1, 5)], repeat=2.5)
    store = SampleStore.build([a, b], max_len=10_000)
    assert store.lengths.size == 10 + 10
    assert np.bincount(store.row_of[store.source_of == 1], minlength=4).tolist().count(3) == 2  # 2 of 4 thrice
    assert store.report["sources"][1]["in_epoch"] == 10
    # A repeat that rounds to no sample drops the source from every epoch: refused, naming it (it read "no
    # training samples: every source is empty or was skipped" when it was the only one, nothing otherwise)
    c = tokenized(tmp_path, tok, "c.jsonl", [chat("fox", "dog")] * 4, repeat=0.1)
    with pytest.raises(ValueError, match=r"sources\[1\] \(.*c.jsonl\): its repeat 0.1 takes 0.4 of its 4 samples .* "
                       r"rounds to none: it needs a repeat of at least 0.125"):  # fmt: skip
        SampleStore.build([a, c], max_len=10_000)


def test_weights_keep_the_epochs_total_sample_count_exactly(tmp_path, toy_tokenizer):
    """Weights 1:2:1 over 7 + 8 + 7 samples share 22 as 5.5 / 11 / 5.5: each source's share was rounded alone (to
    6 / 11 / 6, half to even on the repeat's fraction: 23 samples, not the total the docs promise). Now each share
    is a whole count within one sample of its own and the counts add up to the total."""
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    sizes, weights = (7, 8, 7), (1.0, 2.0, 1.0)
    sources = [
        tokenized(tmp_path, tok, f"{k}.jsonl", [chat(f"q {k} {i}", "a") for i in range(n)], weight=w)
        for k, (n, w) in enumerate(zip(sizes, weights))
    ]
    for seed in range(3):
        store = SampleStore.build(sources, max_len=10_000, seed=seed)
        counts = np.bincount(store.source_of, minlength=3)
        assert counts.sum() == sum(sizes) and [m["in_epoch"] for m in store.report["sources"]] == counts.tolist()
        shares = np.asarray(weights) / sum(weights) * sum(sizes)
        assert np.all(np.abs(counts - shares) < 1), counts
    tiny = tokenized(tmp_path, tok, "tiny.jsonl", [chat("q tiny", "a")], weight=0.01)
    with pytest.raises(ConfigError, match=r"sources\[3\] \(.*tiny.jsonl\): its weight 0.01 shares 0.0574 of the "
                       r"epoch's samples, which the apportionment to whole samples rounds to none"):  # fmt: skip
        SampleStore.build([*sources, tiny], max_len=10_000)
    rng = np.random.default_rng(0)
    for _ in range(200):  # the repeat factors turn back into those whole counts in the build's arithmetic
        n = rng.integers(1, 50, rng.integers(1, 6))
        w = rng.random(n.size) + 0.01
        reps = mixture_repeats(n.tolist(), [None] * n.size, w.tolist())
        counts = [int(r) * k + int(round((r - int(r)) * k)) for r, k in zip(reps, n)]
        assert sum(counts) == n.sum() and np.all(np.abs(np.asarray(counts) - w / w.sum() * n.sum()) < 1)


def test_over_length_error_drop_truncate_name_the_samples(tmp_path, toy_tokenizer):
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    long_answer = chat("hello", "the quick brown fox " * 40)
    long_prompt = chat("the lazy dog " * 40, "fox")
    src = tokenized(tmp_path, tok, "l.jsonl", [chat("a", "b"), long_answer, long_prompt])
    lengths = src.lengths
    limit = int(sorted(lengths)[0]) + 20
    with pytest.raises(ValueError) as e:
        SampleStore.build([src], limit, "error")
    assert f"2 sample(s) longer than the largest level ({limit} tokens): {src.where(1)}" in str(e.value)
    dropped = SampleStore.build([src], limit, "drop")
    assert dropped.lengths.size == 1 and dropped.report["dropped"] == [src.where(1), src.where(2)]
    cut = SampleStore.build([src], limit, "truncate")
    # The long answer keeps its first `limit` tokens (it is supervised throughout, from its start); the
    # long prompt keeps its last ones: the end of the question and the whole answer.
    assert cut.lengths.tolist() == [lengths[0], limit, limit]
    full_ids, full_target = src.sample(1)
    ids, target = cut.tokens(1)
    first = int(np.flatnonzero(full_target)[0])
    assert ids.tolist() == full_ids[first - 1 : first - 1 + limit].tolist()
    assert cut.loss_tokens[1] == target.sum() == target[1:].sum() == limit - 1
    full_ids, full_target = src.sample(2)
    ids, target = cut.tokens(2)
    assert ids.tolist() == full_ids[-limit:].tolist() and target.tolist() == [False, *full_target[-limit + 1 :]]
    assert cut.loss_tokens[2] == full_target.sum() > 0
    assert cut.report["truncated_to_nothing"] == [] and cut.report["truncated"] == [src.where(1), src.where(2)]
    assert [t["kept"] for t in cut.report["truncation"]] == [
        [first - 1, first - 1 + limit],
        [lengths[2] - limit, lengths[2]],
    ]


def test_data_report_lists_every_sample_it_did_not_train(tmp_path, toy_tokenizer):
    from lit_hbp.lightning.datamodule import HBPDataModule

    records = [chat("a", "b")] * 3 + [{"messages": []}] * 7 + [chat("hello", "the quick brown fox " * 40)] * 6
    path = write_jsonl(tmp_path / "d.jsonl", records)
    dm = HBPDataModule(
        sources=[{"path": str(path)}],
        tokenizer=toy_tokenizer,
        levels=["64"],
        over_length="drop",
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup("fit")
    report = json.loads(dm.write_report().read_text())
    assert report["dropped"] == [f"{path}:{line}" for line in range(11, 17)]  # all six, not the first few
    assert report["sources"][0]["skipped_where"]["empty conversation"] == [f"{path}:{line}" for line in range(4, 11)]


def test_per_source_counts_are_those_left_after_the_hold_out_and_over_length(tmp_path, toy_tokenizer):
    from lit_hbp.lightning.datamodule import HBPDataModule

    short = [chat(f"hello {i}", "world") for i in range(20)]
    mixed = [chat(f"fox {i}", "dog " * (3 if i % 3 else 120)) for i in range(9)]  # every third is longer than 96
    a, b = write_jsonl(tmp_path / "a.jsonl", short), write_jsonl(tmp_path / "b.jsonl", mixed)
    dm = HBPDataModule(
        sources=[{"path": str(a)}, {"path": str(b), "repeat": 2}], tokenizer=toy_tokenizer, levels=["96"],
        over_length="drop", cache_dir=str(tmp_path / "cache"), val_fraction=0.25,
    )  # fmt: skip
    dm.setup("fit")
    # Reference: the tokenized sources, and the records held out (those validation kept or dropped as too long).
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    sources = [tokenize_source(Source(str(p)), tok, progress=False) for p in (a, b)]
    report = json.loads(dm.write_report().read_text())
    held = {(int(s), int(r)) for s, r in zip(dm.val_store.source_of, dm.val_store.row_of)}
    held |= {(int(w.startswith(str(b))), int(w.rsplit(":", 1)[1]) - 1) for w in report["validation"]["dropped"]}
    summary = dm.store.summary() + "\n" + dm.val_store.summary()
    for k, repeat in ((0, 1), (1, 2)):
        rows = list(zip(sources[k].lengths.tolist(), sources[k].loss_tokens().tolist()))
        train = [x for r, x in enumerate(rows) if (k, r) not in held and x[0] <= 96]
        val = [x for r, x in enumerate(rows) if (k, r) in held and x[0] <= 96]
        n_held = sum(1 for s, _ in held if s == k)
        assert report["sources"][k]["held_out"] == repeat * n_held
        assert report["sources"][k]["kept"] == dict(
            samples=repeat * len(train),
            tokens=repeat * sum(n for n, _ in train),
            supervised_tokens=repeat * sum(t for _, t in train),
        )
        assert report["validation"]["sources"][k]["selected"] == n_held
        assert report["validation"]["sources"][k]["kept"] == dict(
            samples=len(val), tokens=sum(n for n, _ in val), supervised_tokens=sum(t for _, t in val)
        )
        assert f"-> {repeat * len(train)} samples, {repeat * sum(n for n, _ in train)} tokens" in summary
        assert f"{n_held} of its {len(rows)} records" in summary
    assert report["dropped"] and report["validation"]["dropped"]  # both lose over-length samples here
    assert sum(m["kept"]["samples"] for m in report["sources"]) == dm.store.lengths.size


# ------------------------------------------------------------------------------------ collation


def brute_force_batch(samples, pad_id, multiple):
    ids, labels, pos, cu = [], [], [], [0]
    for s_ids, s_target in samples:
        for t in range(len(s_ids)):
            ids.append(int(s_ids[t]))
            pos.append(t)
            nxt = t + 1
            labels.append(int(s_ids[nxt]) if nxt < len(s_ids) and s_target[nxt] else -100)
        cu.append(len(ids))
    pad = (-len(ids)) % multiple if ids else multiple
    for t in range(pad):
        ids.append(pad_id)
        labels.append(-100)
        pos.append(t)
    if pad:
        cu.append(len(ids))
    return ids, labels, pos, cu


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_collate_matches_brute_force(sp):
    rng = np.random.default_rng(sp)
    samples = {i: (rng.integers(5, 300, n), rng.random(n) < 0.6) for i, n in enumerate(rng.integers(1, 40, 9))}
    packs = [np.array([3, 0, 5]), np.array([8, 1])]
    batch = collate_packs(packs, lambda i: samples[i], sp=sp, pad_id=7, level=2)
    ids, labels, pos, cu = brute_force_batch([samples[i] for i in [3, 0, 5, 8, 1]], 7, 8 * sp // np.gcd(8, sp))
    assert batch.input_ids[0].tolist() == ids
    assert batch.labels[0].tolist() == labels
    assert batch.position_ids[0].tolist() == pos
    assert batch.cu_seqlens.tolist() == cu and batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == max(np.diff(cu))
    assert batch.n_targets == sum(x != -100 for x in labels)
    assert batch.level == 2 and batch.sample_index.tolist() == [3, 0, 5, 8, 1]
    # sample_targets: per token, the number of targets of its sample.
    per_sample = [sum(1 for x in labels[a:b] if x != -100) for a, b in zip(cu[:-1], cu[1:])]
    assert batch.sample_targets[0].tolist() == [
        float(per_sample[k]) for k in range(len(cu) - 1) for _ in range(cu[k + 1] - cu[k])
    ]
    # SP shards are contiguous slices that tile the batch.
    parts = [Ulysses().shard(batch, sp, r) for r in range(sp)]
    assert torch.cat([p.input_ids for p in parts], 1).tolist() == [ids]
    assert all(p.cu_seqlens is batch.cu_seqlens for p in parts)


def test_empty_pack_collates_to_a_dummy_without_targets():
    batch = collate_packs([np.zeros(0, np.int64)], lambda i: None, sp=4, pad_id=0)
    assert batch.input_ids.shape == (1, 8) and batch.n_targets == 0 and batch.n_tokens == 0
    assert (batch.labels == -100).all() and batch.cu_seqlens.tolist() == [0, 8]


def test_weights_whose_shares_an_over_length_drop_moves_are_warned_with_the_shares(tmp_path, toy_tokenizer):
    """The weights share the samples before the over-length ones are dropped: 0.5/0.5 with half of one source too
    long trains 2/3 and 1/3. The warning names the shares asked and those the epoch trains, counted here from the
    records' lengths alone (each fits or not), and the plan's members count as many; a mix the drop leaves
    alone warns nothing."""
    import warnings

    from lit_hbp.lightning.datamodule import HBPDataModule

    a = write_jsonl(tmp_path / "a.jsonl", [chat(f"a{i}", "short") for i in range(40)])
    b = write_jsonl(tmp_path / "b.jsonl", [chat(f"b{i}", "hello world " * (80 if i % 2 else 2)) for i in range(40)])
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    fits = [int((tokenize_source(Source(str(p)), tok, progress=False).lengths <= 128).sum()) for p in (a, b)]
    trained = np.array(fits) / sum(fits)  # each source enters once (equal sizes, equal weights), then the drop
    assert trained[1] < 0.45

    def set_up(b_weight: float, b_path) -> tuple[HBPDataModule, list[str]]:
        dm = HBPDataModule(sources=[{"path": str(a), "weight": 0.5}, {"path": str(b_path), "weight": b_weight}],
                           tokenizer=toy_tokenizer, levels=["128"], over_length="drop",
                           cache_dir=str(tmp_path / "cache"))  # fmt: skip
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            dm.setup("fit")
        return dm, [str(w.message) for w in said if "mixed by weight" in str(w.message)]

    dm, said = set_up(0.5, b)
    counted = np.bincount(dm.store.source_of[dm.plan_for_epoch(0).members], minlength=2)
    assert np.allclose(counted / counted.sum(), trained)
    assert (
        len(said) == 1
        and f"{a}: asked 0.5, trained {trained[0]:.3g}; {b}: asked 0.5, trained {trained[1]:.3g}" in said[0]
    )
    fitting = write_jsonl(tmp_path / "c.jsonl", [chat(f"c{i}", "hello world") for i in range(40)])
    assert set_up(0.5, fitting)[1] == []


def test_a_fractional_repeat_trains_the_same_subset_every_epoch_and_text_gets_special_tokens(tmp_path, toy_tokenizer):
    """What docs/data.md says: ``repeat: 0.5`` draws its half once by the data seed, so epochs 0 and 1 train the
    same records (counted from the plans' members); a ``text`` record is ``tokenizer(text)`` with its special tokens
    and the EOS appended."""
    from lit_hbp.lightning.datamodule import HBPDataModule

    a = write_jsonl(tmp_path / "a.jsonl", [chat(f"a{i}", "short") for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"hello {i} world"} for i in range(20)])
    dm = HBPDataModule(sources=[{"path": str(a)}, {"path": str(b), "repeat": 0.5}], tokenizer=toy_tokenizer,
                       levels=["256"], cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    drawn = []
    for epoch in (0, 1):
        members = dm.plan_for_epoch(epoch).members
        drawn.append(sorted(dm.store.row_of[members][dm.store.source_of[members] == 1].tolist()))
    assert drawn[0] == drawn[1] and len(drawn[0]) == 10 == len(set(drawn[0]))
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    text = tokenize_source(Source(str(b)), tok, progress=False)
    for row in (0, 7):
        want = tok(f"hello {row} world")["input_ids"] + [tok.eos_token_id]
        assert text.sample(row)[0].tolist() == want


def test_a_text_record_that_starts_with_the_tokenizers_bos_keeps_one(tmp_path, toy_tokenizer):
    """A ``{"text"}`` record rendered with ``apply_chat_template(tokenize=False)`` starts with the BOS; a tokenizer
    that prepends its own (Gemma's, Llama's) made it two, the second trained as a target. The reference: the text
    as written, tokenized without the tokenizer's additions. A text without a BOS still gets the tokenizer's."""
    from tokenizers import processors

    from lit_hbp.lightning.datamodule import HBPDataModule

    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    bos = "<|system|>"
    tok.bos_token = bos
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.convert_tokens_to_ids(bos))]
    )
    tok.save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    written, plain = f"{bos}hello world<|endoftext|>", "the lazy dog"
    assert tok(written)["input_ids"][:2] == [tok.bos_token_id] * 2  # the tokenizer's own BOS before the text's
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": written}, {"text": plain}])
    dm = HBPDataModule(sources=[{"path": str(path)}], tokenizer=str(tmp_path / "tok"), levels=["64"],
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    got = sorted((dm.store.tokens(i) for i in range(2)), key=lambda t: len(t[0]))
    want = tok(written, add_special_tokens=False)["input_ids"]
    own = [tok.bos_token_id, *tok(plain, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    by_ids = {tuple(np.asarray(ids).tolist()): np.asarray(mask).tolist() for ids, mask in got}
    assert set(by_ids) == {tuple(want), tuple(own)}, by_ids
    assert by_ids[tuple(want)] == [False] + [True] * (len(want) - 1)


def test_a_pretokenized_records_null_labels_are_refused(tmp_path, toy_tokenizer):
    """``"labels": null`` (or ``assistant_masks``) read as no field, so every token trained without a word."""
    for field in ("labels", "assistant_masks"):
        path = write_jsonl(tmp_path / f"{field}.jsonl", [{"input_ids": [5, 6, 7], field: None}])
        with pytest.raises(DataError, match=rf"{field}.jsonl:1: {field} is null: give it"):
            tokenize_source(Source(str(path)), AutoTokenizer.from_pretrained(toy_tokenizer), progress=False)
