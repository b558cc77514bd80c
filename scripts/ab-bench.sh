#!/usr/bin/env bash
# A/B timing of two `ladder` binaries in one session: for each round and config, both binaries run
# `ladder bench --config C --steps S --profile --json`, in swapped order every other round (so a
# slow minute of a noisy VM falls on both), and the medians of the step time and of each op's time
# per step are printed per config, old beside new. Build the old revision in a worktree first:
#   git worktree add /tmp/old REV && cmake -S /tmp/old -B /tmp/old/build -G Ninja \
#     -DCMAKE_BUILD_TYPE=Release -DLADDER_TESTS=OFF && cmake --build /tmp/old/build --target ladder
#   scripts/ab-bench.sh /tmp/old/build/ladder build/ladder configs/moe-small.yaml configs/moe-v1.yaml
# Environment: ROUNDS (3), STEPS (3).
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 OLD_LADDER NEW_LADDER CONFIG.yaml..." >&2
  exit 2
fi
old=$1 new=$2
shift 2
for b in "$old" "$new"; do [ -x "$b" ] || { echo "error: $b is not an executable" >&2; exit 2; }; done
rounds=${ROUNDS:-3} steps=${STEPS:-3}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for ((r = 1; r <= rounds; ++r)); do
  for c in "$@"; do
    if ((r % 2)); then order="old new"; else order="new old"; fi
    for w in $order; do
      bin=$old
      [ "$w" = new ] && bin=$new
      "$bin" bench --config "$c" --steps "$steps" --profile --json 2>/dev/null |
        python3 -c "import json, sys; j = json.load(sys.stdin); j['ab'] = {'who': '$w', 'config': '$c', 'round': $r}; print(json.dumps(j))" >>"$log"
      echo "round $r/$rounds: $w $c" >&2
    done
  done
done
python3 - "$log" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for cfg in dict.fromkeys(r['ab']['config'] for r in rows):
    def med(who, f):
        v = [f(r) for r in rows if r['ab']['config'] == cfg and r['ab']['who'] == who]
        return statistics.median(v) if v else float('nan')
    print(f"{cfg} (medians of {sum(r['ab']['config'] == cfg for r in rows) // 2} rounds, ms per step)")
    so, sn = med('old', lambda r: 1000 * r['step_s_median']), med('new', lambda r: 1000 * r['step_s_median'])
    print(f"  {'step':<16} {so:10.1f} -> {sn:10.1f}   new/old {sn / so:.3f}")
    ops = sorted({k for r in rows if r['ab']['config'] == cfg for k in r.get('profile', {})})
    for op in ops:
        o = med('old', lambda r: r['profile'].get(op, {}).get('ms_per_step', 0.0))
        n = med('new', lambda r: r['profile'].get(op, {}).get('ms_per_step', 0.0))
        if max(o, n) >= 0.5:
            print(f"  {op:<16} {o:10.1f} -> {n:10.1f}   new/old {n / o if o else float('nan'):.3f}")
EOF
