"""The offline demo SFT set: schema, tokenizer, lengths, answers derivable from context, determinism, caching,
and the committed corpus it is built from (the same on every machine, whatever its Python)."""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import json
import math
import random
import re
import shutil
import statistics
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lit_hbp.demo import conversations
from lit_hbp.demo import text as demo

SMALL = {"n_short": 200, "n_long": 6, "vocab_size": 2048, "seed": 0}
CORPUS = Path(demo.__file__).parent / "corpus" / demo.CORPUS
HEADER = re.compile(r"^### Module `([\w.]+)` \(file `([\w./-]+)`\)$", re.M)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return demo.build_demo(tmp_path_factory.mktemp("demo") / "small", **SMALL)


@pytest.fixture(scope="module")
def tok(small: dict):
    return AutoTokenizer.from_pretrained(small["paths"]["tokenizer"])


def read(path: str | Path) -> list[list[dict[str, str]]]:
    return [json.loads(line)["messages"] for line in Path(path).read_text(encoding="utf-8").splitlines()]


def token_len(tok, messages: list[dict[str, str]]) -> int:
    return len(tok.apply_chat_template(messages, tokenize=True, return_dict=False))


def test_files_and_conversation_schema(small: dict) -> None:
    paths = small["paths"]
    for key in ("short", "long", "manifest"):
        assert Path(paths[key]).is_file()
    assert (Path(paths["tokenizer"]) / "tokenizer.json").is_file()
    assert not list(Path(paths["out_dir"]).glob(".build-*")), "temporary build dir left behind"
    manifest = json.loads(Path(paths["manifest"]).read_text())
    assert manifest["args"] == SMALL
    corpus = json.loads(gzip.decompress(CORPUS.read_bytes()))
    assert manifest["corpus"] == {"file": CORPUS.name, "python_version": "3.11.7", "modules": len(corpus["modules"])}
    for key, n in (("short", SMALL["n_short"]), ("long", SMALL["n_long"])):
        convs = read(paths[key])
        assert len(convs) == n == manifest["files"][f"{key}.jsonl"]["samples"]
        for messages in convs:
            assert isinstance(messages, list) and len(messages) >= 2
            roles = [m["role"] for m in messages]
            assert all(
                set(m) == {"role", "content"} and isinstance(m["content"], str) and m["content"] for m in messages
            )
            if roles[0] == "system":
                roles = roles[1:]
            assert roles == ["user", "assistant"] * (len(roles) // 2), roles
    short = read(paths["short"])
    assert any(len(m) >= 4 for m in short), "expected a few multi-turn conversations"
    assert any(m[0]["role"] == "system" for m in short)
    assert len(manifest["files"]["short.jsonl"]["tasks"]) >= 6, "short samples should use varied templates"
    assert len(set(manifest["files"]["long.jsonl"]["tasks"])) >= 4


def test_tokenizer_special_tokens_template_and_round_trip(small: dict, tok) -> None:
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<|pad|>", "<|endoftext|>", "<|endoftext|>")
    assert len(tok) == SMALL["vocab_size"]
    ids = [tok.encode(t) for t in demo.SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(ids)
    assert tok.chat_template == demo.CHAT_TEMPLATE

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does `json.dumps` do?"},
        {"role": "assistant", "content": "Serialize ``obj`` to a JSON formatted ``str``."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nWhat does `json.dumps` do?<|end|>\n"
        "<|assistant|>\nSerialize ``obj`` to a JSON formatted ``str``.<|end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt)  # prefix-stable: label masking relies on it
    encoded = tok.apply_chat_template(messages, tokenize=True)
    assert encoded["input_ids"] == tok.encode(text)
    assert tok.apply_chat_template(messages, tokenize=True, return_dict=False) == tok.encode(text)

    short, long = read(small["paths"]["short"]), read(small["paths"]["long"])
    texts = [m["content"] for conv in short[:100] for m in conv] + [
        long[0][-2]["content"],
        long[0][0]["content"][:20000],
    ]
    for t in texts:
        assert tok.decode(tok.encode(t)) == t
    special_ids = {i[0] for i in ids}
    assert not special_ids & set(tok.encode("x = 1")), "encode must not add BOS/EOS"


def test_long_samples_are_long_and_spread(small: dict, tok) -> None:
    manifest = small["files"]
    short_len = [token_len(tok, m) for m in read(small["paths"]["short"])]
    long_len = [token_len(tok, m) for m in read(small["paths"]["long"])]
    for name, lengths in (("short.jsonl", short_len), ("long.jsonl", long_len)):
        stats = manifest[name]["tokens"]
        assert (stats["min"], stats["median"], stats["max"]) == (min(lengths), statistics.median(lengths), max(lengths))
    assert max(long_len) >= 8 * statistics.median(short_len)
    assert max(long_len) >= 65536, "the top target is always the top of the range"
    assert min(long_len) <= 4096 and min(long_len) >= 1500
    assert 10 <= min(short_len) and max(short_len) <= 8192

    lo, hi = conversations.LONG_TOKENS
    targets = conversations.long_targets(48, random.Random(0))
    assert max(targets) == hi and all(lo <= t <= hi for t in targets)
    positions = sorted(math.log(t / lo) / math.log(hi / lo) for t in targets)
    assert all(i / 48 - 1e-9 <= u <= (i + 1) / 48 + 1e-9 for i, u in enumerate(positions)), "stratified log-uniform"


@functools.cache
def corpus_sources() -> dict[str, str]:
    """relpath -> source of every module of the committed corpus, read here without lit_hbp.demo.text."""
    return {m["relpath"]: m["source"] for m in json.loads(gzip.decompress(CORPUS.read_bytes()))["modules"]}


def module_ast(context: str, module: str) -> ast.Module:
    """Parse the module's file as the corpus has it, after checking its source is verbatim in the context."""
    relpath = dict(HEADER.findall(context))[module]
    source = corpus_sources()[relpath]
    assert source in context
    return ast.parse(source)


def bullets(answer: str) -> list[str]:
    return re.findall(r"^- `([^`]+)`$", answer, re.M)


def fn_names(body: list[ast.stmt]) -> list[str]:
    return list(dict.fromkeys(n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))))


def check_long_answer(context: str, question: str, answer: str) -> str:
    """Recompute the answer to one long-context question from the context; returns the task kind."""
    for span in re.findall(r"`([^`]+)`", answer):
        assert span in context or all(part in context for part in span.split(".")), span
    if m := re.search(r"top-level functions defined in module `([\w.]+)`", question):
        tree = module_ast(context, m.group(1))
        assert bullets(answer) == fn_names(tree.body)
        return "list_functions"
    if m := re.search(r"methods defined in class `(\w+)` of module `([\w.]+)`", question):
        tree = module_ast(context, m.group(2))
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == m.group(1)]
        assert bullets(answer) == fn_names(cls.body)
        return "list_methods"
    if m := re.search(r"classes are defined at the top level of module `([\w.]+)`", question):
        tree = module_ast(context, m.group(1))
        assert bullets(answer) == list(dict.fromkeys(n.name for n in tree.body if isinstance(n, ast.ClassDef)))
        return "list_classes"
    if m := re.search(r"module `([\w.]+)`, what is the default value of parameter `(\w+)` of \w+ `([\w.]+)`", question):
        tree = module_ast(context, m.group(1))
        node: ast.AST = tree
        for part in m.group(3).split("."):
            node = next(n for n in node.body if getattr(n, "name", None) == part)
        args = node.args
        pos = args.posonlyargs + args.args
        defaults = dict(zip([a.arg for a in pos][len(pos) - len(args.defaults) :], args.defaults))
        defaults |= {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
        expected = ast.unparse(defaults[m.group(2)])
        assert ast.unparse(ast.parse(re.search(r"is `(.+)`\.$", answer).group(1), mode="eval").body) == expected
        return "default_value"
    if m := re.search(r"docstring begins with \"(.+)\"\?", question):
        needle = m.group(1)
        assert context.count(needle) == 1
        defs = list(re.finditer(r"def (\w+)\(", context[: context.index(needle)]))
        assert re.search(r"`([\w.]+)`", answer).group(1).split(".")[-1] == defs[-1].group(1)
        return "needle_docstring"
    if m := re.search(r"defines the function `(\w+)`\?", question):
        fn = m.group(1)
        assert context.count(f"def {fn}(") == 1
        module = re.search(r"module `([\w.]+)`", answer).group(1)
        assert fn in fn_names(module_ast(context, module).body)
        return "which_module"
    raise AssertionError(f"unknown question: {question}")


def test_long_answers_are_derivable_from_context(small: dict) -> None:
    kinds = set()
    for messages in read(small["paths"]["long"]):
        turns = [m for m in messages if m["role"] != "system"]
        first = turns[0]["content"]
        # The question comes after the sources ("...\nQuestion: q") or on the first line before them.
        head, sep, tail = first.rpartition("\nQuestion: ")
        question, context = (tail, head) if sep else first.split("\n", 1)
        assert HEADER.search(context) and "Question:" not in context[-200:]
        for i, (user, assistant) in enumerate(zip(turns[::2], turns[1::2])):
            kinds.add(check_long_answer(context, question if i == 0 else user["content"], assistant["content"]))
    assert len(kinds) >= 4


def test_short_answers_match_the_source(small: dict) -> None:
    checked = 0
    for messages in read(small["paths"]["short"]):
        turns = [m for m in messages if m["role"] != "system"]
        q, a = turns[0]["content"], turns[1]["content"]
        if m := re.fullmatch(r"Write the signature of `([\w.]+)`\.", q):
            name = m.group(1).split(".")[-1]
            assert re.fullmatch(rf"```python\n(async def|def|class) {name}\b.*\n```", a, re.S), (q, a)
            checked += 1
        if m := re.match(r"(?:Write a docstring for|Document the following)[^`]*```python\n(.*)\n```$", q, re.S):
            assert '"""' + a.split("\n", 1)[0] not in m.group(1)  # the docstring was removed from the code
            checked += 1
    assert checked >= 10


def test_ensure_demo_reuses_then_rebuilds_identically(small: dict, tmp_path: Path, capsys) -> None:
    out = tmp_path / "copy"
    shutil.copytree(small["paths"]["out_dir"], out)
    files = sorted(p for p in out.rglob("*") if p.is_file())
    mtimes = {p: p.stat().st_mtime_ns for p in files}
    got = demo.ensure_demo(out)
    assert got["paths"]["out_dir"] == str(out) and got["args"] == SMALL
    assert demo.ensure_demo(out, **SMALL)["files"] == small["files"]
    assert demo.main([str(out), "--if-missing", *[f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]]) == 0
    assert "long.jsonl" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in files} == mtimes, "ensure_demo rebuilt a complete build"

    # A missing file triggers a full, independent rebuild (the corpus read again), which must be byte-identical.
    (out / "long.jsonl").unlink()
    demo._load_modules.cache_clear()
    demo._corpus.cache_clear()
    demo.ensure_demo(out, **SMALL)
    assert (out / "short.jsonl").stat().st_mtime_ns != mtimes[out / "short.jsonl"]
    first = Path(small["paths"]["out_dir"])
    for name in ("short.jsonl", "long.jsonl", "manifest.json", "tokenizer/tokenizer.json"):
        assert (out / name).read_bytes() == (first / name).read_bytes(), name
    vocab = [AutoTokenizer.from_pretrained(d / "tokenizer").get_vocab() for d in (first, out)]
    assert vocab[0] == vocab[1]


