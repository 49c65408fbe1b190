"""The demo's conversations about the corpus's modules (``demo.stdlib``): short chats on one definition (explain
it, write its signature, summarize or write its docstring, explain its code, list its parameters or methods) and
long tasks over whole modules' sources whose answers ``ast`` computes. A change here is a new
``text.GENERATOR_VERSION`` (the build that seeds them rebuilds old folders)."""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from lit_hbp.demo.stdlib import _Def, _Module

LONG_TOKENS = (2048, 70_000)  # log-uniform target range of long samples; the top target is always the max
_LONG_OVERHEAD = 160  # tokens of intro, question, answer and template around the module sources
_MAX_CODE_CHARS = 12_000  # keeps short samples at a few thousand tokens at most
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are an expert Python developer. Answer precisely and concisely.",
    "You are a code assistant that explains the Python standard library.",
    "Answer the user's question about Python code. Quote names exactly.",
)


class TokenCounts:
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
Turns = list[dict[str, str]]


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _t_explain(d: _Def, rng: random.Random) -> Turns | None:
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


def _t_signature(d: _Def, rng: random.Random) -> Turns | None:
    q = rng.choice(("Write the signature of `{m}.{q}`.", "What is the signature of the {w} `{q}` from `{m}`?"))
    answer = f"```python\n{d.signature}\n```"
    return [_turn("user", q.format(m=d.module, q=d.qual, w=d.kind)), _turn("assistant", answer)]


def _t_summary(d: _Def, rng: random.Random) -> Turns | None:
    if not d.doc:
        return None
    q = rng.choice(("Summarize the docstring of `{m}.{q}` in one sentence.", "In one sentence, what is `{m}.{q}`?"))
    return [_turn("user", q.format(m=d.module, q=d.qual)), _turn("assistant", _first_sentence(d.doc))]


def _t_write_docstring(d: _Def, rng: random.Random) -> Turns | None:
    if not d.code or len(d.code) > _MAX_CODE_CHARS:
        return None
    q = rng.choice(
        (
            "Write a docstring for this {w} from the `{m}` module:\n\n```python\n{c}\n```",
            "Document the following code with a docstring.\n\n```python\n{c}\n```",
        )
    )
    return [_turn("user", q.format(m=d.module, w=d.kind, c=d.code)), _turn("assistant", d.doc)]


def _t_explain_code(d: _Def, rng: random.Random) -> Turns | None:
    if not d.code or len(d.code) > _MAX_CODE_CHARS:
        return None
    q = rng.choice(
        ("What does the following code do?\n\n```python\n{c}\n```", "Explain this {w}:\n\n```python\n{c}\n```")
    )
    return [_turn("user", q.format(w=d.kind, c=d.code)), _turn("assistant", _first_paragraph(d.doc))]


def _t_params(d: _Def, rng: random.Random) -> Turns | None:
    if d.kind == "class" or not d.params:
        return None
    lines = [f"- `{p}`" + ("" if default is None else f" (default `{default}`)") for p, default in d.params]
    answer = f"`{d.qual}` takes {len(d.params)} parameter{'s' if len(d.params) > 1 else ''}:\n" + "\n".join(lines)
    q = rng.choice(("What parameters does `{m}.{q}` take?", "List the arguments of `{m}.{q}` and their defaults."))
    return [_turn("user", q.format(m=d.module, q=d.qual)), _turn("assistant", answer)]


def _t_methods(d: _Def, rng: random.Random) -> Turns | None:
    if d.kind != "class" or not d.methods:
        return None
    q = rng.choice(("Which methods does class `{m}.{q}` define?", "List the methods of `{m}.{q}`."))
    answer = f"`{d.qual}` defines {len(d.methods)} method{'s' if len(d.methods) > 1 else ''}:\n" + _bullets(d.methods)
    return [_turn("user", q.format(m=d.module, q=d.qual)), _turn("assistant", answer)]


def _t_multi_turn(d: _Def, rng: random.Random) -> Turns | None:
    first = _t_explain(d, rng)
    if first is None:
        return None
    follow = rng.choice(("And what is its signature?", "Thanks. Can you show me its signature?"))
    return first + [_turn("user", follow), _turn("assistant", f"```python\n{d.signature}\n```")]


_SHORT_TEMPLATES: dict[str, tuple[float, Callable[[_Def, random.Random], Turns | None]]] = {
    "explain": (0.24, _t_explain),
    "signature": (0.14, _t_signature),
    "summary": (0.14, _t_summary),
    "write_docstring": (0.14, _t_write_docstring),
    "explain_code": (0.10, _t_explain_code),
    "params": (0.10, _t_params),
    "methods": (0.10, _t_methods),
    "multi_turn": (0.04, _t_multi_turn),
}


def short_samples(modules: Sequence[_Module], n: int, rng: random.Random) -> tuple[list[Turns], Counter[str]]:
    """Cycle through the shuffled documented definitions, one weighted-random applicable template each."""
    defs = [d for m in modules for d in m.defs if d.doc]
    rng.shuffle(defs)
    names = list(_SHORT_TEMPLATES)
    weights = [_SHORT_TEMPLATES[k][0] for k in names]
    samples: list[Turns] = []
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


LONG_TASKS: dict[str, Callable[[_Module, str, random.Random], _QA | None]] = {
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


def long_targets(n: int, rng: random.Random) -> list[int]:
    """Stratified log-uniform token targets in LONG_TOKENS; the largest is always the top of the range."""
    lo, hi = LONG_TOKENS
    us = [(i + rng.random()) / n for i in range(n)]
    if us:
        us[-1] = 1.0
    return [round(lo * (hi / lo) ** u) for u in us]


def _pick_modules(
    pool: Sequence[_Module], anchor: _Module, budget: int, count: TokenCounts, rng: random.Random
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


def long_sample(
    pool: Sequence[_Module], target: int, task: str, count: TokenCounts, rng: random.Random
) -> tuple[Turns, str] | None:
    """A long-context conversation of about `target` tokens whose answer is computed from the sources."""
    budget = target - _LONG_OVERHEAD
    anchors = [m for m in pool if count.lower_bound(m) <= budget]
    for _ in range(100 if anchors else 0):
        anchor = rng.choice(anchors)
        if count(anchor) > budget * 1.03:
            continue
        modules = _pick_modules(pool, anchor, budget, count, rng)
        context = "\n".join(m.block for m in modules)
        qa = LONG_TASKS[task](anchor, context, rng)
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
            follow = [k for k in LONG_TASKS if k != task]
            rng.shuffle(follow)
            for k in follow:
                qa2 = LONG_TASKS[k](anchor, context, rng)
                if qa2 is not None:
                    turns += [_turn("user", qa2[0]), _turn("assistant", qa2[1])]
                    break
        if rng.random() < 0.3:
            turns = [_turn("system", rng.choice(_SYSTEM_PROMPTS)), *turns]
        return turns, task
    return None
