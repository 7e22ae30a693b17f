#!/usr/bin/env bash
# Runs a draftsmith-peers check that drives vLLM from vLLM's own venv (it pins its own torch): the venv made on first
# use (scripts/vllm_venv.sh), the offline settings, both CPU cores for vLLM's engine, and --vllm-python pointing there.
# bash scripts/vllm_run.sh CHECK [its flags]      # CHECK: engines | concurrency | reload (draftsmith.peers)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-$HOME/.cache/draftsmith/vllm-venv}
VLLM_VENV=$VENV bash scripts/vllm_venv.sh
export VLLM_CPU_NUM_OF_RESERVED_CPU=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
check=$1
shift
exec nice -n 10 python -m draftsmith.peers "$check" --vllm-python "$VENV/bin/python" "$@"
