"""The hydra group `data`: which conversations train a head (read by serve/shared/conversations.py) and how, and the
settings that key the examples."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class RegenerateConfig:
    """Regeneration (train/regenerate.py): the target's own answers replace the source's."""

    max_new_tokens: int = 512  # per answer (and never past data.max_length: later tokens are cut anyway)
    end_at_cut: bool = False  # a conversation ends at its first answer cut at max_new_tokens (not asked past it)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0  # sampling: each answer draws from a seed of (seed, conversation id, turn)
    answers: int = 1  # answers drawn per conversation (sampling only): draws 2.. get ids <id>~1, <id>~2, ...
    backend: str = "auto"  # vllm | draftsmith (own decoders) | auto: own without native bf16, else vLLM where installed
    vllm_python: str | None = None  # a Python with vLLM; default $DRAFTSMITH_VLLM_PYTHON, the setup venv, this one
    dtype: str = "auto"  # vLLM's dtype (auto: bfloat16 where native, else float32); the own decoder runs target.dtype
    engine_args: dict = field(default_factory=dict)  # more vLLM LLM(...) arguments, e.g. {data_parallel_size: 4}
    batch_size: int | None = None  # conversations in flight; null: 256 with vLLM, 64 slots with the own decoder
    spec: str = "ngram"  # own decoder at batch_size 1: the engine's proposer, ar | ngram (lossless either way)
    shard: str | None = None  # i/n: answer only the i-th of n contiguous slices, into the shard's own file
    fidelity: int = 0  # after vLLM wrote answers: this many first turns, vLLM vs draftsmith, fp32 greedy (fidelity.py)
    fidelity_tokens: int = 64  # new tokens per checked turn
    out: str | None = None  # the JSONL; default <target.cache_dir or $DRAFTSMITH_CACHE>/regenerate/<target>-<key>.jsonl

    def __post_init__(self) -> None:
        if self.fidelity < 0 or self.fidelity_tokens < 1:
            f, k = self.fidelity, self.fidelity_tokens
            raise ValueError(f"data.regenerate.fidelity must be >= 0 and fidelity_tokens >= 1, got {f} and {k}")
        if self.max_new_tokens < 1 or (self.batch_size is not None and self.batch_size < 1):
            n, b = self.max_new_tokens, self.batch_size
            raise ValueError(f"data.regenerate.max_new_tokens and batch_size must be >= 1, got {n} and {b}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0) or not 0 < self.top_p <= 1:
            t, p = self.temperature, self.top_p
            raise ValueError(f"data.regenerate.temperature must be >= 0 and top_p in (0, 1], got {t} and {p}")
        if self.answers < 1 or (self.answers > 1 and self.temperature == 0):
            raise ValueError(
                f"data.regenerate.answers={self.answers}: it must be >= 1, and more than one draw per conversation "
                "needs sampling (every greedy draw is the same answer): set data.regenerate.temperature, e.g. 0.7"
            )
        if self.spec not in ("ar", "ngram"):
            raise ValueError(f"data.regenerate.spec must be ar or ngram (no drafter is trained yet), got {self.spec!r}")
        if self.backend not in ("auto", "vllm", "draftsmith"):
            raise ValueError(f"data.regenerate.backend must be auto, vllm or draftsmith, got {self.backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"data.regenerate.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        self.engine_args = dict(self.engine_args)
        taken = sorted(set(self.engine_args) & OWN_ENGINE_ARGS)
        if taken:
            raise ValueError(
                f"data.regenerate.engine_args sets {', '.join(taken)}, which regeneration sets itself (the target's "
                "folder, data.regenerate.dtype, data.max_length, greedy defaults): drop them"
            )


OWN_ENGINE_ARGS = frozenset({"model", "dtype", "seed", "max_model_len", "generation_config"})  # the worker sets them
ANSWER_FIELDS = ("max_new_tokens", "temperature", "top_p", "seed")  # what changes the answers (not how fast)
# answer settings added later: keys and rows record them only where on, so those made before they existed still match
RECORDED_WHEN_ON = ("end_at_cut",)


def answer_settings(cfg: RegenerateConfig) -> dict:
    """What changes the answers (not how fast they come), as cache keys and each row's generator record it."""
    return {k: getattr(cfg, k) for k in ANSWER_FIELDS} | {k: True for k in RECORDED_WHEN_ON if getattr(cfg, k)}


@dataclass
class DataConfig:
    """Mirrors the hydra group `data`."""

    name: str = "sharegpt"
    source: str = "sharegpt"  # sharegpt | a .jsonl file | a folder saved with datasets.save_to_disk
    max_conversations: int | None = 2000  # training conversations kept (after filtering); null = all
    max_length: int = 1024  # tokens per example (longer ones are truncated)
    heldout_fraction: float = 0.02  # share of conversation ids held out for evaluation
    # each answer cut to its first N tokens and its conversation ended there (train/answer_cap.py); null: as made
    answer_cap: int | None = None
    regenerated: bool = False  # train on the target's own answers (train/regenerate.py) instead of the source's
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"data.heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.max_length < 2:
            raise ValueError(f"data.max_length must be >= 2, got {self.max_length}")
        if self.answer_cap is not None and self.answer_cap < 1:
            raise ValueError(f"data.answer_cap must be >= 1 token (null: answers as made), got {self.answer_cap}")


def data_key(cfg: DataConfig) -> dict:
    """The settings that decide the examples (feature cache keys, resume fingerprints). regenerated: the regenerate
    settings that decide the answers when it is on (answers per conversation where more than one); null when off,
    as the others cannot change the examples."""
    key = asdict(cfg)
    del key["regenerate"]
    on = key.pop("regenerated")
    if key["answer_cap"] is None:  # keys made before the setting existed still match
        del key["answer_cap"]
    draws = {"answers": cfg.regenerate.answers} if cfg.regenerate.answers > 1 else {}
    # "self_distill": the name this entry had before regeneration was named so; kept, so existing keys still match
    return {**key, "self_distill": answer_settings(cfg.regenerate) | draws if on else None}
