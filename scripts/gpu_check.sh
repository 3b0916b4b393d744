#!/usr/bin/env bash
# Usage: bash scripts/gpu_check.sh [gpu_check.py options]   (from the repository root, on the GPU machine;
#        prepare here first with `make gpu-bundle` and carry gpu-bundle/ along; docs/gpu.md)
#
# Installs the bundle's wheels that this Python lacks into a scratch folder (offline, --no-deps), then
# runs scripts/gpu_check.py with the repository on PYTHONPATH (cbserve is not pip-installed there) and
# writes gpu_check.json, gpu_check.md and logs/ to $OUT (default ./gpu_check_out). The whole run stays
# under 8 minutes: gpu_check.py's budget is 450 s, and a hard stop 20 s later ends anything still running.
#
# Environment: OUT (the output folder), PYTHON (default python3), GPU_BUNDLE (default gpu-bundle),
# GPU_CHECK_BUDGET (seconds, default 450: the CPU smoke test gives a loaded CPU more).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
OUT_DIR="${OUT:-./gpu_check_out}"
BUNDLE="${GPU_BUNDLE:-gpu-bundle}"
BUDGET="${GPU_CHECK_BUDGET:-450}"
mkdir -p "$OUT_DIR"
SITE="$(mktemp -d "${TMPDIR:-/tmp}/cbserve-gpu-site.XXXXXX")"
trap 'rm -rf "$SITE"' EXIT
"$PYTHON" scripts/gpu_bundle.py install "$BUNDLE" "$SITE" | tee "$OUT_DIR/bundle.log"
export PYTHONPATH="$PWD:$PWD/operator:$SITE${PYTHONPATH:+:$PYTHONPATH}"
status=0
timeout --kill-after=10 $((BUDGET + 20)) "$PYTHON" scripts/gpu_check.py --budget "$BUDGET" --out "$OUT_DIR" "$@" || status=$?
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "gpu_check.sh: stopped at $((BUDGET + 20)) s; $OUT_DIR/gpu_check.md holds the rows finished by then" >&2
fi
exit "$status"
