"""The `spec` group: what drafts and how (SpecConfig), checked when the config is built, before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from draftsmith.heads.kinds import KINDS, by_spec, specs
from draftsmith.serve.engine.tree import TreeConfig

VERIFY = ("fixed", "cost", "policy")


@dataclass
class SuffixConfig:
    """vLLM's suffix_decoding_* settings (same names and defaults), plus `tree`."""

    max_tree_depth: int = 24  # longest substring a tree holds: bounds match length + draft length
    max_cached_requests: int = 10000  # responses the global tree keeps, oldest dropped first; 0 = no global tree
    max_spec_factor: float = 1.0  # draft at most max_spec_factor x match length tokens
    min_token_prob: float = 0.1  # draft no token whose estimated path probability is under this
    tree: bool = False  # draft a tree (the likeliest branches, best first) instead of one path as vLLM does

    def __post_init__(self) -> None:
        if self.max_tree_depth < 2:
            raise ValueError(f"spec.suffix.max_tree_depth must be >= 2 (match + draft), got {self.max_tree_depth}")
        if self.max_cached_requests < 0:
            raise ValueError(
                f"spec.suffix.max_cached_requests must be >= 0 (0 = no global tree), got {self.max_cached_requests}"
            )
        if self.max_spec_factor <= 0:
            raise ValueError(f"spec.suffix.max_spec_factor must be > 0, got {self.max_spec_factor}")
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"spec.suffix.min_token_prob must be in [0, 1], got {self.min_token_prob}")


@dataclass
class PolicyConfig:
    """spec.policy: the draft policy's settings (spec.verify=policy)."""

    probe_every: int = 16  # plain steps in a row before a probe (0: never probe)
    probe_backoff: int = 4  # a probe that finds nothing doubles the wait, up to this many times probe_every
    prior_weight: float = 4.0  # request observations the engine's estimate from earlier requests counts as
    half_life: float = 32.0  # request steps after which an observation weighs half
    # attached requests in a row in which a drafter made no draft but probes: it then sits whole requests out, its
    # prefill left to a later draft and no step asking it (0: never)
    bench_after: int = 2
    attach_every: int = 8  # a drafter sitting requests out is attached to every this-many-th, which probes it
    # verify=fixed or cost: estimate each drafted node's acceptance as the policy would, for the calibration report
    # only (nothing is decided by it); verify=policy always reports its estimates
    report_estimates: bool = False

    def __post_init__(self) -> None:
        if self.probe_every < 0:
            raise ValueError(f"spec.policy.probe_every must be >= 0 (0 = never probe), got {self.probe_every}")
        if self.probe_backoff < 1:
            raise ValueError(f"spec.policy.probe_backoff must be >= 1 (times probe_every), got {self.probe_backoff}")
        if not self.prior_weight > 0:
            raise ValueError(f"spec.policy.prior_weight must be > 0, got {self.prior_weight}")
        if not self.half_life > 0:
            raise ValueError(f"spec.policy.half_life must be > 0 (request steps), got {self.half_life}")
        if self.bench_after < 0:
            raise ValueError(f"spec.policy.bench_after must be >= 0 requests (0 = never), got {self.bench_after}")
        if self.attach_every < 1:
            raise ValueError(f"spec.policy.attach_every must be >= 1 request, got {self.attach_every}")


