#!/usr/bin/env bash
# The first GPU session in one command (nothing from a hub, under 10 minutes): gpu_smoke's cases, the
# generation and memory benchmarks at the 1.5B shape, a ZeRO-2 step by phase and a CUDA resume, and with two
# or more GPUs the multi-GPU leg (scripts/gpu_multi.py; "skipped: 1 GPU(s)" otherwise); every figure in one
# JSON file, then a table. See scripts/gpu_check.py.
#
#   bash scripts/gpu_check.sh                       # -> gpu_check.json
#   OUT_JSON=$OUT/gpu_check.json bash scripts/gpu_check.sh
#   bash scripts/gpu_check.sh --only multi          # the multi-GPU leg alone, with the whole budget
#   bash scripts/gpu_check.sh --device cpu --tiny   # the plumbing on a CPU, toy sizes
#
# Packages: as scripts/gpu_smoke.sh (wheels from scripts/.whl/ when there, made by prepare_gpu_wheels.sh).
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/exgrpo-check.XXXXXX")
source scripts/gpu_smoke_env.sh || exit 1
"$PY" scripts/gpu_check.py --out "${OUT_JSON:-gpu_check.json}" "$@"
