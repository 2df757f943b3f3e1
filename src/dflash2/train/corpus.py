"""Prompt corpora for self-distillation: an offline default, or the user's own prompts / text.

The default corpus needs no download and never contains our evaluation sets (HumanEval,
MT-Bench; a test checks it). *Code* prompts are signatures and docstrings of pure-Python
functions and public methods of the standard library, completed as raw text. *Chat* prompts are
instructions sent with the chat template, in eight families named after the kinds of request a
chat model meets (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities): task
templates x topics, role-play personas, and word problems, logic puzzles and short texts to
extract facts from, made up with a seeded random generator. The families are interleaved, so
that any prefix of the chat prompts is balanced across them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import json
import random
import warnings
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from dflash2.errors import InvalidOptionError

Prompt = str | list[dict[str, str]]


def _tuples(value: Any) -> Any:
    """JSON's lists as tuples, all the way down."""
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# word lists and templates (corpus.json): modules whose functions become code prompts, the names of
# HumanEval entry points kept out, chat task templates by kind on a {topic}, personas and their
# tasks, coding tasks and templates, and names, places and things for made-up word problems,
# puzzles and texts to extract facts from
_DATA = _tuples(json.loads(resources.files(__package__).joinpath("corpus.json").read_text(encoding="utf-8")))
_MODULES = _DATA["modules"]
_EVALUATION_NAMES = frozenset(_DATA["evaluation_names"])
_TASKS: dict[str, tuple[str, ...]] = _DATA["tasks"]
_TOPICS = _DATA["topics"]
_ROLES = _DATA["roles"]
_ROLE_TASKS = _DATA["role_tasks"]
_CODE_TASKS = _DATA["code_tasks"]
_CODE_TEMPLATES = _DATA["code_templates"]
_LANGUAGES = _DATA["languages"]
_NAMES = _DATA["names"]
_SURNAMES = _DATA["surnames"]
_CITIES = _DATA["cities"]
_JOBS = _DATA["jobs"]
_COMPANIES = _DATA["companies"]
_PRODUCTS = _DATA["products"]
_ITEMS = _DATA["items"]
_MONTHS = _DATA["months"]
_DAYS = _DATA["days"]
_EVENTS = _DATA["events"]
_GROUPS = _DATA["groups"]
_COMPARISONS = _DATA["comparisons"]
_SETS = _DATA["sets"]
_EXTRACTIONS = _DATA["extractions"]


def _shopping(rng: random.Random) -> str:
    name = rng.choice(_NAMES)
    (item_a, low_a, high_a), (item_b, low_b, high_b) = rng.sample(_ITEMS, 2)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return (
        f"{name} buys {a} {item_a} at ${rng.randint(low_a, high_a)} each and {b} {item_b} at "
        f"${rng.randint(low_b, high_b)} each. How much does {name} spend altogether? Show the working."
    )


def _discount(rng: random.Random) -> str:
    price, off = rng.randrange(20, 400, 5), rng.choice((10, 15, 20, 25, 30, 40, 50))
    return f"A coat costs ${price} and the shop takes {off}% off. What is the new price, and how much is saved?"


def _speed(rng: random.Random) -> str:
    hours = rng.randint(2, 7)
    km = hours * rng.randint(40, 120)
    vehicle = rng.choice(("train", "bus", "car", "ferry", "cyclist"))
    return f"A {vehicle} covers {km} km in {hours} hours. What is its average speed? How far does it go in 90 minutes?"


def _equation(rng: random.Random) -> str:
    a, x, b = rng.randint(2, 12), rng.randint(-15, 25), rng.randint(-40, 40)
    sign = "+" if b >= 0 else "-"
    return f"Solve the equation {a}x {sign} {abs(b)} = {a * x + b} for x and check the answer."


def _garden(rng: random.Random) -> str:
    width, length = rng.randint(3, 30), rng.randint(4, 45)
    return (
        f"A rectangular plot of land measures {width} m by {length} m. Find its area and its perimeter, "
        f"and say how many meters of fence would surround it."
    )


def _mean(rng: random.Random) -> str:
    values = [rng.randint(1, 99) for _ in range(rng.randint(5, 8))]
    return f"Compute the mean and the range of these numbers: {', '.join(map(str, values))}."


def _lcm(rng: random.Random) -> str:
    a, b = rng.randint(4, 60), rng.randint(4, 60)
    return (
        f"Two buses leave the station together; one comes back every {a} minutes, the other every {b} minutes. "
        f"After how long are both at the station together again?"
    )


