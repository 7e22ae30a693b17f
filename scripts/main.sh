#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct): one generation, then plain vs
# speculative decoding on MT-bench questions with the lossless check. Results land in runs/main/.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
draftsmith-generate target=smollm2-135m spec=ngram prompt="Write a haiku about the sea" max_new_tokens=64
draftsmith-eval target=smollm2-135m spec=ngram suite=mt_bench limit=10 max_new_tokens=64 out=runs/main "$@"
