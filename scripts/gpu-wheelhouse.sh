#!/usr/bin/env bash
# The wheels the lent GPU machines lack, for bench/gpu_device.sh (issue 27).
#
#   bash scripts/gpu-wheelhouse.sh                  .whl/, cp312 (the device's Python)
#   bash scripts/gpu-wheelhouse.sh --rehearsal      .cache/gpu-wheelhouse/cpXY/, for $PYTHON
#                                                   (default .venv's): the CPU rehearsal's
#   bash scripts/gpu-wheelhouse.sh --python-version 3.11 --dest DIR
#
# The device image (/work/.library/device/KINDS.md) has torch, transformers, safetensors,
# tokenizers, httpx, pyyaml, psutil, prometheus-client, matplotlib, anyio, h11, click,
# rich, numpy and protobuf, but none of:
#
#   - pydantic, which every path of the engine imports (spec/experiment.py, spec/api_types.py): pydantic
#     2.14.4 needs pydantic-core, annotated-types, typing-inspection and
#     typing-extensions >= 4.16 (the image's may be older, and the wheel's, first on
#     PYTHONPATH, wins);
#   - the server (`serve`, bench/gpu_tinker.py's stage): fastapi (which imports
#     opentelemetry-api for its telemetry hooks), starlette, uvicorn, zstandard (the
#     Tinker routes' compressed bodies), tinker (the routes' protobuf messages), anyio at
#     fastapi's pin (the image's version is not known);
#   - the official tinker SDK the stage's clients run: tinker and what it imports:
#     distro, orjson, sniffio, zstandard, and h2, hpack, hyperframe (it opens httpx with
#     http2=True, which imports h2). Not pyqwest (5.5 MiB): the engine answers the SDK's
#     client config with use_pyqwest_transport false, so the SDK never imports it (the
#     rehearsal hides it). protobuf: the image's (tinker's generated code needs >= 4.21).
#
# Downloads exactly those, manylinux x86_64, at the pins of requirements/constraints.txt,
# into a git-ignored folder; versions of them no longer pinned are removed (pip's --target
# install stops at two of one package). A wheel already there is not fetched again, so a
# second run works offline. Prints the wheels' total size beside the tracked files': what
# a `device` call carries, under its 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3)"
PY_VERSION=3.12
DEST=.whl
while [[ $# -gt 0 ]]; do
    case "$1" in
    --python-version) PY_VERSION=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    --rehearsal)  # tests/bench/test_gpu_device.py finds them there
        PY_VERSION=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        DEST=.cache/gpu-wheelhouse/cp${PY_VERSION/./}
        shift ;;
    *) echo "gpu-wheelhouse.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
NAMES=(
    pydantic pydantic-core annotated-types typing-inspection typing-extensions
    fastapi starlette uvicorn opentelemetry-api anyio zstandard
    tinker distro orjson sniffio h2 hpack hyperframe
)

norm() { local s=${1,,}; echo "${s//[-_.]/-}"; }  # as pip compares names: - _ . alike

# name==version from the constraints file.
pin() {
    local line
    while IFS= read -r line; do
        if [[ "$(norm "${line%%==*}")" == "$(norm "$1")" ]]; then
            echo "$(norm "$1")==${line#*==}"
            return
        fi
    done < <(grep -E '^[A-Za-z0-9_.-]+==' requirements/constraints.txt)
    echo "gpu-wheelhouse.sh: $1 is not pinned in requirements/constraints.txt" >&2
    return 1
}

# A wheel's file name spells the project with underscores (PEP 427).
wheel_glob() { local name=${1%%==*}; echo "${name//-/_}-${1#*==}-*.whl"; }

mkdir -p "$DEST"
missing=()
for name in "${NAMES[@]}"; do
    spec=$(pin "$name")
    stem=${spec%%==*}
    for old in "$DEST/${stem//-/_}"-*.whl; do  # another version: it would stop the install
        [[ -e "$old" && "$old" != $DEST/$(wheel_glob "$spec") ]] && rm -v "$old"
    done
    compgen -G "$DEST/$(wheel_glob "$spec")" >/dev/null || missing+=("$spec")
done
if ((${#missing[@]})); then
    # The platforms of the device README's recipe; pip matches each tag exactly.
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "$PY_VERSION" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$DEST" "${missing[@]}"
fi
count=$(compgen -G "$DEST/*.whl" | wc -l)
if ((count != ${#NAMES[@]})); then
    echo "gpu-wheelhouse.sh: $DEST holds $count wheels, want ${#NAMES[@]}:" >&2
    ls "$DEST" >&2
    exit 1
fi
wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
tracked=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
ls -1 "$DEST"
echo "wheels: $count in $DEST, $(mib "$wheels") (cp${PY_VERSION/./}); tracked files $(mib "$tracked");" \
    "together $(mib $((wheels + tracked))) of a device call's 64 MiB"
