#!/usr/bin/env bash
# Per-step cost of each attention/norm recipe switch on the dense-small preset (docs/benchmarks-attention.md).
# Variants run interleaved, ROUNDS times, so that a burst of load from other processes on a shared
# machine hits all of them alike; each run reports the median of STEPS timed steps, and the summary
# takes the median over rounds.  Usage: bench/attn_switches.sh [ROUNDS] [STEPS] > results.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
STEPS=${2:-3}
LADDER=${LADDER:-./build/ladder}
BATCH=${BATCH:-8}  # sequences of 512 tokens per step (dense-small: 8)
# THREADS=1 with the reported step_cpu_s_median is the most stable measure on a shared machine.
declare -A V
V[baseline]=""
V[half_rope]="model.half_rope=true"
V[qk_fixed_scale]="model.qk_norm_gain=false model.q_scale=1.3"
V[long_short_w128]="model.long_every=4 model.window=128"
V[pko]="model.long_every=4 model.window=128 model.last_layer_long=true model.half_rope=true model.pko=true"
V[xsa]="model.xsa=true"
V[attn_gate]="model.attn_gate=true"
V[gated_norm_128]="model.gated_norm_rank=128"
V[all_v1_pko]="model.qk_norm_gain=false model.q_scale=1.3 model.long_every=4 model.window=128 model.last_layer_long=true model.half_rope=true model.pko=true model.xsa=true model.attn_gate=true model.gated_norm_rank=128"
ORDER="baseline half_rope qk_fixed_scale long_short_w128 pko xsa attn_gate gated_norm_128 all_v1_pko"
for r in $(seq "$ROUNDS"); do
  for name in $ORDER; do
    sets=()
    for kv in ${V[$name]}; do sets+=(--set "$kv"); done
    json=$(OMP_WAIT_POLICY=passive "$LADDER" bench --config configs/dense-small.yaml --steps "$STEPS" --json --set run.batch_size="$BATCH" --set run.threads="${THREADS:-0}" "${sets[@]}" | tail -1)
    echo "{\"variant\":\"$name\",\"round\":$r,\"result\":$json}"
  done
done
