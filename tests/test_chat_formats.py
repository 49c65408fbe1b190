"""Chat data as users have it (issue 27): the OpenAI chat format with tools, tool calls, tool results,
content parts and per-message weights; ShareGPT, Alpaca and prompt/response records; JSON array files,
parquet and Hugging Face Hub data sets from the local cache; data sets with their own field and role
names. Every format is checked against an independent rendering: the tokenizer's own
``apply_chat_template(messages, tools=...)`` with its assistant mask (``chat_formats.reference``), on
messages written here by hand in the form chat templates take, through ``lit-hbp preview --json`` and
through a ``Trainer.fit``'s batches."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from chat_formats import build_qwen_tokenizer, reference
from conftest import TINY_LLAMA, console_script, quiet_trainer
from transformers import AutoTokenizer

from lit_hbp.cli.app import main
from lit_hbp.data.records import RecordReader
from lit_hbp.data.sources import Source
from lit_hbp.data.tokenize import tokenize_source
from lit_hbp.errors import DataError
from lit_hbp.lightning.datamodule import HBPDataModule
from lit_hbp.lightning.module import HBPLitModule

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOLS = [{"type": "function", "function": WEATHER}]


def call(name, arguments, **extra):
    """A tool call as chat templates take it (arguments a JSON object, or OpenAI's JSON string as given)."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **extra}


# Each case: (record as the data set holds it, the messages and tools a chat template takes).
OPENAI = [
    (  # tools, a call with content null and OpenAI's string arguments, its result, parts, a weight-0 turn
        {
            "id": "a1",
            "source": "support",
            "tools": TOOLS,
            "messages": [
                {"role": "system", "content": "You are a weather bot."},
                {"role": "user", "content": "What is the weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": '{"temperature": 21}'},
                {
                    "role": "assistant",
                    "weight": 0,
                    "content": [{"type": "text", "text": "It is 21 degrees"}, {"type": "text", "text": " and sunny."}],
                },
                {"role": "user", "content": "And in Rome?"},
                {
                    "role": "assistant",
                    "content": "Let me check.",
                    "tool_calls": [
                        {
                            "id": "c2",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c2", "content": '{"temperature": 25}'},
                {"role": "assistant", "content": "It is 25 degrees in Rome.", "weight": 1},
            ],
        },
        (
            [
                {"role": "system", "content": "You are a weather bot."},
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call("get_weather", '{"city": "Paris"}', id="c1")]},
                {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "c1", "name": "get_weather"},
                {"role": "assistant", "content": "It is 21 degrees and sunny.", "weight": 0},
                {"role": "user", "content": "And in Rome?"},
                {
                    "role": "assistant",
                    "content": "Let me check.",
                    "tool_calls": [call("get_weather", '{"city": "Rome"}', id="c2")],
                },
                {"role": "tool", "content": '{"temperature": 25}', "tool_call_id": "c2"},
                {"role": "assistant", "content": "It is 25 degrees in Rome."},
            ],
            TOOLS,
        ),
    ),
    (  # content "" beside two parallel calls and two results in one turn
        {
            "id": "a2",
            "source": "support",
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "Paris and Rome?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
                    ],
                },
                {"role": "tool", "content": '{"temperature": 21}'},
                {"role": "tool", "content": '{"temperature": 25}'},
                {"role": "assistant", "content": "21 and 25 degrees."},
            ],
        },
        (
            [
                {"role": "user", "content": "Paris and Rome?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [call("get_weather", '{"city": "Paris"}'), call("get_weather", {"city": "Rome"})],
                },
                {"role": "tool", "content": '{"temperature": 21}'},
                {"role": "tool", "content": '{"temperature": 25}'},
                {"role": "assistant", "content": "21 and 25 degrees."},
            ],
            TOOLS,
        ),
    ),
    (  # no tools; ShareGPT's role names inside messages
        {
            "id": "a3",
            "source": "chat",
            "messages": [{"role": "human", "content": "Say hello."}, {"role": "gpt", "content": "Hello there."}],
        },
        ([{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there."}], None),
    ),
]

SHAREGPT = [
    (
        {
            "system": "You are a weather bot.",
            "tools": json.dumps([WEATHER]),  # LLaMA-Factory's form: a JSON string of bare functions
            "conversations": [
                {"from": "human", "value": "Weather in Paris?"},
                {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
                {"from": "observation", "value": '{"temperature": 21}'},
                {"from": "gpt", "value": "It is 21 degrees."},
                {"from": "human", "value": "Thanks!"},
                {"from": "gpt", "value": "You are welcome.", "weight": 0},
            ],
        },
        (
            [
                {"role": "system", "content": "You are a weather bot."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris"})]},
                {"role": "tool", "content": '{"temperature": 21}'},
                {"role": "assistant", "content": "It is 21 degrees."},
                {"role": "user", "content": "Thanks!"},
                {"role": "assistant", "content": "You are welcome.", "weight": 0},
            ],
            TOOLS,
        ),
    ),
    (
        {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi, what is packing?"}]},
        ([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi, what is packing?"}], None),
    ),
]

ALPACA = [
    (
        {
            "instruction": "Summarize the document below.",
            "input": "the quick brown fox",
            "output": "A fox.",
            "system": "Be brief.",
            "history": [["hello", "hi"]],
        },
        (
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "Summarize the document below.\nthe quick brown fox"},
                {"role": "assistant", "content": "A fox."},
            ],
            None,
        ),
    ),
    (
        {"instruction": "What is the weather in Paris?", "input": "", "output": "Sunny."},
        (
            [{"role": "user", "content": "What is the weather in Paris?"}, {"role": "assistant", "content": "Sunny."}],
            None,
        ),
    ),
]

PROMPT_RESPONSE = [
    (
        {"prompt": "What is packing?", "response": "Putting samples together.", "system": "Be brief."},
        (
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is packing?"},
                {"role": "assistant", "content": "Putting samples together."},
            ],
            None,
        ),
    ),
]

MAPPED = [  # a data set with its own names: dialog / speaker / text, roles customer and bot
    (
        {"dialog": [{"speaker": "customer", "text": "Weather in Rome?"}, {"speaker": "bot", "text": "Sunny, 25."}]},
        ([{"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": "Sunny, 25."}], None),
    ),
]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> str:
    return str(build_qwen_tokenizer(tmp_path_factory.mktemp("qwen")))


def write_hub_dataset(hub: Path, name: str, rows: list[dict]) -> Path:
    """A data set as ``hf download --repo-type dataset`` leaves it in the Hugging Face cache."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = hub / f"datasets--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123abcd"
    (snapshot / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), snapshot / "data" / "train-00000-of-00001.parquet")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return snapshot


@pytest.fixture
def every_format(tmp_path, monkeypatch):
    """Sources of every format and file type, and per (source as given, line or row from 1) the
    reference messages and tools."""
    import datasets
    import huggingface_hub.constants
    import pyarrow as pa
    import pyarrow.parquet as pq

    def jsonl(name, cases):
        path = tmp_path / name
        path.write_text("".join(json.dumps(record) + "\n" for record, _ in cases))
        return str(path)

    alpaca = tmp_path / "alpaca.json"  # a JSON array, pretty-printed
    alpaca.write_text(json.dumps([record for record, _ in ALPACA], indent=2))
    pq.write_table(pa.Table.from_pylist([r for r, _ in PROMPT_RESPONSE]), tmp_path / "pr.parquet")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
    write_hub_dataset(
        tmp_path / "hub", "my-org/weather-chats", [{"conversations": r["conversations"]} for r, _ in SHAREGPT[1:]]
    )
    sources = [
        ({"path": jsonl("openai.jsonl", OPENAI)}, OPENAI),
        ({"path": jsonl("sharegpt.jsonl", SHAREGPT), "format": "sharegpt"}, SHAREGPT),
        ({"path": str(alpaca)}, ALPACA),
        ({"path": str(tmp_path / "pr.parquet")}, PROMPT_RESPONSE),
        ({"path": jsonl("mapped.jsonl", MAPPED), "format": "openai",
          "fields": {"messages": "dialog", "role": "speaker", "content": "text"},
          "roles": {"customer": "user", "bot": "assistant"}}, MAPPED),
        ({"path": "my-org/weather-chats", "format": "sharegpt"}, SHAREGPT[1:]),
    ]  # fmt: skip
    expected = {(s["path"], i + 1): ref for s, cases in sources for i, (_, ref) in enumerate(cases)}
    return [s for s, _ in sources], expected


def preview_json(capsys, config: Path, *args: str) -> list[dict]:
    main(["preview", "--config", str(config), "--json", "--n", "100", *args])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def write_config(tmp_path: Path, tokenizer: str, sources: list, levels=(4096,), **data) -> Path:
    config = {
        "model": {"model": TINY_LLAMA},
        "data": {"tokenizer": tokenizer, "sources": sources, "levels": list(levels),
                 "cache_dir": str(tmp_path / "cache"), **data},
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant", "all"])
def test_preview_gives_the_templates_own_tokens_and_trained_turns_for_every_format(
    train_on, qwen, every_format, tmp_path, capsys
):
    """The bar: ``lit-hbp preview --json`` of records of every format equals the tokenizer's own
    ``apply_chat_template(messages, tools=...)``, supervised exactly on the trained turns (tool calls
    included; weight-0 turns and every system, user and tool token excluded with ``assistant``)."""
    sources, expected = every_format
    tok = AutoTokenizer.from_pretrained(qwen)
    got = preview_json(capsys, write_config(tmp_path, qwen, sources, train_on=train_on))
    references = {key: reference(tok, *ref, train_on) for key, ref in expected.items()}
    # Every record, but one whose trained turns are all weight 0 (ShareGPT's first with last_assistant).
    trains = [key for key, (_, supervised) in references.items() if any(supervised)]
    assert [(g["source"], g["line"]) for g in got] == trains and len(trains) >= len(expected) - 1
    for g in got:
        ids, supervised = references[(g["source"], g["line"])]
        assert g["input_ids"] == ids, (g["source"], g["line"])
        assert g["supervised"] == supervised, (
            g["source"],
            g["line"],
            tok.decode(np.array(ids)[np.array(supervised, bool)]),
        )
    if train_on == "assistant":  # a tool call is trained as the assistant's output, its result is not
        first = got[0]
        trained = tok.decode([i for i, s in zip(first["input_ids"], first["supervised"]) if s])
        # OpenAI's string arguments as apply_chat_template renders them: this template's tojson quotes a string
        assert '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>' in trained
        assert "temperature" not in trained and "21 degrees and sunny" not in trained


def test_a_fit_trains_exactly_the_reference_tokens(qwen, every_format, tmp_path):
    """Through ``Trainer.fit``: every packed sample's ids and next-token labels equal the reference
    rendering and mask of its record (labels are pre-shifted: position t predicts t + 1)."""
    sources, expected = every_format
    tok = AutoTokenizer.from_pretrained(qwen)
    dm = HBPDataModule(sources=sources, tokenizer=qwen, levels=["512", "2048"], cache_dir=str(tmp_path / "cache"))
    module = HBPLitModule(model=TINY_LLAMA, vocab_size=dm.vocab_size, self_check=False)
    seen = {}

    class Batches(__import__("lightning").Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            cu, ids, labels = batch.cu_seqlens.tolist(), batch.input_ids[0].tolist(), batch.labels[0].tolist()
            for k, sample in enumerate(batch.sample_index.tolist()):
                a, b = cu[k], cu[k + 1]
                trained = [0] + [int(labels[t - 1] != -100) for t in range(a + 1, b)]
                assert all(labels[t - 1] in (-100, ids[t]) for t in range(a + 1, b))
                seen[dm.store.where(sample)] = (ids[a:b], trained)

    quiet_trainer(max_epochs=1, callbacks=[Batches()]).fit(module, dm)
    assert len(seen) == len(expected)
    for (source, line), (messages, tools) in expected.items():
        where = f"{source}:{line}" if source.endswith(".jsonl") else f"{source}:row {line}"
        assert seen[where] == reference(tok, messages, tools), where


def test_metadata_fields_are_listed_once_per_source_in_the_report(qwen, every_format, tmp_path):
    sources, _ = every_format
    dm = HBPDataModule(sources=sources[:2], tokenizer=qwen, levels=["4096"], cache_dir=str(tmp_path / "cache"))
    dm.setup("fit")
    report = json.loads(dm.write_report().read_text())
    assert [s["metadata_fields"] for s in report["sources"]] == [{"id": 3, "source": 3}, {}]
    assert "record fields read as metadata, not trained on: id (3), source (3)" in dm.store.summary()


def test_truncation_keeps_the_answer_of_a_long_document_question(qwen, tmp_path, capsys):
    """The bar: a 3,000-token document-question-answer record, levels up to 1,024, ``over_length:
    truncate``: the sample fits, its answer is still supervised (the document's start is cut)."""
    tok = AutoTokenizer.from_pretrained(qwen)
    document = " ".join(["the quick brown fox jumps over the lazy dog"] * 400)
    messages = [
        {"role": "user", "content": f"{document}\n\nSummarize the document below. What does the fox do?"},
        {"role": "assistant", "content": "It jumps over the lazy dog."},
    ]
    ids, supervised = reference(tok, messages)
    assert len(ids) > 3000
    path = tmp_path / "doc.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    config = write_config(tmp_path, qwen, [{"path": str(path)}], levels=(512, 1024), over_length="truncate")
    (got,) = preview_json(capsys, config)
    assert got["input_ids"] == ids[-1024:] and got["supervised"] == [0, *supervised[-1023:]]
    assert sum(got["supervised"]) == sum(supervised) > 5
    dm = HBPDataModule(sources=[str(path)], tokenizer=qwen, levels=["512", "1024"], over_length="truncate",
                       cache_dir=str(tmp_path / "cache"))  # fmt: skip
    dm.setup("fit")
    (cut,) = json.loads(dm.write_report().read_text())["truncation"]
    assert cut == dict(sample=f"{path}:1", tokens=len(ids), kept=[len(ids) - 1024, len(ids)],
                       supervised=sum(supervised), supervised_kept=sum(supervised))  # fmt: skip


def test_text_preview_marks_the_trained_tokens(qwen, every_format, tmp_path, capsys):
    sources, _ = every_format
    main(["preview", "--config", str(write_config(tmp_path, qwen, sources[:1])), "--n", "1"])
    out = capsys.readouterr().out
    assert "openai.jsonl:1: " in out and "supervised tokens (what the loss trains on) are shown between ⟦ and ⟧" in out
    assert '<|im_start|>assistant\n⟦<tool_call>\n{"name": "get_weather"' in out
    assert (
        "⟦It is 25 degrees in Rome.<|im_end|>\n⟧" in out
        and "It is 21 degrees and sunny.<|im_end|>\n<|im_start|>" in out
    )


# ------------------------------------------------------------------------------------- refusals

REFUSED = {
    "image part": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                   {"type": "image_url", "image_url": {"url": "x.png"}}]},
                      {"role": "assistant", "content": "A cat."}]},
        r"the record has 1 image\(s\) and the tokenizer folder has no processor for them",  # a text-only model's
    ),
    "unknown message field": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "wieght": 0}]},
        r"messages\[1\] has field 'wieght', which lit-hbp does not read; did you mean 'weight'\?",
    ),
    "weight not 0 or 1": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "weight": 0.5}]},
        r"messages\[1\].weight must be 0 or 1 \(whether the turn trains\), got 0.5",
    ),
    "null user content": (
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "yo"}]},
        r"messages\[0\].content is null; only an assistant message with tool_calls may have no content",
    ),
    "unread record field": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "tool": TOOLS},
        r"record field 'tool' is not read by format openai: did you mean 'tools'\?",
    ),
    "record images": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "images": ["a.png"]},
        r"1 image\(s\) in 'images' but 0 <image> marker\(s\) in the text",
    ),
    "reasoning the template drops": (
        {"messages": [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "yo", "reasoning_content": "The user greets me."}]},
        r"messages\[1\].reasoning_content: the chat template does not render it",
    ),
    "malformed arguments": (
        {"messages": [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"type": "function", "function": {"name": "f", "arguments": "{city: Paris}"}}]}]},
        r"messages\[1\].tool_calls\[0\].function.arguments is not valid JSON",
    ),
    "legacy function definitions": (  # OpenAI's functions beside a function_call: the call would train without them
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
         "functions": [{"name": "f", "parameters": {"type": "object", "properties": {}}}]},
        r"record field 'functions' is not supported .*give the definitions as tools",
    ),
    "a mask of trained tokens under TRL's name": (  # every token, the prompt too, would train
        {"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]},
        r"record field 'completion_mask' has a value per token, .*fields: \{assistant_masks: completion_mask\}",
    ),
    "a function call turn of no call": (
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "[]"}]},
        r"conversations\[1\].value is an empty list: a function call turn holds a call",
    ),
    "unknown ShareGPT role": (
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "chatgpt", "value": "yo"}]},
        r"conversations\[1\] is from 'chatgpt', which is no ShareGPT role .*roles: \{chatgpt: assistant\}",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "fields, record, field",
    [
        ({"tools": "functions"}, {"messages": [], "tools": TOOLS}, "tools"),
        ({"system": "sys_prompt"}, {"messages": [], "system": "Be brief."}, "system"),
    ],
)
def test_a_field_renamed_to_a_name_the_record_lacks_is_refused_not_filed_as_metadata(fields, record, field):
    """``fields`` renames a field to a name this record has not, while it holds the field under its own name: the
    mapping would do nothing and the record's tools or system prompt would go untrained, as metadata."""
    from lit_hbp.data.records import RecordReader

    with pytest.raises(DataError, match=f"d.jsonl:1: record field '{field}' is not read: fields renames {field} to"):
        RecordReader("openai", fields).read(record, "d.jsonl:1")
    renamed = {fields[field]: record[field], "messages": [{"role": "user", "content": "hi"}]}
    conversation, metadata = RecordReader("openai", fields).read(renamed, "d.jsonl:1")
    assert metadata == [] and (conversation.tools or conversation.messages[0]["role"] == "system")


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_would_train_wrong_is_refused_with_file_line_and_exit_status_2(case, qwen, tmp_path, capsys):
    record, message = REFUSED[case]
    path = tmp_path / "d.jsonl"
    good = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(SystemExit) as stop:
        main(["preview", "--config", str(write_config(tmp_path, qwen, [{"path": str(path)}]))])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    import re

    assert re.search(f"error: {re.escape(str(path))}:2: {message}", err), err


