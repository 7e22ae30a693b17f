"""LiveJudge: whether a newly swapped-in head version keeps serving or is rolled back, on live traffic.

A version is judged once, after it has served `window` requests that drafted: it is rolled back when its pooled tau
over them falls below the previous version's over that version's last `window` such requests, less `margin`.
Requests that drafted nothing (max_tokens=1, an EOS first) say nothing about a head and are not counted. Without the
previous version's recent requests to compare with (after a restart) a version is not judged. Pooled tau: accepted
draft tokens over drafts, plus one (serve/engine/metrics.py), so a short request weighs less than a long one.
"""

from __future__ import annotations

from collections import deque
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


class LiveJudge:
    def __init__(self, window: int, margin: float) -> None:
        self.window, self.margin = window, margin
        self.totals: dict[str, Tally] = {}  # every request each version served
        self.recent: dict[str, deque[tuple[int, int]]] = {}  # its last `window` requests: (accepted, drafts)
        self.first: dict[str, Tally] = {}  # its first `window` requests
        self.judged: set[str] = set()

    def served(self, version: str, accepted: int, drafts: int) -> None:
        if drafts == 0:
            return
        self.totals.setdefault(version, Tally()).add(accepted, drafts)
        self.recent.setdefault(version, deque(maxlen=self.window)).append((accepted, drafts))
        first = self.first.setdefault(version, Tally())
        if first.requests < self.window:
            first.add(accepted, drafts)

    def last_window(self, version: str) -> Tally:
        t = Tally()
        for accepted, drafts in self.recent.get(version, ()):
            t.add(accepted, drafts)
        return t

    def should_roll_back(self, live: str, previous: str | None) -> bool | None:
        """None: not judged yet (or nothing to go back to); True: roll back; False: it stays, judged for good."""
        if previous is None or live in self.judged or self.first.get(live, Tally()).requests < self.window:
            return None
        self.judged.add(live)
        if not self.recent.get(previous):
            return None  # nothing to compare with (a restart): it stays
        return self.first[live].tau < self.last_window(previous).tau - self.margin

    def summary(self) -> dict[str, dict]:
        return {
            v: {"requests": t.requests, "accepted": t.accepted, "drafts": t.drafts, "tau": t.tau}
            for v, t in self.totals.items()
        }
