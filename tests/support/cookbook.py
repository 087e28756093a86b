"""tinker-cookbook's recipes, run unchanged (``python -m tinker_cookbook...``) against a
real ``serve --tinker-keys``, offline: a Hugging Face cache holding what a recipe loads by
name. The tiny model (built with Qwen3 instruct's chat tokens) stands in the hub cache as
``Qwen/Qwen3-4B-Instruct-2507``, so the recipe's tokenizer, renderer (``qwen3_instruct``)
and base model all resolve from that name, and as ``Qwen/Qwen3.5-9B`` for the recipes that
name that model in their code; the datasets a recipe loads by name are small stand-ins in
the datasets cache (``HF_HUB_OFFLINE=1`` reads them as the cached copy)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUB_ID = "Qwen/Qwen3-4B-Instruct-2507"  # a model the cookbook knows, renderer qwen3_instruct
QWEN3_5_ID = "Qwen/Qwen3.5-9B"  # named in code by eval.custom_evaluators (qwen3_5 renderers)
REVISION = "0" * 40
# Qwen3's own reasoning markers, each one token (added, not special, as Qwen3 ships them):
# the qwen3_5 renderers' parse_response asserts ``</think>`` is one token.
THINK_TOKENS = ["<think>", "</think>"]
CONTEXT = 4096  # tokens; see build_hub_cache


@dataclass(frozen=True)
class HubCache:
    home: Path  # HF_HOME
    model_dir: Path  # the snapshot serve --model reads

    def env(self, key: str) -> dict[str, str]:
        """A recipe's environment: this cache, offline, and the Tinker key."""
        return {
            **os.environ,
            "HF_HOME": str(self.home),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TINKER_API_KEY": key,
            "WANDB_MODE": "disabled",
        }


def _snapshot(home: Path, hub_id: str = HUB_ID) -> Path:
    """The hub cache's folder for ``hub_id``'s snapshot (``refs/main`` naming it)."""
    repo = home / "hub" / ("models--" + hub_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return repo / "snapshots" / REVISION


def link_hub_cache(home: Path, model_dir: Path) -> HubCache:
    """A real model (its weights and tokenizer, each file a link) standing in the hub cache
    under HUB_ID: for a model whose chat tokens are Qwen3 instruct's (ChatML's
    ``<|im_start|>``/``<|im_end|>``, as SmolLM2-Instruct's), so the recipe's renderer fits."""
    snapshot = _snapshot(home)
    snapshot.mkdir(parents=True)
    for f in sorted(model_dir.resolve().iterdir()):
        (snapshot / f.name).symlink_to(f)
    return HubCache(home, snapshot)


def build_hub_cache(home: Path) -> HubCache:
    from loraplex_engine.dev.tiny_model import build_model

    model_dir = build_model(_snapshot(home), arch="qwen3", chat="qwen3")
    # The tiny tokenizer spends a token on about a character, so a multi-turn recipe's
    # system prompt alone nears the built context (512); rotary positions have no learned
    # table, so the model runs longer sequences as they are.
    config = model_dir / "config.json"
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "max_position_embeddings": CONTEXT})
    )
    _add_think_tokens(model_dir)
    alias = _snapshot(home, QWEN3_5_ID)  # the same files under the name Qwen3.5's recipes use
    alias.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        (alias / f.name).symlink_to(f)
    return HubCache(home, model_dir)


def _add_think_tokens(model_dir: Path) -> None:
    """THINK_TOKENS appended to this copy's tokenizer (the earlier ids unchanged) and its
    embedding and output head grown to cover them (transformers' resize: the new rows at
    the mean of the others)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(THINK_TOKENS)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def cache_dataset(
    cache: HubCache, repo_id: str, config: str, splits: dict[str, list[dict[str, Any]]]
) -> None:
    """``datasets.load_dataset(repo_id, config)`` answers ``splits`` offline: the datasets
    cache's layout (``<org>___<name>/<config>/0.0.0/<hash>/<name>-<split>.arrow``, the name
    snake-cased the library's way: ``DeepMath-103K`` is ``deep_math-103_k``)."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    org, name = repo_id.split("/")
    name = camelcase_to_snakecase(name)
    out = cache.home / "datasets" / f"{org}___{name}" / config / "0.0.0" / "0"
    out.mkdir(parents=True)
    info = datasets.DatasetInfo(config_name=config, dataset_name=name)
    info.splits = datasets.SplitDict(dataset_name=name)
    for split, rows in splits.items():
        table = datasets.Dataset.from_list(rows).data.table
        with datasets.arrow_writer.ArrowWriter(path=str(out / f"{name}-{split}.arrow")) as w:
            w.write_table(table)
            count, size = w.finalize()
        info.features = datasets.Features.from_arrow_schema(table.schema)
        info.splits.add(datasets.SplitInfo(split, size, count, dataset_name=name))
    info.write_to_directory(str(out))


@dataclass(frozen=True)
class RecipeRun:
    returncode: int
    output: str
    metrics: list[dict[str, Any]]  # metrics.jsonl, one dict a step
    seconds: float


def recipe_command(module: str, args: list[str], log_path: Path) -> list[str]:
    return [sys.executable, "-m", module, *args, f"log_path={log_path}"]


def run_recipe(
    module: str,
    args: list[str],
    cache: HubCache,
    key: str,
    log_path: Path,
    timeout: float,
    fresh: bool = True,
) -> RecipeRun:
    """``python -m <module> <args> log_path=<log_path>`` to its end; ``fresh=False`` keeps
    what an earlier run left in ``log_path`` (the recipe resumes from it)."""
    import time

    if fresh and log_path.exists():
        shutil.rmtree(log_path)
    t0 = time.monotonic()
    proc = subprocess.run(
        recipe_command(module, args, log_path),
        env=cache.env(key),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=log_path.parent,
    )
    seconds = time.monotonic() - t0
    metrics_file = log_path / "metrics.jsonl"
    metrics = []
    if metrics_file.exists():
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
    return RecipeRun(proc.returncode, proc.stdout + proc.stderr, metrics, seconds)