def test_a_template_that_cannot_render_tools_or_tool_calls_is_refused(toy_tokenizer, tmp_path):
    """The toy template renders role and content only: a record's tools or an assistant's tool calls
    would silently vanish from what the model sees."""
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    tools = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "tools": TOOLS}
    calls = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}]}  # fmt: skip
    cases = [
        (tools, r"d.jsonl:1: tools: the chat template does not render tools"),
        (calls, r"d.jsonl:1: messages\[1\].tool_calls: the chat template does not render it"),
    ]
    for record, message in cases:
        path = tmp_path / "d.jsonl"
        path.write_text(json.dumps(record) + "\n")
        with pytest.raises(DataError, match=message):
            tokenize_source(Source(str(path)), tok, progress=False)


def test_config_mistakes_in_a_source_are_short_errors(qwen, tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                "sys": "Be brief."}))  # fmt: skip
    cases = {
        "sharegtp": ({"format": "sharegtp"}, "format 'sharegtp' is not a record format (did you mean 'sharegpt'?)"),
        "file type": ({"format": "jsonl"}, "format 'jsonl' is a file type: write file_type: jsonl"),
        "fields without format": ({"fields": {"messages": "dialog"}}, "give the source's format too"),
        "unknown field name": (
            {"format": "sharegpt", "fields": {"conversation": "c"}},
            "fields: 'conversation' is no field of format sharegpt (did you mean 'conversations'?)",
        ),
        "role target": ({"roles": {"bot": "assistent"}}, "roles: 'bot' maps to 'assistent', which is no chat role"),
        "role no record has": ({"roles": {"bot": "assistant"}}, "roles maps 'bot', a role no record has"),
        "field no record has": (  # the records' own system prompt would have gone untrained, as metadata
            {"format": "openai", "fields": {"system": "instructions"}},
            "fields renames system to 'instructions', a field no record has (the fields its records have and "
            "lit-hbp does not read: sys): fix the name or drop it from fields",
        ),
        "message field no message has": (
            {"format": "openai", "fields": {"weight": "train"}},
            "fields renames weight to 'train', a field no record has",
        ),
    }
    for name, (source, message) in cases.items():
        with pytest.raises(SystemExit) as stop:
            main(["preview", "--config", str(write_config(tmp_path, qwen, [{"path": str(path), **source}]))])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and "Traceback" not in err, (name, err)


