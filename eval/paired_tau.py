"""Two drafters of one eval run, paired: each one's τ and acceptance by position, and the ratio of their τ, all pooled
over the same resampled prompts (stats.py's bootstrap). What a recipe arm is judged by: both heads drafted the
same prompts in one interleaved run, so the prompts' difficulty cancels out of the ratio."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.eval.journal import RECORDS, RUN, intact_lines, parse_unit
from draftsmith.eval.stats import Bootstrap, interval, ratio


def method_records(folder: Path, names: tuple[str, str]) -> dict[str, list]:
    """Each named method's answered turns in one eval folder, read without touching it (a run still writing may end
    in a torn line, which is left out); in a study run, the cells the run's results are of (its prefix_cache)."""
    folder = Path(folder)
    if names[0] == names[1]:
        raise ValueError(f"name two different methods, got {names[0]!r} twice")
    if not (folder / RECORDS).is_file():
        raise ValueError(f"{folder} holds no {RECORDS}: give a draftsmith-eval out= folder")
    units = [parse_unit(json.loads(line)) for line in intact_lines(folder / RECORDS, mend=False)]
    run = json.loads((folder / RUN).read_text()) if (folder / RUN).is_file() else {}
    cache = run.get("prefix_cache")
    records = [r for u in units for r in u.records if cache is None or r.prefix_cache == cache]
    if cache is None and len({r.prefix_cache for r in records}) > 1:
        raise ValueError(f"{folder} holds cells with and without the prefix cache and no {RUN} naming the reported one")
    found = {r.method for r in records}
    if missing := [n for n in names if n not in found]:
        raise ValueError(f"{folder} has no records of {missing}; its methods are {sorted(found)}")
    return {name: [r for r in records if r.method == name] for name in names}


class OtherPrompts(ValueError):
    """The two methods answered different prompts: nothing pairs them (an eval folder left by another run)."""


def paired_tau(records: dict[str, list]) -> dict:
    """τ (point and interval) and acceptance by position of each of the two methods in `records`, and the ratio of
    the first one's τ to the second's with its paired interval."""
    (a, ra), (b, rb) = records.items()
    ids = {r.id for r in ra}, {r.id for r in rb}
    if ids[0] != ids[1]:
        raise OtherPrompts(
            f"{a} and {b} ran other prompts ({len(ids[0] ^ ids[1])} not shared): the ratio pairs each prompt's "
            "turns, so evaluate both in one run over the same prompts"
        )
    if not ids[0]:
        raise ValueError(f"{a} and {b} answered no prompt")
    if idle := [name for name, rs in records.items() if not sum(r.metrics.drafts for r in rs)]:
        raise ValueError(
            f"{' and '.join(idle)} made no draft, so τ says nothing of {'it' if len(idle) == 1 else 'them'}: plain "
            "decoding (spec=ar) drafts nothing, and a draft policy may judge no draft worth its rows; compare "
            "drafters verifying their whole draft (methods.NAME.verify=fixed)"
        )
    boot = Bootstrap.over(sorted(ids[0]), seed=0)
    paired = boot.enough  # one prompt gives no interval
    report: dict = {}
    taus = {}
    for name, rs in records.items():
        depth = max(len(r.metrics.accepted_per_position) for r in rs)  # the depth this method drafted
        s = boot.sums(rs, depth)
        taus[name] = 1 + ratio(s["accepted_tokens"], s["drafts"])
        drafts = sum(r.metrics.drafts for r in rs)
        accepted = [sum(sum(r.metrics.accepted_per_position[i : i + 1]) for r in rs) for i in range(depth)]
        report[name] = {
            "tau": 1 + sum(r.metrics.accepted_tokens for r in rs) / drafts,
            "tau_interval": interval(taus[name]) if paired else None,
            "acceptance_by_position": [n / drafts for n in accepted],
            "acceptance_intervals": [
                interval(ratio(s[f"pos{i + 1}"], s["drafts"])) if paired else None for i in range(depth)
            ],
        }
    report["tau_ratio"] = report[a]["tau"] / report[b]["tau"]
    report["tau_ratio_interval"] = interval(ratio(taus[a], taus[b])) if paired else None
    return report
