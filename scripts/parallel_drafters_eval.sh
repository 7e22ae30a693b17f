#!/usr/bin/env bash
# The parallel drafters against the main job's EAGLE-3 head, fixed and cost-scheduled verification, in one
# interleaved eval (docs/benchmarks.md, "DSpark and cost-scheduled verification"). Heads from
# `python benchmarks/same_budget.py --out SB --arms dflash_b4,dspark_b4 --no-eval`.
#   [SB=DIR] [EAGLE3=HEAD] bash scripts/parallel_drafters_eval.sh SUITE OUT [more draftsmith-eval overrides...]
set -euo pipefail
suite=$1 out=$2 sb=${SB:-runs/sb29} eagle3=${EAGLE3:-runs/main/eagle3/final}
shift 2
method() { echo "+spec@methods.$1=$2" "methods.$1.drafter=$3" ${4:+"methods.$1.verify=$4"}; }
# shellcheck disable=SC2046  # each method is several words on purpose
draftsmith-eval target=smollm2-135m spec=ar \
  $(method eagle3_d1 eagle3 "$eagle3") $(method eagle3_d1_cost eagle3 "$eagle3" cost) \
  $(method dflash_b4 dflash "$sb/dflash_b4/final") \
  $(method dspark_b4 dspark "$sb/dspark_b4/final") $(method dspark_b4_cost dspark "$sb/dspark_b4/final" cost) \
  "$@" suite="$suite" limit=16 max_new_tokens=64 wandb.enabled=false out="$out"
