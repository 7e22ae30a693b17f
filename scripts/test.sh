#!/usr/bin/env bash
# The test command (README, .ci/run): lint, format check and type check, then the whole suite on CPU, offline.
# The real-SmolLM2 lossless module runs in a process of its own: after the rest of the suite in the
# same process its decode steps run several times slower (docs/benchmarks.md, Figures behind design choices).
set -euo pipefail
cd "$(dirname "$0")/.."
# DRAFTSMITH_REQUIRE_VLLM: setup installs vLLM, so its tests must run, not skip
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline DRAFTSMITH_REQUIRE_VLLM=1
ruff check .
ruff format --check .
bash scripts/typecheck.sh  # mypy on the package (pyproject's [tool.mypy])
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
# one pytest-xdist worker per core, each module's tests on one worker (module fixtures built once); the workers
# split the intra-op threads (tests/conftest.py): most tests are Python-bound, so two cores run them ~twice as fast
python -m pytest -q -n auto --dist loadfile --ignore=tests/test_lossless_smollm2.py ${DURATIONS:+--durations=$DURATIONS}
python -m pytest -q tests/test_lossless_smollm2.py ${DURATIONS:+--durations=$DURATIONS}
