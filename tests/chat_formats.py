# ruff: noqa: E501  (the template keeps Qwen's string literals whole)
"""A Qwen2.5-style tokenizer folder whose chat template renders tools, tool calls and tool results, and
the independent reference of what a chat record trains on: the tokenizer's own
``apply_chat_template(messages, tools=..., return_assistant_tokens_mask=True)``.

``QWEN_TEMPLATE`` renders text exactly as Qwen2.5-Instruct's template does (its system prompt with the
tools, ``<tool_call>`` JSON in assistant turns, consecutive tool results in one user turn). Its
``{% generation %}`` markers, which change nothing in the text, mark what a turn trains, so that
transformers' assistant mask is the reference. The template reads the message's ``weight`` (0: the
turn does not train) and a ``train_on`` keyword: ``assistant``, ``last_assistant`` or ``all``.
"""

from __future__ import annotations

from pathlib import Path

QWEN_TEMPLATE = r"""
{%- set train_on = train_on | default('assistant') -%}
{%- set ns = namespace(last=-1) -%}
{%- for m in messages -%}{%- if m.role == 'assistant' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- macro head() -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] -}}
{%- else -%}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -}}{%- endif -%}
{{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" -}}
{%- for tool in tools -%}{{- "\n" -}}{{- tool | tojson -}}{%- endfor -%}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" -}}
{%- else -%}
{%- if messages[0]['role'] == 'system' -%}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}
{%- else -%}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endmacro -%}
{%- macro body(message, loop) -%}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' -}}
{%- elif message.role == "tool" -%}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endmacro -%}
{%- macro answer(message) -%}
{%- if message.content -%}{{- message.content -}}{%- endif -%}
{%- if message.tool_calls -%}
{%- for tool_call in message.tool_calls -%}
{%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
{%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' -}}{{- tool_call.arguments | tojson -}}{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endmacro -%}
{%- if train_on == 'all' -%}{%- generation -%}{{- head() -}}{%- endgeneration -%}{%- else -%}{{- head() -}}{%- endif -%}
{%- for message in messages -%}
{%- set weight = message.weight if message.weight is defined else none -%}
{%- if train_on == 'all' -%}{%- set trained = weight is none or weight -%}
{%- elif train_on == 'last_assistant' -%}{%- set trained = (weight is none and loop.index0 == ns.last) or weight -%}
{%- else -%}{%- set trained = (weight is none and message.role == 'assistant') or weight -%}{%- endif -%}
{%- if message.role == "assistant" -%}
{%- if train_on == 'all' and trained -%}{%- generation -%}{{- '<|im_start|>assistant\n' -}}{{- answer(message) -}}{%- endgeneration -%}
{%- else -%}{{- '<|im_start|>assistant\n' -}}
{%- if trained -%}{%- generation -%}{{- answer(message) -}}{%- endgeneration -%}{%- else -%}{{- answer(message) -}}{%- endif -%}
{%- endif -%}
{%- elif trained and not (message.role == "system" and loop.first) -%}{%- generation -%}{{- body(message, loop) -}}{%- endgeneration -%}
{%- else -%}{{- body(message, loop) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""
# Qwen's text, without the markers and the keyword: what a user's Qwen2.5 tokenizer folder holds.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}',
    '<tool_response>\n{"temperature": 21}\n</tool_response> the quick brown fox jumps over the lazy dog',
    "What is the weather in Paris? It is 21 degrees and sunny. Summarize the document below. Answer:",
]


def build_qwen_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer with Qwen's special tokens and the reference template, saved as a
    Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 30, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN_TEMPLATE
    fast.save_pretrained(path)
    return Path(path)


def reference(tokenizer, messages: list[dict], tools=None, train_on: str = "assistant") -> tuple[list[int], list[int]]:
    """(input_ids, supervised) of a chat by the tokenizer's own template: every token of a trained turn
    (transformers' assistant mask), except the first token, which no token before it predicts."""
    out = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, train_on=train_on
    )
    supervised = list(out["assistant_masks"])
    supervised[0] = 0
    return list(out["input_ids"]), supervised


# ------------------------------------------------------------------------- real chat templates

# The official chat templates of tests/chat_templates (README.md there says where each comes from): per family,
# its file, the special tokens its template writes, BOS and EOS.
TEMPLATES = Path(__file__).parent / "chat_templates"
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3 = [*CHATML, "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
LLAMA = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
         "<|eom_id|>", "<|python_tag|>"]  # fmt: skip
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
            "<think>", "</think>"]  # fmt: skip
