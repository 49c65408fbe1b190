"""The standard-library corpus the text demo is built from: each module's source and what ``ast`` found in it
(functions, methods, classes, signatures, docstrings, defaults), committed as ``corpus/stdlib.json.gz`` beside
this package so the demo's samples do not depend on the Python that builds them (``freeze_corpus`` wrote it
from one Python release's standard library; ``lit_hbp.demo.text`` reads nothing else).
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import os
import platform
import sysconfig
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

# The demo tokenizer's special tokens: no corpus text may hold one.
PAD, EOS = "<|pad|>", "<|endoftext|>"
SPECIAL_TOKENS = (PAD, EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
CORPUS = "stdlib.json.gz"  # in lit_hbp/demo/corpus/ (package data)
_SKIP_DIRS = frozenset(
    {"site-packages", "test", "tests", "idlelib", "encodings", "lib2to3", "turtledemo", "ensurepip"}
    | {"pydoc_data", "__phello__", "__pycache__", "lib-dynload"}
)
_MAX_FILE_CHARS = 300_000


@dataclass(frozen=True)
class _Def:
    """A function, method or class of a module, with what the chat templates need."""

    module: str
    qual: str
    kind: str  # "function" | "method" | "class"
    signature: str
    doc: str
    code: str  # dedented source without the docstring; "" when the body is only the docstring
    params: tuple[tuple[str, str | None], ...]  # (name, default source) without self/cls
    methods: tuple[str, ...]


@dataclass(frozen=True)
class _Module:
    """A parsed standard library module with the facts the long-context questions ask about."""

    name: str
    relpath: str
    block: str  # the module's source as it appears in long samples: a header and a fenced code block
    defs: tuple[_Def, ...]
    functions: tuple[str, ...]  # top-level functions in definition order
    class_names: tuple[str, ...]  # top-level classes in definition order
    classes: tuple[tuple[str, tuple[str, ...]], ...]  # classes with a unique name and their methods
    defaults: tuple[tuple[str, str, str], ...]  # (qual, parameter, default source), unique quals


def _stdlib_files(root: Path) -> list[Path]:
    """Standard library modules worth reading: no tests, vendored packages or generated tables."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        skip = ("test_", "_sysconfigdata")
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py") and not f.startswith(skip)]
    return sorted(files)


def _corpus_file() -> Any:
    from importlib.resources import files

    return files("lit_hbp.demo") / "corpus" / CORPUS


@functools.cache
def _corpus() -> dict[str, Any]:
    """The committed corpus: {"python_version", "modules": [module record, ...]} (``_module_record``)."""
    with _corpus_file().open("rb") as f:
        return json.loads(gzip.decompress(f.read()).decode("utf-8"))


@functools.cache
def _load_modules() -> tuple[_Module, ...]:
    """The corpus's modules, read once per process; builds with other arguments reuse them."""
    return tuple(_module_from_record(r) for r in _corpus()["modules"])


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _dedup(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


class _Source:
    """Source segments by ast positions (col offsets are UTF-8 byte offsets), without re-splitting."""

    def __init__(self, source: str) -> None:
        self.lines = source.split("\n")
        self._bytes: dict[int, bytes] = {}

    def _line(self, lineno: int) -> bytes:
        if lineno not in self._bytes:
            self._bytes[lineno] = self.lines[lineno - 1].encode()
        return self._bytes[lineno]

    def segment(self, node: ast.expr) -> str | None:
        if node.end_lineno != node.lineno or node.end_col_offset is None:
            return None
        return self._line(node.lineno)[node.col_offset : node.end_col_offset].decode(errors="replace")

    def code_span(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[int] | None:
        """(first line with decorators, docstring's first and last line, last line) of a documented
        definition whose body is more than its docstring, for ``_code``; None otherwise."""
        doc = node.body[0]
        if len(node.body) == 1 or doc.lineno == node.lineno or node.end_lineno is None or doc.end_lineno is None:
            return None
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        return [start, doc.lineno, doc.end_lineno, node.end_lineno]


def _dedent(lines: list[str]) -> str:
    """``textwrap.dedent`` of Python 3.11 on lines: lines of only spaces and tabs become empty, and the
    longest run of spaces and tabs that starts every other line is removed (written out so that the
    demo does not change with another Python's textwrap)."""
    lines = [line if line.strip(" \t") else "" for line in lines]
    margin = os.path.commonprefix([line[: len(line) - len(line.lstrip(" \t"))] for line in lines if line])
    return "\n".join(line[len(margin) :] for line in lines)


def _code(lines: list[str], span: list[int] | None) -> str:
    """A definition's dedented source without its docstring (``_Source.code_span``); "" without a span."""
    if span is None:
        return ""
    start, doc_start, doc_end, end = span
    body = lines[doc_end:end]
    while body and not body[0].strip():
        body = body[1:]
    return _dedent(lines[start - 1 : doc_start - 1] + body).strip("\n")


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, src: _Source, method: bool) -> list[tuple[str, str | None]]:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out: list[tuple[str, str | None]] = [
        (arg.arg, None if d is None else src.segment(d) or ast.unparse(d)) for arg, d in zip(positional, defaults)
    ]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if method and out and not static:
        out = out[1:]
    if a.vararg:
        out.append(("*" + a.vararg.arg, None))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, None if d is None else src.segment(d) or ast.unparse(d)))
    if a.kwarg:
        out.append(("**" + a.kwarg.arg, None))
    return out


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in [*node.bases, *node.keywords])
        return f"class {node.name}({bases})" if bases else f"class {node.name}"
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}"


