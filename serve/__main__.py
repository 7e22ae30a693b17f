"""draftsmith-generate: one prompt through the engine, text and metrics printed."""

from __future__ import annotations

from dataclasses import dataclass, field

import hydra
from omegaconf import DictConfig

from draftsmith.serve.build import build_engine
from draftsmith.serve.engine.compiled import CompiledStep
from draftsmith.serve.engine.sampling import SamplingParams
from draftsmith.serve.models.target import TargetConfig, encode_chat, encode_raw, load_target
from draftsmith.serve.shared.cli import typed_or_exit
from draftsmith.serve.spec import SpecConfig


@dataclass
class GenerateConfig:
    prompt: str
    target: TargetConfig = field(default_factory=TargetConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    chat: bool = True
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    prefix_cache: bool = False
    max_seq_len: int = 4096
    cuda_graphs: str = "auto"  # serve/engine/graphs.py: auto | compile | graphs | eager | off


def run(cfg: GenerateConfig) -> None:
    sp = SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, cfg.seed)
    if not cfg.prompt.strip():
        raise ValueError('prompt is empty: pass prompt="..."')
    target = load_target(cfg.target)
    ids = (
        encode_chat(target.tokenizer, [{"role": "user", "content": cfg.prompt}])
        if cfg.chat
        else encode_raw(target.tokenizer, cfg.prompt)
    )
    engine = build_engine(
        target, cfg.spec, cfg.prefix_cache, cfg.max_seq_len, cfg.cuda_graphs, cache_dir=cfg.target.cache_dir
    )
    g = engine.generate(ids, cfg.max_new_tokens, sp)
    m = g.metrics
    print(target.tokenizer.decode(g.output_ids, skip_special_tokens=True))
    print(
        f"\n[{cfg.spec.name}] {m.new_tokens} tokens in {m.total_s:.2f} s: {m.tokens_per_s:.1f} tok/s, "
        f"TTFT {m.ttft_s * 1000:.0f} ms, TPOT {m.tpot_s * 1000:.1f} ms, "
        f"tau {m.mean_acceptance_length:.2f}, target passes {m.target_forward_passes} "
        f"({m.mean_verify_rows:.2f} rows each, drafting {m.draft_ms_per_step:.1f} ms each), "
        f"device {engine.model.device}, dtype {str(engine.model.weights_dtype).removeprefix('torch.')}"
    )
    if isinstance(engine.static, CompiledStep) and engine.static.compile_s:
        print(
            f"(the compiled step's first call took {engine.static.compile_s:.1f} s: compiling, or loading the cached "
            "graph, is inside this request's TTFT; later requests of a process skip it)"
        )


@hydra.main(config_path="../conf", config_name="generate", version_base=None)
def _main(cfg: DictConfig) -> None:
    run(typed_or_exit(cfg, GenerateConfig, "draftsmith-generate"))


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
