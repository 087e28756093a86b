"""The engine Pod of a multi-rank pool (`spec.gpusPerEngine`): `--world-size`, one GPU per
rank on a GPU pool (none on a CPU pool), and a memory-backed /dev/shm for NCCL; a
one-rank pool's Pod is what it was before the field existed. `spec.shardBase` adds
`--shard-base`, and `serve` reads back what the operator wrote."""

from __future__ import annotations

import argparse
import os
from typing import Any
from unittest import mock

import kubernetes_validate
import pytest
from loraplex_engine.server.flags import add_arguments, serve_settings
from loraplex_engine.spec.errors import UsageError
from loraplex_operator.manifests import (
    GPU_RESOURCE,
    SHM_PATH,
    SHM_VOLUME,
)

from tests.support.builders import pod_of, pod_resources, pool, serve_args
from tests.support.crdkit import admit, apply_defaults, schema_of

K8S_VERSION = "1.33"


def _pool(
    gpus: int | None,
    resources: dict[str, Any] | None = None,
    shard: bool | None = None,
    **template: Any,
) -> Any:
    p = pool("ranks")
    if gpus is not None:
        p = p.gpus(gpus)
    if shard is not None:
        p = p.shard_base(shard)
    if resources is not None:
        template["resources"] = resources
    return apply_defaults(schema_of("EnginePool"), p.template(**template).obj())


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_of(obj, "a1b2c")["spec"]["containers"]
    return container


def _gpu_limits(n: int) -> dict[str, Any]:
    return {"limits": {GPU_RESOURCE: n, "memory": "64Gi"}}


def test_one_rank_pods_are_unchanged() -> None:
    for obj in (_pool(None, _gpu_limits(1)), _pool(1, _gpu_limits(1))):
        pod = pod_of(obj, "a1b2c")
        container = pod["spec"]["containers"][0]
        assert "--world-size" not in container["args"]
        assert SHM_VOLUME not in {v["name"] for v in pod["spec"]["volumes"]}
        assert SHM_PATH not in {m["mountPath"] for m in container["volumeMounts"]}
        assert container["resources"] == _gpu_limits(1)


def test_a_gpu_pool_gets_one_gpu_per_rank_the_world_size_and_a_shared_memory_volume() -> None:
    obj = _pool(4, _gpu_limits(1))
    pod = pod_of(obj, "a1b2c")
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    container = pod["spec"]["containers"][0]
    assert container["resources"] == {"limits": {GPU_RESOURCE: 4, "memory": "64Gi"}}
    args = container["args"]
    assert args[args.index("--world-size") + 1] == "4"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[SHM_VOLUME] == {
        "name": SHM_VOLUME,
        "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"},
    }
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[SHM_PATH] == SHM_VOLUME
    assert obj["spec"]["template"]["resources"] == _gpu_limits(1)  # the pool is not edited


def test_shm_size_sizes_the_volume() -> None:
    pod = pod_of(_pool(2, _gpu_limits(2), shmSize="8Gi"), "x")
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == SHM_VOLUME]
    assert shm["emptyDir"]["sizeLimit"] == "8Gi"


def _vllm_pool(**template: Any) -> Any:
    p = pool("one-vllm").backend("vllm").template(**template)
    return apply_defaults(schema_of("EnginePool"), p.obj())


