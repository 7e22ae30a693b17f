#!/usr/bin/env bash
# The vLLM cross-check of exported drafters (docs/export.md), in one command: `draftsmith-peers vllm` (flags:
# peers/vllm_crosscheck.py). vLLM pins its own torch, so it lives in its own virtual environment
# (scripts/vllm_venv.sh; made here on first use if setup has not).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-$HOME/.cache/draftsmith/vllm-venv}
VLLM_VENV=$VENV bash scripts/vllm_venv.sh
# the speculators package checks format=speculators exports; its own dependencies (vLLM's torch and transformers
# are there; datasets is training-only) stay out: --no-deps
if ! "$VENV/bin/pip" show -q speculators >/dev/null 2>&1; then
  "$VENV/bin/pip" install -q --no-deps speculators==0.9.0
fi
if [[ " $* " == *" --suffix "* ]] && ! "$VENV/bin/python" -c "import arctic_inference.suffix_decoding" >/dev/null 2>&1; then
  "$VENV/bin/pip" install -q arctic-inference  # vLLM's suffix decoding; builds its C++ trees (cmake, g++)
fi
export VLLM_CPU_NUM_OF_RESERVED_CPU=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
exec nice -n 10 python -m draftsmith.peers vllm --vllm-python "$VENV/bin/python" "$@"
