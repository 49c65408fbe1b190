"""Issue 14, "no silent surprises": bad inputs fail with a message that names the problem, and
every count of samples left out says how many distinct records it is and why."""

import json
import os
import re
import types

import numpy as np
import pytest
from conftest import TINY_LLAMA, flat_tokens
from transformers import AutoTokenizer

from lit_hbp.callbacks import PackingMetrics
from lit_hbp.cost.costmodel import CostModel
from lit_hbp.cost.hardware import HARDWARE
from lit_hbp.data import sources as sources_module
from lit_hbp.data.records import RecordReader
from lit_hbp.data.sources import DataError, Source
from lit_hbp.data.store import SampleStore
from lit_hbp.data.tokenize import tokenize_source
from lit_hbp.errors import ConfigError
from lit_hbp.lightning.datamodule import HBPDataModule
from lit_hbp.model_spec import ModelSpec
from lit_hbp.packing import Level, plan_hbp
from lit_hbp.simulate import simulate
from lit_hbp.simulate.__main__ import main as simulate_main
from lit_hbp.simulate.plots import timeline_figure


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(user, assistant, role="assistant"):
    return {"messages": [{"role": "user", "content": user}, {"role": role, "content": assistant}]}


SHORT = chat("a", "b")
LONG_ANSWER = "the quick brown fox " * 40  # well over 64 toy tokens, with supervised tokens up front
LIMIT = 64


@pytest.fixture(scope="module")
def tok(toy_tokenizer):
    return AutoTokenizer.from_pretrained(toy_tokenizer)


# ------------------------------------------------------------------- 1. paths that cannot be read


def test_missing_source_is_a_data_error_naming_the_source_and_the_path(tmp_path, tok, toy_tokenizer):
    good = write_jsonl(tmp_path / "short.jsonl", [SHORT])
    missing = tmp_path / "lnog.jsonl"
    write_jsonl(tmp_path / "long.jsonl", [SHORT])  # the file the typo meant

    # Through the data module: refused when it is configured, naming the entry and the path.
    with pytest.raises(DataError, match=rf"^sources\[1\]: data source not found: {missing}"):
        HBPDataModule(
            sources=[{"path": str(good)}, {"path": str(missing)}],
            tokenizer=toy_tokenizer,
            levels=["64"],
            cache_dir=str(tmp_path / "cache"),
        )

    # The cache key stats the path first: it must not be a raw FileNotFoundError.
    with pytest.raises(DataError) as e:
        tokenize_source(Source(str(missing)), tok, cache_dir=tmp_path / "cache", progress=False, label="sources[1]")
    message = str(e.value)
    assert message.startswith(f"sources[1]: data source not found: {missing}")
    assert message.endswith(f"; did you mean '{tmp_path / 'long.jsonl'}'?")  # not short.jsonl

    with pytest.raises(DataError, match=r"^sources\[1\]: data source not found: .*lnog\.jsonl"):
        sources_module.check_sources([Source(str(good)), Source(str(missing))])

    # A relative path says where it was looked for; a missing folder is named too.
    with pytest.raises(DataError) as e:
        sources_module.check_sources([Source("no_such_dir/d.jsonl")], "val_sources")
    assert str(e.value).startswith("val_sources[0]: data source not found: no_such_dir/d.jsonl (looked for ")
    assert f"{os.getcwd()}/no_such_dir/d.jsonl" in str(e.value)
    assert "its folder no_such_dir does not exist either" in str(e.value)


