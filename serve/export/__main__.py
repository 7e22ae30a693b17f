"""draftsmith-export: a drafter folder -> the folder vLLM, SGLang, TGI or HF transformers loads."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from omegaconf import DictConfig

from draftsmith.serve.export.base import ExportError
from draftsmith.serve.export.pipeline import export, validate
from draftsmith.serve.models.target import TargetConfig
from draftsmith.serve.shared.cli import typed_or_exit


@dataclass
class ExportConfig:
    drafter: str
    format: str
    out: str
    target: TargetConfig = field(default_factory=TargetConfig)
    dtype: str = "bf16"
    overwrite: bool = False
    check: bool = False
    push: bool = False
    gguf_target: str | None = None  # format=gguf: the target GGUF llama.cpp runs beside the head (default: the
    # GGUF the target was read from, e.g. the built-in SmolLM2's)
    vllm_sweep: str | None = None  # a draft-length sweep's results.json (peers/vllm_concurrency.py): the card
    # recommends the draft length per concurrency level from it


def run(cfg: ExportConfig) -> None:
    if cfg.push:
        raise ExportError("push=true is not supported: draftsmith-export never uploads; upload OUT yourself")
    if cfg.check:
        validate(Path(cfg.drafter), cfg.format, Path(cfg.out), cfg.target, cfg.gguf_target)
        print(f"{cfg.out}: a valid {cfg.format} export of {cfg.drafter}")
        return
    settings = (cfg.target, cfg.dtype, cfg.overwrite, cfg.gguf_target, cfg.vllm_sweep)
    out = export(Path(cfg.drafter), cfg.format, Path(cfg.out), *settings)
    print(f"exported {cfg.drafter} to {out} ({cfg.format}, {cfg.dtype}), validated; serve commands in {out}/README.md")


@hydra.main(config_path="../../conf", config_name="export", version_base=None)
def _main(cfg: DictConfig) -> None:
    try:
        run(typed_or_exit(cfg, ExportConfig, "draftsmith-export"))
    except ExportError as e:
        sys.exit(f"draftsmith-export: {e}")


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
