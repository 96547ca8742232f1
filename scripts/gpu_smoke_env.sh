# Sourced by scripts/gpu_smoke.sh and scripts/gpu_check.sh, from the repository root, with PY and SCRATCH set.
# When $WHEELS (default scripts/.whl/) holds wheels made by scripts/prepare_gpu_wheels.sh, they are installed
# into $SCRATCH/site, put first on PYTHONPATH, so a machine without network access needs only Python and a
# CUDA build of torch. Then checks that the packages import; returns 1 (naming the fix) when they do not.
WHEELS=${WHEELS:-scripts/.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    wanted=$(cat "$WHEELS/PYTHON_TAG" 2>/dev/null || echo "")
    have=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    if [[ -n "$wanted" && "$wanted" != "$have" ]]; then
        echo "warning: wheels were prepared for $wanted, this Python is $have" >&2
    fi
    echo "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS"
    "$PY" -m pip install --quiet --no-index --no-deps --disable-pip-version-check \
        --target "$SCRATCH/site" "$WHEELS"/*.whl
    export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
fi

if ! "$PY" - <<'PYTHON'
import deepspeed, lightning, torch, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), lightning {lightning.__version__}, "
      f"transformers {transformers.__version__}, deepspeed {deepspeed.__version__}")
print(f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
PYTHON
then
    echo "packages missing; run scripts/prepare_gpu_wheels.sh where an index is reachable" >&2
    return 1
fi