def test_directory_broken_link_and_unreadable_sources_say_what_is_wrong(tmp_path, tok, monkeypatch):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "chats.jsonl", [SHORT])
    with pytest.raises(DataError, match=f"data source {folder} is a directory, but file_type jsonl reads a file"):
        tokenize_source(Source(str(folder), file_type="jsonl"), tok, progress=False)
    with pytest.raises(ConfigError, match="format 'jsonl' is a file type: write file_type: jsonl"):
        Source(str(folder), format="jsonl")
    with pytest.raises(DataError) as e:
        tokenize_source(Source(str(folder)), tok, cache_dir=tmp_path / "cache", progress=False, label="sources[0]")
    assert str(e.value) == (
        f"sources[0]: data source {folder} is a directory but not a data set saved with datasets.save_to_disk "
        "(it has no dataset_dict.json or state.json): give a .jsonl or .parquet file as the path; "
        "it holds chats.jsonl"
    )
    with pytest.raises(DataError, match="is a file, but file_type hf reads a folder"):
        tokenize_source(Source(str(folder / "chats.jsonl"), file_type="hf"), tok, progress=False)
    # JSON Lines read as a JSON array: the fix named (file_type jsonl, or auto, which reads the first character)
    with pytest.raises(DataError, match=r"file_type json reads a JSON array of records; it starts with '\{': JSON "
                       r"Lines\? set file_type: jsonl"):  # fmt: skip
        tokenize_source(Source(str(folder / "chats.jsonl"), file_type="json"), tok, progress=False)
    json_named = folder / "chats.json"
    json_named.write_text((folder / "chats.jsonl").read_text())
    assert Source(str(json_named)).resolved_file_type == "jsonl"

    link = tmp_path / "gone.jsonl"
    link.symlink_to(tmp_path / "deleted.jsonl")
    with pytest.raises(DataError, match=f"a symbolic link to {tmp_path / 'deleted.jsonl'}, which does not exist"):
        tokenize_source(Source(str(link)), tok, cache_dir=tmp_path / "cache", progress=False)

    locked = write_jsonl(tmp_path / "locked.jsonl", [SHORT])
    locked.chmod(0)
    if os.geteuid() == 0:  # root reads any file: make the permission check see what a user would
        monkeypatch.setattr(sources_module.os, "access", lambda path, mode: False)
    with pytest.raises(DataError, match=rf"^sources\[2\]: data source {locked} cannot be read \(permission denied\)"):
        tokenize_source(Source(str(locked)), tok, progress=False, label="sources[2]")


# ------------------------------------------------------------------------------ 2. unknown roles


def test_unknown_role_names_role_file_line_known_roles_and_closest(tmp_path, tok):
    path = write_jsonl(tmp_path / "c.jsonl", [SHORT, chat("hello", "world", role="assitant")])
    with pytest.raises(DataError) as e:
        tokenize_source(Source(str(path)), tok, progress=False)
    assert str(e.value) == (
        f"{path}:2: messages[1] has unknown role 'assitant': known roles are "
        "system, user, assistant, tool, developer, function, ipython; did you mean 'assistant'?"
    )
    capitalized = {"messages": [{"role": "Usr", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = write_jsonl(tmp_path / "u.jsonl", [capitalized])
    with pytest.raises(DataError, match=f"^{path}:1: messages\\[0\\] has unknown role 'Usr'.*did you mean 'user'"):
        tokenize_source(Source(str(path)), tok, progress=False)
    # The roles accepted before stay accepted, and the assistant turn is still the target.
    ok = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "world"},
        ]
    }
    t = tokenize_source(Source(str(write_jsonl(tmp_path / "ok.jsonl", [ok]))), tok, progress=False)
    ids, target = flat_tokens(t)
    assert len(t) == 1 and tok.decode(ids[target].tolist()) == "world<|end|>\n"


def test_a_key_given_twice_in_a_record_is_refused_with_its_file_line_and_key(tmp_path, tok):
    """JSON keeps a duplicated key's last value: the record's first ``messages`` (or a message's first content)
    was dropped without a word. Refused in JSON Lines and in a JSON array, at any depth."""
    twice = '{"messages": [{"role": "user", "content": "a"}], "messages": [{"role": "user", "content": "b"}]}'
    lines = tmp_path / "twice.jsonl"
    lines.write_text(json.dumps(SHORT) + "\n" + twice + "\n")
    with pytest.raises(DataError, match=f"^{lines}:2: the key 'messages' appears twice in one object"):
        tokenize_source(Source(str(lines)), tok, progress=False)
    inner = '{"messages": [{"role": "user", "content": "a", "content": "b"}, {"role": "assistant", "content": "c"}]}'
    array = tmp_path / "twice.json"
    array.write_text("[\n" + json.dumps(SHORT) + ",\n" + inner + "\n]\n")
    with pytest.raises(DataError, match=f"^{array}:row 2 \\(line 3\\): the key 'content' appears twice"):
        tokenize_source(Source(str(array)), tok, progress=False)


