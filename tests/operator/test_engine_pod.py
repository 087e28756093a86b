"""Engine Pod builder: labels, ownership, engine args, probes, token and checkpoint mounts."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from loraplex_operator import manifests
from loraplex_operator.config import Config
from loraplex_operator.manifests import (
    KUEUE_QUEUE_LABEL,
    POOL_LABEL,
    TOKEN_FILE,
    engine_url,
    is_pod_ready,
)
from loraplex_operator.resources import Pool

from tests.support.builders import pod_of, pool, serve_args
from tests.support.crdkit import REPO, admit, apply_defaults, schema_of

K8S_VERSION = "1.33"
_PVC = {"persistentVolumeClaim": {"claimName": "ckpt"}}


def _gpu_pool() -> dict[str, Any]:
    obj = (
        pool("gpu-qwen")
        .backend("vllm")
        .slots(16)
        .max_rank(64)
        .replicas(0, 4)
        .checkpoint(root="/shared/ckpt", volume=_PVC)
        .template(
            image="ghcr.io/loraplex/engine:0.1.0",
            resources={"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}},
            nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H200"},
            tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            volumes=[{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
            volumeMounts=[{"name": "models", "mountPath": "/models", "readOnly": True}],
            env=[{"name": "HF_HUB_OFFLINE", "value": "1"}],
            extraArgs=["--log-level", "info"],
        )
        .set("spec.baseModel", "/models/Qwen3-4B")
        .obj()
    )
    return apply_defaults(schema_of("EnginePool"), obj)


def _sample_pool(name: str = "pool-cpu.yaml") -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "samples" / name).read_text())
    doc["metadata"]["uid"] = "5f0c-uid"
    return apply_defaults(schema_of("EnginePool"), doc)


def _minimal_pool() -> dict[str, Any]:
    return apply_defaults(schema_of("EnginePool"), pool("tiny").obj())


POOLS = {
    "gpu": _gpu_pool,
    "sample": _sample_pool,
    "gpu-sample": lambda: _sample_pool("pool-gpu.yaml"),
    "minimal": _minimal_pool,
}


@pytest.mark.parametrize("which", sorted(POOLS))
def test_pod_validates_strictly(which: str) -> None:
    # validate() raises on any schema error and returns the version it checked against
    checked = kubernetes_validate.validate(
        pod_of(POOLS[which](), "a1b2c"), K8S_VERSION, strict=True
    )
    assert checked == K8S_VERSION


def test_identity_labels_and_owner() -> None:
    pod = pod_of(_gpu_pool(), "a1b2c")
    meta = pod["metadata"]
    assert meta["name"] == "gpu-qwen-engine-a1b2c" and meta["namespace"] == "loraplex-system"
    assert meta["labels"][POOL_LABEL] == "gpu-qwen"
    (owner,) = meta["ownerReferences"]
    assert owner == {
        "apiVersion": "loraplex.dev/v1alpha1",
        "kind": "EnginePool",
        "name": "gpu-qwen",
        "uid": "uid-gpu-qwen",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def test_queue_name_labels_the_pod_for_kueue() -> None:
    obj = _gpu_pool()
    assert KUEUE_QUEUE_LABEL not in pod_of(obj, "x")["metadata"]["labels"]
    obj["spec"]["queueName"] = "gpu-team"
    labels = pod_of(obj, "x")["metadata"]["labels"]
    assert labels[KUEUE_QUEUE_LABEL] == "gpu-team" and labels[POOL_LABEL] == "gpu-qwen"
    kubernetes_validate.validate(pod_of(obj, "x"), K8S_VERSION, strict=True)


def test_engine_command_line() -> None:
    (container,) = pod_of(_gpu_pool(), "x")["spec"]["containers"]
    assert container["command"] == ["loraplex-engine"]
    assert container["args"] == [
        "serve",
        "--model", "/models/Qwen3-4B",
        "--port", "8000",
        "--token-file", "/var/run/loraplex/token",
        "--checkpoint-root", "/shared/ckpt",
        "--max-adapters", "16",
        "--max-rank", "64",
        "--rollout-backend", "vllm",
        "--max-registered", "16",
        "--log-level", "info",
    ]  # fmt: skip


def test_log_format_is_the_templates_else_the_operators() -> None:
    """spec.template.logFormat wins; without it the operator's engine log format
    (Config.engine_log_format, LORAPLEX_ENGINE_LOG_FORMAT) is passed to `serve`."""

    def log_format(obj: dict[str, Any], default: str) -> str | None:
        (c,) = manifests.engine_pod(Pool.from_obj(obj), "x", default)["spec"]["containers"]
        args = c["args"]
        return args[args.index("--log-format") + 1] if "--log-format" in args else None

    obj = _gpu_pool()
    # Neither asks: no flag (the engine's default, text; images without the flag run it).
    assert log_format(obj, "text") is None and log_format(obj, "json") == "json"
    obj["spec"]["template"]["logFormat"] = "json"
    assert log_format(obj, "text") == "json"
    obj["spec"]["template"]["logFormat"] = "text"
    assert log_format(obj, "json") == "text"
    kubernetes_validate.validate(pod_of(obj, "x"), K8S_VERSION, strict=True)


def test_a_log_format_the_engine_lacks_is_refused_by_the_crd_and_the_operator() -> None:
    obj = _gpu_pool()
    obj["spec"]["template"]["logFormat"] = "xml"
    assert any("logFormat" in e for e in admit("EnginePool", obj))
    assert Config.from_env({"LORAPLEX_ENGINE_LOG_FORMAT": " JSON "}).engine_log_format == "json"
    assert Config.from_env({}).engine_log_format == "text"
    with pytest.raises(ValueError, match="LORAPLEX_ENGINE_LOG_FORMAT must be one of text, json"):
        Config.from_env({"LORAPLEX_ENGINE_LOG_FORMAT": "xml"})


def test_args_use_pool_defaults() -> None:
    args = serve_args(_minimal_pool()["spec"])
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    assert flags["--max-adapters"] == "8" and flags["--max-rank"] == "64"
    assert flags["--rollout-backend"] == "torch" and flags["--checkpoint-root"] == "/ckpt"


def test_args_leave_precision_to_the_engine_unless_the_pool_sets_it() -> None:
    bare = serve_args(_minimal_pool()["spec"])
    assert "--dtype" not in bare and not any("checkpointing" in a for a in bare)
    for on, flag in ((True, "--gradient-checkpointing"), (False, "--no-gradient-checkpointing")):
        obj = pool("bf16").set("spec.dtype", "bfloat16").set("spec.gradientCheckpointing", on)
        full = apply_defaults(schema_of("EnginePool"), obj.obj())
        args = serve_args(full["spec"])
        assert args[args.index("--dtype") + 1] == "bfloat16" and flag in args
        kubernetes_validate.validate(pod_of(full, "a1b2c"), K8S_VERSION, strict=True)


def test_a_vllm_pools_placement_reaches_the_engine_as_vllm_options() -> None:
    import argparse

    from loraplex_engine.server.flags import add_arguments, serve_settings

    placed = {"device": "cuda:1", "gpuMemoryUtilization": 0.8, "sleepMode": False}
    obj = pool("v").set("spec.rolloutBackend", "vllm").set("spec.vllm", placed)
    full = apply_defaults(schema_of("EnginePool"), obj.obj())
    args = serve_args(full["spec"])
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    served = parser.parse_args(args[1:])  # `serve`'s own parser reads them back
    assert serve_settings(served).vllm_options == {
        "device": "cuda:1",
        "gpu_memory_utilization": 0.8,
        "sleep_mode": False,
    }
    torch_pool = apply_defaults(schema_of("EnginePool"), pool("t").set("spec.vllm", placed).obj())
    assert not any(a.startswith("--vllm-option") for a in serve_args(torch_pool["spec"]))
    bare = apply_defaults(
        schema_of("EnginePool"), pool("b").set("spec.rolloutBackend", "vllm").obj()
    )
    assert not any(a.startswith("--vllm-option") for a in serve_args(bare["spec"]))


def test_args_leave_the_memory_budgets_to_the_engine_unless_the_pool_sets_them() -> None:
    bare = serve_args(_minimal_pool()["spec"])
    assert not {"--micro-batch-tokens", "--rollout-kv-tokens", "--device-memory"} & set(bare)
    obj = pool("sized").set("spec.capacity.microBatchTokens", 8192)
    obj = obj.set("spec.capacity.rolloutKvTokens", 2048)
    obj = obj.set("spec.capacity.deviceMemoryBytes", 80 * 2**30)
    full = apply_defaults(schema_of("EnginePool"), obj.obj())
    args = serve_args(full["spec"])
    assert args[args.index("--micro-batch-tokens") + 1] == "8192"
    assert args[args.index("--rollout-kv-tokens") + 1] == "2048"
    assert args[args.index("--device-memory") + 1] == str(80 * 2**30)
    kubernetes_validate.validate(pod_of(full, "a1b2c"), K8S_VERSION, strict=True)


def test_probes_hit_engine_routes() -> None:
    (container,) = pod_of(_gpu_pool(), "x")["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_token_secret_mounted_read_only_at_token_file() -> None:
    pod = pod_of(_gpu_pool(), "x")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    secret = volumes["loraplex-token"]["secret"]
    assert secret["secretName"] == "engine-token"
    assert secret["items"] == [{"key": "token", "path": "token"}]
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    token_mount = mounts["loraplex-token"]
    assert f"{token_mount['mountPath']}/token" == TOKEN_FILE and token_mount["readOnly"] is True


def test_checkpoint_volume_mounted_at_root() -> None:
    pod = pod_of(_gpu_pool(), "x")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["loraplex-checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts == {
        "loraplex-token": "/var/run/loraplex",
        "loraplex-checkpoints": "/shared/ckpt",
        "loraplex-shm": "/dev/shm",  # a vLLM pool: adapter updates cross through /dev/shm
        "models": "/models",
    }


def test_checkpoint_falls_back_to_empty_dir() -> None:
    volumes = {v["name"]: v for v in pod_of(_minimal_pool(), "x")["spec"]["volumes"]}
    assert volumes["loraplex-checkpoints"] == {"name": "loraplex-checkpoints", "emptyDir": {}}


def test_template_pod_bits_pass_through() -> None:
    spec = pod_of(_gpu_pool(), "x")["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["HF_HUB_OFFLINE"]["value"] == "1" and env["LORAPLEX_POOL"]["value"] == "gpu-qwen"
    assert spec["automountServiceAccountToken"] is False


def test_user_env_cannot_override_operator_env() -> None:
    obj = _minimal_pool()
    obj["spec"]["template"]["env"] = [{"name": "LORAPLEX_POOL", "value": "spoofed"}]
    env = pod_of(obj, "x")["spec"]["containers"][0]["env"]
    assert [e.get("value") for e in env if e["name"] == "LORAPLEX_POOL"] == ["tiny"]


def test_builder_does_not_alias_the_pool() -> None:
    obj = _gpu_pool()
    pod = pod_of(obj, "x")
    pod["spec"]["volumes"][-1]["persistentVolumeClaim"]["claimName"] = "changed"
    assert obj["spec"]["template"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"


def test_pod_helpers() -> None:
    pod = {"status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]}}
    assert engine_url(pod) == "http://10.0.0.7:8000" and is_pod_ready(pod)
    assert engine_url({}) is None and not is_pod_ready({"status": {"conditions": []}})


def test_data_roots_and_reward_hosts_become_serve_flags() -> None:
    obj = pool("tenants").obj()
    obj["spec"] |= {"dataRoots": ["/data", "/more"], "rewardHosts": ["rewards.test", "::1"]}
    args = serve_args(apply_defaults(schema_of("EnginePool"), obj)["spec"])
    trust = [a for a in args if a.startswith(("--data-root", "--allow-reward-host"))]
    assert trust == [
        "--data-root=/data",
        "--data-root=/more",
        "--allow-reward-host=rewards.test",
        "--allow-reward-host=::1",
    ]
    assert not any(a.startswith("--data-root") for a in serve_args(_minimal_pool()["spec"]))


def test_the_checkpoint_quota_becomes_the_serve_flag_the_engine_parses() -> None:
    from loraplex_engine.settings.values import bytes_or_none

    obj = pool("tenants").obj()
    obj["spec"]["checkpoint"] = {"quotaBytesPerNamespace": 50 * 2**30}
    args = serve_args(apply_defaults(schema_of("EnginePool"), obj)["spec"])
    (quota,) = [a for a in args if a.startswith("--checkpoint-quota-bytes")]
    assert bytes_or_none(quota.split("=", 1)[1]) == 50 * 2**30
    plain = serve_args(_minimal_pool()["spec"])
    assert not any(a.startswith("--checkpoint-quota-bytes") for a in plain)  # unbounded


def test_checkpoint_retention_and_hard_links_become_the_serve_flags_the_engine_parses() -> None:
    from loraplex_engine.cli import build_parser
    from loraplex_engine.server.flags import serve_settings
    from loraplex_engine.server.serve import trust_policy

    obj = pool("tenants").obj()
    obj["spec"]["checkpoint"] = {"keepRuns": 5}
    obj["spec"] |= {"dataRoots": ["/data"], "allowDatasetHardLinks": True}
    args = serve_args(apply_defaults(schema_of("EnginePool"), obj)["spec"])
    ours = [a for a in args if a.startswith(("--checkpoint-keep-runs", "--allow-dataset"))]
    assert ours == ["--allow-dataset-hard-links", "--checkpoint-keep-runs=5"]
    settings = serve_settings(build_parser().parse_args(["serve", *ours, "--data-root=/data"]))
    assert settings.checkpoint_keep_runs == 5
    assert trust_policy(settings, 8000).data.allow_hard_links
    plain = serve_args(apply_defaults(schema_of("EnginePool"), pool("tenants").obj())["spec"])
    assert not [a for a in plain if a.startswith(("--checkpoint-keep-runs", "--allow-dataset"))]


def test_the_plugin_allowlist_becomes_serve_flags_the_engine_enforces() -> None:
    """spec.plugins.allowed: one `--allow-plugins` a grant, which `serve` parses into the
    allowlist its PUT checks (tests/engine/plugins/test_plugin_access.py: on a real engine)."""
    from loraplex_engine.cli import build_parser
    from loraplex_engine.server.flags import serve_settings
    from loraplex_engine.server.serve import trust_policy

    def engine_access(allowed: Any) -> tuple[list[str], Any]:
        obj = pool("tenants").obj()
        obj["spec"]["plugins"] = {"allowed": allowed}
        assert admit("EnginePool", obj) == []
        args = serve_args(apply_defaults(schema_of("EnginePool"), obj)["spec"])
        ours = [a for a in args if a.startswith("--allow-plugins")]
        settings = serve_settings(build_parser().parse_args(["serve", *ours]))
        return ours, trust_policy(settings, 8000).plugins

    grants = [
        {"namespaces": ["team-b"], "rewards": ["acme-format"], "environments": ["acme-calc"]},
        {"environments": ["gsm8k-calculator", "verifiers:guess"]},  # every namespace
    ]
    flags, access = engine_access(grants)
    assert flags == [
        "--allow-plugins=team-b=reward:acme-format,environment:acme-calc",
        "--allow-plugins=*=environment:gsm8k-calculator,environment:verifiers:guess",
    ]
    assert access.allows("team-b", "reward", "acme-format")
    assert not access.allows("team-a", "reward", "acme-format")
    assert access.allows("team-a", "environment", "verifiers:guess")
    # An empty list: on, granting nothing; absent: every plug-in for every namespace.
    flags, access = engine_access([])
    assert flags == ["--allow-plugins=*="] and not access.allows("team-b", "reward", "x")
    plain = serve_args(apply_defaults(schema_of("EnginePool"), pool("tenants").obj())["spec"])
    assert not [a for a in plain if a.startswith("--allow-plugins")]


def test_the_object_store_becomes_serve_flags_and_the_secrets_keys_the_engines_env() -> None:
    """The prefixes and endpoint as flags `serve` parses into its trust policy; the
    credentials only as references to the pool's Secret (never a value in the pod)."""
    from loraplex_engine.cli import build_parser
    from loraplex_engine.server.flags import serve_settings
    from loraplex_engine.server.serve import trust_policy

    obj = pool("tenants").obj()
    obj["spec"]["objectStore"] = {
        "prefixes": ["s3://datasets/{namespace}/", "s3://shared/teams/{namespace}/rl/"],
        "endpointUrl": "http://minio.storage:9000",
        "region": "eu-west-1",
        "secretRef": {"name": "datasets-s3", "accessKeyIdKey": "id"},
    }
    assert admit("EnginePool", obj) == []
    full = apply_defaults(schema_of("EnginePool"), obj)
    args = [a for a in serve_args(full["spec"]) if a.startswith("--object-store")]
    settings = serve_settings(build_parser().parse_args(["serve", *args]))
    store = trust_policy(settings, 8000, objects=None).objects
    assert store.check("s3://datasets/team-a/x.parquet", "team-a").key == "team-a/x.parquet"
    assert (store.endpoint_url, store.region) == ("http://minio.storage:9000", "eu-west-1")
    pod = pod_of(full)
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    refs = {
        n: e["valueFrom"]["secretKeyRef"] for n, e in env.items() if n.startswith("LORAPLEX_S3")
    }
    assert refs == {
        "LORAPLEX_S3_ACCESS_KEY_ID": {"name": "datasets-s3", "key": "id"},
        "LORAPLEX_S3_SECRET_ACCESS_KEY": {"name": "datasets-s3", "key": "AWS_SECRET_ACCESS_KEY"},
        "LORAPLEX_S3_SESSION_TOKEN": {
            "name": "datasets-s3",
            "key": "AWS_SESSION_TOKEN",
            "optional": True,
        },
    }
    plain = pod_of(apply_defaults(schema_of("EnginePool"), pool("tenants").obj()))
    assert not [e for e in plain["spec"]["containers"][0]["env"] if "S3" in e["name"]]


