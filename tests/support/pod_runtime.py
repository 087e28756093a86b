"""A Pod's container run as a local process, the way a kubelet would run it.

The container's `command`, `args` and `env` run as written, with only what a node
provides mapped to this machine:

- the image: its programs (`command[0]`, e.g. `loraplex-engine`, `kopf`) are the local
  virtualenv's, and paths the image holds (the model under `/models/...`) are local
  directories (`Node.image_paths`);
- volumes: every volumeMount's `mountPath` is a local directory: `emptyDir` one per Pod,
  `hostPath` one per host path on this "node" (shared by its Pods, as on a node's disk), a
  `secret` volume a directory with its `items` written as files (`defaultMode`);
- the network: every Pod shares this machine's loopback, so a `containerPort` given as an
  argument is replaced by 0 (the process binds a free port and says which); the caller
  publishes the port it got.

A reference in `args` or `env` to a path in no mounted volume and not in the image map
stays as it is; so does anything else.
"""

from __future__ import annotations

import base64
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VENV_BIN = Path(sys.executable).parent
# Environment the images set (operator/Dockerfile, trainer-image/Dockerfile) plus what
# a process needs to find the local install; nothing else of the test process leaks in.
IMAGE_ENV = {"PYTHONUNBUFFERED": "1"}
HOST_ENV = ("PATH", "HOME", "PYTHONPATH", "LANG", "TMPDIR")

SecretReader = Callable[[str, str], Mapping[str, str] | None]  # (namespace, name) -> data


class PodSpecError(ValueError):
    """The Pod asks for something this runtime cannot provide (the message says what)."""


class ContainerConfigError(ValueError):
    """What a kubelet reports as `CreateContainerConfigError`: the container's config
    names a Secret or key that is not there (the message in the kubelet's words)."""


def local_program(name: str) -> str:
    """The image's program `name` → the virtualenv's (fails naming it when absent)."""
    path = VENV_BIN / name
    if not path.exists():
        raise PodSpecError(f"container command {name!r} is not installed in {VENV_BIN}")
    return str(path)


def field_ref(pod: Mapping[str, Any], path: str) -> str:
    """The downward API: `metadata.name`, `metadata.namespace`, `spec.nodeName`, ..."""
    value: Any = pod
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if value is None:
        raise PodSpecError(f"env fieldRef {path!r}: the Pod has no such field")
    return str(value)


def container_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    read_secret: SecretReader | None = None,
) -> dict[str, str]:
    """The process environment: the image's, then the container's `env` in order."""
    env = {k: os.environ[k] for k in HOST_ENV if k in os.environ} | IMAGE_ENV
    for var in container.get("env") or []:
        source = var.get("valueFrom") or {}
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif "fieldRef" in source:
            env[var["name"]] = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            value = secret_key(pod, source["secretKeyRef"], read_secret)
            if value is not None:
                env[var["name"]] = value
        else:
            raise PodSpecError(f"env {var['name']}: only value, fieldRef and secretKeyRef")
    return env


def secret_key(
    pod: Mapping[str, Any], ref: Mapping[str, Any], read_secret: SecretReader | None
) -> str | None:
    """An env var's `secretKeyRef`: its value, None when optional and absent."""
    namespace = pod["metadata"].get("namespace", "default")
    data = read_secret(namespace, ref["name"]) if read_secret else None
    if data is not None and ref["key"] in data:
        return base64.b64decode(data[ref["key"]]).decode()
    if ref.get("optional"):
        return None
    if data is None:
        raise ContainerConfigError(f'secret "{ref["name"]}" not found')
    raise ContainerConfigError(
        f"couldn't find key {ref['key']} in Secret {namespace}/{ref['name']}"
    )


@dataclass
class Node:
    """The node's disk: where volumes of its Pods live, and what the images hold."""

    root: Path
    image_paths: dict[str, Path] = field(default_factory=dict)  # path in image -> local
    labels: dict[str, str] = field(default_factory=dict)  # what nodeSelectors match
    # Images its registry holds (None: every image pulls); extended resources whose
    # devices the device plugin reports unhealthy (a Pod asking for one is refused).
    images: set[str] | None = None
    unhealthy: set[str] = field(default_factory=set)

    def pulls(self, image: str) -> bool:
        return self.images is None or image in self.images

    def volume_dirs(
        self, pod: Mapping[str, Any], read_secret: SecretReader | None = None
    ) -> dict[str, Path]:
        """Volume name → its local directory (created and filled)."""
        meta = pod["metadata"]
        pod_dir = self.root / "pods" / meta.get("namespace", "default") / meta["name"]
        dirs: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes") or []:
            name = volume["name"]
            if "emptyDir" in volume:
                dirs[name] = pod_dir / "volumes" / name
            elif "hostPath" in volume:
                dirs[name] = self.root / "host" / volume["hostPath"]["path"].lstrip("/")
            elif "secret" in volume:
                dirs[name] = pod_dir / "volumes" / name
                self._write_secret(meta, volume["secret"], dirs[name], read_secret)
                continue
            else:
                raise PodSpecError(f"volume {name}: only emptyDir, hostPath and secret")
            dirs[name].mkdir(parents=True, exist_ok=True)
        return dirs

    @staticmethod
    def _write_secret(
        meta: Mapping[str, Any],
        source: Mapping[str, Any],
        directory: Path,
        read_secret: SecretReader | None,
    ) -> None:
        name = source["secretName"]
        data = read_secret(meta.get("namespace", "default"), name) if read_secret else None
        if data is None:
            raise PodSpecError(f"secret volume: Secret {name} not found")
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        directory.mkdir(parents=True, exist_ok=True)
        for item in items:
            if item["key"] not in data:
                raise PodSpecError(f"secret volume: Secret {name} has no key {item['key']!r}")
            target = directory / item["path"]
            target.write_bytes(base64.b64decode(data[item["key"]]))
            target.chmod(item.get("mode", source.get("defaultMode", 0o644)))

    def path_map(
        self, container: Mapping[str, Any], volumes: Mapping[str, Path]
    ) -> dict[str, Path]:
        """Container path → local path: the image's paths and every volumeMount."""
        mapped = dict(self.image_paths)
        for mount in container.get("volumeMounts") or []:
            if mount["name"] not in volumes:
                raise PodSpecError(f"volumeMount {mount['mountPath']}: no volume {mount['name']}")
            mapped[mount["mountPath"]] = volumes[mount["name"]]
        return mapped


def map_path(value: str, mapped: Mapping[str, Path]) -> str:
    """`value` with its container path prefix (the longest that matches) made local."""
    for prefix in sorted(mapped, key=len, reverse=True):
        if value == prefix or value.startswith(prefix.rstrip("/") + "/"):
            return str(mapped[prefix]) + value[len(prefix.rstrip("/")) :]
    return value


def local_command(
    container: Mapping[str, Any], mapped: Mapping[str, Path], free_ports: bool = True
) -> list[str]:
    """`command` + `args` with the program, paths and (with `free_ports`) the declared
    container ports made local: `--port 8000` becomes `--port 0`."""
    command = list(container.get("command") or [])
    if not command:
        raise PodSpecError("container has no command: the image's entrypoint is not modelled")
    ports = {str(p["containerPort"]) for p in container.get("ports") or []} if free_ports else set()
    args = ["0" if a in ports else map_path(a, mapped) for a in container.get("args") or []]
    return [local_program(command[0]), *(map_path(a, mapped) for a in command[1:]), *args]


def local_env(env: Mapping[str, str], mapped: Mapping[str, Path]) -> dict[str, str]:
    return {k: map_path(v, mapped) for k, v in env.items()}