def test_a_role_of_a_templates_own_is_said_once_per_role_by_each_reader():
    """A role of some templates' own, far from every known one: kept, said once per role by each reader
    (a source's), whatever another reader said before, not supervised."""
    import warnings

    other = {"messages": [{"role": "user", "content": "hi"}, {"role": "critic", "content": "x"}]}
    reader = RecordReader()
    with pytest.warns(UserWarning, match=r"^o.jsonl:1: messages\[1\]: role 'critic' is none of system, user"):
        reader.read(other, "o.jsonl:1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said already by this reader: no second warning
        reader.read(other, "o.jsonl:2")
    judge = {"messages": [{"role": "user", "content": "hi"}, {"role": "judge", "content": "x"}]}
    with pytest.warns(UserWarning, match=r"^o.jsonl:3: messages\[1\]: role 'judge' is none of system, user"):
        reader.read(judge, "o.jsonl:3")
    with pytest.warns(UserWarning, match=r"^p.jsonl:1: messages\[1\]: role 'critic'"):  # another source's reader
        RecordReader().read(other, "p.jsonl:1")


# ----------------------------------------------------------------- 3. occurrences beside records

# Hand-counted reference: a.jsonl (repeat 2) has 4 distinct long records and one empty one, b.jsonl
# (once) 1 long record: 4 * 2 + 1 = 9 over-length samples in the epoch, 5 distinct records.
A_RECORDS = [SHORT, *(chat("hello", f"{w} " + LONG_ANSWER) for w in ("one", "two", "three", "four")), {"messages": []}]
B_RECORDS = [SHORT, chat("fox", LONG_ANSWER)]
A_LONG_LINES, B_LONG_LINES = [2, 3, 4, 5], [2]


def two_sources(tmp_path, tok):
    a = tokenize_source(Source(str(write_jsonl(tmp_path / "a.jsonl", A_RECORDS)), repeat=2), tok, progress=False)
    b = tokenize_source(Source(str(write_jsonl(tmp_path / "b.jsonl", B_RECORDS))), tok, progress=False)
    assert a.lengths.tolist()[0] <= LIMIT < min(a.lengths.tolist()[1:])  # the premise of the counts
    assert b.lengths.tolist()[0] <= LIMIT < b.lengths.tolist()[1]
    return a, b


def test_store_counts_dropped_and_truncated_as_occurrences_and_distinct_records(tmp_path, tok):
    a, b = two_sources(tmp_path, tok)
    expected = [f"{tmp_path / 'a.jsonl'}:{n}" for n in A_LONG_LINES] * 2 + [
        f"{tmp_path / 'b.jsonl'}:{n}" for n in B_LONG_LINES
    ]
    dropped = SampleStore.build([a, b], LIMIT, "drop")
    assert sorted(dropped.report["dropped"]) == sorted(expected)  # unchanged key: every occurrence
    assert dropped.report["dropped_distinct"] == 5
    summary = dropped.summary()
    assert f"9 sample(s) (5 distinct records, repeated in the epoch) dropped as longer than {LIMIT} tokens" in summary
    assert "skipped 1 distinct record(s) of the file (1 empty conversation)" in summary

    cut = SampleStore.build([a, b], LIMIT, "truncate")
    assert len(cut.report["truncated"]) == 9 and cut.report["truncated_distinct"] == 5
    assert cut.report["truncated_to_nothing_distinct"] == 0
    assert f"9 sample(s) (5 distinct records, repeated in the epoch) truncated to {LIMIT} tokens" in cut.summary()

    with pytest.raises(ValueError, match=r"; 9 sample\(s\) \(5 distinct records, repeated in the epoch\) in all\."):
        SampleStore.build([a, b], LIMIT, "error")


def datamodule(tmp_path, toy_tokenizer):
    write_jsonl(tmp_path / "a.jsonl", A_RECORDS)
    write_jsonl(tmp_path / "b.jsonl", B_RECORDS)
    dm = HBPDataModule(
        sources=[{"path": str(tmp_path / "a.jsonl"), "repeat": 2}, {"path": str(tmp_path / "b.jsonl")}],
        tokenizer=toy_tokenizer,
        levels=[str(LIMIT)],
        over_length="drop",
        cache_dir=str(tmp_path / "cache"),
    )
    dm.setup("fit")
    return dm


def test_data_report_json_has_distinct_counts_beside_the_lists(tmp_path, toy_tokenizer):
    report = json.loads(datamodule(tmp_path, toy_tokenizer).write_report().read_text())
    assert len(report["dropped"]) == 9 and report["dropped_distinct"] == 5
    assert report["truncated"] == [] and report["truncated_distinct"] == 0


# ------------------------------------------------------------------ 4. TensorBoard keys agree


class RecordingLogger:
    def __init__(self):
        self.metrics = {}

    def log_metrics(self, metrics, step):
        self.metrics.update(metrics)


def test_packing_and_data_drop_keys_agree(tmp_path, toy_tokenizer):
    dm = datamodule(tmp_path, toy_tokenizer)
    logger = RecordingLogger()
    trainer = types.SimpleNamespace(datamodule=dm, loggers=[logger], global_step=0, current_epoch=0)
    PackingMetrics().on_train_epoch_start(trainer, None)
    m = logger.metrics
    assert m["packing/dropped"] == m["data/dropped"] == 9.0
    assert m["data/dropped_distinct"] == 5.0
    assert m["packing/truncated"] == m["data/truncated"] == 0.0


def test_packing_dropped_counts_the_planners_drops_too():
    """A data module with a plan only (no store): the planner's own drops, as before."""
    plan = plan_hbp(np.r_[np.full(20, 100), [5000, 6000]], [Level(512), Level(1024)], 1, over_length="drop")
    logger = RecordingLogger()
    trainer = types.SimpleNamespace(
        datamodule=types.SimpleNamespace(plan=plan), loggers=[logger], global_step=0, current_epoch=0
    )
    PackingMetrics().on_train_epoch_start(trainer, None)
    assert logger.metrics["packing/dropped"] == 2.0 and "data/dropped" not in logger.metrics


# ---------------------------------------------------------------- 5. the simulator says what it drops


def test_simulate_command_says_how_many_samples_it_drops_and_why(tmp_path, capsys):
    lengths = np.r_[np.full(300, 200), [3000, 3000, 4000, 3000], np.full(100, 900)]
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths)) + "\n")
    code = simulate_main(
        [str(path), "--model", "llama3.1-8b", "--gpus", "2", "--levels", "1024:1:0", "2048:2:0", "--no-auto"]
    )
    assert code == 0
    out = capsys.readouterr().out
    # Reference by hand: four entries above 2048 tokens, of two distinct lengths, 13000 tokens.
    assert (
        "dropped 4 of 404 samples (2 distinct lengths; 13,000 tokens, the longest 4,000): longer than the "
        "largest level (2,048 tokens), so no plan below trains them" in out
    )
    assert "(simulated with the cost model)" in out


