"""Prompts shaped like users' requests, built offline from real code and documentation.

The template corpus (``corpus.default_corpus``) states made-up tasks; users paste real code and
text, ask for completions in the middle of real files, and write stubs with examples. The
``"users"`` corpus adds three kinds, all from the standard library's own sources (never from
HumanEval or MT-Bench; the corpus test checks 8-gram overlap and function names):

* **completions**: a real function's source cut a few lines into its body, completed as raw text
  (what an editor sends);
* **stubs with examples**: the signature and whole docstring of standard-library functions whose
  docstring shows ``>>>`` examples, and made-up small tasks stated with examples that a reference
  implementation computed;
* **chat about real material**: explain, test, type or review a real function; summarise or
  simplify a real documentation paragraph.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import json
import random
import re
import textwrap
from collections.abc import Callable
from typing import Any

from dflash2.train.corpus import Prompt, chat_prompts, code_prompts, stdlib_functions


def _source(fn: Any) -> str | None:
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    return text if text.startswith("def ") else None  # no decorators, lambdas or async defs


def _body_start(source: str) -> int | None:
    """The index of the first line after the docstring (or the signature), or None if unparsable."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef) or not node.body:
        return None
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno
    return first.lineno - 1


@functools.lru_cache(maxsize=4)
def completions(seed: int = 0) -> tuple[str, ...]:
    """Real function sources cut 1-4 lines into the body (at least 3 lines left to complete)."""
    rng = random.Random(seed)
    out: dict[str, None] = {}
    for _, fn in stdlib_functions():
        source = _source(fn)
        start = _body_start(source) if source else None
        if source is None or start is None:
            continue
        lines = source.splitlines(keepends=True)
        if len(lines) - start < 4 or len(lines) > 80:
            continue
        cut = start + rng.randint(1, min(4, len(lines) - start - 3))
        out["".join(lines[:cut])] = None
    return tuple(out)


def _doctest_stubs() -> list[str]:
    """Signature + whole docstring of standard-library functions that show ``>>>`` examples."""
    stubs: dict[str, None] = {}
    for name, fn in stdlib_functions():
        doc = fn.__doc__ if isinstance(fn.__doc__, str) else ""
        if ">>>" not in doc:
            continue
        try:
            signature = str(inspect.signature(fn))
        except (TypeError, ValueError):
            continue
        if " at 0x" in signature:
            continue
        body = inspect.cleandoc(doc).replace('"""', "'''").replace("\n", "\n    ")
        stubs[f'def {name}{signature}:\n    """{body}\n    """\n'] = None
    return list(stubs)


# made-up small tasks: (name, signature, description, reference, random arguments)
_Task = tuple[str, str, str, Callable[..., Any], Callable[[random.Random], tuple[Any, ...]]]


def _words(rng: random.Random, n: int) -> list[str]:
    pool = ("apple", "river", "stone", "cloud", "lamp", "tiger", "paper", "orbit", "maple", "frost", "cable", "delta")
    return [rng.choice(pool) for _ in range(n)]


def _ints(rng: random.Random, n: int, low: int = -9, high: int = 30) -> list[int]:
    return [rng.randint(low, high) for _ in range(n)]


