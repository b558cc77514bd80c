#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, prepare the built-in default corpus,
# train the dense-tiny preset for a few minutes, plot its curves, evaluate it, sample from it, and say where
# everything is.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target ladder
bash scripts/make-corpus.sh data/corpus/default.jsonl
if [ ! -f data/default/meta.json ]; then
  ./build/ladder data --input data/corpus/default.jsonl --out data/default --vocab 8192 --val-fraction 0.02
fi
RUN=runs/dense-tiny
if [ -d "$RUN" ]; then  # again: resume (or start over a run that died before its first checkpoint)
  ./build/ladder train configs/dense-tiny.yaml --run-dir "$RUN" --resume
else
  ./build/ladder train configs/dense-tiny.yaml --run-dir "$RUN"
fi
echo
echo "== curves =="
./build/ladder plot "$RUN" --y loss,val_loss,lr,tokens_per_s --smooth 0.6 --out "$RUN/curves.svg"
echo
echo "== evaluation (the whole validation split) =="
./build/ladder eval "$RUN"
echo
echo "== samples =="
for p in "And God said" "The hacker" "A fortune:"; do
  ./build/ladder sample "$RUN" --prompt "$p" --max-tokens 60 --temperature 0.8 --top-k 40
  echo "--"
done
echo
echo "metrics:     $RUN/metrics.jsonl  (one JSON object per line; plotted: $RUN/curves.svg)"
echo "checkpoints: $RUN/checkpoints/   (model.safetensors, optimizer state, loader state)"
echo "benchmark:   ./build/ladder bench --torch"
