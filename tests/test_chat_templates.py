"""Records through the official chat templates of real checkpoints (``tests/chat_templates``: Qwen2.5, Qwen3,
Hermes 3, Llama 3.1 and 3.2, DeepSeek-V3.1) on a small tokenizer with each family's special tokens. The reference
is the same tokenizer's ``apply_chat_template(messages, tools=..., tokenize=True)`` of the record as given, and for
the mask the brute-force rendering of the conversation cut before and after each trained turn
(``chat_formats.brute_force``)."""

import json
import warnings

import pytest
from chat_formats import blocks_reference, brute_force, build_tokenizer

from lit_hbp.data.sources import Source
from lit_hbp.data.tokenize import tokenize_source
from lit_hbp.errors import DataError

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOLS = [{"type": "function", "function": WEATHER}]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """The tokenizer of a family (``chat_formats.FAMILIES``), built once per module."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_tokenizer(tmp_path_factory.mktemp(name.replace(".", "_")), name)
        return built[name]

    return get


def tool_chat(arguments, answered: bool) -> list[dict]:
    """A question, a call of get_weather with ``arguments`` (as OpenAI's API writes them: a JSON string), and with
    ``answered`` the call's result and the answer."""
    call = {"id": "call1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]}]  # fmt: skip
    if answered:
        messages += [{"role": "tool", "tool_call_id": "call1", "content": '{"temperature": 21}'},
                     {"role": "assistant", "content": "It is 21 degrees and sunny."}]  # fmt: skip
    return messages


def lit_hbp(tok, record: dict, tmp_path, train_on: str = "assistant") -> tuple[list[int], list[int]]:
    """lit-hbp's (input_ids, supervised) of one record."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    ids, mask = tokenize_source(Source(str(path)), tok, train_on=train_on, progress=False, num_proc=1).sample(0)
    return ids.tolist(), mask.astype(int).tolist()


def reference(tok, messages, tools, train_on: str) -> tuple[list[int], list[int]]:
    """``apply_chat_template``'s ids, and the brute-force mask of the turns ``train_on`` trains."""
    ids = list(tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"])
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    brute_ids, supervised = brute_force(tok, messages, tools, None if train_on == "assistant" else [last])
    assert brute_ids == ids
    return ids, supervised


ARGUMENTS = ['{"city":"Paris"}', '{"city": "Paris"}', {"city": "Paris"}]


@pytest.mark.parametrize("arguments", ARGUMENTS, ids=["compact string", "spaced string", "object"])
@pytest.mark.parametrize(
    "name, answered, train_on",
    [
        ("qwen3", False, "assistant"),
        ("qwen3", True, "last_assistant"),
        ("hermes3", False, "assistant"),
        ("llama3.1", False, "assistant"),
        ("llama3.1", True, "assistant"),
        ("qwen2.5", False, "assistant"),
        ("qwen2.5", True, "assistant"),
    ],
)
def test_tool_call_arguments_render_as_apply_chat_template_renders_the_record(
    name, answered, train_on, arguments, family, tmp_path
):
    """OpenAI's tool-call arguments, a JSON string, were parsed and written back by the template's ``tojson``:
    Qwen3 and Hermes 3 print a string as written (``arguments is string``), so ``{"city":"Paris"}`` trained as
    ``{"city": "Paris"}``; Qwen2.5 and Llama 3.1 quote a string, and trained an object. The record now renders
    as ``apply_chat_template`` renders it, its arguments as given."""
    tok = family(name)
    messages = tool_chat(arguments, answered)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the quoted string is said (test below)
        got = lit_hbp(tok, {"messages": messages, "tools": TOOLS}, tmp_path, train_on)
    assert got == reference(tok, messages, TOOLS, train_on), tok.decode(got[0])


def test_a_template_that_concatenates_string_arguments_renders_them(family, tmp_path):
    """DeepSeek-V3.1 writes ``arguments`` by string concatenation: the record with OpenAI's string arguments was
    refused (lit-hbp handed it an object); with an object, ``apply_chat_template`` fails as lit-hbp refuses."""
    tok = family("deepseek3.1")
    messages = tool_chat('{"city":"Paris"}', answered=False)
    assert lit_hbp(tok, {"messages": messages}, tmp_path) == reference(tok, messages, None, "assistant")
    with pytest.raises(TypeError):
        tok.apply_chat_template(tool_chat({"city": "Paris"}, answered=False), tokenize=False)
    with pytest.raises(DataError, match="d.jsonl:1: the chat template cannot render this record: can only concatenate"):
        lit_hbp(tok, {"messages": tool_chat({"city": "Paris"}, answered=False)}, tmp_path)


def test_string_arguments_a_template_quotes_are_said(family, tmp_path):
    """Qwen2.5's ``tojson`` quotes a string argument (as ``apply_chat_template`` of the record does): the model
    learns to call with a string, which the run says; an object, or a template printing the string, says nothing."""
    cases = [("qwen2.5", '{"city": "Paris"}', True), ("qwen2.5", {"city": "Paris"}, False),
             ("qwen3", '{"city": "Paris"}', False)]  # fmt: skip
    for name, arguments, said in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lit_hbp(family(name), {"messages": tool_chat(arguments, False), "tools": TOOLS}, tmp_path)
        quoted = [w for w in caught if "writes the tool-call arguments given as a JSON string quoted" in str(w.message)]
        assert len(quoted) == said, (name, arguments, [str(w.message) for w in caught])


def test_a_template_that_prints_todays_date_is_tokenized_again_the_next_day(family, tmp_path, monkeypatch):
    """Llama 3.2's template writes today's date (``strftime_now``): the token cache of one day was read the next,
    with the old date, where ``apply_chat_template`` that day writes the new one. A template without the date
    (Llama 3.1's fixed "26 Jul 2024") still reads its cache. The clock is transformers' own, set per day."""
    import datetime

    from transformers.utils import chat_template_utils

    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "It is sunny."}]  # fmt: skip
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    for name, dated in (("llama3.2", True), ("llama3.1", False)):
        tok = family(name)
        for day in (1, 2):

            class Day(datetime.datetime):
                @classmethod
                def now(cls, tz=None, day=day):
                    return datetime.datetime(2025, 1, day, 12)

            monkeypatch.setattr(chat_template_utils, "datetime", Day)
            tokens = tokenize_source(Source(str(path)), tok, cache_dir=tmp_path / name, progress=False)
            ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            assert tokens.sample(0)[0].tolist() == list(ids), (name, day)
            assert tokens.from_cache == (day == 2 and not dated), (name, day)
        assert ("Today Date: 02 Jan 2025" in tok.decode(ids)) == dated


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant"])
@pytest.mark.parametrize("result", ["21 degrees, sunny", '{"temperature": 21}', 'line\nbreak "q" é'])
@pytest.mark.parametrize("name", ["llama3.1", "llama3.2", "gpt-oss"])
def test_a_tool_result_the_template_writes_as_json_is_rendered(name, result, train_on, family, tmp_path):
    """Llama 3.x and gpt-oss write a tool result as ``content | tojson``: quoted, its quotes and control characters
    escaped, so lit-hbp's check (the text, or a control-character mark, as written) found neither and refused every
    tool record of those templates as "does not render its content"."""
    tok = family(name)
    messages = tool_chat({"city": "Paris"}, answered=True)
    messages[2]["content"] = result
    assert json.dumps(result, ensure_ascii=False) in tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    got = lit_hbp(tok, {"messages": messages, "tools": TOOLS}, tmp_path, train_on)
    assert got == reference(tok, messages, TOOLS, train_on), tok.decode(got[0])


SYSTEM = {"role": "system", "content": "You are a weather bot."}
Q1, Q2 = {"role": "user", "content": "What is the weather in Paris?"}, {"role": "user", "content": "And in Rome?"}
A1, A2 = {"role": "assistant", "content": "It is 21 degrees and sunny."}, {"role": "assistant", "content": "25 here."}
CHATS = {
    "one turn": [Q1, A1],
    "two turns": [Q1, A1, Q2, A2],
    "system": [SYSTEM, Q1, A1, Q2, A2],
    "empty answer": [Q1, {"role": "assistant", "content": ""}, Q2, A2],
    "weight 0": [Q1, {**A1, "weight": 0}, Q2, A2],
    "tools": [*tool_chat({"city": "Paris"}, answered=True), Q2, A2],
}


# A template, and the training template of the same text whose blocks are the reference.
UNSTABLE = [
    ("phi3.5", "phi3.5-training"),
    ("phi3.5-training", "phi3.5-training"),
    ("gpt-oss-training", "gpt-oss-training"),
]


def trained_turns(messages: list[dict], train_on: str) -> list[int]:
    """The assistant messages ``train_on`` and the weights train."""
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    picked = answers if train_on == "assistant" else answers[-1:]
    return [i for i in picked if messages[i].get("weight", 1)]


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant"])
@pytest.mark.parametrize(
    "name, training, chat",
    [(name, training, chat) for name, training in UNSTABLE for chat in CHATS
     if not (chat == "tools" and name.startswith("phi"))],  # Phi-3.5 renders no tools
)  # fmt: skip
def test_turns_that_render_otherwise_at_the_conversations_end_are_located(
    name, training, chat, train_on, family, tmp_path
):
    """Phi-3.5 ends a conversation with EOS where no generation prompt follows, so no shorter conversation renders
    as the start of the whole: even one question and answer was refused as not prefix-stable. gpt-oss's training
    template ends the last answer with <|return|>, the others with <|end|>. The EOS is now cut off the shorter
    renderings, and a template's ``{% generation %}`` blocks go to the answer whose content they hold. The
    reference: ``apply_chat_template`` of the original, and the blocks of TRL's training template of the same
    text (``return_assistant_tokens_mask``) on the turns that train."""
    messages = CHATS[chat]
    tok, reference_tok = family(name), family(training)
    record = {"messages": messages, **({"tools": TOOLS} if chat == "tools" else {})}
    got = lit_hbp(tok, record, tmp_path, train_on)
    given = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
    tools = record.get("tools")
    ids, supervised = blocks_reference(reference_tok, given, tools, trained_turns(messages, train_on))
    assert ids == list(tok.apply_chat_template(given, tools=tools, tokenize=True, return_dict=True)["input_ids"])
    assert got == (ids, supervised), show(tok, *got)
    assert sum(supervised) > 3


def show(tok, ids: list[int], supervised: list[int]) -> str:
    """The text with its supervised tokens between ⟦ and ⟧."""
    return "".join(f"⟦{tok.decode([i])}⟧" if s else tok.decode([i]) for i, s in zip(ids, supervised))


@pytest.mark.parametrize("name", ["gpt-oss", "qwen3"])
def test_turns_that_render_otherwise_once_the_conversation_goes_on_stay_refused(name, family, tmp_path):
    """Without blocks, gpt-oss's earlier answers end otherwise than the conversation cut after them (<|end|>, not
    <|return|>) and Qwen3's lose the empty thought the cut gives them: not located, refused; the last answer is
    located, and ``train_on: last_assistant`` gives the reference's tokens."""
    tok = family(name)
    messages = CHATS["two turns"]
    with pytest.raises(DataError, match="not prefix-stable at message 1 .*use train_on: last_assistant .*passes"):
        lit_hbp(tok, {"messages": messages}, tmp_path)
    ids, supervised = brute_force(tok, messages, None, [3])
    assert lit_hbp(tok, {"messages": messages}, tmp_path, "last_assistant") == (ids, supervised)


@pytest.mark.parametrize("train_on", ["assistant", "last_assistant"])
def test_last_assistant_is_advised_only_where_the_record_passes_with_it(train_on, family, tmp_path):
    """A weight-1 earlier answer trains under ``train_on: last_assistant`` too, and gpt-oss cannot locate it: that
    advice would fail the same way, and the error, which gave it always, now names the templates that would do."""
    messages = [Q1, {**A1, "weight": 1}, Q2, A2]
    with pytest.raises(DataError, match="not prefix-stable at message 1") as refused:
        lit_hbp(family("gpt-oss"), {"messages": messages}, tmp_path, train_on)
    assert "last_assistant" not in str(refused.value).split("d.jsonl:1:")[1]
    assert str(refused.value).endswith(
        "use a chat template (data.chat_template) that renders earlier turns unchanged or has {% generation %} blocks"
    )


THOUGHT = "<think>\nadd them\n</think>\n\n4"


@pytest.mark.parametrize("turns, train_on", [(1, "assistant"), (1, "last_assistant"), (2, "last_assistant")])
@pytest.mark.parametrize("name", ["qwen3", "qwq"])
def test_reasoning_written_inline_in_the_answer_is_rendered(name, turns, train_on, family, tmp_path):
    """Qwen3 and QwQ take an answer's ``<think>...</think>`` part out of its content and render it back in front:
    the content stands in the text as written, but the check's mark in front of it went with the thought, and the
    record was refused as "does not render its content". The mark behind the content stands. (Two turns train
    the last: Qwen3's earlier answers render otherwise once the conversation goes on.)"""
    tok = family(name)
    messages = [Q1, A1, Q2][: 2 * turns - 1] + [{"role": "assistant", "content": THOUGHT}]
    assert THOUGHT in tok.apply_chat_template(messages, tokenize=False)
    got = lit_hbp(tok, {"messages": messages}, tmp_path, train_on)
    assert got == brute_force(tok, messages, None, [len(messages) - 1]), show(tok, *got)


def test_reasoning_a_template_drops_from_the_answer_stays_refused(family, tmp_path):
    """DeepSeek-R1-Distill keeps only what follows ``</think>`` of an earlier or final answer: the thought would
    never be seen, so the record is refused; so is Qwen3's thought in an answer before the last question."""
    cases = [("r1-distill", [Q1, {"role": "assistant", "content": THOUGHT}], 1),
             ("qwen3", [Q1, {"role": "assistant", "content": THOUGHT}, Q2, A2], 1)]  # fmt: skip
    for name, messages, i in cases:
        assert THOUGHT not in family(name).apply_chat_template(messages, tokenize=False)
        with pytest.raises(DataError, match=rf"messages\[{i}\] \(assistant\): the chat template does not render its"):
            lit_hbp(family(name), {"messages": messages}, tmp_path, "last_assistant")


@pytest.mark.parametrize("name", ["llama3.1", "qwen2.5", "hermes3"])
def test_an_empty_tool_list_renders_as_apply_chat_template_renders_it(family, tmp_path, name):
    """A record's ``"tools": []`` (a table's rows without tools) was read as no tools: Llama 3.1's template, which
    asks ``tools is not none``, lost its tool preamble (silent) and Hermes 3's tool-use template was refused.
    Reference: ``apply_chat_template(messages, tools=[])``, as TRL calls it."""
    tok = family(name)
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "It is 21 degrees and sunny."}]  # fmt: skip
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": messages, "tools": []}) + "\n")
    got = tokenize_source(Source(str(path)), tok, "assistant", tmp_path / "cache", progress=False, num_proc=1)
    want = tok.apply_chat_template(messages, tools=[], tokenize=True, return_dict=True)["input_ids"]
    assert list(got.sample(0)[0]) == list(want)