def test_ensure_demo_concurrent_callers_build_once_and_seed_matters(small: dict, tmp_path: Path, monkeypatch) -> None:
    calls = []
    build = demo.build_demo

    def counting_build(*args, **kwargs):
        calls.append(args)
        return build(*args, **kwargs)

    monkeypatch.setattr(demo, "build_demo", counting_build)
    reseeded = {**SMALL, "seed": 1}
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: demo.ensure_demo(tmp_path / "shared", **reseeded), range(2)))
    assert len(calls) == 1
    assert results[0]["files"] == results[1]["files"] and results[0]["args"] == reseeded

    before = Path(small["paths"]["short"]).read_text().splitlines()
    after = (tmp_path / "shared" / "short.jsonl").read_text().splitlines()
    assert len(after) == len(before) and before != after
    # Arguments that differ from the manifest make ensure_demo rebuild; those not passed are not compared.
    assert demo._complete(tmp_path / "shared", {"seed": 0}) is None
    assert demo._complete(tmp_path / "shared", {"n_short": SMALL["n_short"]}) is not None


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["{out}", "--n-short", "-1"], "argument --n-short: must be a whole number >= 0, got -1"),
        (["{out}", "--n-long", "-1"], "argument --n-long: must be a whole number >= 0, got -1"),
        (["{out}", "--vocab-size", "100"], "argument --vocab-size: must be a whole number >= 512, got 100"),
        (["{file}"], "argument out_dir: {file} is a file: give a folder"),
        (["{file}/sub"], "argument out_dir: {file} is a file: give a folder"),
        (
            ["{out}", "--freeze-corpus", "{corpus}"],
            "--freeze-corpus writes the corpus and builds nothing: drop OUT_DIR",
        ),
        (["--freeze-corpus", "{corpus}", "--n-short", "5"], "builds nothing: drop --n-short"),
    ],
)
def test_the_cli_refuses_what_it_cannot_build_in_one_line(tmp_path: Path, capsys, args: list[str], reason: str) -> None:
    """``python -m lit_hbp.demo`` with a count or a vocabulary the build refuses, a file as the output folder, or
    ``--freeze-corpus`` (a maintainer's mode that writes the corpus and builds nothing) with build options: exit 2,
    the reason on the last line naming the option, no traceback, nothing written."""
    (tmp_path / "file").write_text("x")
    paths = {"out": tmp_path / "out", "file": tmp_path / "file", "corpus": tmp_path / "c.json.gz"}
    with pytest.raises(SystemExit) as stop:
        demo.main([a.format(**paths) for a in args])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("python -m lit_hbp.demo.text: error: ")
    assert reason.format(**paths) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_the_demo_reads_only_the_committed_corpus(small: dict, tmp_path: Path, monkeypatch) -> None:
    """Another Python's standard library (here: a folder with one module, and no way to list files)
    changes nothing: the build reads the corpus committed to the package, so every machine gets the
    same chats, whose text does not depend on the tokenizer either (pinned by its hash)."""
    other = tmp_path / "other-stdlib"
    other.mkdir()
    (other / "only.py").write_text('def only():\n    """The only function."""\n    return 1\n')
    paths = {**sysconfig.get_paths(), "stdlib": str(other), "platstdlib": str(other)}
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: paths)

    def no_listing(root):
        raise AssertionError(f"the demo listed {root}")

    from lit_hbp.demo import stdlib

    monkeypatch.setattr(stdlib, "_stdlib_files", no_listing)
    demo._load_modules.cache_clear()
    demo._corpus.cache_clear()
    rebuilt = demo.build_demo(tmp_path / "demo", **SMALL)
    first = Path(small["paths"]["out_dir"])
    for name in ("short.jsonl", "long.jsonl", "manifest.json", "tokenizer/tokenizer.json"):
        assert (tmp_path / "demo" / name).read_bytes() == (first / name).read_bytes(), name
    assert rebuilt["files"] == small["files"]
    short = hashlib.sha256((first / "short.jsonl").read_bytes()).hexdigest()
    assert short == SMALL_SHORT_SHA256, "the corpus or the chat templates changed: the README's counts change too"