def test_fields_naming_a_message_field_some_records_have_is_read(qwen, tmp_path):
    """A renamed message field is checked over the whole source: one turn of one record having it is enough."""
    path = tmp_path / "d.jsonl"
    turns = [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]
    records = [{"conversations": turns}, {"conversations": [*turns[:1], {**turns[1], "train": 0}, *turns]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = AutoTokenizer.from_pretrained(qwen)
    t = tokenize_source(Source(str(path), format="sharegpt", fields={"weight": "train"}), tok, progress=False)
    assert int(t.sample(0)[1].sum()) > 0 and int(t.sample(1)[1].sum()) == int(t.sample(0)[1].sum())


def test_a_hub_data_set_missing_from_the_cache_names_where_it_looked(qwen, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        HBPDataModule(sources=["my-org/no-such-set"], tokenizer=qwen, levels=["512"])
    assert str(e.value).startswith("sources[0]: data source 'my-org/no-such-set' is neither a file or folder here")
    assert f"looked for {tmp_path / 'hub' / 'datasets--my-org--no-such-set'}" in str(e.value)
    assert "hf download --repo-type dataset my-org/no-such-set" in str(e.value)


def test_json_arrays_read_record_by_record_with_row_and_line(tmp_path, qwen):
    """A .json array (compact or pretty-printed) gives the records of the same lines as JSON Lines;
    a bad element is named by its row and the line it starts on."""
    from lit_hbp.data.sources import iter_chunks, iter_records

    records = [{"text": f"record {i} " + "x" * (i * 37 % 300)} for i in range(50)]
    for indent in (None, 2):
        path = tmp_path / f"a{indent}.json"
        path.write_text(json.dumps(records, indent=indent))
        got = list(iter_records(Source(str(path))))
        assert [r for r, _ in got] == records
        chunks = list(iter_chunks(Source(str(path)), chunk_bytes=64, chunk_rows=7))  # records over many reads
        assert [r for c in chunks for r in c.records] == records and sum(len(c.records) for c in chunks) == 50
    assert got[3][1] == f"{path}:row 4 (line {1 + 3 * 3 + 1})"  # "[", then 3 lines a record
    bad = tmp_path / "bad.json"
    bad.write_text('[\n  {"text": "a"},\n  [1, 2]\n]')
    with pytest.raises(DataError, match=rf"{bad}:row 2 \(line 3\): expected a JSON object, got list"):
        list(iter_records(Source(str(bad))))
    bad.write_text('[\n  {"text": "a"},\n  {"text": }\n]')
    with pytest.raises(DataError, match=rf"{bad}:row 2 \(line 3\): malformed JSON"):
        list(iter_records(Source(str(bad))))
    bad.write_text('[{"text": "a"}')
    with pytest.raises(DataError, match="the JSON array is not closed"):
        list(iter_records(Source(str(bad))))
    wide = tmp_path / "wide.json"  # characters of 2 and 3 bytes cut by every read size
    records = [{"text": "中文字符" * (i % 7 + 1) + "é" * (i % 3), "i": i} for i in range(40)]
    wide.write_text(json.dumps(records, ensure_ascii=False, indent=1), encoding="utf-8")
    for size in range(1, 14):
        assert [r for c in iter_chunks(Source(str(wide)), chunk_bytes=size, chunk_rows=3) for r in c.records] == records
    assert sum(c.size for c in iter_chunks(Source(str(wide)), chunk_bytes=50, chunk_rows=3)) == wide.stat().st_size
    bom = tmp_path / "bom.jsonl"  # a byte order mark before the first line of JSON Lines
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"text": "a"}\n{"text": "b"}\n')
    assert [r for r, _ in iter_records(Source(str(bom)))] == [{"text": "a"}, {"text": "b"}]
    lines = tmp_path / "lines.json"  # a .json file of JSON Lines reads as JSONL
    lines.write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    assert [r for r, _ in iter_records(Source(str(lines)))] == records[:3]


def test_a_config_of_only_the_data_section_previews(qwen, tmp_path, capsys):
    """Preview builds no model: a config without a model section (a data-only file, or the run's before its
    checkpoint is chosen) shows the chat template's own tokens as a full config does."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps([r for r, _ in ALPACA]))
    config = write_config(tmp_path, qwen, [{"path": str(path)}])
    data_only = tmp_path / "data_only.yaml"
    data_only.write_text(yaml.safe_dump({"data": yaml.safe_load(config.read_text())["data"]}))
    got = preview_json(capsys, data_only)
    tok = AutoTokenizer.from_pretrained(qwen)
    assert [(g["line"], g["input_ids"], g["supervised"]) for g in got] == [
        (i + 1, *reference(tok, *ref)) for i, (_, ref) in enumerate(ALPACA)
    ]


@pytest.mark.slow
def test_the_console_script_previews_and_refuses_like_fit(qwen, tmp_path):
    """``lit-hbp preview`` as a user runs it: JSON lines on stdout (logs and progress on stderr)."""
    import subprocess

    script = console_script("lit-hbp")
    path = tmp_path / "d.json"
    path.write_text(json.dumps([r for r, _ in ALPACA]))
    config = write_config(tmp_path, qwen, [{"path": str(path)}])
    out = subprocess.run([str(script), "preview", "--config", str(config), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "not recommended to provide both args and command line arguments" not in out.stderr, out.stderr[-2000:]
    got = [json.loads(line) for line in out.stdout.splitlines()]
    tok = AutoTokenizer.from_pretrained(qwen)
    assert [(g["line"], g["input_ids"], g["supervised"]) for g in got] == [
        (i + 1, *reference(tok, *ref)) for i, (_, ref) in enumerate(ALPACA)
    ]


def qwen_with(tmp_path: Path, qwen: str, template) -> object:
    """The Qwen-style tokenizer with another chat template (a string, or named templates)."""
    tok = AutoTokenizer.from_pretrained(qwen)
    tok.chat_template = template
    tok.save_pretrained(tmp_path / "tok")
    return AutoTokenizer.from_pretrained(tmp_path / "tok")


def test_named_templates_are_picked_as_at_inference(qwen, tmp_path):
    """A tokenizer with named templates (``{"default", "tool_use"}``, as Hermes ships) renders a record
    with tools by ``tool_use`` (here one that cannot render without tools) and one without by
    ``default``, as ``apply_chat_template`` does."""
    from chat_formats import QWEN_TEMPLATE

    tool_use = QWEN_TEMPLATE.replace("{%- if tools -%}", "{%- if true -%}")  # iterates tools unconditionally
    tok = qwen_with(
        tmp_path, qwen, {"default": QWEN_TEMPLATE.replace("You are Qwen", "You are Hermes"), "tool_use": tool_use}
    )
    cases = [OPENAI[0], OPENAI[2]]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record, _ in cases))
    t = tokenize_source(Source(str(path)), tok, progress=False)
    for row, (_, (messages, tools)) in enumerate(cases):
        ids, mask = t.sample(row)
        assert (ids.tolist(), mask.astype(int).tolist()) == reference(tok, messages, tools)
    assert "You are Hermes" in tok.decode(t.sample(1)[0].tolist())  # the default template, no tools


MISTRAL_LIKE = (  # the system prompt goes into the user turn only when that turn is the last message
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- '<|endoftext|>' }}{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
    "{%- if loop.last and system is defined %}{{- '<|im_start|>' + system + '\\n\\n' + m['content'] + '<|im_end|>' }}"
    "{%- else %}{{- '<|im_start|>' + m['content'] + '<|im_end|>' }}{%- endif %}"
    "{%- elif m['role'] == 'assistant' %}{{- ' ' + m['content'] + '<|endoftext|>' }}{%- endif %}{%- endfor %}"
)
ROLES_ONLY = (  # user and assistant turns only: any other role vanishes
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{{ '<|im_start|>user\\n' + m['content'] + '<|im_end|>' }}"
    "{%- elif m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' + m['content'] + '<|im_end|>' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

NO_STOP = (  # GLM-4.5's turns: an answer ends where the next turn's role token starts, outside the answer
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
STOP_OUTSIDE = (  # a generation block that leaves the turn's end token out
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] }}{% endgeneration %}{{ '<|im_end|>' }}{%- else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
NEVER_STOPS = r"messages\[1\] \(assistant\): the chat template ends the trained turn with no special token \('{}'\), "
NEVER_STOPS += "so the model would never learn to stop"


@pytest.mark.parametrize(
    "template, record, message",
    [
        (
            NO_STOP,
            {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                          {"role": "user", "content": "A joke?"}, {"role": "assistant", "content": "No."}]},
            NEVER_STOPS.format("Hello!"),
        ),
        (
            STOP_OUTSIDE,
            {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]},
            NEVER_STOPS.format("Hello!"),
        ),
        (
            MISTRAL_LIKE,
            {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"},
                          {"role": "assistant", "content": "Hello!"}]},
            r"messages\[0\] \(system\): the chat template does not render its content",
        ),
        (
            MISTRAL_LIKE,  # the user turn before an answer renders otherwise in the whole conversation; so does the
            # last answer's, so train_on: last_assistant, which would not pass, is not advised
            {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"},
                          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "A joke?"}]},
            r"the chat template is not prefix-stable at message 2 .* located: use a chat template "
            r"\(data.chat_template\) that renders earlier turns unchanged or has {% generation %} blocks$",
        ),
        (
            ROLES_ONLY,
            {"messages": [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "21 degrees"},
                          {"role": "assistant", "content": "It is 21."}]},
            r"messages\[1\] \(tool\): the chat template does not render its content",
        ),
        (
            ROLES_ONLY,  # the dropped tool result's text stands in the answer: its own turn is still missing
            {"messages": [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "sunny"},
                          {"role": "assistant", "content": "It is sunny in Paris."}]},
            r"messages\[1\] \(tool\): the chat template does not render its content",
        ),
        (
            ROLES_ONLY,  # a system prompt the user repeats
            {"messages": [{"role": "system", "content": "Answer in French."},
                          {"role": "user", "content": "Answer in French. Weather?"},
                          {"role": "assistant", "content": "Il fait beau."}]},
            r"messages\[0\] \(system\): the chat template does not render its content",
        ),
    ],
)  # fmt: skip
def test_a_template_that_would_mis_mask_or_drop_a_message_is_refused(template, record, message, qwen, tmp_path):
    """What real templates do (Mistral v0.3 puts the system prompt in the last user turn only; Zephyr
    has no branch for tool results; GLM-4.5 ends an answer with the next turn's role token, or with nothing
    after the last one): refused with the record's line, never trained as rendered."""
    tok = qwen_with(tmp_path, qwen, template)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=f"{path}:1: {message}"):
        tokenize_source(Source(str(path)), tok, progress=False)


R1_LIKE = (  # DeepSeek-R1-Distill's: the generation prompt opens a thought the rendered answer does not have
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{%- else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("answer", ["<div>hi</div>", "<thin ice", "Sure."])
def test_an_answer_opening_as_the_generation_prompt_goes_on_trains_from_its_first_character(answer, qwen, tmp_path):
    """A located turn starts where its rendering departs from the conversation with the generation prompt; where
    the prompt goes on past the turn's header (R1's ``<think>\\n``) and the answer opens with the same characters,
    those characters were left untrained. The reference: the template's own ``{% generation %}`` mask."""
    marked = qwen_with(tmp_path / "marked", qwen, R1_LIKE)
    plain = qwen_with(tmp_path / "plain", qwen, without_generation_tags(R1_LIKE))
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "And now?"}, {"role": "assistant", "content": answer}]  # fmt: skip
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    ids, mask = tokenize_source(Source(str(path)), plain, progress=False).sample(0)
    assert (ids.tolist(), mask.astype(int).tolist()) == reference(marked, messages)


QWEN3_LIKE = (  # Qwen3's: an answer's reasoning rendered only after the last user turn
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{%- if m.reasoning_content and loop.index0 > ns.last %}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}{{ m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_reasoning_the_template_renders_only_in_the_last_turn_is_refused_on_an_earlier_one(qwen, tmp_path):
    """Under ``train_on: last_assistant`` an earlier answer's reasoning was dropped from the context without a word
    (its turn is not located, so no prefix of it was checked); the last answer's reasoning trains, as the
    template's own mask says."""
    tok = qwen_with(tmp_path, qwen, QWEN3_LIKE)
    first = {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look outside."}
    last = {"role": "assistant", "content": "Rain.", "reasoning_content": "Clouds came."}
    question = [{"role": "user", "content": "Weather?"}]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [*question, first, *question, last]}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: messages\[1\].reasoning_content: the chat template drops it "
                       "once the conversation goes on"):  # fmt: skip
        tokenize_source(Source(str(path)), tok, progress=False, train_on="last_assistant")
    kept = [*question, {**first, "reasoning_content": None}, *question, last]
    path.write_text(json.dumps({"messages": [*question, {"role": "assistant", "content": "Sunny."}, *question, last]}))
    ids, mask = tokenize_source(Source(str(path)), tok, progress=False, train_on="last_assistant").sample(0)
    assert "Clouds came." in tok.decode(ids[mask.astype(bool)].tolist())
    assert ids.tolist() == tok.apply_chat_template(kept, tokenize=True, return_dict=True)["input_ids"]


FIRST_TURNS = [  # the first message trains: the template's preamble (its default system prompt) must not
    (
        {"messages": [{"role": "assistant", "content": "Hello! How can I help?"},
                      {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}]},
        [{"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}],
    ),
    (
        {"messages": [{"role": "user", "content": "Weather?", "weight": 1}, {"role": "assistant", "content": "Yes."}]},
        [{"role": "user", "content": "Weather?", "weight": 1}, {"role": "assistant", "content": "Yes."}],
    ),
    (
        {"system": "Be brief.", "messages": [{"role": "user", "content": "Weather?", "weight": 0},
                                              {"role": "assistant", "content": "Sunny."}]},
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?", "weight": 0},
         {"role": "assistant", "content": "Sunny."}],
    ),
]  # fmt: skip


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_a_first_turn_that_trains_leaves_the_templates_preamble_out(train_on, qwen, tmp_path):
    """A chat opening with an assistant greeting, a weight-1 first user turn, a weight-0 first user turn
    under ``all``, and the OpenAI record's own ``system`` field: as the template's own mask says."""
    tok = AutoTokenizer.from_pretrained(qwen)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record, _ in FIRST_TURNS))
    t = tokenize_source(Source(str(path)), tok, progress=False, train_on=train_on)
    for row, (_, messages) in enumerate(FIRST_TURNS):
        ids, mask = t.sample(row)
        assert (ids.tolist(), mask.astype(int).tolist()) == reference(tok, messages, None, train_on), row


@pytest.mark.parametrize(
    "record, message",
    [
        ({"messages": [{"role": "user", "content": "hi", "name": "Alice"}, {"role": "assistant", "content": "yo"}]},
         r"messages\[0\].name: the chat template does not render it"),
        ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "1"}, {"role": "assistant", "content": "y"}]},
         r"messages\[0\].tool_call_id: the chat template does not render it"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "y", "tool_call_id": "1"}]},
         r"messages\[1\].tool_call_id: the chat template does not render it"),
        ({"system": "Be brief.", "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]},
         r"the record has a 'system' field and a system message: give one"),
        ({"system": "Be brief.", "conversations": [{"from": "system", "value": "x"}, {"from": "human", "value": "hi"},
                                                   {"from": "gpt", "value": "yo"}]},
         r"the record has a 'system' field and a system message: give one"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]},
         r"messages\[0\].content\[0\] must be a text part"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "code", "code": "1"}]}]},
         r"messages\[0\].tool_calls\[0\] is a 'code' call: only function calls are read"),
        ({"input_ids": [1, 2, 3], "labels": [-100, None, 3]}, r"labels must be a flat list of integers"),
        ({"input_ids": [1.7, 2.2, 3.9]}, r"input_ids must be a flat list of integers"),
        ({"input_ids": [1, 2, 3], "attention_mask": 1}, r"attention_mask must hold one value .*\(int 1 for 3"),
        ({"input_ids": [1, 2, 3], "attention_mask": [1, 1]}, r"attention_mask must hold one value .*\(2 values for 3"),
        ({"input_ids": [1, 2, 3], "attention_mask": [1, 0, 1]}, r"attention_mask has zeros"),
        ({"input_ids": [1, 2, 3], "labels": [-100, -100, 3], "assistant_masks": [0, 1, 1]},
         r"labels and assistant_masks disagree at token 1: give one of them"),
    ],
)  # fmt: skip
def test_fields_that_would_be_dropped_or_misread_are_refused(record, message, qwen, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=f"{path}:1: {message}"):
        tokenize_source(Source(str(path)), AutoTokenizer.from_pretrained(qwen), progress=False)


