"""The base model's dimensions the engine reports on /v1/capacity (`modelShape`), which an
EnginePool without a declared `modelShape` uses for its adapter memory estimate: they
must be the widths the LoRA-wrapped projections really have."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex_engine.base_model import model_shape_of
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config


def _projections(config: object) -> dict[str, torch.nn.Linear]:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    return {
        "k_proj": layer.self_attn.k_proj,
        "q_proj": layer.self_attn.q_proj,
        "up_proj": layer.mlp.up_proj,
    }


def _qwen3_4b_shaped() -> Qwen3Config:
    """Qwen3-4B's published dimensions (grouped-query attention, head_dim 128), with few
    layers and a small vocabulary: built on the meta device, no weights."""
    return Qwen3Config(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128,
    )


@pytest.mark.parametrize("which", ["tiny-llama", "qwen3-4b-shaped"])
def test_reported_shape_is_the_models(which: str, tiny_model_dir: Path) -> None:
    config = (
        AutoConfig.from_pretrained(tiny_model_dir) if which == "tiny-llama" else _qwen3_4b_shaped()
    )
    shape = model_shape_of(config)
    assert shape is not None
    linears = _projections(config)
    assert shape.num_layers == config.num_hidden_layers
    assert shape.hidden_size == linears["q_proj"].in_features
    assert shape.intermediate_size == linears["up_proj"].out_features
    assert shape.kv_dim == linears["k_proj"].out_features
    assert shape.kv_dim <= shape.hidden_size  # the EnginePool schema's rule


def test_qwen3_4b_reports_grouped_query_width() -> None:
    shape = model_shape_of(_qwen3_4b_shaped())
    assert shape is not None and (shape.hidden_size, shape.kv_dim) == (2560, 1024)
    assert shape.to_json() == {
        "numLayers": 2,
        "hiddenSize": 2560,
        "intermediateSize": 9728,
        "kvDim": 1024,
    }


def test_a_config_without_dimensions_reports_none() -> None:
    assert model_shape_of(object()) is None
