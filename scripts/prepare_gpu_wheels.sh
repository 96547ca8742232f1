#!/usr/bin/env bash
# Prepare the wheels scripts/gpu_smoke.sh installs on a GPU machine that has Python and a CUDA torch but no
# package index: lightning, transformers, deepspeed, tokenizers, jsonargparse, torchmetrics, tensorboard,
# peft, math-verify and everything they need except torch and torch's own dependencies.
#
#   bash scripts/prepare_gpu_wheels.sh                    # -> scripts/.whl/ (Linux x86_64, CPython 3.12)
#   PY_VERSION=3.11 WHEELS=/tmp/whl bash scripts/prepare_gpu_wheels.sh
#
# Run it where an index is reachable and the `dev` environment is installed: versions are pinned to the
# ones installed here (the ones the CPU tests pass with), found by walking the installed packages'
# metadata. deepspeed publishes no wheels, only a source archive: it is built here into a pure-Python wheel
# (DS_BUILD_OPS=0; DeepSpeed compiles any op it needs at run time, and ZeRO-2/3 with the module's torch
# AdamW needs none), which needs torch installed here.
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${WHEELS:-scripts/.whl}
PY_VERSION=${PY_VERSION:-3.12}
TAG="cp${PY_VERSION/./}"
PACKAGES=${PACKAGES:-"lightning transformers deepspeed tokenizers jsonargparse torchmetrics tensorboard peft
math-verify docstring-parser typeshed-client"}  # the last two: jsonargparse[signatures]
mkdir -p "$OUT"
echo "$TAG" >"$OUT/PYTHON_TAG"

# name==version for the packages and their requirements, torch and its requirements left out.
# shellcheck disable=SC2086
mapfile -t REQUIREMENTS < <(PY_VERSION="$PY_VERSION" "$PY" - $PACKAGES <<'EOF'
import importlib.metadata as metadata
import os
import re
import sys

from packaging.requirements import Requirement

TARGET = os.environ["PY_VERSION"]
# Requirement markers are evaluated for the GPU machine's Python, not this one.
ENVIRONMENT = {"extra": "", "python_version": TARGET, "python_full_version": f"{TARGET}.0", "sys_platform": "linux"}


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names):
    """Installed version of each package reachable from `names` (None: not installed here)."""
    found = {}
    stack = list(names)
    while stack:
        name = canonical(stack.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            found[name] = None
            continue
        found[name] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate(ENVIRONMENT):
                continue
            stack.append(requirement.name)
    return found


torch = closure(["torch"])
for name, version in sorted(closure(sys.argv[1:]).items()):
    if name in torch or name.startswith("nvidia-") or name == "triton":
        continue
    if version is None:
        print(f"prepare_gpu_wheels: {name} is not installed here: taking the newest", file=sys.stderr)
        print(name)
    else:
        print(f"{name}=={version}")
EOF
)
if [[ ${#REQUIREMENTS[@]} -eq 0 ]]; then
    echo "prepare_gpu_wheels: could not list the packages (is the dev environment installed here?)" >&2
    exit 1
fi
echo "prepare_gpu_wheels: ${#REQUIREMENTS[@]} packages for $TAG manylinux x86_64 -> $OUT"

BINARY=()
SOURCE=()
for requirement in "${REQUIREMENTS[@]}"; do
    case "$requirement" in
        deepspeed==* | deepspeed) SOURCE+=("$requirement") ;;
        *) BINARY+=("$requirement") ;;
    esac
done

download() {
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "$PY_VERSION" --implementation cp --abi "$TAG" --abi abi3 --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform linux_x86_64 -d "$OUT" "$@"
}

if ! download "${BINARY[@]}" 2>/dev/null; then
    # Find the culprits one by one: a package without a wheel for the target needs building like deepspeed.
    for requirement in "${BINARY[@]}"; do
        download "$requirement" || SOURCE+=("$requirement")
    done
fi

for requirement in "${SOURCE[@]}"; do
    echo "prepare_gpu_wheels: building $requirement from source"
    sdist=$(mktemp -d)
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary=:all: -d "$sdist" \
        "$requirement"
    DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
        -w "$sdist/wheel" "$sdist"/*.tar.gz
    for wheel in "$sdist"/wheel/*.whl; do
        if [[ "$wheel" != *-none-any.whl ]]; then
            echo "prepare_gpu_wheels: $requirement built a platform wheel ($wheel): build it on a" \
                "Python $PY_VERSION x86_64 machine instead" >&2
            exit 1
        fi
        mv "$wheel" "$OUT/"
    done
    rm -rf "$sdist"
done

echo "prepare_gpu_wheels: $(ls "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1), in $OUT"
