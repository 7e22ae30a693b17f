#!/usr/bin/env bash
# Drafter versions loaded one after another into one running vLLM (docs/export.md); vLLM's venv as for the
# cross-check (scripts/vllm_venv.sh makes it on first use).
# bash scripts/vllm_reload_versions.sh V0 V1 [V0 ...] [--prompts 8 --max-new-tokens 48 --k 4 --work DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-$HOME/.cache/draftsmith/vllm-venv}
VLLM_VENV=$VENV bash scripts/vllm_venv.sh
export VLLM_CPU_NUM_OF_RESERVED_CPU=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
exec nice -n 10 python scripts/vllm_reload_versions.py --vllm-python "$VENV/bin/python" "$@"