def _fractions(rng: random.Random) -> str:
    a, b, c, d = rng.randint(1, 9), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 12)
    op = rng.choice(("add", "multiply", "subtract"))
    return f"{op.capitalize()} the fractions {a}/{b} and {c}/{d}, and write the result in lowest terms."


def _marbles(rng: random.Random) -> str:
    red, blue, green = rng.randint(1, 12), rng.randint(1, 12), rng.randint(0, 8)
    return (
        f"A jar holds {red} red, {blue} blue and {green} green marbles. If two marbles are drawn without putting "
        f"the first back, what is the chance that both are red?"
    )


def _interest(rng: random.Random) -> str:
    money, rate, years = rng.randrange(500, 20000, 100), rng.choice((2, 3, 4, 5, 6, 8)), rng.randint(2, 10)
    return f"${money} is saved at {rate}% interest a year, compounded yearly. What is the balance after {years} years?"


def _pipes(rng: random.Random) -> str:
    a, b = rng.randint(2, 9), rng.randint(3, 12)
    return f"One hose fills a pool in {a} hours and a second one fills it in {b} hours. How long do both together take?"


def _ages(rng: random.Random) -> str:
    first, second = rng.sample(_NAMES, 2)
    younger, gap = rng.randint(3, 40), rng.randint(1, 30)
    return f"{first} is {gap} years older than {second}, and their ages add up to {2 * younger + gap}. How old is each?"


def _convert(rng: random.Random) -> str:
    value = rng.randint(3, 500)
    unit, target = rng.choice((
        ("kilometers", "miles"), ("pounds", "kilograms"), ("liters", "US gallons"), ("feet", "meters"),
        ("degrees Fahrenheit", "degrees Celsius"), ("square meters", "square feet"),
    ))  # fmt: skip
    return f"Convert {value} {unit} to {target}, and explain the conversion factor you use."


def _sequence(rng: random.Random) -> str:
    start, step, kind = rng.randint(1, 20), rng.randint(2, 9), rng.random()
    terms = [start * step**i for i in range(5)] if kind < 0.3 else [start + step * i for i in range(5)]
    return f"What are the next two numbers in {', '.join(map(str, terms))}, ...? Describe the rule."


def _recipe(rng: random.Random) -> str:
    people, more, grams = rng.randint(2, 6), rng.randint(3, 15), rng.randrange(100, 900, 25)
    return f"A recipe for {people} people needs {grams} g of flour. How much flour is needed to cook for {more} people?"


def _clock(rng: random.Random) -> str:
    hour, minute, length = rng.randint(9, 21), rng.randrange(0, 60, 5), rng.randint(75, 200)
    return f"A film starts at {hour}:{minute:02d} and runs for {length} minutes. At what time does it end?"


def _order_puzzle(rng: random.Random) -> str:
    more, most = rng.choice(_COMPARISONS)
    people = rng.sample(_NAMES, rng.randint(3, 5))
    facts = [f"{a} is {more} than {b}" for a, b in itertools.pairwise(people)]
    rng.shuffle(facts)
    return f"{'. '.join(facts)}. Who is the {most}? Explain how you worked it out."


def _syllogism(rng: random.Random) -> str:
    x, y, z = rng.choice(_SETS)
    return f"All {x} are {y}, and some {y} are {z}. Must some {x} be {z}? Explain your reasoning."


def _weekday(rng: random.Random) -> str:
    return f"If today is {rng.choice(_DAYS)}, what day of the week will it be in {rng.randint(3, 400)} days? Explain."


def _odd_one_out(rng: random.Random) -> str:
    (_, members), (_, others) = rng.sample(_GROUPS, 2)
    words = [*rng.sample(members, 3), rng.choice(others)]
    rng.shuffle(words)
    return f"Find the odd one out among {', '.join(words)}, and explain your choice."


