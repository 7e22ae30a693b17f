"""LiveTally: each head version's pooled live tau over the requests it served, reported in live.json.

It decides nothing: two versions serve different requests, from different clients, at different times, so their
live tau do not compare. Rollback goes by the trainer's paired verdict (verdict.py). Requests that drafted nothing
(max_tokens=1, an EOS first) say nothing about a head and are not counted. Pooled tau: accepted draft tokens over
drafts, plus one (serve/engine/metrics.py), so a short request weighs less than a long one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Tally:
    requests: int = 0
    accepted: int = 0
    drafts: int = 0

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    def add(self, accepted: int, drafts: int) -> None:
        self.requests, self.accepted, self.drafts = self.requests + 1, self.accepted + accepted, self.drafts + drafts


class LiveTally:
    def __init__(self) -> None:
        self.totals: dict[str, Tally] = {}  # every request each version served

    def served(self, version: str, accepted: int, drafts: int) -> None:
        if drafts:
            self.totals.setdefault(version, Tally()).add(accepted, drafts)

    def summary(self) -> dict[str, dict]:
        return {
            v: {"requests": t.requests, "accepted": t.accepted, "drafts": t.drafts, "tau": t.tau}
            for v, t in self.totals.items()
        }
