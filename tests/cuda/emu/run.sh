#!/usr/bin/env bash
# Host emulation of the tensor-core attention kernels (no GPU needed; see emu_cuda.h):
#   bash tests/cuda/emu/run.sh [plain|asan|tsan] [quick]
# plain (default): all test shapes at -O2; asan: AddressSanitizer + UBSan (out-of-bounds global and
# shared memory); tsan: ThreadSanitizer (shared-memory races between barriers), quick shapes only.
set -euo pipefail
cd "$(dirname "$0")/../../.."
mode=${1:-plain}
shift || true
out=${EMU_OUT:-/tmp/ladder-emu-attn-tc}
mkdir -p "$out"
# kernel<<<grid, block, smem, stream>>>(args)  ->  EMU_LAUNCH(grid, block, smem, stream, kernel, args)
python3 - src/backend/cuda/attention_tc.cu "$out/attention_tc_emu.inc" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
s = s.replace("extern __shared__ __align__(128) unsigned char smem[];", "unsigned char* smem = emu::g_smem;")
s, n = re.subn(r"([A-Za-z_]\w*(?:<\w+>)?)<<<(.*?)>>>\(", r"EMU_LAUNCH(\2, \1, ", s)
assert n == 4, n
assert "__shared__" not in s
open(sys.argv[2], "w").write(s)
PY
flags="-std=c++20 -pthread -g -fno-strict-aliasing -Isrc -Itests/cuda/emu -I$out"
case $mode in
  plain) flags="$flags -O2" ;;
  asan) flags="$flags -O1 -fsanitize=address,undefined -fno-omit-frame-pointer" ;;
  tsan) flags="$flags -O1 -fsanitize=thread" ;;
  *) echo "mode: plain|asan|tsan"; exit 2 ;;
esac
g++ $flags tests/cuda/emu/emu_attention_tc.cpp -o "$out/emu_$mode"
"$out/emu_$mode" "$@"
