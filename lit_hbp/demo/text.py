"""Offline demo SFT data and tokenizer, built from a snapshot of the Python standard library sources.

Why: CPU training runs, tests and benchmarks need a realistic long-context SFT mix (thousands of
short chats plus a few 2K-64K+ token long-context tasks) and a tokenizer, without network access.
Both are generated from the standard library modules of one Python release (``corpus/`` beside this
package: each module's source and what ``ast`` found in it), the same files on every machine, so the
demo's samples, tokenizer and counts do not depend on the Python that builds them:

- ``short.jsonl``: question/answer chats about one function, method or class (explain it, write its
  signature, summarize or write its docstring, explain its code, list its parameters or methods),
  some with a system prompt, a few with two turns.
- ``long.jsonl``: one or more whole modules concatenated in the user turn, followed by a question
  whose answer is computed from the source with ``ast`` (list a module's functions or a class's
  methods, find the function whose docstring begins with a needle, a parameter's default value,
  which module defines a function, a module's classes). Target lengths are drawn log-uniformly
  (stratified) between 2K and 70K tokens; the largest target is always the top of the range.
- ``tokenizer/``: a byte-level BPE tokenizer trained on the module sources and the short chats,
  saved with ``PreTrainedTokenizerFast.save_pretrained`` so ``AutoTokenizer.from_pretrained`` loads
  it offline; it has no post-processor, so ``encode`` adds no BOS/EOS.
- ``manifest.json``: arguments, counts, token length statistics, the corpus and its Python release.

Token lengths are measured on the chat-template rendering encoded with ``add_special_tokens=False``.
In transformers 5.23, ``tok.apply_chat_template(messages, tokenize=True)`` returns a
``BatchEncoding`` with ``input_ids`` and ``attention_mask`` (``return_dict`` defaults to True);
``return_dict=False`` gives a plain ``list[int]``. Both equal ``tok.encode(rendered_text)``.

The build is deterministic (a fixed corpus, seeded ``random.Random``, deterministic BPE training): same
arguments give byte-identical files on every machine with the same ``tokenizers`` release. Run
``python -m lit_hbp.demo.text OUT_DIR [--n-short N] [--n-long M] [--vocab-size V] [--seed S]``.
``python -m lit_hbp.demo.text --freeze-corpus FILE`` writes the corpus anew from the running Python's
standard library (how ``corpus/`` was made; building from another corpus changes every count).

One module of about 600 lines on purpose: the chat and long-task generators, the tokenizer trained on
their output and the build that seeds them all change together, and any change to one is a new
``GENERATOR_VERSION`` (which tells ``ensure_demo`` to rebuild a folder built by the old code).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from lit_hbp.demo.stdlib import (  # noqa: F401  (tests and the packaging check read them here too)
    CORPUS,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    _corpus,
    _corpus_file,
    _dedent,
    _Def,
    _load_modules,
    _Module,
    _module_from_record,
    _stdlib_files,
    freeze_corpus,
)

__all__ = ["CHAT_TEMPLATE", "GENERATOR_VERSION", "SPECIAL_TOKENS", "build_demo", "ensure_demo", "main"]

GENERATOR_VERSION = "2"  # 2: from the committed corpus, not the host's standard library
# Prefix-stable: rendering a conversation's first k turns gives a prefix of rendering all turns.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SHORT_FILE, LONG_FILE, TOKENIZER_DIR, MANIFEST_FILE = "short.jsonl", "long.jsonl", "tokenizer", "manifest.json"
LONG_TOKENS = (2048, 70_000)  # log-uniform target range of long samples; the top target is always the max
_LONG_OVERHEAD = 160  # tokens of intro, question, answer and template around the module sources
_MAX_CODE_CHARS = 12_000  # keeps short samples at a few thousand tokens at most
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are an expert Python developer. Answer precisely and concisely.",
    "You are a code assistant that explains the Python standard library.",
    "Answer the user's question about Python code. Quote names exactly.",
)


class _TokenCounts:
    """Exact token counts of module blocks, computed on first use: a build needs only some of them."""

    # Byte-level BPE on code stays below 5 characters per token; the bound only skips hopeless candidates.
    MAX_CHARS_PER_TOKEN = 8

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.cache: dict[str, int] = {}

    def __call__(self, m: _Module) -> int:
        if m.name not in self.cache:
            self.cache[m.name] = len(self.backend.encode(m.block).ids)
        return self.cache[m.name]

    @classmethod
    def lower_bound(cls, m: _Module) -> int:
        return len(m.block) // cls.MAX_CHARS_PER_TOKEN


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.split("\n\n", 1)[0].split())


def _first_sentence(doc: str) -> str:
    para = _first_paragraph(doc)
    match = re.match(r"(.+?[.!?])(\s|$)", para)
    return match.group(1) if match else para


def _bullets(names: Sequence[str]) -> str:
    return "\n".join(f"- `{n}`" for n in names)


# Short templates: each takes a definition and the rng and returns the turns, or None when it does not apply.
_Turns = list[dict[str, str]]


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _t_explain(d: _Def, rng: random.Random) -> _Turns | None:
    if not d.doc:
        return None
    q = rng.choice(
        (
            "What does `{m}.{q}` do?",
            "Explain what the {w} `{q}` in the `{m}` module is for.",
            "I'm reading the `{m}` module. What is `{q}` used for?",
            "Describe the behaviour of `{m}.{q}`.",
        )
    )
    return [_turn("user", q.format(m=d.module, q=d.qual, w=d.kind)), _turn("assistant", d.doc)]


def _t_signature(d: _Def, rng: random.Random) -> _Turns | None:
    q = rng.choice(("Write the signature of `{m}.{q}`.", "What is the signature of the {w} `{q}` from `{m}`?"))
    answer = f"```python\n{d.signature}\n```"
    return [_turn("user", q.format(m=d.module, q=d.qual, w=d.kind)), _turn("assistant", answer)]


def _t_summary(d: _Def, rng: random.Random) -> _Turns | None:
    if not d.doc:
        return None
    q = rng.choice(("Summarize the docstring of `{m}.{q}` in one sentence.", "In one sentence, what is `{m}.{q}`?"))
    return [_turn("user", q.format(m=d.module, q=d.qual)), _turn("assistant", _first_sentence(d.doc))]


def _t_write_docstring(d: _Def, rng: random.Random) -> _Turns | None:
    if not d.code or len(d.code) > _MAX_CODE_CHARS:
        return None
    q = rng.choice(
        (
            "Write a docstring for this {w} from the `{m}` module:\n\n```python\n{c}\n```",
            "Document the following code with a docstring.\n\n```python\n{c}\n```",
        )
    )
    return [_turn("user", q.format(m=d.module, w=d.kind, c=d.code)), _turn("assistant", d.doc)]


def _t_explain_code(d: _Def, rng: random.Random) -> _Turns | None:
    if not d.code or len(d.code) > _MAX_CODE_CHARS:
        return None
    q = rng.choice(
        ("What does the following code do?\n\n```python\n{c}\n```", "Explain this {w}:\n\n```python\n{c}\n```")
    )
    return [_turn("user", q.format(w=d.kind, c=d.code)), _turn("assistant", _first_paragraph(d.doc))]


def _t_params(d: _Def, rng: random.Random) -> _Turns | None:
    if d.kind == "class" or not d.params:
        return None
    lines = [f"- `{p}`" + ("" if default is None else f" (default `{default}`)") for p, default in d.params]
    answer = f"`{d.qual}` takes {len(d.params)} parameter{'s' if len(d.params) > 1 else ''}:\n" + "\n".join(lines)
    q = rng.choice(("What parameters does `{m}.{q}` take?", "List the arguments of `{m}.{q}` and their defaults."))
    return [_turn("user", q.format(m=d.module, q=d.qual)), _turn("assistant", answer)]


def _t_methods(d: _Def, rng: random.Random) -> _Turns | None:
    if d.kind != "class" or not d.methods:
        return None
    q = rng.choice(("Which methods does class `{m}.{q}` define?", "List the methods of `{m}.{q}`."))
    answer = f"`{d.qual}` defines {len(d.methods)} method{'s' if len(d.methods) > 1 else ''}:\n" + _bullets(d.methods)
    return [_turn("user", q.format(m=d.module, q=d.qual)), _turn("assistant", answer)]


def _t_multi_turn(d: _Def, rng: random.Random) -> _Turns | None:
    first = _t_explain(d, rng)
    if first is None:
        return None
    follow = rng.choice(("And what is its signature?", "Thanks. Can you show me its signature?"))
    return first + [_turn("user", follow), _turn("assistant", f"```python\n{d.signature}\n```")]


_SHORT_TEMPLATES: dict[str, tuple[float, Callable[[_Def, random.Random], _Turns | None]]] = {
    "explain": (0.24, _t_explain),
    "signature": (0.14, _t_signature),
    "summary": (0.14, _t_summary),
    "write_docstring": (0.14, _t_write_docstring),
    "explain_code": (0.10, _t_explain_code),
    "params": (0.10, _t_params),
    "methods": (0.10, _t_methods),
    "multi_turn": (0.04, _t_multi_turn),
}


def _short_samples(modules: Sequence[_Module], n: int, rng: random.Random) -> tuple[list[_Turns], Counter[str]]:
    """Cycle through the shuffled documented definitions, one weighted-random applicable template each."""
    defs = [d for m in modules for d in m.defs if d.doc]
    rng.shuffle(defs)
    names = list(_SHORT_TEMPLATES)
    weights = [_SHORT_TEMPLATES[k][0] for k in names]
    samples: list[_Turns] = []
    used: Counter[str] = Counter()
    i = 0
    while len(samples) < n and defs:
        d = defs[i % len(defs)]
        i += 1
        for name in rng.choices(names, weights, k=3):
            turns = _SHORT_TEMPLATES[name][1](d, rng)
            if turns is not None:
                break
        else:
            turns, name = _t_signature(d, rng), "signature"
        assert turns is not None
        if rng.random() < 0.25:
            turns = [_turn("system", rng.choice(_SYSTEM_PROMPTS)), *turns]
        samples.append(turns)
        used[name] += 1
    return samples, used


# Long tasks: each takes the anchor module and the full context text and returns (question, answer) or None.
_QA = tuple[str, str]


def _l_list_functions(m: _Module, context: str, rng: random.Random) -> _QA | None:
    if not m.functions or len(m.functions) > 80:
        return None
    q = f"List the top-level functions defined in module `{m.name}`, in the order they appear."
    return q, f"Module `{m.name}` defines {len(m.functions)} top-level function(s):\n{_bullets(m.functions)}"


def _l_list_methods(m: _Module, context: str, rng: random.Random) -> _QA | None:
    options = [(c, ms) for c, ms in m.classes if 2 <= len(ms) <= 80]
    if not options:
        return None
    cls, methods = rng.choice(options)
    q = f"List the methods defined in class `{cls}` of module `{m.name}`, in order."
    return q, f"Class `{cls}` defines {len(methods)} methods:\n{_bullets(methods)}"


def _needle_prefix(doc: str) -> str | None:
    words = doc.split("\n", 1)[0].split()
    prefix = ""
    for w in words:
        if len(prefix) + len(w) + 1 > 70:
            break
        prefix = f"{prefix} {w}".strip()
    return prefix if len(prefix) >= 20 and len(prefix.split()) >= 3 else None


def _l_needle(m: _Module, context: str, rng: random.Random) -> _QA | None:
    options = []
    for d in m.defs:
        if d.kind == "class" or not d.doc:
            continue
        prefix = _needle_prefix(d.doc)
        if prefix and '"' not in prefix and context.count(prefix) == 1:
            options.append((d, prefix))
    if not options:
        return None
    d, prefix = rng.choice(options)
    q = f'Which function\'s docstring begins with "{prefix}"? Give its module and qualified name.'
    return q, f"It is the docstring of {d.kind} `{d.qual}` in module `{m.name}`."


def _l_default(m: _Module, context: str, rng: random.Random) -> _QA | None:
    if not m.defaults:
        return None
    qual, param, default = rng.choice(m.defaults)
    kind = "method" if "." in qual else "function"
    q = f"In module `{m.name}`, what is the default value of parameter `{param}` of {kind} `{qual}`?"
    return q, f"The default value of `{param}` in `{qual}` is `{default}`."


def _l_which_module(m: _Module, context: str, rng: random.Random) -> _QA | None:
    options = [f for f in m.functions if context.count(f"def {f}(") == 1]
    if not options:
        return None
    fn = rng.choice(options)
    return f"Which of the modules above defines the function `{fn}`?", f"`{fn}` is defined in module `{m.name}`."


def _l_classes(m: _Module, context: str, rng: random.Random) -> _QA | None:
    names = m.class_names
    if not names or len(names) > 80 or len(m.classes) != len(names):  # a class defined twice makes "how many" moot
        return None
    q = f"How many classes are defined at the top level of module `{m.name}`? Name them in order."
    return q, f"{len(names)} class{'es' if len(names) > 1 else ''}:\n{_bullets(names)}"


_LONG_TASKS: dict[str, Callable[[_Module, str, random.Random], _QA | None]] = {
    "list_functions": _l_list_functions,
    "needle_docstring": _l_needle,
    "default_value": _l_default,
    "list_methods": _l_list_methods,
    "which_module": _l_which_module,
    "list_classes": _l_classes,
}
_LONG_INTROS = (
    "Below are the sources of {k} Python standard library module(s).",
    "Read the following Python source file(s) carefully; a question follows.",
    "Here is some code from the Python standard library ({k} file(s)).",
)


def _long_targets(n: int, rng: random.Random) -> list[int]:
    """Stratified log-uniform token targets in LONG_TOKENS; the largest is always the top of the range."""
    lo, hi = LONG_TOKENS
    us = [(i + rng.random()) / n for i in range(n)]
    if us:
        us[-1] = 1.0
    return [round(lo * (hi / lo) ** u) for u in us]


def _pick_modules(
    pool: Sequence[_Module], anchor: _Module, budget: int, count: _TokenCounts, rng: random.Random
) -> list[_Module]:
    """The anchor plus randomly ordered modules that fit, until the budget is filled to within 3%."""
    chosen = [anchor]
    left = budget - count(anchor)
    slack = max(64, budget // 33)
    for i in rng.sample(range(len(pool)), len(pool)):
        if left <= slack:
            break
        m = pool[i]
        if m is anchor or count.lower_bound(m) > left + slack:
            continue
        n = count(m)
        if n <= left + slack:
            chosen.append(m)
            left -= n
    rng.shuffle(chosen)
    return chosen


def _long_sample(
    pool: Sequence[_Module], target: int, task: str, count: _TokenCounts, rng: random.Random
) -> tuple[_Turns, str] | None:
    """A long-context conversation of about `target` tokens whose answer is computed from the sources."""
    budget = target - _LONG_OVERHEAD
    anchors = [m for m in pool if count.lower_bound(m) <= budget]
    for _ in range(100 if anchors else 0):
        anchor = rng.choice(anchors)
        if count(anchor) > budget * 1.03:
            continue
        modules = _pick_modules(pool, anchor, budget, count, rng)
        context = "\n".join(m.block for m in modules)
        qa = _LONG_TASKS[task](anchor, context, rng)
        if qa is None:
            continue
        question, answer = qa
        intro = rng.choice(_LONG_INTROS).format(k=len(modules))
        if rng.random() < 0.7:
            user = f"{intro}\n\n{context}\nQuestion: {question}"
        else:
            user = f"{question}\n\n{intro}\n\n{context}"
        turns = [_turn("user", user), _turn("assistant", answer)]
        if rng.random() < 0.2:
            follow = [k for k in _LONG_TASKS if k != task]
            rng.shuffle(follow)
            for k in follow:
                qa2 = _LONG_TASKS[k](anchor, context, rng)
                if qa2 is not None:
                    turns += [_turn("user", qa2[0]), _turn("assistant", qa2[1])]
                    break
        if rng.random() < 0.3:
            turns = [_turn("system", rng.choice(_SYSTEM_PROMPTS)), *turns]
        return turns, task
    return None


def byte_level_bpe(texts: list[str], vocab_size: int, specials: Sequence[str]) -> Any:
    """A byte-level BPE (``tokenizers``) trained on ``texts`` with ``specials`` first: the demos' own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer, length=len(texts))
    return backend