def test_split_and_subset_only_where_they_are_read(tmp_path):
    from lit_hbp.data.sources import check_source

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match="split is read from data sets saved with save_to_disk and Hub data sets"):
        check_source(Source(str(path), split="test"))
    with pytest.raises(DataError, match="subset is read from Hub data sets only"):
        check_source(Source(str(path), subset="en"))


# ------------------------------------------------------------------- {% generation %} templates


def without_generation_tags(template: str) -> str:
    """The same text, its ``{% generation %}`` markers gone: a template whose turns renderings locate."""
    import re

    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


def generation_template(newline_in_block: bool) -> str:
    """``QWEN_TEMPLATE`` (the same text) marking an assistant turn with ``{% generation %}`` around its
    answer and ``<|im_end|>``, the newline after ``<|im_end|>`` outside; with ``newline_in_block``, the
    newline after the header inside. Renderings locate another turn (after the header to the newline)."""
    from chat_formats import QWEN_TEMPLATE

    edits = [
        ("{{- '<|im_end|>\\n' -}}\n{%- endmacro -%}", "{{- '<|im_end|>' -}}\n{%- endmacro -%}"),
        ("{{- answer(message) -}}{%- endgeneration -%}", "{{- answer(message) -}}{%- endgeneration -%}{{- '\\n' -}}"),
        (
            "{%- else -%}{{- answer(message) -}}{%- endif -%}",
            "{%- else -%}{{- answer(message) -}}{{- '\\n' -}}{%- endif -%}",
        ),
    ]
    if newline_in_block:
        edits += [
            (
                "{{- '<|im_start|>assistant\\n' -}}\n{%- if trained -%}{%- generation -%}",
                "{{- '<|im_start|>assistant' -}}\n{%- if trained -%}{%- generation -%}{{- '\\n' -}}",
            ),
            (
                "{%- else -%}{{- answer(message) -}}{{- '\\n' -}}",
                "{%- else -%}{{- '\\n' -}}{{- answer(message) -}}{{- '\\n' -}}",
            ),
        ]
    out = QWEN_TEMPLATE
    for old, new in edits:
        assert out.count(old) >= 1, old
        out = out.replace(old, new)
    return out


