#!/usr/bin/env bash
# The test command (README, .ci/run): lint, then the whole suite on CPU, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
ruff check .
python -m pytest -q "$@"
