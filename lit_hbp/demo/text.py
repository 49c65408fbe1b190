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

The chats and long tasks are written by ``demo.conversations``; a change to them, the tokenizer trained on their
output or the build that seeds them is a new ``GENERATOR_VERSION`` (which tells ``ensure_demo`` to rebuild a
folder built by the old code).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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

from lit_hbp.demo.conversations import (
    LONG_TASKS,
    LONG_TOKENS,
    TokenCounts,
    Turns,
    long_sample,
    long_targets,
    short_samples,
)
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


def _token_lengths(tok: Any, conversations: list[Turns]) -> list[int]:
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


def _write_jsonl(path: Path, conversations: list[Turns]) -> None:
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

    short, short_tasks = short_samples(modules, n_short, rng)
    corpus = [m.block for m in modules] + [t["content"] for turns in short for t in turns]
    tok = _train_tokenizer(corpus, vocab_size)
    count = TokenCounts(tok.backend_tokenizer)
    pool = [m for m in modules if count.lower_bound(m) <= LONG_TOKENS[1]]
    tasks = list(LONG_TASKS)
    long: list[Turns] = []
    long_tasks: Counter[str] = Counter()
    for i, target in enumerate(tqdm(long_targets(n_long, rng), desc="long samples", disable=None)):
        if i % len(tasks) == 0:
            rng.shuffle(tasks)
        order = tasks[i % len(tasks) :] + tasks[: i % len(tasks)]
        for task in order:
            built = long_sample(pool, target, task, count, rng)
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