def _train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """Byte-level BPE over the demo text, wrapped as a transformers fast tokenizer with the chat template."""
    from transformers import PreTrainedTokenizerFast

    backend = byte_level_bpe(texts, vocab_size, SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=EOS,
        extra_special_tokens=list(SPECIAL_TOKENS[2:]),
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _token_lengths(tok: Any, conversations: list[_Turns]) -> list[int]:
    if not conversations:
        return []
    texts = tok.apply_chat_template(conversations, tokenize=False)
    return [len(e.ids) for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def _stats(lengths: list[int]) -> dict[str, Any]:
    if not lengths:
        return {"min": 0, "median": 0, "max": 0, "mean": 0.0, "total": 0}
    return {
        "min": min(lengths),
        "median": statistics.median(lengths),
        "max": max(lengths),
        "mean": round(statistics.fmean(lengths), 1),
        "total": sum(lengths),
    }


# Characters that str.splitlines() treats as line breaks but json.dumps(ensure_ascii=False) leaves raw.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _write_jsonl(path: Path, conversations: list[_Turns]) -> None:
    """UTF-8 JSON lines that stay one record per line for any line splitter."""
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for turns in conversations:
            f.write(json.dumps({"messages": turns}, ensure_ascii=False).translate(_LINE_BREAKS) + "\n")


def _paths(out: Path) -> dict[str, str]:
    return {
        "out_dir": str(out),
        "short": str(out / SHORT_FILE),
        "long": str(out / LONG_FILE),
        "tokenizer": str(out / TOKENIZER_DIR),
        "manifest": str(out / MANIFEST_FILE),
    }


def build_demo(
    out_dir: str | os.PathLike[str], n_short: int = 4000, n_long: int = 48, vocab_size: int = 8192, seed: int = 0
) -> dict[str, Any]:
    """Build the demo dataset and tokenizer into `out_dir`; returns the manifest plus a `paths` entry.

    Files are built in a temporary directory inside `out_dir` and moved into place one by one,
    the manifest last, so a present manifest means a complete build.
    """
    if n_short < 0 or n_long < 0 or vocab_size < 512:
        raise ValueError("n_short and n_long must be >= 0 and vocab_size >= 512")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    modules = _load_modules()

    short, short_tasks = _short_samples(modules, n_short, rng)
    corpus = [m.block for m in modules] + [t["content"] for turns in short for t in turns]
    tok = _train_tokenizer(corpus, vocab_size)
    count = _TokenCounts(tok.backend_tokenizer)
    pool = [m for m in modules if count.lower_bound(m) <= LONG_TOKENS[1]]
    tasks = list(_LONG_TASKS)
    long: list[_Turns] = []
    long_tasks: Counter[str] = Counter()
    for i, target in enumerate(tqdm(_long_targets(n_long, rng), desc="long samples", disable=None)):
        if i % len(tasks) == 0:
            rng.shuffle(tasks)
        order = tasks[i % len(tasks) :] + tasks[: i % len(tasks)]
        for task in order:
            built = _long_sample(pool, target, task, count, rng)
            if built is not None:
                long.append(built[0])
                long_tasks[built[1]] += 1
                break
    rng.shuffle(long)

    short_len, long_len = _token_lengths(tok, short), _token_lengths(tok, long)
    manifest: dict[str, Any] = {
        "generator": "lit_hbp.demo.text",
        "generator_version": GENERATOR_VERSION,
        "args": {"n_short": n_short, "n_long": n_long, "vocab_size": vocab_size, "seed": seed},
        "corpus": {"file": CORPUS, "python_version": _corpus()["python_version"], "modules": len(modules)},
        "files": {
            SHORT_FILE: {
                "samples": len(short),
                "tokens": _stats(short_len),
                "tasks": dict(sorted(short_tasks.items())),
            },
            LONG_FILE: {"samples": len(long), "tokens": _stats(long_len), "tasks": dict(sorted(long_tasks.items()))},
        },
        "long_token_range": list(LONG_TOKENS),
        "tokenizer": {
            "dir": TOKENIZER_DIR,
            "vocab_size": len(tok),
            "special_tokens": {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS},
            "chat_template": CHAT_TEMPLATE,
        },
    }

    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out))
    try:
        _write_jsonl(tmp / SHORT_FILE, short)
        _write_jsonl(tmp / LONG_FILE, long)
        tok.save_pretrained(str(tmp / TOKENIZER_DIR))
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        (out / MANIFEST_FILE).unlink(missing_ok=True)
        for name in (SHORT_FILE, LONG_FILE):
            os.replace(tmp / name, out / name)
        if (out / TOKENIZER_DIR).exists():
            os.replace(out / TOKENIZER_DIR, tmp / "old-tokenizer")
        os.replace(tmp / TOKENIZER_DIR, out / TOKENIZER_DIR)
        os.replace(tmp / MANIFEST_FILE, out / MANIFEST_FILE)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**manifest, "paths": _paths(out)}