def _knights(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    claim = rng.choice((
        f"'{b} is a liar.'", "'We are both liars.'", f"'{b} and I are different kinds.'",
        "'At least one of us tells the truth.'",
    ))  # fmt: skip
    return (
        f"On an island every person either always tells the truth or always lies. {a} says: {claim} "
        f"{b} says nothing. What can you conclude about {a} and {b}?"
    )


def _coins(rng: random.Random) -> str:
    coins = rng.choice((3, 8, 9, 12, 27))
    weight = rng.choice(("heavier", "lighter"))
    return (
        f"Among {coins} coins that look the same, one is slightly {weight}. With a balance scale, what is the "
        f"smallest number of weighings that always finds it? Describe the strategy."
    )


def _schedule(rng: random.Random) -> str:
    name = rng.choice(_NAMES)
    leave, walk, wait, ride = rng.randint(6, 9), rng.randint(5, 20), rng.randint(2, 15), rng.randint(10, 50)
    return (
        f"{name} leaves home at {leave}:{rng.randrange(0, 60, 5):02d}, walks {walk} minutes to the stop, waits "
        f"{wait} minutes and rides for {ride} minutes. Can {name} make a meeting at {leave + 1}:15? Reason it out."
    )


_MATH = (
    _shopping, _discount, _speed, _equation, _garden, _mean, _lcm, _fractions, _marbles, _interest, _pipes, _ages,
    _convert, _sequence, _recipe, _clock,
)  # fmt: skip
_PUZZLES = (_order_puzzle, _syllogism, _weekday, _odd_one_out, _knights, _coins, _schedule)


def _fact(rng: random.Random) -> str:
    name, city = f"{rng.choice(_NAMES)} {rng.choice(_SURNAMES)}", rng.choice(_CITIES)
    company, year, month = rng.choice(_COMPANIES), rng.randint(1995, 2024), rng.choice(_MONTHS)
    return rng.choice((
        f"{name}, a {rng.choice(_JOBS)} from {city}, joined {company} in {month} {year}.",
        f"{company} released {rng.choice(_PRODUCTS)} on {month} {rng.randint(1, 28)}, {year}, priced at "
        f"${rng.randint(20, 900)}.",
        f"About {rng.randrange(50, 5000, 10)} people came to the {rng.choice(_EVENTS)} in {city} on "
        f"{month} {rng.randint(1, 28)}, {year}.",
        f"In {year}, {company} earned ${rng.randint(2, 900)} million, {rng.randint(2, 40)}% more than the year before.",
        f"{name} traveled from {city} to {rng.choice([c for c in _CITIES if c != city])} in {month} and stayed for "
        f"{rng.randint(2, 21)} nights.",
        f"{name} paid ${rng.randint(15, 600)} for {rng.choice(_PRODUCTS)} at the {city} branch of {company}.",
    ))  # fmt: skip


def _extraction(rng: random.Random) -> str:
    facts = " ".join(_fact(rng) for _ in range(rng.randint(3, 5)))
    return f"{rng.choice(_EXTRACTIONS)}\n\n{facts}"


def _topic_family(rng: random.Random, templates: tuple[str, ...]) -> list[str]:
    pairs = list(itertools.product(templates, _TOPICS))
    rng.shuffle(pairs)
    return [task.format(topic=topic) for task, topic in pairs]


def _made_up(rng: random.Random, makers: tuple[Callable[[random.Random], str], ...], count: int) -> list[str]:
    return [makers[i % len(makers)](rng) for i in range(count)]


def _families(rng: random.Random) -> list[list[str]]:
    """One list of prompts per kind of request, each in a seeded random order."""
    roleplay = [
        task.format(role=role, topic=topic)
        for role, task in itertools.product(_ROLES, _ROLE_TASKS)
        for topic in rng.sample(_TOPICS, 4)
    ]
    coding = [
        template.format(task=task, language=rng.choice(_LANGUAGES))
        for task, template in itertools.product(_CODE_TASKS, _CODE_TEMPLATES)
    ]
    math = _made_up(rng, _MATH, 40 * len(_MATH))
    puzzles = _made_up(rng, _PUZZLES, 60 * len(_PUZZLES))
    extraction = _made_up(rng, (_extraction,), 600)
    for made in (roleplay, coding, math, puzzles):
        rng.shuffle(made)
    topical = {kind: _topic_family(rng, templates) for kind, templates in _TASKS.items()}
    return [
        topical["writing"],
        roleplay,
        [p for pair in itertools.zip_longest(puzzles, topical["reasoning"]) for p in pair if p is not None],
        [p for pair in itertools.zip_longest(math, topical["math"]) for p in pair if p is not None],
        [p for pair in itertools.zip_longest(coding, topical["coding"]) for p in pair if p is not None],
        extraction,
        topical["stem"],
        topical["humanities"],
    ]


def _signature_prompt(name: str, fn: Any) -> str | None:
    """``def name(args):`` + the first paragraph of the docstring, or None if ``fn`` does not qualify."""
    if name.startswith("_") or name in _EVALUATION_NAMES or not inspect.isfunction(fn):
        return None
    doc = inspect.cleandoc(fn.__doc__) if isinstance(fn.__doc__, str) else ""  # its own, not an inherited one
    if len(doc) < 40:
        return None
    try:
        signature = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None
    if " at 0x" in signature:  # a default that prints its address would differ from run to run
        return None
    summary = doc.split("\n\n")[0].strip().replace('"""', "'''").replace("\n", "\n    ")
    return f'def {name}{signature}:\n    """{summary}\n    """\n'


@functools.lru_cache(maxsize=1)
def stdlib_functions() -> tuple[tuple[str, Any], ...]:
    """(name, function) of the public pure-Python functions and methods of ``_MODULES``, in a fixed
    order, without the names of HumanEval's entry points."""
    found: list[tuple[str, Any]] = []
    for module_name in _MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, value in sorted(vars(module).items()):
            if getattr(value, "__module__", None) != module.__name__:
                continue
            candidates: list[tuple[str, Any]]
            if inspect.isfunction(value):
                candidates = [(name, value)]
            elif inspect.isclass(value) and not name.startswith("_"):
                members = sorted(vars(value).items())
                candidates = [(n, m.__func__ if isinstance(m, (staticmethod, classmethod)) else m) for n, m in members]
            else:
                continue
            found += [
                (n, fn)
                for n, fn in candidates
                if not n.startswith("_") and n not in _EVALUATION_NAMES and inspect.isfunction(fn)
            ]
    return tuple(found)


@functools.lru_cache(maxsize=1)
def _code_prompts() -> tuple[str, ...]:
    prompts = (_signature_prompt(name, fn) for name, fn in stdlib_functions())
    return tuple(dict.fromkeys(p for p in prompts if p is not None))  # ordered, and without repeats


def code_prompts(limit: int | None = None) -> list[str]:
    """``def name(args):`` + docstring of standard-library functions and public methods, for raw completion."""
    prompts = list(_code_prompts())
    return prompts[:limit] if limit is not None else prompts


def chat_prompts(limit: int | None = None, seed: int = 0) -> list[list[dict[str, str]]]:
    """Single-turn instructions, made up and shuffled with ``seed``, the kinds of request taking turns."""
    families = _families(random.Random(seed))
    unique = dict.fromkeys(p for group in itertools.zip_longest(*families) for p in group if p is not None)
    prompts = [[{"role": "user", "content": content}] for content in unique]
    return prompts[:limit] if limit is not None else prompts


def default_corpus(size: int, seed: int = 0) -> list[Prompt]:
    """Code and chat prompts taking turns (chat alone once the code runs out), the first ``size``.

    A corpus is a prefix of every larger one, so a run grown with a larger ``--samples`` keeps its
    cached responses."""
    code = code_prompts()
    random.Random(seed).shuffle(code)
    chat = chat_prompts(seed=seed)
    out: list[Prompt] = []
    for a, b in itertools.zip_longest(code, chat):
        out += [p for p in (a, b) if p is not None]
        if len(out) >= size:
            break
    return out[:size]


def load_prompts(path: Path) -> list[Prompt]:
    """A ``.jsonl`` file: one ``{"prompt": str}`` or ``{"messages": [...]}`` per line."""
    prompts: list[Prompt] = []
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise InvalidOptionError(f"cannot read the prompts file {path}: {err}") from err
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError as err:
            raise InvalidOptionError(f"{path}:{number} is not JSON: {err}") from err
        if isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            prompts.append(record["messages"])
        else:
            raise InvalidOptionError(f'{path}:{number}: expected {{"prompt": "..."}} or {{"messages": [...]}}.')
    if not prompts:
        raise InvalidOptionError(f"{path} holds no prompts.")
    return prompts


def load_text(directory: Path, chunk_chars: int = 1200) -> list[str]:
    """Raw text files under ``directory`` (``*.txt``, ``*.md``, ``*.py``), cut into prompt-sized chunks."""
    if not directory.is_dir():
        raise InvalidOptionError(f"{directory} is not a directory of text files.")
    chunks: list[str] = []
    for file in sorted(p for p in directory.rglob("*") if p.suffix in (".txt", ".md", ".py") and p.is_file()):
        text = file.read_text(errors="ignore")
        chunks += [text[i : i + chunk_chars] for i in range(0, len(text), chunk_chars) if text[i : i + chunk_chars]]
    if not chunks:
        raise InvalidOptionError(f"no .txt, .md or .py text under {directory}.")
    return chunks