def test_a_one_rank_vllm_pool_gets_the_shared_memory_volume() -> None:
    """Adapter updates cross to the vLLM worker through /dev/shm segments, which the
    runtime's 64 MiB would not hold for a rank-32 adapter of a 4B model."""
    pod = pod_of(_vllm_pool(shmSize="2Gi"), "x")
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] == SHM_VOLUME]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    mounts = {m["mountPath"]: m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts[SHM_PATH] == SHM_VOLUME
    assert "--world-size" not in pod["spec"]["containers"][0]["args"]


def test_a_one_rank_vllm_pool_that_mounts_its_own_shm_keeps_it() -> None:
    own = {"name": "big-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    obj = _vllm_pool(volumes=[own], volumeMounts=[{"name": "big-shm", "mountPath": "/dev/shm/"}])
    assert admit("EnginePool", obj) == []  # allowed with one rank
    pod = pod_of(obj, "x")
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert SHM_VOLUME not in {v["name"] for v in pod["spec"]["volumes"]}
    mounts = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "big-shm"]
    assert mounts == [{"name": "big-shm", "mountPath": "/dev/shm/"}]
    assert {v["name"] for v in pod["spec"]["volumes"]} >= {"big-shm"}


@pytest.mark.parametrize(
    ("resources", "want"),
    [
        # limits and requests of an extended resource must be equal: both are raised
        (
            {"limits": {GPU_RESOURCE: 1}, "requests": {GPU_RESOURCE: 1, "cpu": "8"}},
            {"limits": {GPU_RESOURCE: 2}, "requests": {GPU_RESOURCE: 2, "cpu": "8"}},
        ),
        # requests alone: the limit a GPU needs is added
        (
            {"requests": {GPU_RESOURCE: "1"}},
            {"limits": {GPU_RESOURCE: 2}, "requests": {GPU_RESOURCE: 2}},
        ),
        # never lowered: the template may want a GPU more than it has ranks
        ({"limits": {GPU_RESOURCE: 8}}, {"limits": {GPU_RESOURCE: 8}}),
    ],
)  # fmt: skip
def test_the_gpu_count_is_raised_to_the_rank_count_where_the_template_asks_for_gpus(
    resources: dict[str, Any], want: dict[str, Any]
) -> None:
    obj = _pool(2, resources)
    assert pod_resources(obj["spec"]) == want
    kubernetes_validate.validate(pod_of(obj, "x"), K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    "resources",
    [None, {"limits": {"cpu": "4", "memory": "8Gi"}}, {"limits": {GPU_RESOURCE: 0, "cpu": "4"}}],
)
def test_a_cpu_pool_runs_gloo_ranks_and_asks_for_no_gpu(resources: dict[str, Any] | None) -> None:
    obj = _pool(2, resources)
    container = _container(obj)
    assert container.get("resources") == resources  # as written: no GPU appears
    assert container["args"][container["args"].index("--world-size") + 1] == "2"
    assert SHM_PATH in {m["mountPath"] for m in container["volumeMounts"]}
    kubernetes_validate.validate(pod_of(obj, "x"), K8S_VERSION, strict=True)


def test_world_size_comes_before_the_templates_extra_args() -> None:
    args = serve_args(_pool(2, extraArgs=["--log-level", "debug"])["spec"])
    assert args[-2:] == ["--log-level", "debug"] and "--world-size" in args[:-2]


def _serve_parser() -> argparse.ArgumentParser:
    """`serve`'s own parser, with LORAPLEX_SHARD_BASE unset: only the args count here."""
    parser = argparse.ArgumentParser()
    with mock.patch.dict(os.environ, {"LORAPLEX_SHARD_BASE": ""}):
        add_arguments(parser)
    return parser


def test_serve_reads_the_world_size_back() -> None:
    parser = _serve_parser()
    for gpus in (1, 2, 8):
        args = serve_args(_pool(gpus, _gpu_limits(1))["spec"])
        assert parser.parse_args(args[1:]).world_size == gpus


def test_shard_base_puts_the_flag_in_a_multi_rank_engines_args() -> None:
    obj = _pool(4, _gpu_limits(1), shard=True)
    assert admit("EnginePool", obj) == []
    pod = pod_of(obj, "a1b2c")
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    args = pod["spec"]["containers"][0]["args"]
    assert args.count("--shard-base") == 1
    assert args[args.index("--world-size") : args.index("--world-size") + 3] == [
        "--world-size",
        "4",
        "--shard-base",
    ]
    served = _serve_parser().parse_args(args[1:])
    assert (served.world_size, served.shard_base) == (4, True)
    serve_settings(served).check()  # what `serve` checks before it starts a rank


@pytest.mark.parametrize("shard", [None, False])
def test_a_pool_that_does_not_shard_passes_no_flag(shard: bool | None) -> None:
    for gpus in (1, 2):
        args = serve_args(_pool(gpus, _gpu_limits(1), shard=shard)["spec"])
        assert "--shard-base" not in args
        assert _serve_parser().parse_args(args[1:]).shard_base is False


def test_shard_base_with_one_rank_is_refused_by_the_crd_and_by_serve_alike() -> None:
    """The CRD's rule and `serve`'s check refuse the same pool: were the rule bypassed (an
    older CRD), the engine would name the mistake at start, not run the base unsharded."""
    obj = _pool(1, _gpu_limits(1), shard=True)
    (error,) = admit("EnginePool", obj)
    assert error.startswith("shardBase needs gpusPerEngine of 2 or more")
    args = serve_args(obj["spec"])
    assert "--world-size" not in args and "--shard-base" in args
    with pytest.raises(UsageError, match="--shard-base needs --world-size above 1"):
        serve_settings(_serve_parser().parse_args(args[1:])).check()