# ------------------------------------------------------------------ 6. simulated figures say so


def one_line(text: str) -> str:
    """A figure's title as read: its lines (wrapped to the figure's width) joined."""
    return " ".join(text.split())


def test_timeline_figures_say_simulated_and_name_the_modelled_gpu():
    lengths = np.random.default_rng(0).integers(10, 1000, 300)
    plan = plan_hbp(lengths, [Level(512), Level(1024)], 2, seed=0)
    spec = ModelSpec("tiny", layers=2, hidden=256, heads=4, kv_heads=4, intermediate=512, vocab=1000)
    fig = timeline_figure([simulate(plan, CostModel(spec, HARDWARE["h100"], 2), "HBP")])
    assert "simulated on 2 x H100-80GB (cost model, not measured)" in one_line(fig._suptitle.get_text())
    (ax,) = [ax for ax in fig.axes if ax.containers]
    assert "simulated epoch " in one_line(ax.get_title()) and ax.get_xlabel().startswith("simulated time (")

    from transformers import LlamaConfig

    module = types.SimpleNamespace(model=types.SimpleNamespace(config=LlamaConfig(**TINY_LLAMA, vocab_size=400)))
    fig = PackingMetrics(figures=True, hardware="h100")._timeline(module, plan)
    (ax,) = [ax for ax in fig.axes if ax.containers]
    assert "this epoch's plan, simulated on 2 x H100-80GB (cost model)" in one_line(ax.get_title())
    assert "this run" not in one_line(ax.get_title() + " " + fig._suptitle.get_text())


