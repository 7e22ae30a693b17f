#!/usr/bin/env bash
# Speculation's speedup at 1-32 concurrent requests through vLLM's OpenAI server: `draftsmith-peers concurrency`
# (flags: peers/vllm_concurrency.py)
exec bash "$(dirname "$0")/vllm_run.sh" concurrency "$@"