SMALL_SHORT_SHA256 = "00dd3d8fbade4eb930851abe2e8bcc81e70b9e4c8a9223d023b2c170ba800df6"

FAKE_MODULE = """import functools


@functools.cache
def double(x, y=2, *rest, scale: float = 1.0, **kw) -> int:
    \"\"\"Twice x.

        Indented more.\"\"\"

    return 2 * x * y


class Box:
    \"\"\"A box.\"\"\"

    def __init__(self, size=(1, 2)):
        \"\"\"Make it.\"\"\"
        if size:
            pass
  \t
        self.size = size

    def only_doc(self):
        \"\"\"Nothing else.\"\"\"
"""


def test_freeze_corpus_keeps_what_the_demo_reads_of_each_module(tmp_path: Path) -> None:
    """``freeze_corpus`` over a standard library of a few files: test files, test folders, empty files,
    files that do not parse and files with the chat's special tokens are left out; a module's
    definitions come back as ``ast`` and ``textwrap`` give them, read here from the file itself."""
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    (lib / "tests").mkdir()
    (lib / "pkg" / "__init__.py").write_text("")
    (lib / "pkg" / "mod.py").write_text(FAKE_MODULE)
    (lib / "test_left_out.py").write_text(FAKE_MODULE)
    (lib / "tests" / "t.py").write_text(FAKE_MODULE)
    (lib / "broken.py").write_text("def (:\n")
    (lib / "special.py").write_text('S = "<|end|>"\n')
    summary = demo.freeze_corpus(tmp_path / "c.json.gz", lib)
    records = json.loads(gzip.decompress((tmp_path / "c.json.gz").read_bytes()))["modules"]
    assert summary["modules"] == 1 and [r["relpath"] for r in records] == ["pkg/mod.py"]

    m = demo._module_from_record(records[0])
    assert (m.name, m.relpath) == ("pkg.mod", "pkg/mod.py")
    assert m.block == f"### Module `pkg.mod` (file `pkg/mod.py`)\n```python\n{FAKE_MODULE}\n```\n"
    assert (m.functions, m.class_names, m.classes) == (("double",), ("Box",), (("Box", ("__init__", "only_doc")),))
    defs = {d.qual: d for d in m.defs}
    assert list(defs) == ["double", "Box", "Box.__init__", "Box.only_doc"]
    assert defs["double"].doc == "Twice x.\n\nIndented more."
    assert defs["double"].signature == "def double(x, y=2, *rest, scale: float=1.0, **kw) -> int"  # ast.unparse's
    # Decorators and the def line, the body after the docstring (leading blank lines dropped), dedented.
    assert defs["double"].code == (
        "@functools.cache\ndef double(x, y=2, *rest, scale: float = 1.0, **kw) -> int:\n    return 2 * x * y"
    )
    assert defs["double"].params == (("x", None), ("y", "2"), ("*rest", None), ("scale", "1.0"), ("**kw", None))
    assert defs["Box"].methods == ("__init__", "only_doc") and defs["Box"].signature == "class Box"
    # The method out of its class, the line of a space and a tab inside its body left empty.
    init = "def __init__(self, size=(1, 2)):\n    if size:\n        pass\n\n    self.size = size"
    assert defs["Box.__init__"].code == init
    assert defs["Box.__init__"].params == (("size", "(1, 2)"),) and defs["Box.only_doc"].code == ""
    assert m.defaults == (("double", "y", "2"), ("double", "scale", "1.0"), ("Box.__init__", "size", "(1, 2)"))