def test_a_misspelled_source_field_names_the_entry_the_field_and_the_nearest_one(tmp_path):
    from lit_hbp.data.sources import DataError, Source

    with pytest.raises(DataError, match=r"sources\[1\]: unknown source field 'repet' \(did you mean 'repeat'\?\)"):
        [Source.of(e, f"sources[{i}]") for i, e in enumerate([{"path": "a.jsonl"}, {"path": "b.jsonl", "repet": 2}])]
    with pytest.raises(DataError, match=r"val_sources\[0\]: the source has no path"):
        Source.of({"repeat": 2}, "val_sources[0]")
    import yaml  # what YAML makes of --data.sources '[{path:chats.jsonl}]': one key holding the colon

    entry = yaml.safe_load("[{path:chats.jsonl}]")[0]
    with pytest.raises(DataError, match=r"'path:chats.jsonl' \(YAML needs a space after the colon: path: chats"):
        Source.of(entry, "sources[0]")
    assert Source.of("a.jsonl", "sources[0]") == Source("a.jsonl")
    assert Source.of({"path": "a.jsonl", "repeat": 2}, "sources[0]").repeat == 2


def test_a_source_given_twice_or_validated_on_what_trains_is_refused(tmp_path, toy_tokenizer):
    """The same file twice (or through a link) would enter an epoch twice and train the records held out of
    one copy for validation through the other; a validation source reading a training source's file would
    measure what trains. Both refused when the data module is configured, naming the two entries."""
    from lit_hbp.data.sources import check_sources

    data = write_jsonl(tmp_path / "d.jsonl", [chat(f"q{i}", "a") for i in range(20)])
    link = tmp_path / "link.jsonl"
    link.symlink_to(data)
    other = write_jsonl(tmp_path / "e.jsonl", [chat(f"r{i}", "b") for i in range(20)])
    for twice in ([data, data], [data, link]):
        with pytest.raises(DataError, match=r"sources\[1\] reads the same data as sources\[0\] .*\(repeat: 2"):
            HBPDataModule(sources=[str(p) for p in twice], tokenizer=toy_tokenizer, levels=[256], val_fraction=0.2)
    with pytest.raises(DataError, match=r"val_sources\[0\] reads the data of sources\[0\] .*, which trains"):
        HBPDataModule(sources=[str(data)], val_sources=[str(link)], tokenizer=toy_tokenizer, levels=[256])
    check_sources([Source(str(data)), Source(str(other))])  # two files: two sources
    check_sources([Source(str(other))], "val_sources", apart=[Source(str(data))])
    # A saved DatasetDict read without a split reads its train split: given again with split train, twice.
    import datasets

    saved = tmp_path / "saved"
    rows = {name: datasets.Dataset.from_list([chat(f"{name}{i}", "a") for i in range(3)]) for name in ("train", "test")}
    datasets.DatasetDict(rows).save_to_disk(str(saved))
    with pytest.raises(DataError, match=r"sources\[1\] reads the same data as sources\[0\] "):
        check_sources([Source(str(saved)), Source(str(saved), split="train")])
    with pytest.raises(DataError, match=r"val_sources\[0\] reads the data of sources\[0\] .*, which trains"):
        check_sources([Source(str(saved), split="train")], "val_sources", apart=[Source(str(saved))])
    check_sources([Source(str(saved)), Source(str(saved), split="test")])  # two splits: two sources


def test_a_split_of_a_saved_data_set_without_splits_is_refused(tmp_path):
    import datasets

    from lit_hbp.data.sources import iter_records

    datasets.Dataset.from_list([chat("q", "a")]).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(DataError, match=r"split 'test', but this folder holds one data set .*: drop split"):
        list(iter_records(Source(str(tmp_path / "one"), split="test")))
    assert len(list(iter_records(Source(str(tmp_path / "one"))))) == 1


