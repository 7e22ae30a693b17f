"""The domain-shift experiment's numbers (benchmarks/domain_shift.py): JSON, Markdown and a PNG in its out folder.

Every interval is a 95% percentile bootstrap over requests. tau pools over a set of requests (1 + accepted draft
tokens / drafts); a speedup is an arm's tokens per second of request latency over plain decoding's on the same
requests (pooled: sums of tokens over sums of seconds), resampled in pairs.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

DRAWS = 2000


def arrays(log: list[dict]) -> dict[str, np.ndarray]:
    keys = ("accepted_tokens", "drafts", "tokens", "latency_s")
    return {k: np.array([r[k] for r in log], dtype=float) for k in keys}


def boot(n: int, seed: int = 0) -> np.ndarray:
    """[DRAWS, n] resampling weights (how often each request is drawn)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, [1 / n] * n, size=DRAWS).astype(float) if n else np.zeros((DRAWS, 0))


def tau(a: dict, w: np.ndarray) -> np.ndarray:
    return 1 + (w @ a["accepted_tokens"]) / np.maximum(w @ a["drafts"], 1)


def rate(a: dict, w: np.ndarray) -> np.ndarray:
    return (w @ a["tokens"]) / (w @ a["latency_s"])


def estimate(stat, *groups: dict, seed: int = 0) -> dict:
    """stat(*groups, weights) at the point and its bootstrap interval; groups share the request index (paired)."""
    n = len(groups[0]["tokens"])
    point = float(stat(*groups, np.ones((1, n)))[0])
    draws = stat(*groups, boot(n, seed))
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return {"value": round(point, 4), "ci": [round(float(lo), 4), round(float(hi), 4)]}


def pick(log: list[dict], keep) -> dict:
    return arrays([r for r in log if keep(r)])


def windows(stream: dict[str, list[dict]], size: int) -> list[dict]:
    n = len(stream["plain"])
    rows = []
    for start in range(0, n, size):
        part = {arm: pick(log, lambda r, s=start: s <= r["index"] < s + size) for arm, log in stream.items()}
        row = {"requests": [start, min(n, start + size)], "domain": stream["plain"][start]["domain"]}
        for arm in ("frozen", "adapting"):
            row[f"tau_{arm}"] = estimate(lambda a, w: tau(a, w), part[arm])
            row[f"speedup_{arm}"] = estimate(lambda a, p, w: rate(a, w) / rate(p, w), part[arm], part["plain"])
        row["tau_gain"] = estimate(lambda a, f, w: tau(a, w) - tau(f, w), part["adapting"], part["frozen"])
        row["version"] = max(r.get("version", 0) for r in stream["adapting"][start : start + size])
        rows.append(row)
    return rows