_TASKS: tuple[_Task, ...] = (
    (
        "clamp_all", "(values: list[int], low: int, high: int) -> list[int]",
        "Limit every value to the closed range [low, high], keeping the order.",
        lambda v, lo, hi: [min(max(x, lo), hi) for x in v],
        lambda r: (_ints(r, r.randint(3, 6)), r.randint(-5, 5), r.randint(8, 20)),
    ),
    (
        "run_length_pairs", "(text: str) -> list[tuple[str, int]]",
        "Describe the text as (character, count) pairs of consecutive equal characters.",
        lambda t: [(k, len(list(g))) for k, g in itertools.groupby(t)],
        lambda r: ("".join(r.choice("aabbc") for _ in range(r.randint(4, 9))),),
    ),
    (
        "every_nth", "(items: list[str], n: int) -> list[str]",
        "Return every n-th item of the list, starting with the first one.",
        lambda items, n: items[::n],
        lambda r: (_words(r, r.randint(4, 8)), r.randint(2, 3)),
    ),
    (
        "moving_totals", "(values: list[int], window: int) -> list[int]",
        "Return the sums of each run of `window` consecutive values.",
        lambda v, w: [sum(v[i : i + w]) for i in range(len(v) - w + 1)],
        lambda r: (_ints(r, r.randint(4, 7), 0, 9), r.randint(2, 3)),
    ),
    (
        "word_frequencies", "(sentence: str) -> dict[str, int]",
        "Count how often each lower-cased word occurs in the sentence, in order of first appearance.",
        lambda s: {w: s.lower().split().count(w) for w in dict.fromkeys(s.lower().split())},
        lambda r: (" ".join(w.capitalize() if r.random() < 0.3 else w for w in _words(r, r.randint(3, 7))),),
    ),
    (
        "chunk_text", "(text: str, size: int) -> list[str]",
        "Cut the text into pieces of `size` characters; the last piece may be shorter.",
        lambda t, n: [t[i : i + n] for i in range(0, len(t), n)],
        lambda r: ("".join(_words(r, 2)), r.randint(2, 4)),
    ),
    (
        "alternate_merge", "(first: list[int], second: list[int]) -> list[int]",
        "Take items from the two lists in turn; when one runs out, append the rest of the other.",
        lambda a, b: [x for pair in itertools.zip_longest(a, b) for x in pair if x is not None],
        lambda r: (_ints(r, r.randint(1, 4), 0, 9), _ints(r, r.randint(1, 4), 10, 20)),
    ),
    (
        "round_to_step", "(value: int, step: int) -> int",
        "Round the value to the nearest multiple of `step`; halfway values round up.",
        lambda v, s: ((v + s // 2) // s) * s,
        lambda r: (r.randint(0, 200), r.choice((5, 10, 25))),
    ),
    (
        "clock_text", "(seconds: int) -> str",
        "Format a number of seconds as 'H:MM:SS'.",
        lambda s: f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}",
        lambda r: (r.randint(0, 20000),),
    ),
    (
        "gaps", "(values: list[int]) -> list[int]",
        "Return the differences between each value and the one before it.",
        lambda v: [b - a for a, b in itertools.pairwise(v)],
        lambda r: (_ints(r, r.randint(3, 6), 0, 50),),
    ),
    (
        "initials_of", "(full_name: str) -> str",
        "Return the upper-case initials of a name, each followed by a dot.",
        lambda n: "".join(w[0].upper() + "." for w in n.split()),
        lambda r: (" ".join(r.sample(("ada", "grace", "alan", "linus", "barbara", "edsger", "margaret"), 2)),),
    ),
    (
        "keep_longer_than", "(words: list[str], length: int) -> list[str]",
        "Keep the words with more than `length` characters, in their original order.",
        lambda w, n: [x for x in w if len(x) > n],
        lambda r: (_words(r, r.randint(3, 6)), r.randint(3, 5)),
    ),
    (
        "count_in_ranges", "(values: list[int], width: int) -> dict[int, int]",
        "Count the values falling in each range [k * width, (k + 1) * width), keyed by k, smallest k first.",
        lambda v, w: dict(sorted({k: sum(1 for x in v if x // w == k) for k in {x // w for x in v}}.items())),
        lambda r: (_ints(r, r.randint(4, 7), 0, 40), r.choice((5, 10))),
    ),
    (
        "swap_pairs", "(items: list[str]) -> list[str]",
        "Swap the first item with the second, the third with the fourth, and so on.",
        lambda s: [x for i in range(0, len(s), 2) for x in reversed(s[i : i + 2])],
        lambda r: (_words(r, r.randint(3, 6)),),
    ),
)  # fmt: skip


def _task_stub(task: _Task, rng: random.Random) -> str:
    name, signature, description, reference, arguments = task
    examples = []
    for _ in range(rng.randint(2, 3)):
        args = arguments(rng)
        call = ", ".join(repr(a) for a in args)
        examples.append(f"    >>> {name}({call})\n    {reference(*args)!r}")
    return f'def {name}{signature}:\n    """{description}\n\n' + "\n".join(examples) + '\n    """\n'


def stubs(seed: int = 0) -> list[str]:
    """Standard-library stubs with examples, then made-up ones, interleaved; seeded."""
    rng = random.Random(seed)
    made = list(dict.fromkeys(_task_stub(_TASKS[i % len(_TASKS)], rng) for i in range(40 * len(_TASKS))))
    real = _doctest_stubs()
    rng.shuffle(real)
    return [p for pair in itertools.zip_longest(real, made) for p in pair if p is not None]


_CODE_ASKS = (
    "Explain what this Python function does, step by step:\n\n```python\n{code}```",
    "Write pytest unit tests for this function:\n\n```python\n{code}```",
    "Add type hints to this function and explain each change:\n\n```python\n{code}```",
    "Review this code. Is there anything you would change, and why?\n\n```python\n{code}```",
    "What inputs could make this function fail or behave unexpectedly?\n\n```python\n{code}```",
    "Rewrite this function so that it is easier to read, keeping its behaviour:\n\n```python\n{code}```",
)
_TEXT_ASKS = (
    "Summarize this documentation in two sentences:\n\n{text}",
    "Explain this to someone who is new to programming:\n\n{text}",
    "Turn this description into a short list of bullet points:\n\n{text}",
    "Write a usage example in Python for the function described here:\n\n{text}",
)


def chat_about_material(seed: int = 0) -> list[list[dict[str, str]]]:
    """Requests about real functions and documentation paragraphs (chat template), seeded."""
    rng = random.Random(seed)
    sources = [s for _, fn in stdlib_functions() if (s := _source(fn)) is not None and 4 <= s.count("\n") <= 30]
    paragraphs = [
        " ".join(inspect.cleandoc(fn.__doc__).split("\n\n")[0].split())
        for _, fn in stdlib_functions()
        if isinstance(fn.__doc__, str)
    ]
    paragraphs = [p for p in dict.fromkeys(paragraphs) if 120 <= len(p) <= 900]
    asks = [rng.choice(_CODE_ASKS).format(code=code) for code in dict.fromkeys(sources)]
    asks += [rng.choice(_TEXT_ASKS).format(text=text) for text in paragraphs]
    rng.shuffle(asks)
    return [[{"role": "user", "content": content}] for content in asks]


# material that counts 1 .. 8 in a row is left out: HumanEval's examples count so too, and the
# corpus shares no 8-word sequence with an evaluation prompt (tests/test_train.py)
_COUNTING = re.compile(r"\b1\W+2\W+3\W+4\W+5\W+6\W+7\W+8\b")


def users_corpus(size: int, seed: int = 0) -> list[Prompt]:
    """The kinds of ``completions``, ``stubs``, ``chat_about_material`` and the template corpus's
    code and chat prompts taking turns, the first ``size``; a prefix of every larger one."""
    completed, code = list(completions(seed)), code_prompts()
    random.Random(seed + 1).shuffle(completed)
    random.Random(seed).shuffle(code)
    families: list[list[Any]] = [completed, stubs(seed), chat_about_material(seed), code, chat_prompts(seed=seed)]
    out: dict[str, Prompt] = {}  # by its JSON: a prompt met twice is kept once
    for group in itertools.zip_longest(*families):
        kept = (p for p in group if p is not None and not _COUNTING.search(json.dumps(p)))
        out.update((json.dumps(p), p) for p in kept if json.dumps(p) not in out)
        if len(out) >= size:
            break
    return list(out.values())[:size]
