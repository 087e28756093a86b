"""tenancy/object_store.py: which object-storage URLs a namespace's dataset may name (pure).
A dataset read through a real S3 API is tests/engine/data/test_datasets_live.py."""

from __future__ import annotations

import pytest
from loraplex_engine.spec.errors import TaskError, UsageError
from loraplex_engine.tenancy.object_store import (
    ObjectStore,
    ObjectUrl,
    credentials_from,
    is_object_url,
    parse_object_url,
)

STORE = ObjectStore.build(["s3://datasets/tenants/{namespace}/", "gs://shared/{namespace}/"])


def _refusal(url: str, namespace: str = "team-a", store: ObjectStore = STORE) -> str:
    with pytest.raises(TaskError) as info:
        store.check(url, namespace)
    assert info.value.field == "spec.task.dataset"
    return info.value.message


def test_a_url_under_the_namespace_prefix_is_allowed_as_written() -> None:
    assert STORE.check("s3://datasets/tenants/team-a/x.parquet", "team-a") == ObjectUrl(
        "s3", "datasets", "tenants/team-a/x.parquet"
    )
    saved = STORE.check("gs://shared/team-a/gsm8k/", "team-a")  # a saved directory
    assert saved.path == "shared/team-a/gsm8k"
    assert STORE.check("s3://datasets/tenants/team-a/d=2024-01-01/p.parquet", "team-a")


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("s3://datasets/tenants/team-b/x.parquet", "must lie under"),
        ("s3://datasets/tenants/team-ab/x.parquet", "must lie under"),  # a longer name
        ("s3://datasets/tenants/team-a/", "must lie under"),  # the prefix itself
        ("s3://other/tenants/team-a/x.parquet", "must lie under"),  # another bucket
        ("gs://datasets/tenants/team-a/x.parquet", "must lie under"),  # another scheme
        ("s3://datasets/tenants/team-a/../team-b/x", "'..' segments"),
        ("s3://datasets/tenants/team-a/./x", "'..' segments"),
        ("s3://datasets/tenants/team-a//x", "empty"),
        ("s3://datasets/tenants/team-a/%2e%2e/team-b/x", "percent-encoding"),
        ("s3://datasets/tenants/team-a/x?versionId=1", "the key may hold only"),
        ("s3://datasets/tenants/team-a/x#frag", "the key may hold only"),
        ("s3://datasets/tenants/team-a/x\\..\\y", "the key may hold only"),
        ("s3://user@datasets/tenants/team-a/x", "not a bucket name"),
        ("s3://datasets:9000/tenants/team-a/x", "not a bucket name"),
        ("s3://DATASETS/tenants/team-a/x", "not a bucket name"),
        ("S3://datasets/tenants/team-a/x", "the scheme must be"),
        ("http://datasets/tenants/team-a/x", "the scheme must be"),
        ("file:///etc/passwd", "the scheme must be"),
        ("s3://datasets", "names a bucket"),
        ("s3://datasets/", "names a bucket"),
        ("s3://datasets/tenants/team-a/ x", "the key may hold only"),
        ("s3://datasets/tenants/team-a/" + "x" * 3000, "longer than"),
    ],
)
def test_anything_else_is_refused_naming_why(url: str, why: str) -> None:
    assert why in _refusal(url)


def test_the_refusal_names_the_namespace_prefix_rule() -> None:
    message = _refusal("s3://datasets/tenants/team-b/x.parquet", "team-a")
    assert "team-a's datasets must lie under s3://datasets/tenants/team-a/" in message
    assert "gs://shared/team-a/" in message


def test_a_pool_without_an_object_store_refuses_every_url() -> None:
    message = _refusal("s3://datasets/tenants/team-a/x.parquet", store=ObjectStore())
    assert "no objectStore" in message


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("s3://datasets/tenants/", "{namespace}"),
        ("s3://datasets/{namespace}", "end with '/'"),
        ("s3://{namespace}/x/", "{namespace}"),  # the bucket is no namespace's own
        ("s3://datasets/{namespace}/{name}/", "only placeholder"),
        ("s3://datasets/../{namespace}/", "'..' segments"),
        ("https://datasets/{namespace}/", "scheme"),
    ],
)
def test_a_bad_prefix_template_stops_the_engine_at_start(template: str, why: str) -> None:
    with pytest.raises(UsageError, match="--object-store-prefix") as info:
        ObjectStore.build([template])
    assert why in str(info.value)


def test_a_bad_endpoint_stops_the_engine_at_start() -> None:
    with pytest.raises(UsageError, match="--object-store-endpoint"):
        ObjectStore.build(["s3://data/{namespace}/"], endpoint_url="minio:9000")


def test_credentials_are_taken_out_of_the_environment_and_never_shown() -> None:
    env = {
        "LORAPLEX_S3_ACCESS_KEY_ID": "AKID",
        "LORAPLEX_S3_SECRET_ACCESS_KEY": "SHHH",
        "LORAPLEX_S3_SESSION_TOKEN": " ",
        "PATH": "/bin",
    }
    found = credentials_from(env)
    assert found == {"key": "AKID", "secret": "SHHH"}
    assert env == {"PATH": "/bin"}  # no process the engine starts inherits them
    store = ObjectStore.build(["s3://data/{namespace}/"], credentials=found)
    assert "SHHH" not in repr(store) and "AKID" not in repr(store)


def test_paths_are_not_object_urls() -> None:
    assert is_object_url("s3://b/k") and is_object_url("gs://b/k") and is_object_url("x://y")
    for path in ("data/x.parquet", "/abs/x.jsonl", "s3:/b/k", "weird:name.jsonl"):
        assert not is_object_url(path)
    assert isinstance(parse_object_url("s3:/b/k"), str)