GPT_OSS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
           "<|call|>", "<|constrain|>"]  # fmt: skip
PHI3 = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
FAMILIES = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", CHATML, None, "<|im_end|>"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", QWEN3, None, "<|im_end|>"),
    "hermes3": ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", [*CHATML, "<|begin_of_text|>"],
                "<|begin_of_text|>", "<|im_end|>"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA, "<|begin_of_text|>", "<|eot_id|>"),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA, "<|begin_of_text|>", "<|eot_id|>"),
    "deepseek3.1": ("deepseek-ai-DeepSeek-V3.1.jinja", DEEPSEEK, DEEPSEEK[0], DEEPSEEK[1]),
    "gpt-oss": ("openai-gpt-oss-120b.jinja", GPT_OSS, "<|startoftext|>", "<|return|>"),
    "gpt-oss-training": ("trl-gptoss_training.jinja", GPT_OSS, "<|startoftext|>", "<|return|>"),
    "phi3.5": ("microsoft-Phi-3.5-mini-instruct.jinja", PHI3, None, "<|endoftext|>"),
    "phi3.5-training": ("trl-phi3_5_training.jinja", PHI3, None, "<|endoftext|>"),
    "qwq": ("Qwen-QwQ-32B.jinja", QWEN3, None, "<|im_end|>"),
    "r1-distill": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", DEEPSEEK, DEEPSEEK[0], DEEPSEEK[1]),
}  # fmt: skip
WORDS = (
    "the quick brown fox jumps over the lazy dog. What is the weather in Paris? It is 21 degrees and sunny. "
    "You are a helpful assistant. get_weather city Rome temperature Let me check. Hello there! think reason "
    "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 Environment: ipython tools function"
)


def build_tokenizer(path: Path, family: str):
    """A byte-level BPE tokenizer folder with ``family``'s special tokens, BOS, EOS and official chat template,
    saved and loaded back as a user's checkpoint folder is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    name, specials, bos, eos = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([WORDS] * 30, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos)
    fast.chat_template = (TEMPLATES / name).read_text()
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def brute_force(tokenizer, messages: list[dict], tools=None, trained=None) -> tuple[list[int], list[int]]:
    """(input_ids, supervised) of a chat by rendering it cut at each trained assistant message i (``trained``:
    their indices, None: every assistant's): the turn is what ``messages[:i + 1]`` adds to ``messages[:i]`` with
    the generation prompt, asserted to be a prefix of the whole; a token trains when it overlaps a turn."""
    import numpy as np

    def render(ms, prompt=False):
        return tokenizer.apply_chat_template(ms, tools=tools, tokenize=False, add_generation_prompt=prompt)

    full = render(messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"]).reshape(-1, 2)
    supervised = np.zeros(len(offsets), int)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or (trained is not None and i not in trained):
            continue
        before, upto = render(messages[:i], True) if i else "", render(messages[: i + 1])
        assert full.startswith(upto) and upto.startswith(before), i
        supervised |= (offsets[:, 1] > len(before)) & (offsets[:, 0] < len(upto))
    supervised[:1] = 0
    return list(enc["input_ids"]), supervised.tolist()


def blocks_reference(tokenizer, messages: list[dict], tools=None, trained=None) -> tuple[list[int], list[int]]:
    """(input_ids, supervised) of a chat by its template's ``{% generation %}`` blocks: transformers' assistant mask
    (``return_assistant_tokens_mask``), kept, where ``trained`` names the assistant messages that train, on the
    tokens between the content of the message before each of those and the content of the one after (each found
    in the text in order, a tool result as JSON where the template writes it so)."""
    import json

    import numpy as np

    out = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, supervised = list(out["input_ids"]), np.array(out["assistant_masks"])
    if trained is not None:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        starts = np.asarray(tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"])
        spans, at = {}, 0  # per message but the assistant's: where its content stands in the text
        for j, m in enumerate(messages):
            if m["role"] != "assistant" and m["content"]:
                content = m["content"] if m["content"] in text[at:] else json.dumps(m["content"])[1:-1]
                start = text.index(content, at)
                spans[j] = (start, at := start + len(content))
        keep = np.zeros(len(ids), bool)
        for i in trained:
            after = max((end for j, (_, end) in spans.items() if j < i), default=0)
            before = min((start for j, (start, _) in spans.items() if j > i), default=len(text))
            keep |= (starts[:, 0] >= after) & (starts[:, 0] < before)
        supervised &= keep
    supervised[:1] = 0
    return ids, supervised.astype(int).tolist()