EMPTY_FIELDS = [{"role": "system", "content": "Be brief.", "name": ""},
                {"role": "user", "content": "What is the weather in Paris?", "name": ""},
                {"role": "assistant", "content": "It is sunny.", "reasoning_content": "", "tool_calls": []},
                {"role": "user", "content": "Thanks.", "tool_calls": []},
                {"role": "assistant", "content": "You are welcome.", "thinking": ""}]  # fmt: skip


@pytest.mark.parametrize(
    "name, train_on",
    [("qwen3", "last_assistant"), ("qwen2.5", "assistant"), ("phi3.5", "last_assistant")],
)  # fmt: skip
def test_empty_message_fields_render_as_apply_chat_template_renders_them(name, train_on, family, tmp_path):
    """``name: ""``, ``reasoning_content: ""``, ``thinking: ""`` and ``tool_calls: []`` (a table's rows where other
    rows have them) carry nothing, yet were refused as "the chat template does not render it" (it renders them as
    nothing) or "must be a non-empty list". Reference: ``apply_chat_template`` of the record as given."""
    tok = family(name)
    assert lit_hbp(tok, {"messages": EMPTY_FIELDS}, tmp_path, train_on) == reference(tok, EMPTY_FIELDS, None, train_on)


def test_an_empty_tool_call_list_a_template_renders_otherwise_is_refused_as_apply_chat_template_fails(family, tmp_path):
    """Where ``tool_calls: []`` changes the rendering, the record stays refused: DeepSeek-V3.1 renders the turn as a
    call and drops its answer (as ``apply_chat_template`` does), Llama 3.1 fails as ``apply_chat_template`` fails."""
    tok = family("deepseek3.1")
    assert "It is sunny." not in tok.apply_chat_template(EMPTY_FIELDS, tokenize=False)
    with pytest.raises(DataError, match=r"messages\[2\] \(assistant\): the chat template does not render its content"):
        lit_hbp(tok, {"messages": EMPTY_FIELDS}, tmp_path)
    with pytest.raises(Exception, match="only supports single tool-calls"):
        family("llama3.1").apply_chat_template(EMPTY_FIELDS, tokenize=False)
    with pytest.raises(DataError, match="cannot render this record: This model only supports single tool-calls"):
        lit_hbp(family("llama3.1"), {"messages": EMPTY_FIELDS}, tmp_path)
