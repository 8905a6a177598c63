#!/usr/bin/env bash
# The device check for the NVML inventory: what `vlaunch gpus` and `vlaunch plan` say on a real
# NVIDIA machine, beside nvidia-smi's own numbers, and what one NVML reading costs there.
#
# It installs this checkout in a fresh venv with only the light dependencies (no vLLM, no torch).
# The device machine has no internet, so first, here (with PyPI), from the repo root:
#     bench/device_check.sh --prepare      # light deps + hatchling wheels -> .cache/device-wheels
# then on the GPU machine (carry .cache/device-wheels):
#     bench/device_check.sh
# Without .cache/device-wheels it installs from PyPI instead. Exits non-zero only when the
# install fails; the checks' own exit codes are printed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=$ROOT/.cache/device-wheels
VENV=${VLAUNCH_CHECK_VENV:-/tmp/vlaunch-device-venv}
PY=${PYTHON:-python3}

if [ "${1:-}" = "--prepare" ]; then
    BUILD_PY=${BUILD_PY:-$ROOT/.venv/bin/python}
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$BUILD_PY" -m pip download -q -d "$WHEELS" --only-binary=:all: hatchling || exit 1
    mapfile -t DEPS < <("$BUILD_PY" -c '
import tomllib, sys
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
        "$ROOT/pyproject.toml")
    for v in 3.10 3.11 3.12 3.13; do
        "$BUILD_PY" -m pip download -q -d "$WHEELS" --only-binary=:all: --python-version "$v" \
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "${DEPS[@]}" || exit 1
    done
    du -sh "$WHEELS" && ls "$WHEELS"
    exit 0
fi

step() { printf '\n===== %s\n' "$*"; }

step "nvidia-smi (for comparison)"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --format=csv --query-gpu=index,name,uuid,memory.total,memory.reserved,\
memory.used,memory.free,compute_cap,mig.mode.current,driver_version 2>&1
    nvidia-smi topo -m 2>&1 | head -20
else
    echo "(nvidia-smi not available)"
fi

step "install vlaunch (light deps only) into $VENV with $($PY --version 2>&1)"
rm -rf "$VENV"
"$PY" -m venv "$VENV" || exit 1
if [ -d "$WHEELS" ]; then  # offline: the build backend from the wheelhouse, then the checkout
    "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" hatchling || exit 1
    "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" --no-build-isolation "$ROOT" \
        || exit 1
else
    "$VENV/bin/pip" install -q "$ROOT" || exit 1
fi
cd /tmp || exit 1  # run the installed package, not the checkout

step "vlaunch gpus --format json"
"$VENV/bin/vlaunch" gpus --format json; echo "exit code $?"

step "vlaunch gpus"
"$VENV/bin/vlaunch" gpus; echo "exit code $?"

step "vlaunch plan deepseek-v2-lite"
"$VENV/bin/vlaunch" plan deepseek-v2-lite; echo "exit code $?"

step "cost of read_inventory() against the real driver"
"$VENV/bin/python" - <<'PY'
import statistics, time
from launcher.inputs import inventory
t = time.perf_counter(); inv = inventory.read_inventory(); first = (time.perf_counter() - t) * 1e3
times = []
for _ in range(200):
    t = time.perf_counter(); inventory.read_inventory(); times.append((time.perf_counter() - t) * 1e3)
times.sort()
print(f"{len(inv.devices)} devices; first read {first:.1f} ms; "
      f"poll p50 {statistics.median(times):.2f} ms p99 {times[int(0.99 * len(times))]:.2f} ms")
hw = inventory.detect_hardware(inv)
print("detect_hardware:", hw.describe(), "| nvlink", hw.kind.nvlink)
for note in hw.notes:
    print("  note:", note)
PY
echo "exit code $?"
