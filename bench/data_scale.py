"""Data set-up at scale (issue 20): tokens/s and peak RSS of HBPDataModule.setup("fit"), cold and warm.

    python bench/data_scale.py [--records 20000 200000] [--num-proc 1 2] [--repeats 1] [--work /tmp/lit_hbp_data_scale]

For each --records size it writes (once, cached in --work) a JSONL file of that many chat records
({"messages": [user, assistant]}) with lognormal lengths in words (median 200, sigma 1.9, capped at
20K words, split at random between the two turns), the words drawn by their frequency in a fixed set
of Python standard-library modules (seeded; streamed to disk in chunks, so 2M records need no more
memory than 20K). The tokenizer is the demo tokenizer (``lit_hbp.demo.text``, built in --work).

Every measurement runs in a fresh process (this script with --child), on the same records:

- import: peak RSS of a process that imports lit_hbp.lightning.datamodule and transformers and loads the
  tokenizer, what every set-up pays anyway; the RSS columns are peaks above it;
- tokenizer alone (the baseline of the same run): stream the JSONL, render each record with
  ``tok.apply_chat_template(messages, tokenize=False)`` and encode batches of 512 with
  ``tok(texts, add_special_tokens=False)`` (the fast tokenizer's own threads, as a user would call it);
- cold: the cache folder removed, then ``HBPDataModule(levels 16K sp1 + 64K sp1, over_length="drop",
  num_proc=P).setup("fit")`` without a Trainer: wall time, tokens/s of the tokens tokenized, peak RSS of
  the main process and of its largest worker (RUSAGE_CHILDREN), once per --num-proc;
- warm: the same with the cache present (what every rank of every later run pays).

With --repeats R the tokenizer alone and each cold set-up run R times (each in a fresh process) and
the fastest counts, with the highest peak RSS of the R; on a shared 2-core machine one run's
tokens/s can vary by 15%.

Bars (issue 20, 2-core CPU machine): peak RSS above import <= 1.0 GB, cold and warm; tokenization
>= 0.8 of the tokenizer alone at the default num_proc (every core). The 2M-record size needs ~5 GB
of JSONL and ~12 GB of cache disk; run it where the disk is.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

GEN_VERSION = "2"  # bump when the generated records change
MEDIAN_WORDS, SIGMA, MAX_WORDS = 200, 1.9, 20_000
SENTENCE_END = 1 / 12  # chance that a word starts a new sentence
CHUNK_RECORDS = 4096
VOCAB_MODULES = (  # fixed: the same words on every machine with the same Python
    "argparse.py", "collections/__init__.py", "dataclasses.py", "inspect.py", "json/decoder.py",
    "logging/__init__.py", "pathlib.py", "subprocess.py", "threading.py", "typing.py",
)  # fmt: skip
VOCAB_SIZE = 20_000
LEVELS = [{"pack_len": 16384, "sp": 1}, {"pack_len": 65536, "sp": 1}]
BATCH = 512
PREFIX, MID, SUFFIX = (
    b'{"messages": [{"role": "user", "content": "',
    b'."}, {"role": "assistant", "content": "',
    b'."}]}\n',
)
GB = 1 << 30


# ----------------------------------------------------------------------------------------- records


def vocabulary() -> tuple[list[str], np.ndarray]:
    """The VOCAB_SIZE most frequent words of VOCAB_MODULES and their frequencies (Zipf-like)."""
    import re
    from collections import Counter

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    counts: Counter = Counter()
    for name in VOCAB_MODULES:
        path = stdlib / name
        if path.is_file():
            counts.update(re.findall(r"[A-Za-z][a-z]{1,13}", path.read_text(encoding="utf-8", errors="replace")))
    if not counts:
        raise SystemExit(f"no vocabulary: none of {VOCAB_MODULES} under {stdlib}")
    words, freq = zip(*sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:VOCAB_SIZE])
    return list(words), np.asarray(freq, np.float64) / sum(freq)


class RecordWriter:
    """JSONL chat records built by one numpy gather per chunk: each record is a sequence of pieces
    (the JSON prefix, a message's first word, " word" or ". Word" for the next ones, the JSON between
    the turns, ..., the JSON suffix) whose bytes are gathered from one buffer."""

    def __init__(self, seed: int):
        words, self.p = vocabulary()
        v = len(words)
        pieces = [w.encode() for w in words] + [b" " + w.encode() for w in words]
        pieces += [b". " + w.capitalize().encode() for w in words] + [PREFIX, MID, SUFFIX]
        self.first, self.next, self.new_sentence = 0, v, 2 * v
        self.prefix, self.mid, self.suffix = 3 * v, 3 * v + 1, 3 * v + 2
        self.piece_len = np.array([len(x) for x in pieces], np.int64)
        self.piece_start = np.r_[0, np.cumsum(self.piece_len)[:-1]]
        self.buf = np.frombuffer(b"".join(pieces), np.uint8)
        self.rng = np.random.default_rng(seed)

    def chunk(self, n: int) -> bytes:
        rng = self.rng
        total = np.clip(np.rint(rng.lognormal(np.log(MEDIAN_WORDS), SIGMA, n)), 2, MAX_WORDS).astype(np.int64)
        user = np.clip(np.rint(total * rng.uniform(0.1, 0.9, n)), 1, total - 1).astype(np.int64)
        lens = np.stack([user, total - user], 1).ravel()  # words of each message, in order
        words = rng.choice(self.p.size, int(lens.sum()), p=self.p)
        words += np.where(rng.random(words.size) < SENTENCE_END, self.new_sentence, self.next)
        first = np.r_[0, np.cumsum(lens)[:-1]]
        words[first] = words[first] % self.p.size  # a message starts with the bare word
        # Insert prefix / mid / suffix: message m's words move right by (m // 2) * 3 + 1 + (m % 2).
        m = np.arange(lens.size)
        shift = np.repeat((m // 2) * 3 + 1 + (m % 2), lens)
        seq = np.empty(words.size + 3 * n, np.int64)
        seq[np.arange(words.size) + shift] = words
        rec_end = np.cumsum(lens.reshape(n, 2).sum(1) + 3)  # exclusive end of each record in seq
        seq[rec_end - 1] = self.suffix
        seq[rec_end - 2 - lens[1::2]] = self.mid
        seq[rec_end - 3 - lens[1::2] - lens[0::2]] = self.prefix
        # Gather the pieces' bytes.
        plen = self.piece_len[seq]
        out_start = np.cumsum(plen) - plen
        pos = np.arange(int(plen.sum()), dtype=np.int64) + np.repeat(self.piece_start[seq] - out_start, plen)
        return self.buf[pos].tobytes()


def ensure_records(work: Path, n: int, seed: int) -> Path:
    """The JSONL file of ``n`` records (written once; a half-written file is never used)."""
    path = work / f"chats-{n}-seed{seed}-v{GEN_VERSION}.jsonl"
    if path.exists():
        return path
    t = time.perf_counter()
    writer = RecordWriter(seed)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with tmp.open("wb") as f:
        for start in range(0, n, CHUNK_RECORDS):
            f.write(writer.chunk(min(CHUNK_RECORDS, n - start)))
    os.replace(tmp, path)
    say(f"wrote {n:,} records ({path.stat().st_size / 1e6:.0f} MB) to {path} in {time.perf_counter() - t:.1f} s")
    return path


def ensure_tokenizer(work: Path) -> str:
    from lit_hbp.demo.text import ensure_demo

    return str(ensure_demo(work / "demo")["paths"]["tokenizer"])


# ------------------------------------------------------------------------------------------ children


def peak_rss(who=resource.RUSAGE_SELF) -> int:
    """Peak resident set in bytes. This process's is VmHWM, the high-water mark of its own address
    space: ru_maxrss would carry over the RSS of the parent that started it (Linux keeps the larger
    of the two across exec), here the bench parent after writing the records. For RUSAGE_CHILDREN,
    the largest reaped worker's ru_maxrss: a forked worker counts the pages it shares with this one."""
    if who == resource.RUSAGE_SELF and Path("/proc/self/status").is_file():
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(who).ru_maxrss * 1024