def _complete(out: Path, requested: dict[str, Any]) -> dict[str, Any] | None:
    """The existing manifest when every file is present and it matches the requested arguments."""
    needed = [SHORT_FILE, LONG_FILE, f"{TOKENIZER_DIR}/tokenizer.json", f"{TOKENIZER_DIR}/tokenizer_config.json"]
    try:
        manifest = json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not all((out / n).is_file() for n in needed) or manifest.get("generator_version") != GENERATOR_VERSION:
        return None
    if any(manifest.get("args", {}).get(k) != v for k, v in requested.items()):
        return None
    return manifest


def ensure_demo(out_dir: str | os.PathLike[str], **kwargs: Any) -> dict[str, Any]:
    """Return the demo in `out_dir`, building it only if a file is missing or `kwargs` differ from its manifest.

    Arguments not passed are not compared, so `ensure_demo(d)` accepts any complete build. A file
    lock in `out_dir` makes concurrent callers wait for one build instead of racing.
    """
    from filelock import FileLock

    out = Path(out_dir)
    unknown = set(kwargs) - {"n_short", "n_long", "vocab_size", "seed"}
    if unknown:
        raise TypeError(f"unknown arguments: {sorted(unknown)}")
    manifest = _complete(out, kwargs)
    if manifest is not None:
        return {**manifest, "paths": _paths(out)}
    out.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out / ".demo.lock")):
        manifest = _complete(out, kwargs)
        if manifest is not None:
            return {**manifest, "paths": _paths(out)}
        return build_demo(out, **kwargs)