def tokenized_by_line(source: dict, tok, train_on: str) -> dict[int, tuple[list[int], list[int]]]:
    """Per line (or row) of a source, its (input_ids, supervised) as lit-hbp tokenizes it."""
    t = tokenize_source(Source(**source), tok, train_on=train_on, progress=False)
    return {int(t.rows[i]): tuple(x.astype(int).tolist() for x in t.sample(i)) for i in range(len(t))}


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant"])
@pytest.mark.parametrize("newline_in_block", [False, True], ids=["newline after", "newline in block"])
def test_a_generation_template_supervises_its_own_assistant_mask_for_every_format(
    newline_in_block, train_on, qwen, every_format, tmp_path
):
    """The issue: with ``{% generation %}`` around the answer and ``<|im_end|>`` (the newline after it
    outside, or the newline after the header inside), every record format supervises exactly
    ``apply_chat_template(..., return_assistant_tokens_mask=True)``'s tokens of its trained turns (the
    template sees no weight and no ``train_on``: lit-hbp leaves the other turns out), never the
    renderings' turn (header newline to trailing newline)."""
    sources, expected = every_format
    tok = qwen_with(tmp_path, qwen, generation_template(newline_in_block))
    qwen_tok = AutoTokenizer.from_pretrained(qwen)
    for source in sources:
        got = tokenized_by_line(source, tok, train_on)
        cases = {
            line: reference(tok, *ref, train_on) for (path, line), ref in expected.items() if path == source["path"]
        }
        assert got == {line: ref for line, ref in cases.items() if any(ref[1])}, source["path"]
    for messages, tools in expected.values():  # Qwen's text: only the markers moved
        assert reference(tok, messages, tools)[0] == reference(qwen_tok, messages, tools)[0]
    ids, supervised = reference(tok, *OPENAI[2][1])
    trained = tok.decode([i for i, s in zip(ids, supervised) if s])
    assert trained == ("\nHello there.<|im_end|>" if newline_in_block else "Hello there.<|im_end|>")


