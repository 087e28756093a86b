"""The operator's typed views: their defaults are the CRDs', field by field, and they read
what an object says over any default. The pool's view is the model its CRD schema is
generated from (api/pool.py), so its defaults are the CRD's by construction
(tests/test_spec_drift.py); the experiment's few fields are checked here one by one."""

from __future__ import annotations

from typing import Any

import pytest
from loraplex_operator.resources import Algorithm, Experiment, ExperimentSpec, Lora, Pool

from tests.support.builders import experiment, pool
from tests.support.crdkit import apply_defaults, schema_of

# (CRD kind, path under .spec, the view's default for it)
VIEW_DEFAULTS: list[tuple[str, str, Any]] = [
    ("LoRAExperiment", "lora.rank", Lora.rank),
    ("LoRAExperiment", "algorithm.maxSteps", Algorithm.max_steps),
    ("LoRAExperiment", "suspend", ExperimentSpec.suspend),
]
# No CRD default, and None in the view: absent means the default class / nothing written.
UNDEFAULTED = ("priorityClassName", "priority")


def _crd_default(kind: str, path: str) -> Any:
    node = schema_of(kind)["properties"]["spec"]
    for part in path.split("."):
        node = node["properties"][part]
    assert "default" in node, f"{kind} spec.{path} has no default in the CRD"
    return node["default"]


@pytest.mark.parametrize(("kind", "path", "default"), VIEW_DEFAULTS)
def test_view_default_is_the_crds(kind: str, path: str, default: Any) -> None:
    assert _crd_default(kind, path) == default


@pytest.mark.parametrize("path", UNDEFAULTED)
def test_priority_fields_have_no_crd_default(path: str) -> None:
    # A default priority would be written into every object, and a default class name
    # would have to exist in every pool; absent is the default class (value 0).
    assert "default" not in schema_of("LoRAExperiment")["properties"]["spec"]["properties"][path]
    assert (ExperimentSpec.priority_class_name, ExperimentSpec.priority) == (None, None)


def test_unset_target_modules_stay_unset_for_the_engines_family_default() -> None:
    # No CRD default: the API server must not write Llama names into a Phi-3 experiment.
    lora = schema_of("LoRAExperiment")["properties"]["spec"]["properties"]["lora"]
    assert "default" not in lora["properties"]["targetModules"]
    assert Lora.target_modules is None
    assert Experiment.from_obj(experiment("a").obj()).spec.lora.target_modules is None


def test_views_of_bare_objects_equal_views_of_the_objects_the_api_server_defaults() -> None:
    # Covers every field the views read, including any missing from VIEW_DEFAULTS.
    bare_exp, bare_pool = experiment("a").obj(), pool().obj()
    full_exp = apply_defaults(schema_of("LoRAExperiment"), bare_exp)
    full_pool = apply_defaults(schema_of("EnginePool"), bare_pool)
    assert Experiment.from_obj(bare_exp) == Experiment.from_obj(full_exp)
    assert Pool.from_obj(bare_pool) == Pool.from_obj(full_pool)


def test_views_read_what_the_object_says() -> None:
    obj = experiment("a").rank(32).modules("q_proj").priority(5).suspend().obj()
    obj["spec"]["priorityClassName"] = "high"
    obj["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    obj["status"] = {"phase": "Running", "restarts": 2, "checkpoint": {"path": "/c", "step": 4}}
    exp = Experiment.from_obj(obj)
    assert (exp.key, exp.id, exp.meta.uid) == ("team-a/a", "team-a.a", "uid-team-a-a")
    assert (exp.spec.lora.rank, exp.spec.lora.target_modules) == (32, ("q_proj",))
    assert (exp.spec.priority, exp.spec.suspend, exp.meta.deleting) == (5, True, True)
    assert exp.spec.priority_class_name == "high"
    assert (exp.status.phase, exp.status.restarts) == ("Running", 2)
    assert (exp.status.checkpoint.path, exp.status.checkpoint.step) == ("/c", 4)

    p = Pool.from_obj(pool().slots(2).max_rank(16).replicas(1, 3).target_modules().obj())
    assert (p.spec.capacity.max_adapters, p.spec.capacity.max_rank) == (2, 16)
    assert (p.spec.replicas.min, p.spec.replicas.max) == (1, 3)
    assert p.spec.allowed_target_modules == ()  # an empty list allows nothing
    assert p.spec.allowed_namespaces is None and p.spec.model_shape is None
    assert p.spec.dtype is None and p.spec.gradient_checkpointing is None  # engine decides
    bf16 = pool().set("spec.dtype", "bfloat16").set("spec.gradientCheckpointing", False).obj()
    assert (Pool.from_obj(bf16).spec.dtype, Pool.from_obj(bf16).spec.gradient_checkpointing) == (
        "bfloat16",
        False,
    )
    assert p.spec.capacity.rollout_kv_tokens is None
    sized = pool().set("spec.capacity.microBatchTokens", 2048)
    capacity = Pool.from_obj(sized.set("spec.capacity.rolloutKvTokens", 8192).obj()).spec.capacity
    assert (capacity.micro_batch_tokens, capacity.rollout_kv_tokens) == (2048, 8192)
    assert p.spec.queue_name is None  # no Kueue queue unless named
    # Absent memory budgets: each engine's memory plan derives them.
    assert (p.spec.capacity.micro_batch_tokens, p.spec.capacity.device_memory_bytes) == (None, None)
    sized = pool().set("spec.capacity.microBatchTokens", 8192).obj()
    assert Pool.from_obj(sized).spec.capacity.micro_batch_tokens == 8192
    queued = Pool.from_obj(pool().set("spec.queueName", "gpu-team").obj())
    assert queued.spec.queue_name == "gpu-team"
    assert (p.spec.gpus_per_engine, p.spec.template.shm_size) == (1, "1Gi")  # one rank
    ranks = Pool.from_obj(
        pool().set("spec.gpusPerEngine", 4).set("spec.template.shmSize", "8Gi").obj()
    )
    assert (ranks.spec.gpus_per_engine, ranks.spec.template.shm_size) == (4, "8Gi")
    assert p.spec.shard_base is False  # the base whole on every rank, as before
    assert Pool.from_obj(pool().gpus(2).shard_base().obj()).spec.shard_base is True


def test_a_null_sub_object_reads_as_defaults() -> None:
    obj = experiment("a").obj()
    obj["spec"]["lora"] = None
    obj["status"] = None
    exp = Experiment.from_obj(obj)
    assert exp.spec.lora == Lora() and exp.status.restarts == 0
