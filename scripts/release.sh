#!/usr/bin/env bash
# loraplex's release naming and publishing, in one place (`make images`, `make release`,
# `make release-chart`, `make image-names` call it; tests/chart/test_release_oci.py runs it
# against a real OCI registry on loopback).
#
# One naming scheme, from the chart's appVersion (charts/loraplex/Chart.yaml):
#   $REGISTRY/operator:<appVersion>     operator/Dockerfile
#   $REGISTRY/engine:<appVersion>       trainer-image/Dockerfile      (CUDA, vLLM)
#   $REGISTRY/engine-cpu:<appVersion>   trainer-image/Dockerfile.cpu  (CPU, tiny model)
#   oci://$REGISTRY/charts/loraplex, tag <chart version>: the chart, as an OCI artifact
# REGISTRY defaults to ghcr.io/loraplex, the registry the chart's values and samples/ name.
# The chart is published with its image references pointed at $REGISTRY, so a chart
# pushed to another registry installs the images pushed next to it.
#
#   scripts/release.sh names            print the references above (name=reference)
#   scripts/release.sh images [--push]  build the three images (and push them): needs a
#                                       running Docker or Podman engine
#   scripts/release.sh chart            package the chart and `helm push` it
#
# Environment: REGISTRY; IMAGE_TAG (images only, default the appVersion: `release`
# refuses another, the chart's images carry the appVersion); CONTAINER_TOOL (docker or
# podman; default the first whose engine answers); HELM (default .tools/bin/helm);
# HELM_PUSH_FLAGS (e.g. --plain-http for a registry without TLS); OUT (default out/release).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CHART_DIR="$ROOT/charts/loraplex"
DEFAULT_REGISTRY="ghcr.io/loraplex"
REGISTRY="${REGISTRY:-$DEFAULT_REGISTRY}"
REGISTRY="${REGISTRY%/}"
HELM="${HELM:-$ROOT/.tools/bin/helm}"
OUT="${OUT:-$ROOT/out/release}"
log() { printf '[release] %s\n' "$*" >&2; }
die() { printf '[release] error: %s\n' "$*" >&2; exit 1; }

chart_field() { # the top-level scalar $1 of Chart.yaml, quotes dropped
  sed -n "s/^$1:[[:space:]]*[\"']\{0,1\}\([^\"']*\)[\"']\{0,1\}[[:space:]]*\$/\1/p" "$CHART_DIR/Chart.yaml"
}
APP_VERSION="$(chart_field appVersion)"
CHART_VERSION="$(chart_field version)"
[[ -n "$APP_VERSION" && -n "$CHART_VERSION" ]] || die "no appVersion/version in $CHART_DIR/Chart.yaml"
IMAGE_TAG="${IMAGE_TAG:-$APP_VERSION}"

# image name → Dockerfile (build context: the repository root)
declare -A DOCKERFILE=(
  [operator]=operator/Dockerfile
  [engine]=trainer-image/Dockerfile
  [engine-cpu]=trainer-image/Dockerfile.cpu
)
IMAGES=(operator engine engine-cpu)

ref() { echo "$REGISTRY/$1:$IMAGE_TAG"; }

names() {
  local name
  for name in "${IMAGES[@]}"; do echo "$name=$(ref "$name")"; done
  echo "chart=oci://$REGISTRY/charts/loraplex:$CHART_VERSION"
}

container_tool() {
  local tool
  for tool in ${CONTAINER_TOOL:-docker podman}; do
    if command -v "$tool" >/dev/null && "$tool" info >/dev/null 2>&1; then
      echo "$tool"
      return
    fi
  done
  die "no container engine to build images with: neither \`docker info\` nor \`podman info\`" \
    "answered (tried: ${CONTAINER_TOOL:-docker podman}). Start Docker or Podman, or set" \
    "CONTAINER_TOOL. Nothing was built or pushed."
}

images() {
  local push="${1:-}" tool name
  if [[ "$push" == "--push" && "$IMAGE_TAG" != "$APP_VERSION" ]]; then
    die "IMAGE_TAG=$IMAGE_TAG: a release tags images with the chart's appVersion ($APP_VERSION); bump Chart.yaml instead"
  fi
  tool="$(container_tool)"
  for name in "${IMAGES[@]}"; do
    log "$tool build -f ${DOCKERFILE[$name]} -t $(ref "$name")"
    "$tool" build -f "$ROOT/${DOCKERFILE[$name]}" -t "$(ref "$name")" "$ROOT"
  done
  [[ "$push" == "--push" ]] || return 0
  for name in "${IMAGES[@]}"; do
    log "$tool push $(ref "$name")"
    "$tool" push "$(ref "$name")"
  done
}

# The chart as published: a copy whose image references name $REGISTRY (identity for the
# default registry), packaged into $OUT.
package_chart() {
  local stage="$1"
  cp -r "$CHART_DIR" "$stage/loraplex"
  sed -i "s#^\(\s*\(repository\|image\):\s*\)$DEFAULT_REGISTRY/#\1$REGISTRY/#" "$stage/loraplex/values.yaml"
  mkdir -p "$OUT"
  "$HELM" package "$stage/loraplex" -d "$OUT" >&2
  echo "$OUT/loraplex-$CHART_VERSION.tgz"
}

chart() {
  [[ -x "$HELM" ]] || die "helm not found at $HELM: run \`make tools\`"
  local stage tgz
  stage="$(mktemp -d)"
  trap 'rm -rf "$stage"' RETURN
  tgz="$(package_chart "$stage")"
  # shellcheck disable=SC2086 # HELM_PUSH_FLAGS is a list of flags
  "$HELM" push "$tgz" "oci://$REGISTRY/charts" ${HELM_PUSH_FLAGS:-} >&2
  log "published oci://$REGISTRY/charts/loraplex:$CHART_VERSION (images $(ref operator), ...)"
}

case "${1:-}" in
  names) names ;;
  images) images "${2:-}" ;;
  chart) chart ;;
  *) die "usage: $0 names | images [--push] | chart" ;;
esac