def test_first_turns_and_weights_of_a_generation_template(qwen, tmp_path):
    """A weight-1 user turn (no block marks it: its rendering trains), a weight-0 one, an assistant
    greeting first: as the template's own mask says."""
    tok = qwen_with(tmp_path, qwen, generation_template(False))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record, _ in FIRST_TURNS))
    got = tokenized_by_line({"path": str(path)}, tok, "assistant")
    assert got == {line + 1: reference(tok, messages) for line, (_, messages) in enumerate(FIRST_TURNS)}


def test_train_on_all_trains_every_token_whatever_the_generation_blocks(qwen, every_format, tmp_path):
    """``train_on: all`` trains whole messages (weight 0 leaves its message out): the blocks, which mark
    what the assistant generates, do not narrow it."""
    sources, _ = every_format
    marked = qwen_with(tmp_path / "marked", qwen, generation_template(False))
    plain = qwen_with(tmp_path / "plain", qwen, without_generation_tags(generation_template(False)))
    for source in sources:
        assert tokenized_by_line(source, marked, "all") == tokenized_by_line(source, plain, "all"), source["path"]


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant", "all"])
def test_without_generation_blocks_renderings_locate_the_same_turns(train_on, qwen, every_format, tmp_path):
    """``QWEN_TEMPLATE``'s blocks agree with its renderings (the newline after ``<|im_end|>`` is in them):
    its text without the blocks, where renderings locate the turns, supervises the same tokens."""
    from chat_formats import QWEN_TEMPLATE

    sources, expected = every_format
    tok = AutoTokenizer.from_pretrained(qwen)
    plain = qwen_with(tmp_path, qwen, without_generation_tags(QWEN_TEMPLATE))
    for source in sources:
        cases = {
            line: reference(tok, *ref, train_on) for (path, line), ref in expected.items() if path == source["path"]
        }
        got = tokenized_by_line(source, plain, train_on)
        assert got == {line: ref for line, ref in cases.items() if any(ref[1])}, source["path"]