def _table(result: dict[str, Any]) -> str:
    rows = [("file", "samples", "min", "median", "max")]
    for name, info in result["files"].items():
        t = info["tokens"]
        rows.append((name, str(info["samples"]), str(t["min"]), f"{t['median']:g}", str(t["max"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
    )


BUILD_DEFAULTS = {
    "n_short": 4000,
    "n_long": 48,
    "vocab_size": 8192,
    "seed": 0,
}  # build_demo's: what the CLI builds with where an option is not given


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``low``, refused in one line naming the option otherwise
    (the demos' counts and sizes; a build would stop on it with a traceback, or build nothing)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text}")
        return value

    return parse


def out_folder(text: str) -> Path:
    """An argparse ``type``: a folder to build a demo in, refused in one line where it, or the nearest
    part of it that exists, is a file (the build would stop there with a traceback)."""
    path = Path(text)
    there = next(p for p in (path, *path.parents) if p.exists())
    if not there.is_dir():
        raise argparse.ArgumentTypeError(f"{there} is a file: give a folder (the demo is built there)")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: build the demo data and print a per-file token length summary."""
    parser = argparse.ArgumentParser(prog="python -m lit_hbp.demo.text", description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("out_dir", type=out_folder, nargs="?")
    parser.add_argument("--n-short", type=at_least(0), help="short chats (default 4000)")
    parser.add_argument("--n-long", type=at_least(0), help="long-context tasks (default 48)")
    parser.add_argument("--vocab-size", type=at_least(512), help="tokenizer vocabulary (default 8192)")
    parser.add_argument("--seed", type=int, help="default 0")  # no argparse defaults: --freeze-corpus refuses them
    parser.add_argument("--if-missing", action="store_true", help="keep an existing complete build (ensure_demo)")
    parser.add_argument(
        "--freeze-corpus",
        type=Path,
        metavar="FILE",
        help="write the corpus from this Python's standard library instead (maintainers: how corpus/ was made)",
    )
    args = parser.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if k in BUILD_DEFAULTS and v is not None}
    if args.freeze_corpus is not None:
        build = (
            [f"--{k.replace('_', '-')}" for k in given]
            + ["OUT_DIR"] * bool(args.out_dir)
            + ["--if-missing"] * args.if_missing
        )
        if build:
            parser.error(f"--freeze-corpus writes the corpus and builds nothing: drop {', '.join(build)}")
        frozen = freeze_corpus(args.freeze_corpus)
        what = f"{frozen['modules']} modules of Python {frozen['python_version']}, {frozen['bytes']} bytes"
        print(f"{args.freeze_corpus}: {what}")
        return 0
    if args.out_dir is None:
        parser.error("the output folder is required (or --freeze-corpus FILE)")
    kwargs = {**BUILD_DEFAULTS, **given}
    start = time.perf_counter()
    result = ensure_demo(args.out_dir, **kwargs) if args.if_missing else build_demo(args.out_dir, **kwargs)
    print(_table(result))
    tok = result["tokenizer"]
    print(f"tokenizer: {result['paths']['tokenizer']} (vocab {tok['vocab_size']})")
    corpus = result["corpus"]
    print(
        f"{corpus['modules']} modules of Python {corpus['python_version']}'s standard library ({corpus['file']}); "
        f"{time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