def test_dedent_is_python_311s_textwrap_dedent() -> None:
    """The demo's own dedent, against what Python 3.11's ``textwrap.dedent`` returns (written out: a
    later Python's textwrap may treat whitespace-only lines otherwise, the demo must not change)."""
    cases = {
        ("    a", "      b", "", "    c"): "a\n  b\n\nc",
        ("\tx", "\t  y", "  ", "\t"): "x\n  y\n\n",
        ("    a", "  \tb"): "  a\n\tb",
        ("  a", "\x0c", "  b"): "  a\n\x0c\n  b",
        ("   ",): "",
    }
    for lines, want in cases.items():
        assert demo._dedent(list(lines)) == want, lines


def test_a_demo_folder_holding_another_kind_of_demo_is_refused_not_built_over(small_demo, tmp_path):
    """``data.demo: vision`` on a folder holding the text demo wrote the vision demo into it (its manifest replaced)
    and trained the config's text sources without a word; the next text run then rebuilt the text demo at its
    default size over the user's. Refused now naming both kinds; the folder is left as it was."""
    import json

    from lit_hbp.demo import ensure_kind
    from lit_hbp.errors import ConfigError

    before = {p.name: p.stat().st_mtime_ns for p in small_demo.iterdir()}
    with pytest.raises(ConfigError, match=r"^data.demo: vision, but data.demo_dir .* holds the text demo"):
        ensure_kind(small_demo, "vision")
    assert {p.name: p.stat().st_mtime_ns for p in small_demo.iterdir()} == before
    ensure_kind(small_demo, "text")  # the kind it holds: kept as built (its size too)
    assert {p.name: p.stat().st_mtime_ns for p in small_demo.iterdir()} == before
    for held, manifest, asked in (
        ("vision", {"version": "2", "args": {}, "records": 4, "images": 3}, "text"),
        ("video", {"version": "1", "args": {}, "records": 4, "images": 3, "videos": 2}, "vision"),
    ):
        folder = tmp_path / held
        folder.mkdir()
        (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ConfigError, match=rf"data.demo: {asked}, but .* holds the {held} demo .*data.demo: {held}"):
            ensure_kind(folder, asked)
        assert [p.name for p in folder.iterdir()] == ["manifest.json"]
