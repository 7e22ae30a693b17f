"""Does vLLM answer as the target does? On a sample of first user turns, vLLM's greedy answers against draftsmith's
own plain greedy decoding, both in fp32, token for token. Any difference is counted and shown, with where it
starts (a near-tie that the two engines' fp32 rounding breaks apart, or a real mismatch: a template, a stop token,
a weight that loads differently)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from jinja2 import TemplateError

from draftsmith.files import write_file_atomic
from draftsmith.serve.build import build_engine
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.target import LoadedTarget, TargetConfig, encode_chat, eos_ids, load_target
from draftsmith.serve.shared.conversations import Conversation
from draftsmith.serve.spec import SpecConfig

from .data import RegenerateConfig
from .regenerate_vllm import VllmJob, VllmWorker, find_vllm_python
from .turns import user_segments


@dataclass
class Fidelity:
    prompts: int
    max_new_tokens: int
    vllm_version: str
    identical: int
    first_differences: list[int]  # per differing prompt: the index of its first differing token
    reused_worker: bool = False  # vLLM's answers came from the worker that regenerated (its prefix cache warm)

    def __str__(self) -> str:
        head = f"fidelity (fp32 greedy, {self.prompts} first turns x {self.max_new_tokens} tokens): "
        head += f"vLLM {self.vllm_version} equals draftsmith's plain decoding on {self.identical}/{self.prompts}"
        if not self.first_differences:
            return head
        return head + f"; the others part at tokens {', '.join(map(str, self.first_differences))}"


def first_prompts(convs: list[Conversation], tokenizer, n: int, limit: int) -> list[list[int]]:
    """The chat-encoded first user turns of the first n conversations that have one and fit under `limit`."""
    out = []
    for conv in convs:
        segments = user_segments(conv.messages)
        try:
            ids = encode_chat(tokenizer, segments[0]) if segments else None
        except TemplateError:  # one regeneration skipped too
            continue
        if ids and len(ids) < limit:
            out.append(ids)
        if len(out) == n:
            break
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_prompts(loaded: LoadedTarget, convs: list[Conversation], cfg: RegenerateConfig) -> list[list[int]]:
    """The first turns the check answers: data.regenerate.fidelity of them that fit the target's context with
    data.regenerate.fidelity_tokens to answer."""
    context = loaded.model.config.max_position_embeddings
    prompts = first_prompts(convs, loaded.tokenizer, cfg.fidelity, context - cfg.fidelity_tokens)
    if not prompts:
        raise ValueError(
            f"the fidelity check found no conversation whose first user turn fits {context} tokens with "
            f"data.regenerate.fidelity_tokens={cfg.fidelity_tokens} to answer: lower it, or skip the check "
            "(data.regenerate.fidelity=0)"
        )
    return prompts


def check_fidelity(
    loaded: LoadedTarget,
    prompts: list[list[int]],
    cfg: RegenerateConfig,
    out: Path,
    cache_dir: str | None = None,
    regenerating: VllmWorker | None = None,
) -> Fidelity:
    """`prompts` answered by both engines in fp32 (the target read again from its folder); the result is also
    written to `out` (JSON). `regenerating`: the fp32 vLLM worker that wrote the answers, asked instead of starting
    another (`FidelityCheck`)."""
    max_new_tokens = cfg.fidelity_tokens
    target = load_target(TargetConfig(path=str(loaded.folder), dtype="float32", cache_dir=cache_dir))
    context = target.model.config.max_position_embeddings
    engine = build_engine(target, SpecConfig("ar"), prefix_cache=False, max_seq_len=context)
    ours = [engine.generate(p, max_new_tokens, SamplingParams()).output_ids for p in prompts]
    batch = {"prompts": prompts, "max_tokens": [max_new_tokens] * len(prompts), "seeds": [0] * len(prompts)}
    batch |= {"temperature": 0.0, "top_p": 1.0, "stop_token_ids": list(eos_ids(target))}
    if regenerating is not None:
        theirs, version = regenerating.generate(batch)["outputs"], regenerating.version
    else:
        python = find_vllm_python(cfg.vllm_python, cache_dir)
        job = VllmJob(str(target.folder), "float32", context, dict(cfg.engine_args))
        with VllmWorker(python, job, out.with_suffix(".vllm.log")) as worker:
            theirs, version = worker.generate(batch)["outputs"], worker.version
    differences = [d for a, b in zip(ours, theirs, strict=True) if (d := first_difference(a, b)) is not None]
    reused = regenerating is not None
    result = Fidelity(len(prompts), max_new_tokens, version, len(prompts) - len(differences), differences, reused)
    write_file_atomic(out, lambda tmp: tmp.write_text(json.dumps(asdict(result), indent=1) + "\n"))
    return result


@dataclass
class FidelityCheck:
    """The check after a regeneration through vLLM: on the worker that regenerated, before it closes, where that
    one runs the target in fp32 and every checked turn fits its context (the regeneration's max_length may be
    shorter than the target's); else on a fresh fp32 worker once it has closed (two engines at once could exceed
    the memory of a GPU that holds one). The same turns either way."""

    target: LoadedTarget
    convs: list[Conversation]
    cfg: RegenerateConfig
    out: Path
    cache_dir: str | None
    say: Callable[[str], None]
    done: bool = False

    def on_worker(self, worker: VllmWorker | None) -> None:
        """Called with the regeneration's backend still open (its vLLM worker, None for draftsmith's own)."""
        if worker is None or not self.cfg.fidelity or worker.job.dtype != "float32":
            return
        prompts = check_prompts(self.target, self.convs, self.cfg)
        if max(map(len, prompts)) + self.cfg.fidelity_tokens <= worker.job.max_model_len:
            self.run(prompts, worker)

    def after(self, generator: dict) -> None:
        """Called once the regeneration's backend has closed."""
        if self.cfg.fidelity and generator.get("engine") == "vllm" and not self.done:
            self.run(check_prompts(self.target, self.convs, self.cfg), None)

    def run(self, prompts: list[list[int]], worker: VllmWorker | None) -> None:
        self.say(str(check_fidelity(self.target, prompts, self.cfg, self.out, self.cache_dir, worker)))
        self.done = True