def _module_record(root: Path, path: Path) -> dict[str, Any] | None:
    """What the demo reads of one file, as JSON: its source and, per definition, (qualified name, kind,
    signature, cleaned docstring, ``code_span``, parameters with their default's source, methods); None
    for files that cannot serve as demo text."""
    source = path.read_text(encoding="utf-8", errors="replace")
    if len(source) > _MAX_FILE_CHARS or len(source.strip()) == 0 or any(t in source for t in SPECIAL_TOKENS):
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    rel = path.relative_to(root)
    src = _Source(source)
    defs: list[list[Any]] = []
    functions: list[str] = []
    classes: list[tuple[str, tuple[str, ...]]] = []
    fn_types = (ast.FunctionDef, ast.AsyncFunctionDef)

    def add(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, qual: str, kind: str) -> None:
        doc = ast.get_docstring(node, clean=True) or ""
        params: list[tuple[str, str | None]] = []
        methods: tuple[str, ...] = ()
        if isinstance(node, ast.ClassDef):
            methods = _dedup([n.name for n in node.body if isinstance(n, fn_types)])
        else:
            params = _params(node, src, method=kind == "method")
        span = src.code_span(node) if doc else None
        defs.append([qual, kind, _signature(node), doc, span, params, list(methods)])

    for node in tree.body:
        if isinstance(node, fn_types):
            functions.append(node.name)
            add(node, node.name, "function")
        elif isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, fn_types)]
            classes.append((node.name, _dedup([m.name for m in methods])))
            add(node, node.name, "class")
            for m in methods:
                add(m, f"{node.name}.{m.name}", "method")
    return {
        "name": _module_name(rel),
        "relpath": rel.as_posix(),
        "source": source,
        "defs": defs,
        "functions": list(_dedup(functions)),
        "classes": [[c, list(m)] for c, m in classes],
    }


def _module_from_record(r: dict[str, Any]) -> _Module:
    """A corpus record as the builder uses it: definitions whose qualified name is unique in the module,
    classes whose name is, defaults of at most 60 characters."""
    name, lines = r["name"], r["source"].split("\n")
    defs = [
        _Def(name, q, kind, sig, doc, _code(lines, span), tuple((p, d) for p, d in params), tuple(methods))
        for q, kind, sig, doc, span, params, methods in r["defs"]
    ]
    quals = Counter(d.qual for d in defs)
    class_names = Counter(c for c, _ in r["classes"])
    defaults = [
        (d.qual, p, default)
        for d in defs
        if d.kind != "class"
        for p, default in d.params
        if default is not None and len(default) <= 60
    ]
    return _Module(
        name=name,
        relpath=r["relpath"],
        block=f"### Module `{name}` (file `{r['relpath']}`)\n```python\n{r['source']}\n```\n",
        defs=tuple(d for d in defs if quals[d.qual] == 1),
        functions=tuple(r["functions"]),
        class_names=_dedup([c for c, _ in r["classes"]]),
        classes=tuple((c, tuple(m)) for c, m in r["classes"] if class_names[c] == 1),
        defaults=tuple(d for d in defaults if quals[d[0]] == 1),
    )


def freeze_corpus(path: str | os.PathLike[str], stdlib: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Write the corpus the demo is built from: the modules of ``stdlib`` (the running Python's
    standard library by default) that can serve as demo text, as gzipped JSON; returns its summary.
    The committed ``corpus/stdlib.json.gz`` was written by it; the demo reads nothing else."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = _stdlib_files(root)
    records = [r for p in tqdm(files, desc="parse stdlib", unit="file", disable=None) if (r := _module_record(root, p))]
    if not records:
        raise RuntimeError(f"no parsable standard library sources under {root}")
    corpus = {"python_version": platform.python_version(), "modules": records}
    data = json.dumps(corpus, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    Path(path).write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    return {"python_version": corpus["python_version"], "modules": len(records), "bytes": Path(path).stat().st_size}
