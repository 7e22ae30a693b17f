#!/usr/bin/env bash
# Speculation's speedup at 1-32 concurrent requests through vLLM's OpenAI server; flags: scripts/vllm_concurrency.py
exec bash "$(dirname "$0")/vllm_run.sh" scripts/vllm_concurrency.py "$@"