@pytest.mark.parametrize(
    "prefix",
    [
        "s3://datasets/",  # no {namespace}: every namespace would share it
        "s3://datasets/{namespace}",  # no trailing '/': team-a would match team-ab
        "s3://datasets/x-{namespace}/",  # not a whole segment
        "s3://datasets/../{namespace}/",
        "http://datasets/{namespace}/",
    ],
)
def test_the_crd_refuses_a_prefix_that_would_not_confine_a_namespace(prefix: str) -> None:
    obj = pool("tenants").obj()
    obj["spec"]["objectStore"] = {"prefixes": [prefix]}
    assert admit("EnginePool", obj) != []


def test_the_pools_trackers_become_the_serve_flags_the_engine_parses() -> None:
    from loraplex_engine.cli import build_parser
    from loraplex_engine.server.flags import serve_settings

    obj = pool("tenants").obj()
    obj["spec"]["tracking"] = {
        "mlflow": {"trackingUri": "http://mlflow.mlops.svc:5000"},
        "wandb": {"mode": "online", "entity": "team", "dir": "/ckpt/wandb"},
        "tensorboard": {"logDir": "/ckpt/tb"},
        "queue": 500,
    }
    args = serve_args(apply_defaults(schema_of("EnginePool"), obj)["spec"])
    ours = [a for a in args if a.startswith("--tracking-")]
    settings = serve_settings(build_parser().parse_args(["serve", "--model=/m", *ours]))
    assert (settings.tracking_mlflow_uri, settings.tracking_mlflow_experiment) == (
        "http://mlflow.mlops.svc:5000",
        "loraplex",  # the CRD's default prefix
    )
    assert (settings.tracking_wandb, settings.tracking_wandb_project) == ("online", "loraplex")
    assert (settings.tracking_wandb_entity, settings.tracking_wandb_dir) == ("team", "/ckpt/wandb")
    assert (settings.tracking_tensorboard_dir, settings.tracking_queue) == ("/ckpt/tb", 500)
    plain = serve_args(apply_defaults(schema_of("EnginePool"), pool("tenants").obj())["spec"])
    assert not [a for a in plain if a.startswith("--tracking-")]  # no block: no tracker
