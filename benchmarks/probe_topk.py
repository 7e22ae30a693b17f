#!/usr/bin/env python
"""Teacher-forced top-k agreement of EAGLE heads with their target: a deterministic estimate of depth-1 acceptance.

The target answers MT-bench first turns greedily (once, kept in --answers as JSON). Each head then reads the
target's own features along those answers and predicts every answer token from the second on, as a depth-1
draft does (the first comes from the prefill). top-k: how often the target's token is among the head's k best,
the acceptance of a depth-1 draft that verifies those k tokens side by side. Against draftsmith-eval's measured
depth-1 x 3 acceptance: 0.452 vs 0.44-0.45 for one quick head, 0.526 vs 0.50 for another. Unlike the
in-training eval (4 prompts, 32 tokens) it is the same few thousand positions every time.

    python benchmarks/probe_topk.py runs/main/eagle3/final runs/other/final
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from draftsmith.eval.suites import mt_bench, round_robin  # noqa: E402
from draftsmith.heads.drafter_folder import read_meta  # noqa: E402
from draftsmith.serve.build import build_engine  # noqa: E402
from draftsmith.serve.drafters import folder_drafter  # noqa: E402
from draftsmith.serve.engine.sampling import SamplingParams  # noqa: E402
from draftsmith.serve.models.target import (  # noqa: E402
    LoadedTarget,
    TargetConfig,  # noqa: E402
    encode_chat,
    load_target,
)
from draftsmith.serve.spec import SpecConfig  # noqa: E402
from draftsmith.train.features import target_states  # noqa: E402

KS = (1, 3, 5)


def greedy_answers(target: LoadedTarget, n: int, max_new_tokens: int) -> list[dict]:
    """The target's greedy answers to n MT-bench first turns (spread over categories): prompt and answer ids."""
    engine = build_engine(target, SpecConfig("ngram", 5), False, 2048)  # lossless, so the plain greedy answer
    rows = []
    for p in round_robin(mt_bench(max_turns=1), n):
        ids = encode_chat(target.tokenizer, [{"role": "user", "content": p.turns[0]}])
        rows.append(
            {"id": p.id, "prompt": ids, "answer": engine.generate(ids, max_new_tokens, SamplingParams()).output_ids}
        )
    return rows


def top_k_hits(head, states, prompt: list[int], answer: list[int]) -> tuple[torch.Tensor, int]:
    """Hits per k over the answer's tokens 2.. (a [len(KS)] count) and how many tokens were predicted."""
    x = torch.tensor([prompt + answer])
    hidden, aux = states
    m = x.shape[1] - 1
    # pair (feature_i, token_i+1) at position i+1 -> the head's feature i+1 -> its guess for token i+2
    h = head(head.target_features(hidden[:, :m], None if aux is None else aux[:, :m]), x[:, 1:], torch.arange(1, m + 1))
    top = head.logits(h)[0, :-1].topk(max(KS), -1).indices
    if head.vocab_ids is not None:
        top = head.vocab_ids[top]
    want = x[0, 2:]
    first = len(prompt) + 1 - 2  # row i guesses token i+2; the answer's second token sits at len(prompt)+1
    top, want = top[first:], want[first:]
    hits = torch.tensor([(top[:, :k] == want[:, None]).any(-1).sum().item() for k in KS])
    return hits, want.numel()


def probe(folder: Path, target: LoadedTarget, rows: list[dict], memo: dict) -> dict:
    """memo: the target's states per (row, layers), shared by heads that read the same layers."""
    kind = read_meta(folder)["kind"]
    if kind not in ("eagle", "eagle3"):
        raise ValueError(f"{folder} is a {kind} drafter; the probe reads EAGLE heads (eagle, eagle3)")
    head = folder_drafter(folder, target, kind, target.model, dtype=torch.float32)  # eagle, eagle3: spec = kind
    layers = tuple(head.target_layers)
    hits, n = torch.zeros(len(KS), dtype=torch.long), 0
    for i, r in enumerate(rows):
        if (i, layers) not in memo:
            memo[i, layers] = target_states(target.model, torch.tensor([r["prompt"] + r["answer"]]), layers)
        h, m = top_k_hits(head, memo[i, layers], r["prompt"], r["answer"])
        hits, n = hits + h, n + m
    return {
        "drafter": str(folder),
        "kind": kind,
        "positions": n,
        **{f"top{k}": (hits[i] / n).item() for i, k in enumerate(KS)},
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafters", nargs="+", type=Path)
    p.add_argument("--questions", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--answers", type=Path, default=Path("runs/probe_answers.json"), help="made once, then reused")
    p.add_argument("--out", type=Path, default=Path("runs/probe_topk.json"))
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    target = load_target(TargetConfig(name="smollm2-135m", dtype="float32"))
    key = {"target": target.target_id, "questions": args.questions, "max_new_tokens": args.max_new_tokens}
    saved = json.loads(args.answers.read_text()) if args.answers.is_file() else {}
    if saved.get("key") != key:
        saved = {"key": key, "rows": greedy_answers(target, args.questions, args.max_new_tokens)}
        args.answers.parent.mkdir(parents=True, exist_ok=True)
        args.answers.write_text(json.dumps(saved))
    results, memo = [], {}
    for folder in args.drafters:
        results.append(probe(folder, target, saved["rows"], memo))
        r = results[-1]
        print(
            f"{folder}: {r['positions']} positions  " + "  ".join(f"top{k} {r[f'top{k}']:.3f}" for k in KS), flush=True
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"answers": key, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
