#!/usr/bin/env bash
# the issue-29 comparison: one interleaved eval per suite
set -e
SB=runs/sb29
suite=$1; out=$2; shift 2
m() { echo "+spec@methods.$1=$2" "methods.$1.drafter=$3" ${4:+methods.$1.verify=$4}; }
draftsmith-eval target=smollm2-135m spec=ar \
  $(m eagle3_d1 eagle3 runs/main/eagle3/final) $(m eagle3_d1_cost eagle3 runs/main/eagle3/final cost) \
  $(m dflash_b4 dflash $SB/dflash_b4/final) \
  $(m dspark_b4 dspark $SB/dspark_b4/final) $(m dspark_b4_cost dspark $SB/dspark_b4/final cost) \
  "$@" suite=$suite limit=16 max_new_tokens=64 wandb.enabled=false out=$out