@dataclass
class SpecConfig:
    """Mirrors the hydra group `spec`; each method reads the fields it needs. The draft's shape (num_tokens, tree,
    choices) left None comes from the drafter folder (the shape it was made for), else the kind's default
    (resolve_shape)."""

    name: str = "ar"
    num_tokens: int | None = None  # chain length k (tree depth for tree proposers; suffix: the most tokens a draft
    # holds); None: the drafter's
    min_n: int = 2  # ngram
    max_n: int = 4  # ngram
    drafter: str | None = None  # draft: an HF folder sharing the target's tokenizer, or a draft_model drafter folder
    layers: int = 8  # layerskip: how many of the target's layers draft
    choices: list[list[int]] | None = None  # medusa: tree paths, e.g. [[0], [0, 0], [1]]; None: the drafter's
    # eagle, eagle3: topk (1 = a chain), total_tokens; None: the drafter's
    tree: TreeConfig = field(default_factory=lambda: TreeConfig(None, None))
    ngram_tokens: int = 0  # eagle, eagle3, medusa: also draft an n-gram lookup chain this long (0 = off)
    suffix_tokens: int = 0  # eagle, eagle3, medusa: also draft by suffix decoding, up to this many tokens (0 = off)
    ngram_policy: str = "prefer"  # for either lookup: prefer: its draft alone when found, else the tree | merge: both
    suffix: SuffixConfig = field(default_factory=SuffixConfig)  # suffix (and suffix_tokens): vLLM's suffix settings
    draft_dtype: str = "auto"  # the drafter's weights: auto (serve/drafters.py draft_dtype) | float32 | bfloat16
    draft_vocab: int = 0  # eagle, medusa, draft: draft over the N most frequent training-answer tokens (0 = all)
    # eagle, eagle3: the head reads only the prompt's last N tokens (and all it generates), so its prefill runs over
    # those alone: a long prompt's head prefill costs a fixed N tokens, not the prompt (0 = the whole prompt)
    head_window: int = 512
    # fixed: verify every draft whole | cost: verify the part that emits the most tokens per second, by the drafter's
    # accept probabilities and this machine's measured verify cost (serve/engine/draft_cut.py); a draft without
    # accept probabilities (n-gram, suffix) is verified whole | policy: decide before each step whether to draft,
    # with which drafter and how deep, by acceptance calibrated on what the target accepted, then cut as cost does
    # (serve/engine/policy.py)
    verify: str = "fixed"
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # verify=policy's settings

    def __post_init__(self) -> None:  # checked when the config is built, before any model loads
        if self.name not in specs():
            raise ValueError(f"unknown spec {self.name!r}; choose one of {', '.join(specs())}")
        if needs_drafter(self.name) and not self.drafter:
            raise ValueError(f"spec={self.name} needs spec.drafter=DIR: {needs_drafter(self.name)}")
        if self.num_tokens is not None and self.num_tokens < 1:
            raise ValueError(f"spec.num_tokens must be >= 1, got {self.num_tokens}")
        if self.draft_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"spec.draft_dtype must be auto, float32, bfloat16 or float16, got {self.draft_dtype!r}")
        if self.ngram_tokens < 0:
            raise ValueError(f"spec.ngram_tokens must be >= 0 (0 = off), got {self.ngram_tokens}")
        if self.head_window < 0:
            raise ValueError(f"spec.head_window must be >= 0 (0 = the whole prompt), got {self.head_window}")
        if self.suffix_tokens < 0:
            raise ValueError(f"spec.suffix_tokens must be >= 0 (0 = off), got {self.suffix_tokens}")
        if self.ngram_tokens and self.suffix_tokens:
            raise ValueError("spec.ngram_tokens and spec.suffix_tokens both set: pair the drafter with one lookup")
        if self.draft_vocab < 0:
            raise ValueError(f"spec.draft_vocab must be >= 0 (0 = the full vocabulary), got {self.draft_vocab}")
        if self.verify not in VERIFY:
            raise ValueError(f"spec.verify must be one of {', '.join(VERIFY)}, got {self.verify!r}")
        if self.verify == "policy" and self.ngram_policy == "merge" and (self.ngram_tokens or self.suffix_tokens):
            raise ValueError(
                "spec.ngram_policy=merge verifies the lookup's and the drafter's drafts together, and "
                "spec.verify=policy picks one of them each step: set spec.ngram_policy=prefer, or spec.verify=cost to "
                "keep merge"
            )
        if self.verify != "fixed" and self.name == "ar":
            raise ValueError(
                f"spec.verify={self.verify} decides what is drafted and spec=ar drafts nothing: drop it or pick a "
                "drafting spec"
            )
        lookup = self.ngram_tokens or self.suffix_tokens
        if self.policy.report_estimates and self.verify != "policy" and (self.name == "ar" or lookup):
            raise ValueError(
                "spec.policy.report_estimates estimates one drafter's nodes beside a fixed or cut draft: spec=ar "
                "drafts nothing, and a drafter paired with a lookup is reported part by part under spec.verify=policy"
            )
        if self.draft_vocab and self.name not in vocab_specs():
            raise ValueError(draft_vocab_refusal(self.name))


def needs_drafter(name: str) -> str:
    """What spec.drafter must be for spec=name; "" when that spec takes none."""
    return next((k.drafter_help() for k in KINDS.values() if k.name == name and k.proposer), "")


def vocab_specs() -> list[str]:
    """Specs whose drafter can narrow its logits at serve time (its module has restrict_vocab)."""
    return [k.name for k in KINDS.values() if k.proposer and hasattr(k.module, "restrict_vocab")]


def draft_vocab_refusal(name: str) -> str:
    names, config = vocab_specs(), by_spec(name).config if name != "ar" else None
    own = config is not None and "draft_vocab_size" in {f.name for f in fields(config)}
    why = f" an {name} head has its own (draft_vocab_size, set in training)" if own else ""
    return f"spec.draft_vocab applies to spec={', '.join(names[:-1])} and {names[-1]}, not {name}.{why}"
