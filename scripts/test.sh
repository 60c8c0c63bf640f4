#!/usr/bin/env bash
# Every test of the project: lint, C++ (plain and ASan+UBSan) with ctest, then pytest.
# Expects scripts/setup.sh --dev to have run (the README's test command does both).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.tools/bin:$PWD/.venv/bin:$PATH"
JOBS=$(nproc)

echo "== lint"
ruff check .
ruff format --check .
find native -name '*.cpp' -o -name '*.h' | xargs clang-format --dry-run -Werror
if [[ -f .importlinter ]]; then lint-imports; fi

echo "== C++ (release) + ctest"
cmake -S native -B build/ctest -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDINFER_BUILD_TESTS=ON >/dev/null
cmake --build build/ctest -j "$JOBS"
ctest --test-dir build/ctest --output-on-failure -j "$JOBS"

echo "== C++ (AddressSanitizer + UndefinedBehaviorSanitizer) + ctest"
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
cmake -S native -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DPAGEDINFER_BUILD_TESTS=ON \
  -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_EXE_LINKER_FLAGS="$SAN" >/dev/null
cmake --build build/asan -j "$JOBS"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build/asan --output-on-failure -j "$JOBS"

echo "== pytest"
python -m pytest -q "$@"