def test_fields_that_would_change_training_are_refused_not_kept_as_metadata():
    """Pre-tokenized records' loss masks and positions (pre-packed documents), an instruction's history in a
    format without one, and a record holding two formats' training fields under ``auto``: refused with the fix.
    A record's other fields stay its metadata (``prompt`` beside ``messages``, as UltraChat has it), and a
    format the source names makes the other format's fields metadata."""
    reader = RecordReader()
    tokens = {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}
    for field in ("loss_mask", "label_mask", "position_ids"):
        with pytest.raises(DataError, match=rf"p.jsonl:1: record field '{field}' is not supported"):
            reader.read({**tokens, field: [0, 1, 1]}, "p.jsonl:1")
    with pytest.raises(DataError, match=r"record field 'history' is not supported \(format prompt_response"):
        reader.read({"prompt": "q", "response": "a", "history": [["q0", "a0"]]}, "p.jsonl:2")
    both = {**chat("q", "a"), "prompt": "q2", "response": "a2"}
    with pytest.raises(DataError, match=r"p.jsonl:3: record holds what two formats train on: openai \(messages\) "
                                        r"and prompt_response \(prompt, response\); .*format: openai"):  # fmt: skip
        reader.read(both, "p.jsonl:3")
    with pytest.raises(DataError, match=r"two formats train on: openai \(messages\) and text \(text\)"):
        reader.read({**chat("q", "a"), "text": "q a"}, "p.jsonl:4")
    _, metadata = reader.read({**chat("q", "a"), "prompt": "q", "prompt_id": "x1"}, "p.jsonl:5")
    assert metadata == ["prompt", "prompt_id"]
    conversation, metadata = RecordReader("openai").read(both, "p.jsonl:3")
    assert conversation.messages[1]["content"] == "a" and metadata == ["prompt", "response"]


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"repeat": "two"}, r"repeat must be a finite number >= 0, got 'two'"),
        ({"repeat": float("inf")}, r"repeat must be a finite number >= 0, got inf"),
        ({"weight": True}, r"weight must be a finite number >= 0, got True"),
        ({"format": "openai", "fields": "dialog"}, r"fields maps the data set's names .* got 'dialog'"),
        ({"format": "text", "roles": {"bot": "assistant"}}, r"format text has none: drop roles"),
    ],
)
def test_source_options_of_the_wrong_kind_are_refused_by_name(entry, message):
    with pytest.raises(ConfigError, match=message):
        Source.of({"path": "a.jsonl", **entry}, "sources[0]")


def test_a_source_of_blank_lines_is_refused_as_an_empty_file_is(tmp_path, tok):
    path = tmp_path / "blank.jsonl"
    path.write_text("\n   \n\n")
    with pytest.raises(DataError, match=r"data source .*blank.jsonl holds no records \(blank lines or no rows\)"):
        tokenize_source(Source(str(path)), tok, progress=False)


def test_a_demo_kind_without_its_folder_is_refused(toy_tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [chat("q", "a")])
    with pytest.raises(ConfigError, match=r"data.demo: video names the demo data.demo_dir builds, and no demo_dir"):
        HBPDataModule(sources=[str(data)], tokenizer=toy_tokenizer, levels=[256], demo="video")


def test_a_data_file_read_as_the_list_of_sources_is_named_whatever_its_records_length():
    """The command line reads a file given to ``--data.sources`` as the list itself: each entry a record's JSON,
    longer than any file name may be (an OSError from the file system asked whether it exists)."""
    record = json.dumps({"messages": [{"role": "user", "content": "word " * 200}]})
    with pytest.raises(DataError, match=r"sources\[0\]: .* is a record, not a path"):
        Source.of(record, "sources[0]")


def test_a_parquet_source_that_is_not_one_is_a_data_error_naming_it(tmp_path, toy_tokenizer):
    """A Parquet file cut short, or a JSONL file given ``file_type: parquet``: pyarrow's ArrowInvalid stopped the run
    on a 40-line traceback naming neither (an Arrow or Hub file_type on the same file was named)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from lit_hbp.data.tokenize import tokenize_source

    rows = [{"prompt": f"q {i}", "response": f"a {i}"} for i in range(200)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "whole.parquet")
    data = (tmp_path / "whole.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    for source in (Source(str(tmp_path / "cut.parquet")), Source(str(tmp_path / "d.jsonl"), file_type="parquet")):
        with pytest.raises(DataError, match=rf"^{re.escape(str(source.local_path))}: not a Parquet file .*file_type"):
            tokenize_source(source, tok, progress=False)
    assert tokenize_source(Source(str(tmp_path / "whole.parquet")), tok, progress=False).where(0).endswith(":row 1")