def heldout(held: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for domain in sorted({r["domain"] for r in held["plain"]}):
        part = {arm: pick(log, lambda r, d=domain: r["domain"] == d) for arm, log in held.items()}
        row = {"prompts": len(part["plain"]["tokens"])}
        for arm in ("frozen", "adapted"):
            row[f"tau_{arm}"] = estimate(lambda a, w: tau(a, w), part[arm])
            row[f"speedup_{arm}"] = estimate(lambda a, p, w: rate(a, w) / rate(p, w), part[arm], part["plain"])
        row["tau_gain"] = estimate(lambda a, f, w: tau(a, w) - tau(f, w), part["adapted"], part["frozen"])
        row["speedup_ratio"] = estimate(lambda a, f, w: rate(a, w) / rate(f, w), part["adapted"], part["frozen"])
        out[domain] = row
    return out


def throughput(stream: dict[str, list[dict]]) -> dict[str, dict]:
    """Each arm's tokens/s with the trainer running over that with it paused (unpaired: separate resamples)."""
    out = {}
    for arm, log in stream.items():
        run, paused = pick(log, lambda r: r["trainer"] == "running"), pick(log, lambda r: r["trainer"] == "paused")
        if not len(run["tokens"]) or not len(paused["tokens"]):
            continue
        point = float(
            rate(run, np.ones((1, len(run["tokens"]))))[0] / rate(paused, np.ones((1, len(paused["tokens"]))))[0]
        )
        draws = rate(run, boot(len(run["tokens"]), 1)) / rate(paused, boot(len(paused["tokens"]), 2))
        lo, hi = np.percentile(draws, [2.5, 97.5])
        out[arm] = {"value": round(point, 4), "ci": [round(float(lo), 4), round(float(hi), 4)]}
    return out


def lossless(logs: dict) -> dict[str, str]:
    return {
        f"{phase}/{arm}": f"{sum(r['identical'] for r in log)}/{len(log)}"
        for phase, arms in logs.items()
        for arm, log in arms.items()
    }


def fmt(e: dict) -> str:
    return f"{e['value']:.3f} [{e['ci'][0]:.3f}, {e['ci'][1]:.3f}]"


def markdown(res: dict) -> str:
    lines = ["# Domain shift: frozen vs adapting drafter", "", "## Stream, per window", ""]
    head = ("requests", "domain", "head version", "tau frozen", "tau adapting", "tau gain", "speedup frozen")
    lines += ["| " + " | ".join(head) + " | speedup adapting |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for w in res["windows"]:
        cells = [f"{w['requests'][0]}-{w['requests'][1]}", w["domain"], f"v{w['version']:04d}"]
        cells += [fmt(w[k]) for k in ("tau_frozen", "tau_adapting", "tau_gain", "speedup_frozen", "speedup_adapting")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"## Held-out prompts, final head {res['final_version']} vs the frozen one", ""]
    lines += [
        "| domain | prompts | tau frozen | tau adapted | tau gain | speedup frozen | speedup adapted | adapted/frozen |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for d, r in res["heldout"].items():
        keys = ("tau_frozen", "tau_adapted", "tau_gain", "speedup_frozen", "speedup_adapted", "speedup_ratio")
        lines.append(f"| {d} | {r['prompts']} | " + " | ".join(fmt(r[k]) for k in keys) + " |")
    lines += ["", "## Cost", "", "| measure | value |", "|---|---|"]
    for arm, e in res["throughput_running_over_paused"].items():
        lines.append(f"| {arm}: tokens/s with the trainer running / paused | {fmt(e)} |")
    lines.append(f"| trainer CPU seconds / stream wall seconds | {res['trainer_cpu_share']:.3f} (of 2 cores) |")
    published = sum(1 for r in res["trainer_rounds"] if r.get("published"))
    lines.append(f"| trainer rounds / versions published | {len(res['trainer_rounds'])} / {published} |")
    lines += ["", "## Output identical to plain decoding", ""]
    lines += [f"- {k}: {v}" for k, v in res["identical"].items()]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(res["windows"]))
    for ax, key, label in ((axes[0], "tau", "tau"), (axes[1], "speedup", "speedup vs plain")):
        for arm, shift in (("frozen", -0.1), ("adapting", 0.1)):
            e = [w[f"{key}_{arm}"] for w in res["windows"]]
            v = np.array([p["value"] for p in e])
            err = np.array([[p["value"] - p["ci"][0], p["ci"][1] - p["value"]] for p in e]).T
            ax.errorbar(x + shift, v, yerr=err, fmt="o-", capsize=3, label=arm)
        ax.set_xticks(x, [f"{w['domain']}\n{w['requests'][0]}" for w in res["windows"]], fontsize=7)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("Stream windows (95% intervals): frozen vs adapting drafter")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(logs: dict, meta: dict, out: Path) -> dict:
    res = {"windows": windows(logs["stream"], meta["args"]["window"]), "heldout": heldout(logs["heldout"])}
    res["throughput_running_over_paused"] = throughput(logs["stream"])
    res["trainer_cpu_share"] = meta["trainer_cpu_s"] / meta["stream_wall_s"]
    res |= {
        "identical": lossless(logs),
        "final_version": meta["final_version"],
        "trainer_rounds": meta["trainer_rounds"],
    }
    res["meta"] = {k: v for k, v in meta.items() if k != "trainer_rounds"}
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "report.md").write_text(markdown(res))
    plot(res, out / "windows.png")
    print(markdown(res))
    return res
