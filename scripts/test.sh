#!/usr/bin/env bash
# The test command: installs what is missing, builds (Release, tests on), runs every test via CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
BUILD=${BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLADDER_TESTS=ON >/dev/null
cmake --build "$BUILD" -j "$(nproc)"
python_check=$(/usr/bin/python3 tests/reference/run_ref.py selftest 2>&1) || { echo "$python_check"; echo "reference selftest failed"; exit 1; }
echo "PyTorch reference selftest: ok"
cd "$BUILD" && ctest --output-on-failure -j 1 "$@"
