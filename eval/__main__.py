"""draftsmith-eval: plain decoding vs a speculative method on a prompts file -> results.json."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftsmith.serve.__main__ import typed

from .runner import EvalConfig, run_eval


def print_headline(r: dict) -> None:
    b, s, lossless = r["baseline"], r["spec"], r["lossless"]
    print(
        f"{r['target']} on {r['device']} ({r['dtype']}), {r['prompts']} prompts, {r['max_new_tokens']} new tokens\n"
        f"  ar            {b['tokens_per_s']:6.1f} tok/s  TTFT {b['ttft_ms']:6.0f} ms  TPOT {b['tpot_ms']:5.1f} ms\n"
        f"  {s['method']:<13} {s['tokens_per_s']:6.1f} tok/s  TTFT {s['ttft_ms']:6.0f} ms  TPOT {s['tpot_ms']:5.1f} ms"
        f"  speedup {s['speedup']:.2f}x  tau {s['mean_acceptance_length']:.2f}\n"
        f"  lossless: {lossless['identical']}/{lossless['checked']} identical; prefix cache hit "
        f"{r['prefix_cache']['hit_tokens']}/{r['prefix_cache']['queried_tokens']} tokens"
    )


@hydra.main(config_path="../conf", config_name="eval", version_base=None)
def _main(cfg: DictConfig) -> None:
    config = typed(cfg, EvalConfig)
    results = run_eval(config)
    print_headline(results)
    print(f"  results: {config.out}/results.json, outputs: {config.out}/outputs.jsonl")


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