def child_import(args) -> dict:
    import transformers  # noqa: F401

    from lit_hbp.lightning.datamodule import load_tokenizer

    load_tokenizer(args.tokenizer)
    return dict(rss=peak_rss())


def child_tokenizer(args) -> dict:
    """The tokenizer alone on the same records: render + batch encode, streaming the file."""
    import transformers  # noqa: F401

    from lit_hbp.lightning.datamodule import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    records = tokens = 0
    t = time.perf_counter()
    with open(args.jsonl, encoding="utf-8") as f:
        while True:
            lines = [line for _, line in zip(range(BATCH), f)]
            if not lines:
                break
            texts = [tok.apply_chat_template(json.loads(x)["messages"], tokenize=False) for x in lines]
            tokens += sum(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"])
            records += len(lines)
    seconds = time.perf_counter() - t
    return dict(records=records, tokens=tokens, seconds=seconds, tok_s=tokens / seconds, rss=peak_rss())


def child_setup(args) -> dict:
    """One HBPDataModule.setup("fit"), cold (cache removed first) or warm."""
    import transformers  # noqa: F401

    from lit_hbp.lightning.datamodule import HBPDataModule

    cold = args.child == "cold"
    if cold:
        shutil.rmtree(args.cache, ignore_errors=True)
    dm = HBPDataModule(
        sources=[{"path": args.jsonl}],
        tokenizer=args.tokenizer,
        levels=LEVELS,
        over_length="drop",
        cache_dir=args.cache,
        num_proc=args.num_proc,
    )
    t = time.perf_counter()
    dm.setup("fit")
    seconds = time.perf_counter() - t
    store = dm.store
    from_cache = [bool(s.from_cache) for s in store.sources]
    if any(from_cache) if cold else not all(from_cache):
        raise SystemExit(f"{args.child} set-up but sources from cache: {from_cache}")
    tokenized = sum(int(s.offsets[-1]) for s in store.sources)
    return dict(
        seconds=seconds,
        records=sum(len(s) for s in store.sources),
        samples=int(store.lengths.size),
        tokens=tokenized,
        tokens_kept=int(store.lengths.sum()),
        tok_s=tokenized / seconds,
        rss=peak_rss(),
        child_rss=peak_rss(resource.RUSAGE_CHILDREN),
    )


CHILDREN = {"import": child_import, "tokenizer": child_tokenizer, "cold": child_setup, "warm": child_setup}


def run_child(kind: str, **kw) -> dict:
    """Run this script as a fresh ``--child kind`` process; its last stdout line is its JSON result."""
    cmd = [sys.executable, __file__, "--child", kind]
    for k, v in kw.items():
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"child {kind} {kw} failed with exit status {proc.returncode}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    say(f"  {kind} {kw.get('num_proc') or ''}: {time.perf_counter() - t:.1f} s in all")
    return out


def best_child(repeats: int, kind: str, **kw) -> dict:
    """The fastest of ``repeats`` fresh runs, with the highest peak RSS among them."""
    runs = [run_child(kind, **kw) for _ in range(repeats)]
    best = min(runs, key=lambda r: r["seconds"])
    return {**best, **{k: max(r[k] for r in runs) for k in ("rss", "child_rss") if k in best}}


# -------------------------------------------------------------------------------------------- parent


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def disk_usage(folder: Path) -> int:
    """Bytes on disk under ``folder`` (like du)."""
    return sum(os.lstat(Path(d) / f).st_blocks * 512 for d, _, files in os.walk(folder) for f in files)


def markdown(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table of ``rows``: columns are (key, header, format)."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format(r[k], f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


COLUMNS = [
    ("records", "records", ","),
    ("tokens", "tokens", ","),
    ("num_proc", "num_proc", "d"),
    ("cold_s", "cold s", ".1f"),
    ("cold_tok_s", "cold tok/s", ",.0f"),
    ("ratio", "vs tokenizer alone", ".2f"),
    ("cold_rss", "cold RSS over import GB (main)", ".2f"),
    ("child_rss", "max child RSS GB", ".2f"),
    ("warm_s", "warm s", ".3f"),
    ("warm_rss", "warm RSS over import GB", ".2f"),
    ("cache", "cache on disk GB", ".3f"),
]


def measure(args, tokenizer: str) -> tuple[list[dict], list[str]]:
    imported = run_child("import", tokenizer=tokenizer)["rss"]
    notes = [f"import only (lit_hbp.lightning.datamodule + transformers + tokenizer): peak RSS {imported / GB:.2f} GB"]
    rows = []
    for n in args.records:
        say(f"{n:,} records")
        jsonl = ensure_records(args.work, n, args.seed)
        cache = args.work / f"cache-{n}"
        base = best_child(args.repeats, "tokenizer", tokenizer=tokenizer, jsonl=jsonl)
        notes.append(
            f"{n:,} records ({jsonl.stat().st_size / 1e6:,.0f} MB JSONL): tokenizer alone {base['tokens']:,} tokens "
            f"in {base['seconds']:.1f} s, {base['tok_s']:,.0f} tokens/s"
        )
        for p in args.num_proc:
            kw = dict(tokenizer=tokenizer, jsonl=jsonl, cache=cache, num_proc=p)
            cold, warm = best_child(args.repeats, "cold", **kw), run_child("warm", **kw)
            if cold["tokens"] != base["tokens"]:
                notes.append(f"note: {n:,} records, num_proc {p}: set-up tokenized {cold['tokens']:,} tokens, "
                             f"the tokenizer alone {base['tokens']:,}")  # fmt: skip
            rows.append(
                dict(
                    records=cold["records"],
                    tokens=cold["tokens"],
                    num_proc=p,
                    cold_s=cold["seconds"],
                    cold_tok_s=cold["tok_s"],
                    ratio=cold["tok_s"] / base["tok_s"],
                    cold_rss=(cold["rss"] - imported) / GB,
                    child_rss=cold["child_rss"] / GB,
                    warm_s=warm["seconds"],
                    warm_rss=(warm["rss"] - imported) / GB,
                    cache=disk_usage(cache) / GB,
                )
            )
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    return rows, notes


def main() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, nargs="+", default=[20_000, 200_000])
    p.add_argument("--num-proc", type=int, nargs="+", default=sorted({1, cores}))
    p.add_argument("--work", type=Path, default=Path("/tmp/lit_hbp_data_scale"), help="records, tokenizer, caches")
    p.add_argument(
        "--repeats", type=int, default=1, help="best of R runs of the tokenizer alone and of each cold set-up"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-cache", action="store_true", help="keep each size's token cache after the run")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    for name in ("tokenizer", "jsonl", "cache"):
        p.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.num_proc = args.num_proc[0]
        print(json.dumps(CHILDREN[args.child](args)))
        return 0

    args.work.mkdir(parents=True, exist_ok=True)
    rows, notes = measure(args, ensure_tokenizer(args.work))
    print(f"HBPDataModule.setup('fit'), levels 16K sp1 + 64K sp1, over_length drop, {cores} cores; "
          "each set-up in a fresh process; ratio = cold tokens/s / the tokenizer alone's in the same run")  # fmt: skip
    print(markdown(rows, COLUMNS))
    print("\n" + "\n".join(notes))
    rss = max(max(r["cold_rss"], r["warm_rss"]) for r in rows)
    default = [r for r in rows if r["num_proc"] == cores] or rows
    ratio = min(r["ratio"] for r in default)
    rss_ok, speed_ok = rss <= 1.0, ratio >= 0.8
    print(f"\npeak RSS over import <= 1.0 GB (cold and warm, worst {rss:.2f} GB): {'PASS' if rss_ok else 'FAIL'}")
    print(
        f"tokenization >= 0.8 of the tokenizer alone (num_proc {default[0]['num_proc']}, worst {ratio:.2f}): "
        f"{'PASS' if speed_ok else 'FAIL'}"
    )
    return 0 if rss_ok and speed_ok else 1


if __name__ == "__main__":
    sys.exit(main())
