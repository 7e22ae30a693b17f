"""Training-free drafting methods: kinds with no module, no loss and no drafter folder, drafting from the target
(its prompt and output, or its own first layers). Their proposers live in serve/."""

from __future__ import annotations

from .kinds import DraftShape, Kind, register

register(
    Kind(
        name="ngram",
        proposer="draftsmith.serve.ngram:ngram_proposer",
        draft_shape=DraftShape(num_tokens=5, topk=1, total_tokens=0),
        parameters=0,
    )
)
register(
    Kind(
        name="layerskip",
        proposer="draftsmith.serve.draft_model:layerskip_proposer",
        draft_shape=DraftShape(num_tokens=3, topk=1, total_tokens=0),
    )
)
