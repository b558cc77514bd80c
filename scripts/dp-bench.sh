#!/usr/bin/env bash
# Data parallel on this machine: one process with every core and R micro-batches per step against
# R ranks (mpirun) with cores/R threads and one micro-batch each: the same tokens per step, the
# same updates (docs/data-parallel.md). Alternating runs, median tokens/s of each (the progress
# line's median), and the ratio. Usage: scripts/dp-bench.sh [CONFIG] [RANKS] [REPEATS] [STEPS]
# [--set key=value ...] (passed to both; run.batch_size is per rank and per micro-batch).
set -euo pipefail
cd "$(dirname "$0")/.."
CFG=${1:-configs/dense-small.yaml}
R=${2:-2}
REP=${3:-3}
STEPS=${4:-12}
shift $(( $# < 4 ? $# : 4 ))
CORES=$(nproc)
T=$(( CORES / R > 0 ? CORES / R : 1 ))
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
common=(--set run.steps="$STEPS" --set run.eval_every=0 --set run.ckpt_every=0 --set run.log_every=2 "$@")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rate() { sed -n 's/^done: .* median \([0-9.]*\) tokens\/s.*/\1/p' "$1" | tail -1; }
one=() many=()
for i in $(seq "$REP"); do
  ./build/ladder train "$CFG" --run-dir "$tmp/one$i" "${common[@]}" --set run.threads="$CORES" \
    --set run.grad_accum="$R" >"$tmp/one$i.log" 2>&1
  one+=("$(rate "$tmp/one$i.log")")
  mpirun -np "$R" --bind-to none ./build/ladder train "$CFG" --run-dir "$tmp/many$i" "${common[@]}" \
    --set run.threads="$T" --set run.grad_accum=1 >"$tmp/many$i.log" 2>&1
  many+=("$(rate "$tmp/many$i.log")")
done
med() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
m1=$(med "${one[@]}"); mR=$(med "${many[@]}")
echo "config $CFG $*, $STEPS steps, $REP runs each ($(nproc) cores)"
printf '%-34s %s\n' "1 process x $CORES threads, accum $R:" "${one[*]} tokens/s (median $m1)"
printf '%-34s %s\n' "$R ranks x $T threads, accum 1:" "${many[*]} tokens/s (median $mR)"
awk -v a="$mR" -v b="$m1" 'BEGIN {printf "ranks / one process: %.2fx\n", a / b}'
