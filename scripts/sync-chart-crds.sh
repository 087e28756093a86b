#!/usr/bin/env bash
# Copy the CustomResourceDefinitions from crds/ (their source) into the Helm chart's
# crds/ folder, byte for byte, and remove chart copies whose source is gone.
# tests/chart/test_chart_crds_sync.py fails when the two drift.
#   scripts/sync-chart-crds.sh          copy
#   scripts/sync-chart-crds.sh --check  only report drift (exit 1 when there is some)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SRC="$ROOT/crds"
DST="$ROOT/charts/loraplex/crds"
CHECK=0
[[ "${1:-}" == "--check" ]] && CHECK=1

shopt -s nullglob
sources=("$SRC"/*.yaml)
if ((${#sources[@]} == 0)); then
  echo "sync-chart-crds: no CRDs in crds/ yet; nothing to copy" >&2
  exit 0
fi
mkdir -p "$DST"
drift=0
for src in "${sources[@]}"; do
  dst="$DST/$(basename "$src")"
  if ! cmp -s "$src" "$dst"; then
    drift=1
    if ((CHECK)); then
      echo "drift: charts/loraplex/crds/$(basename "$src") differs from crds/$(basename "$src")"
    else
      cp "$src" "$dst"
      echo "copied crds/$(basename "$src") -> charts/loraplex/crds/"
    fi
  fi
done
for dst in "$DST"/*.yaml; do
  if [[ ! -e "$SRC/$(basename "$dst")" ]]; then
    drift=1
    if ((CHECK)); then
      echo "drift: charts/loraplex/crds/$(basename "$dst") has no source in crds/"
    else
      rm "$dst"
      echo "removed charts/loraplex/crds/$(basename "$dst") (no longer in crds/)"
    fi
  fi
done
if ((CHECK && drift)); then
  echo "run scripts/sync-chart-crds.sh to update the chart's CRDs" >&2
  exit 1
fi
exit 0
