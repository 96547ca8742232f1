#!/usr/bin/env bash
# GPU smoke test on one GPU: a tiny policy trained a few steps plain (bf16-mixed), under DeepSpeed ZeRO-2 and
# ZeRO-3, then resumed once from the ZeRO-3 checkpoint (a directory); prints step time, tokens/s and peak
# memory per variant and exits non-zero when any variant fails. A few minutes (each variant <= 100 s).
#
#   bash scripts/gpu_smoke.sh
#   STEPS=4 VARIANT_TIMEOUT=60 bash scripts/gpu_smoke.sh
#
# Packages: when scripts/.whl/ holds wheels (made by scripts/prepare_gpu_wheels.sh on a machine with an
# index), they are installed into a scratch directory put first on PYTHONPATH, so a machine without network
# access needs only Python and a CUDA build of torch. exgrpo_pl itself always comes from this checkout.
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
STEPS=${STEPS:-6}
VARIANT_TIMEOUT=${VARIANT_TIMEOUT:-100}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/exgrpo-smoke.XXXXXX")
echo "gpu_smoke: scratch directory $SCRATCH"

# exgrpo_pl from this checkout: the package-dir mapping puts callbacks/ at exgrpo_pl.callbacks.
mkdir -p "$SCRATCH/src"
cp -r exgrpo_pl "$SCRATCH/src/exgrpo_pl"
rm -rf "$SCRATCH/src/exgrpo_pl/callbacks"
cp -r callbacks "$SCRATCH/src/exgrpo_pl/callbacks"
export PYTHONPATH="$SCRATCH/src${PYTHONPATH:+:$PYTHONPATH}"

source scripts/gpu_smoke_env.sh || exit 1

status=0
for variant in plain zero2 zero3 resume; do
    echo "gpu_smoke: --- $variant"
    set +e
    timeout "$VARIANT_TIMEOUT" "$PY" scripts/gpu_smoke.py --variant "$variant" --steps "$STEPS" \
        --workdir "$SCRATCH/run" >"$SCRATCH/$variant.log" 2>&1
    rc=$?
    set -e
    grep -E "^SMOKE" "$SCRATCH/$variant.log" || true
    if [[ $rc -ne 0 ]]; then
        echo "gpu_smoke: $variant FAILED (exit $rc$([[ $rc -eq 124 ]] && echo ", timed out")); end of its log:" >&2
        tail -n 30 "$SCRATCH/$variant.log" >&2
        status=1
    fi
done

"$PY" scripts/gpu_smoke.py --summary --workdir "$SCRATCH/run" || status=1
exit $status
