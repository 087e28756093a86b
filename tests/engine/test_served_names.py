"""The names ``serve`` serves its base model under (base_model.served_names): a recipe names
its model as a hub id (``Qwen/Qwen3-8B``), from which it derives renderer and tokenizer."""

import json
from pathlib import Path

import pytest
from loraplex_engine.base_model import hub_id_of, served_names
from loraplex_engine.spec.errors import UsageError


def _model(path: Path, **config: object) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    return path


def test_a_plain_directory_is_served_under_its_name(tmp_path: Path) -> None:
    assert served_names(_model(tmp_path / "tiny-llama"), ()) == ("tiny-llama",)


def test_a_hub_id_in_the_config_is_the_default_name(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", _name_or_path="Qwen/Qwen3-8B")
    assert served_names(model, ()) == ("Qwen/Qwen3-8B",)
    assert hub_id_of(model) == "Qwen/Qwen3-8B"


def test_a_local_name_or_path_is_not_a_hub_id(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", _name_or_path="/data/models/m")
    assert served_names(model, ()) == ("m",) and hub_id_of(model) is None


def test_a_hub_cache_snapshot_is_served_under_its_repo_id(tmp_path: Path) -> None:
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-4B-Instruct-2507" / "snapshots" / "abc123"
    assert served_names(_model(snap), ()) == ("Qwen/Qwen3-4B-Instruct-2507",)


def test_names_given_are_served_first_given_first_and_commas_split(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", _name_or_path="Qwen/Qwen3-8B")
    names = served_names(model, ("acme/base,Qwen/Qwen3-8B", " other "))
    assert names == ("acme/base", "Qwen/Qwen3-8B", "other")


@pytest.mark.parametrize("bad", ["a/b/c", "Qwen/Qwen3:8B", "/abs", "x" * 200, "a b"])
def test_a_bad_name_is_a_usage_error_naming_the_flag(tmp_path: Path, bad: str) -> None:
    with pytest.raises(UsageError, match="--served-model-name"):
        served_names(_model(tmp_path / "m"), (bad,))
