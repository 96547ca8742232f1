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
WHEELS=${WHEELS:-scripts/.whl}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/exgrpo-smoke.XXXXXX")
echo "gpu_smoke: scratch directory $SCRATCH"

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    wanted=$(cat "$WHEELS/PYTHON_TAG" 2>/dev/null || echo "")
    have=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    if [[ -n "$wanted" && "$wanted" != "$have" ]]; then
        echo "gpu_smoke: warning: wheels were prepared for $wanted, this Python is $have" >&2
    fi
    echo "gpu_smoke: installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS"
    "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check \
        --target "$SCRATCH/site" "$WHEELS"/*.whl
    export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
fi

# exgrpo_pl from this checkout: the package-dir mapping puts callbacks/ at exgrpo_pl.callbacks.
mkdir -p "$SCRATCH/src"
cp -r exgrpo_pl "$SCRATCH/src/exgrpo_pl"
rm -rf "$SCRATCH/src/exgrpo_pl/callbacks"
cp -r callbacks "$SCRATCH/src/exgrpo_pl/callbacks"
export PYTHONPATH="$SCRATCH/src${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" - <<'EOF'
import deepspeed, lightning, torch, transformers
print(f"gpu_smoke: torch {torch.__version__} (CUDA {torch.version.cuda}), lightning {lightning.__version__}, "
      f"transformers {transformers.__version__}, deepspeed {deepspeed.__version__}")
print(f"gpu_smoke: device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
EOF
then
    echo "gpu_smoke: packages missing; run scripts/prepare_gpu_wheels.sh where an index is reachable" >&2
    exit 1
fi

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