def test_a_slow_tokenizer_is_refused_for_a_generation_template(tmp_path):
    """The template's mask maps characters onto tokens by their offsets, which only a fast tokenizer gives."""
    from transformers import ByT5Tokenizer

    from lit_hbp.errors import ConfigError

    tok = ByT5Tokenizer()
    tok.chat_template = generation_template(False)
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    )
    with pytest.raises(ConfigError, match="ByT5Tokenizer is a slow tokenizer: lit-hbp needs a fast one"):
        tokenize_source(Source(str(path)), tok, progress=False)


def test_tool_records_in_a_table_render_as_written_not_with_the_other_rows_keys(qwen, tmp_path):
    """Arrow stores a column's rows in one shape, the union of their keys: a parquet file or a ``save_to_disk``
    folder of these records read back every tool's parameters and call's arguments with the other rows' keys
    as null, and trained on those nulls in the prompt, silently. Each row now renders as the template renders
    its record (tools and calls of different shapes in every row)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    def tool(name, params):
        props = {p: {"type": "string"} for p in params}
        return {"type": "function", "function": {"name": name, "description": name, "parameters": {
            "type": "object", "properties": props, "required": list(params)}}}  # fmt: skip

    def record(question, name, arguments, answer):
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        return {"messages": [{"role": "user", "content": question},
                             {"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "content": answer},
                             {"role": "assistant", "content": f"it is {answer}"}],
                "tools": [tool(name, list(arguments))]}  # fmt: skip

    records = [record("Weather in Paris?", "weather", {"city": "Paris"}, "sunny"),
               record("Add 1 and 2", "add", {"a": "1", "b": "2"}, "3"),
               record("Convert 3 m", "convert", {"value": "3", "unit": "m", "to": "ft"}, "9.8")]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "calls.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    tok = AutoTokenizer.from_pretrained(qwen)
    for path in (tmp_path / "calls.parquet", tmp_path / "saved"):
        tokens = tokenize_source(Source(str(path)), tok, progress=False)
        for i, r in enumerate(records):
            ids, supervised = reference(tok, r["messages"], tools=r["tools"])
            got, mask = tokens.sample(i)
            assert got.tolist() == ids, (path.name, i, tok.decode(got.tolist()))
            assert mask.astype(int).tolist() == supervised, (path.name, i)


def test_a_tables_struct_arguments_in_another_key_order_are_said(qwen, tmp_path):
    """Arrow keeps one key order (the first rows') and one number type per struct column: a call's arguments
    written ``{"unit", "city"}`` after a row's ``{"city", "unit"}`` rendered as ``{"city", "unit"}`` from a table
    (and 1 beside 1.5 as 1.0), where the same records in JSONL render as written, without a word. Said now,
    naming the columns; arguments kept as JSON strings (OpenAI's form) keep each row's own and are not."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    def record(arguments):
        call = {"type": "function", "function": {"name": "weather", "arguments": arguments}}
        return {"messages": [{"role": "user", "content": "Weather?"},
                             {"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "content": "sunny"},
                             {"role": "assistant", "content": "it is sunny"}]}  # fmt: skip

    records = [record({"city": "Paris", "unit": "c"}), record({"unit": "f", "city": "Rome"})]
    tok = AutoTokenizer.from_pretrained(qwen)
    want = [reference(tok, r["messages"])[0] for r in records]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "calls.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "calls.parquet", tmp_path / "saved"):
        with pytest.warns(UserWarning, match=r"holds messages.tool_calls.function.arguments as struct columns"):
            tokens = tokenize_source(Source(str(path)), tok, progress=False)
        assert tokens.sample(0)[0].tolist() == want[0]
        assert tokens.sample(1)[0].tolist() != want[1]  # what the warning says: the column's order, not the row's
    sampling = [{**r, "meta": {"parameters": {"temperature": 0.7}}} for r in records]  # not a tool's: not said
    pq.write_table(pa.Table.from_pylist(sampling), tmp_path / "sampling.parquet")
    with pytest.warns(UserWarning) as said:
        tokenize_source(Source(str(tmp_path / "sampling.parquet")), tok, progress=False)
    assert [str(w.message) for w in said if "struct columns" in str(w.message)][0].count("parameters") == 0
    as_strings = [record(json.dumps(r["messages"][1]["tool_calls"][0]["function"]["arguments"])) for r in records]
    pq.write_table(pa.Table.from_pylist(as_strings), tmp_path / "strings.parquet")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*struct columns")
        tokens = tokenize_source(Source(str(tmp_path / "strings.parquet")), tok, progress=False)
    for i, r in enumerate(as_strings):
        assert tokens.sample(i)[0].tolist() == reference(tok, r["messages"])[0]


CONTENT = (  # as Gemma 3's and Llama 4's: a string's content trimmed, or each text part trimmed
    "{%- if m.content is string -%}{{ m.content | trim }}"
    "{%- else -%}{%- for item in m.content -%}{%- if item.type == 'text' -%}{{ item.text | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
PARTS_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{%- if m.role == 'assistant' -%}{% generation %}"
    + CONTENT
    + "<|im_end|>\n{% endgeneration %}{%- else -%}"
    + CONTENT
    + "<|im_end|>\n{%- endif -%}{%- endfor -%}"
)


def test_text_parts_reach_a_template_that_renders_parts_as_written(qwen, tmp_path):
    """A record's text parts were joined before the template saw them: a template that renders each part
    itself (trimming it) rendered "Translate:\\nbonjour" where ``apply_chat_template`` of the record, as at
    inference, renders "Translate:bonjour". They now reach such a template as written; a template that renders
    string content only (the Qwen one here) gets them joined, as the record wrote them."""
    tok = AutoTokenizer.from_pretrained(qwen)
    tok.chat_template = PARTS_TEMPLATE
    tok.save_pretrained(tmp_path / "parts_tok")
    parts = AutoTokenizer.from_pretrained(tmp_path / "parts_tok")
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Translate:\n"}, {"type": "text", "text": " bonjour"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]},
    ]
    path = tmp_path / "parts.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    for tokenizer, given in ((parts, messages), (AutoTokenizer.from_pretrained(qwen), None)):
        if given is None:  # the string template: the parts joined as written
            given = [{**m, "content": "".join(p["text"] for p in m["content"])} for m in messages]
        ids, supervised = reference(tokenizer, given)
        got, mask = tokenize_source(Source(str(path)), tokenizer, progress=False).sample(0)
        assert got.tolist() == ids, tokenizer.decode(got.tolist())
        assert mask.astype(int).tolist() == supervised
    assert "Translate:bonjour" in parts.decode(tokenize_source(Source(str(path)), parts, progress=False).sample(0)[0])


ROLE_TEMPLATE = (  # as Mistral 3.1's: a user's parts rendered one by one, other roles' content concatenated
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}[INST]"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- else -%}{%- for item in m.content -%}{{ item.text }}{%- endfor -%}{%- endif -%}[/INST]"
    "{%- elif m.role == 'system' -%}{{ '[SYS]' + m.content + '[/SYS]' }}"
    "{%- else -%}{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}{%- endif -%}{%- endfor -%}"
)


def test_a_roles_text_parts_are_joined_where_the_template_renders_that_roles_content_as_a_string(qwen, tmp_path):
    """The template renders parts for users and concatenates the system's and assistant's content (a list would
    fail there): each role's parts go as that role's template takes them, what ``apply_chat_template`` of
    the record renders where it can, the joined text where it cannot."""
    tok = AutoTokenizer.from_pretrained(qwen)
    tok.chat_template = ROLE_TEMPLATE
    tok.save_pretrained(tmp_path / "role_tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "role_tok")
    two = [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]
    messages = [{"role": "system", "content": two}, {"role": "user", "content": two},
                {"role": "assistant", "content": two}]  # fmt: skip
    path = tmp_path / "roles.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    as_taken = [{**messages[0], "content": "be brief"}, messages[1], {**messages[2], "content": "be brief"}]
    ids, supervised = reference(tok, as_taken)
    got, mask = tokenize_source(Source(str(path)), tok, progress=False).sample(0)
    assert got.tolist() == ids, tok.decode(got.tolist())
    assert mask.astype(int).tolist() == supervised
    with pytest.raises(TypeError):  # the record as written: the template cannot concatenate a list
        tok.apply_chat_template(messages, tokenize=False)


def test_image_markers_in_a_content_of_text_parts_stand_where_written():
    """An ``images`` list placed at ``<image>`` markers that stand in text parts (not a string content)."""
    record = {"messages": [{"role": "user", "content": [{"type": "text", "text": "<image>\nWhat is it?"}]},
                           {"role": "assistant", "content": "a cat"}], "images": ["cat.png"]}  # fmt: skip
    conversation, _ = RecordReader("openai", root="/data").read(record, "d.jsonl:1")
    assert conversation.images == ("/data/cat.png",)
    assert conversation.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "\nWhat is it?"}]


