#!/usr/bin/env bash
# Drafter versions loaded one after another into one running vLLM (docs/export.md): `draftsmith-peers reload`
# (flags: peers/vllm_reload_versions.py); vLLM's venv as for the cross-check (scripts/vllm_venv.sh makes it on
# first use).
# bash scripts/vllm_reload_versions.sh V0 V1 [V0 ...] [--prompts 8 --max-new-tokens 48 --k 4 --work DIR]
exec bash "$(dirname "$0")/vllm_run.sh" reload "$@"
