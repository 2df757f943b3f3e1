"""Prompt corpora for self-distillation: an offline default, or the user's own prompts / text.

The default corpus needs no download and never contains our evaluation sets (HumanEval,
MT-Bench; a test checks it): *code* prompts are signatures and docstrings of pure-Python
functions of the standard library, completed as raw text; *chat* prompts are instructions built
from task templates and topics, sent with the chat template.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import random
import warnings
from pathlib import Path
from typing import Any

from dflash2.errors import InvalidOptionError

Prompt = str | list[dict[str, str]]

_MODULES = (
    "textwrap", "string", "shlex", "fnmatch", "glob", "heapq", "bisect", "statistics", "fractions",
    "colorsys", "calendar", "difflib", "html", "base64", "ipaddress", "json", "csv", "configparser",
    "argparse", "dataclasses", "functools", "operator", "copy", "pprint", "random", "secrets", "uuid",
    "urllib.parse", "email.utils", "posixpath", "ntpath", "pathlib", "tempfile", "shutil", "zipfile",
    "tarfile", "gettext", "locale", "codecs", "quopri", "uu", "wave", "tokenize", "ast", "dis",
    "inspect", "typing", "enum", "graphlib", "sched", "queue", "threading", "logging", "datetime",
    "zoneinfo", "decimal", "numbers", "cmath", "contextlib", "abc", "reprlib", "keyword", "traceback",
    "warnings", "mimetypes", "netrc", "smtplib", "http.cookies", "xml.dom.minidom", "plistlib",
)  # fmt: skip

# standard-library functions that share a name with a HumanEval entry point stay out
_EVALUATION_NAMES = frozenset({"median", "encode", "unique"})

_TASKS = (
    "Explain {topic} to a beginner in a few sentences.",
    "Write a short poem about {topic}.",
    "Give three practical tips about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a short story that involves {topic}.",
    "Summarize the history of {topic} in one paragraph.",
    "Write a Python function related to {topic} and explain how it works.",
    "List five interesting facts about {topic}.",
    "Compare {topic} with something similar and explain the differences.",
    "Write an email to a friend recommending {topic}.",
    "What questions should someone ask before getting started with {topic}?",
    "Describe a typical day of a person who works with {topic}.",
)
_TOPICS = (
    "gardening", "sourdough bread", "public transport", "solar panels", "chess openings", "volcanoes",
    "learning a new language", "budget travel", "houseplants", "the water cycle", "electric bikes",
    "time management", "birds of prey", "recycling", "jazz music", "the Roman aqueducts", "coffee brewing",
    "marathon training", "binary search", "sorting algorithms", "hash tables", "version control",
    "unit testing", "regular expressions", "linked lists", "recursion", "SQL joins", "web servers",
    "photosynthesis", "the moon landing", "ocean tides", "honey bees", "board games", "knitting",
    "mountain hiking", "saving money", "healthy breakfasts", "remote work", "city parks", "libraries",
    "the printing press", "weather forecasts", "bridges", "lighthouses", "origami", "camping",
    "first aid", "dinosaurs", "rain forests", "the human heart", "vaccines", "prime numbers",
    "probability", "compound interest", "maps and navigation", "street food", "tea ceremonies",
    "video game design", "podcasts", "museums", "trains", "composting", "sleep", "meditation",
)  # fmt: skip


def code_prompts(limit: int | None = None) -> list[str]:
    """``def name(args):`` + docstring of standard-library functions, for raw completion."""
    prompts: list[str] = []
    for module_name in _MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, fn in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                continue
            if name in _EVALUATION_NAMES:
                continue
            doc = inspect.getdoc(fn)
            try:
                signature = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            if not doc or len(doc) < 40:
                continue
            summary = doc.split("\n\n")[0].strip().replace('"""', "'''")
            prompts.append(f'def {name}{signature}:\n    """{summary}\n    """\n')
    return prompts[:limit] if limit is not None else prompts


def chat_prompts(limit: int | None = None, seed: int = 0) -> list[list[dict[str, str]]]:
    """Instructions from task templates x topics, shuffled with ``seed``."""
    pairs = list(itertools.product(_TASKS, _TOPICS))
    random.Random(seed).shuffle(pairs)
    prompts = [[{"role": "user", "content": task.format(topic=topic)}] for task, topic in pairs]
    return prompts[:limit] if limit is not None else prompts


def default_corpus(size: int, seed: int = 0) -> list[Prompt]:
    """Half code, half chat (as far as each goes), interleaved."""
    code = code_prompts()
    random.Random(seed).shuffle(code)
    chat = chat_prompts(seed=seed)
    half = size // 2
    picked_code = code[: max(half, size - len(chat))]
    picked_chat = chat[: size - len(picked_code)]
    out: list[Prompt] = []
    for a, b in itertools.zip_longest(picked_code, picked_chat):
        out += [p for p in (a, b) if p is not None]
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