def test_template_arguments_a_record_carries_are_refused_not_filed_as_metadata(toy_tokenizer, tmp_path):
    """TRL hands a record's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``) and transformers a record's
    ``documents`` (Command-R's) to ``apply_chat_template``: with a template that reads them, the reference renders
    otherwise than without them, so rendering the record without them would train what it does not say."""
    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    tok.chat_template = (
        "{% if documents %}<|system|>\n{% for d in documents %}{{ d['text'] }}\n{% endfor %}<|end|>\n{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' and enable_thinking is not false %}"
        "<think>\n{% endif %}{{ m['content'] }}<|end|>\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for field, value, kwargs in (
        ("chat_template_kwargs", {"enable_thinking": False}, {"enable_thinking": False}),
        ("documents", [{"title": "t", "text": "DOC"}], {"documents": [{"title": "t", "text": "DOC"}]}),
    ):
        plain = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"] != plain
        path = tmp_path / "d.jsonl"
        path.write_text(json.dumps({"messages": messages, field: value}) + "\n")
        with pytest.raises(DataError, match=f"{path}:1: record field '{field}' is not supported .*: remove it, and "):
            tokenize_source(Source(str(path)), tok, progress=False)


def test_misnamed_records_and_paths_say_the_fix_and_upper_case_suffixes_read(tmp_path, toy_tokenizer):
    """TRL's prompt/completion records, a JSON array in a .jsonl file and a path with wildcards each name the fix,
    which then reads them as the reference does (``apply_chat_template`` of the pair, ``json.load``); .JSONL, .JSON
    and .PARQUET read as their lower-case suffixes (the records ``json``/pyarrow read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lit_hbp.data.sources import iter_records

    tok = AutoTokenizer.from_pretrained(toy_tokenizer)
    pair = tmp_path / "pc.jsonl"
    pair.write_text(json.dumps({"prompt": "what is 2+2?", "completion": "four"}) + "\n")
    with pytest.raises(
        DataError, match=r"no 'response'; set the source's format: prompt_response, fields: \{response: completion\}"
    ):
        tokenize_source(Source(str(pair)), tok, progress=False)
    got = tokenize_source(
        Source(str(pair), format="prompt_response", fields={"response": "completion"}), tok, progress=False
    )
    chat = [{"role": "user", "content": "what is 2+2?"}, {"role": "assistant", "content": "four"}]
    assert got.sample(0)[0].tolist() == tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    pair.write_text(json.dumps({"prompt": chat[:1], "completion": chat[1:]}) + "\n")
    with pytest.raises(DataError, match=r"no 'response'; give its prompt's messages and completion's as messages"):
        tokenize_source(Source(str(pair)), tok, progress=False)

    records = [{"text": f"record {i}"} for i in range(5)]
    for indent in (None, 2):
        array = tmp_path / f"array{indent}.jsonl"
        array.write_text(json.dumps(records, indent=indent))
        with pytest.raises(DataError, match=rf"{array}:1: .*; the file is a JSON array, .*: set file_type: json"):
            list(iter_records(Source(str(array))))
        assert [r for r, _ in iter_records(Source(str(array), file_type="json"))] == json.loads(array.read_text())
    (tmp_path / "shards").mkdir()
    with pytest.raises(DataError, match=r"not found: .*; a path's wildcards are not expanded: give each file as"):
        list(iter_records(Source(str(tmp_path / "shards" / "*.jsonl"))))

    upper = {"d.JSONL": "".join(json.dumps(r) + "\n" for r in records), "d.JSON": json.dumps(records)}
    for name, text in upper.items():
        (tmp_path / name).write_text(text)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.PARQUET")
    for name in (*upper, "d.PARQUET"):
        reference = pq.read_table(tmp_path / name).to_pylist() if name.endswith("PARQUET") else records
        assert [r for r, _ in iter_records(Source(str(tmp_path / name)))] == reference, name


@pytest.mark.parametrize("seed", [7, False])
def test_preview_shows_the_records_fit_trains_with_the_runs_seed(qwen, tmp_path, capsys, seed):
    """``seed_everything: 7`` with ``val_fraction: 0.5``: preview drew the hold-out with seed 0, so it showed records
    the fit of seed 7 held out for validation. Preview's records are fit's training records, in order."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"say {i}", "output": f"{i} " * (i % 7 + 1)}) + "\n"
                            for i in range(40)))  # fmt: skip
    config = write_config(tmp_path, qwen, [{"path": str(path)}], val_fraction=0.5)
    config.write_text(f"seed_everything: {str(seed).lower()}\n" + config.read_text())
    shown = [g["line"] for g in preview_json(capsys, config)]
    cli = main(["--config", str(config), "--trainer.accelerator", "cpu", "--trainer.logger", "false"], run=False)
    cli.datamodule.setup("fit")
    store = cli.datamodule.store
    trained = [int(store.sources[s].rows[r]) for s, r in zip(store.source_of, store.row_of)]
    assert shown == sorted(trained) and len(shown) == 20, (shown, sorted(trained))
