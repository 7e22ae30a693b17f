"""Per-request counters and timings, named as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.serve.engine.calibration import reliability_add


@dataclass
class Metrics:
    drafts: int = 0  # steps that verified a non-empty draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose depth i+1 was accepted
    target_forward_passes: int = 0
    verify_rows: list[int] = field(default_factory=list)  # [i]: target passes that verified i + 1 rows
    draft_s: float = 0.0  # seconds in the proposer (propose and accept), summed
    new_tokens: int = 0
    prompt_tokens: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    ttft_s: float = 0.0  # summed over requests
    total_s: float = 0.0
    requests: int = 1  # pooled totals start from Metrics(requests=0)
    # how each step with a proposer went (spec.verify=cost or policy): nothing verified, a probe, a draft verified
    # whole, or cut to the nodes that pay
    plain_steps: int = 0
    probe_steps: int = 0
    whole_steps: int = 0
    cut_steps: int = 0
    drafters_benched: int = 0  # drafters the policy left out of the request (summed over pooled requests)
    # reliability tables (calibration.reliability_add), keyed "<drafter>/<depth>" for the policy's estimates,
    # ".../settled" for those past a request's first 32 steps, ".../own" for the drafter's own probabilities
    calibration: dict[str, list[float]] = field(default_factory=dict)

    def record_step(self, draft_size: int, accepted: int, rows: int = 1) -> None:
        """One target pass. draft_size, accepted: drafted and accepted nodes within the output only (the engine
        leaves out those past max_new_tokens or an accepted EOS), so tau never counts tokens that were cut.
        rows: what the pass verified (the pending token and every node sent, within the output or not)."""
        self.target_forward_passes += 1
        self.verify_rows += [0] * (rows - len(self.verify_rows))
        self.verify_rows[rows - 1] += 1
        if draft_size == 0:
            return
        self.drafts += 1
        self.draft_tokens += draft_size
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < accepted:
            self.accepted_per_position += [0] * (accepted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def record_decision(self, decision: str) -> None:
        name = f"{decision}_steps"
        setattr(self, name, getattr(self, name) + 1)

    def record_estimate(self, drafter: str, depth: int, estimate: float, own: float | None, hit: bool, settled: bool):
        """A verified node whose parent was accepted: what acceptance it was estimated at, and whether it was."""
        key = f"{drafter}/{depth}"
        for k, p in ((key, estimate), (f"{key}/settled", estimate if settled else None), (f"{key}/own", own)):
            if p is not None:
                self.calibration[k] = reliability_add(self.calibration.get(k, []), p, hit)

    def merge(self, other: Metrics) -> None:
        """Pool counters over requests (tau is pooled over drafts, not a mean of means)."""
        for name, value in vars(other).items():
            if isinstance(value, dict):
                mine = getattr(self, name)
                setattr(self, name, {k: add_lists(mine.get(k, []), value.get(k, [])) for k in mine.keys() | value})
            elif isinstance(value, list):
                setattr(self, name, add_lists(getattr(self, name), value))
            else:
                setattr(self, name, getattr(self, name) + value)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_position] if self.drafts else []

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_verify_rows(self) -> float:
        steps = sum(self.verify_rows)
        return sum((i + 1) * c for i, c in enumerate(self.verify_rows)) / steps if steps else 0.0

    @property
    def draft_ms_per_step(self) -> float:
        return 1000 * self.draft_s / self.target_forward_passes if self.target_forward_passes else 0.0

    @property
    def mean_ttft_s(self) -> float:
        return self.ttft_s / self.requests if self.requests else 0.0

    @property
    def tpot_s(self) -> float:
        """Decode time per output token after the first, pooled over requests."""
        decoded = self.new_tokens - self.requests
        return (self.total_s - self.ttft_s) / decoded if decoded > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0


def add_lists(a: list, b: list) -> list:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
