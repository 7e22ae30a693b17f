"""Training-free drafting methods: kinds with no module, no loss and no drafter folder, drafting from the target
(its prompt and output, earlier responses, or its own first layers). Their proposers live in serve/proposers/."""

from __future__ import annotations

from .kinds import DraftShape, Kind

NGRAM = Kind(
    name="ngram",
    proposer="draftsmith.serve.proposers.propose_ngram:ngram_proposer",
    draft_shape=DraftShape(num_tokens=5, topk=1, total_tokens=0),
    parameters=0,
)
# suffix decoding (arXiv 2411.04975, vLLM's method: suffix); its settings: spec.suffix (SuffixConfig)
SUFFIX = Kind(
    name="suffix",
    proposer="draftsmith.serve.proposers.propose_suffix:suffix_proposer",
    draft_shape=DraftShape(num_tokens=24, topk=1, total_tokens=0),  # vLLM: num_speculative_tokens = max depth
    parameters=0,
)
LAYERSKIP = Kind(
    name="layerskip",
    proposer="draftsmith.serve.proposers.propose_layerskip:layerskip_proposer",
    draft_shape=DraftShape(num_tokens=3, topk=1, total_tokens=0),
)
