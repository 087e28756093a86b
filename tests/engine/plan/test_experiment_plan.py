"""An experiment's spec compiled once against the engine's limits (plan/): the plan it
gives, every engine-side check with the field it names, and the rank checked in one place
only (the plan's limits; the model's own guard on the slots it sets stays beside it)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import loraplex_engine
import pytest
from loraplex_engine.lora.config import LoRAConfig
from loraplex_engine.plan.client import client_lora_config
from loraplex_engine.plan.experiment import ExperimentPlan, compile_plan, plan_problems
from loraplex_engine.plan.limits import EngineLimits
from loraplex_engine.spec.errors import InvalidRequestError, InvalidSpecError
from loraplex_engine.spec.experiment import parse_spec
from loraplex_engine.spec.publish import PublishSpec
from loraplex_engine.spec.training_service import ClientLora
from loraplex_engine.tenancy.work_limits import WorkLimits

PACKAGE = Path(loraplex_engine.__file__).parent
MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "lm_head"})
LIMITS = EngineLimits(8, MODULES, WorkLimits(100, 10_000, 512))
CLIENT = {"modelId": "s0123456789abcdef0123:train:0"}


def spec(**over: Any) -> Any:
    body: dict[str, Any] = {
        "lora": {"rank": 4, "alpha": 8},
        "task": {"name": "copy"},
        "algorithm": {"groupSize": 2, "promptsPerStep": 4, "learningRate": 0.01, "seed": 7},
        "rollout": {"maxNewTokens": 8},
    }
    return parse_spec({**body, **over})


def test_a_spec_compiles_to_the_plan_the_engine_builds_from() -> None:
    plan = compile_plan(spec(), LIMITS)
    assert isinstance(plan, ExperimentPlan)
    # No targetModules: the base model family's default (q_proj, v_proj here).
    assert plan.lora == LoRAConfig(4, 8.0, 0.0, ("q_proj", "v_proj"))
    assert (plan.optimizer.lr, plan.optimizer.weight_decay, plan.seed) == (0.01, 0.0, 7)
    assert plan.task is not None and plan.task.name == "copy"
    assert plan.client_lora is None and plan.publish is None
    assert plan.checkpoint.every_steps == plan.spec.checkpoint.every_steps
    assert plan.step_tokens == 8 * (100 + 8)  # rows x (prompt limit + maxNewTokens)
    with pytest.raises(AttributeError):
        plan.seed = 3  # type: ignore[misc]  # frozen


def test_named_target_modules_are_kept() -> None:
    plan = compile_plan(spec(lora={"rank": 4, "targetModules": ["o_proj", "q_proj"]}), LIMITS)
    assert plan.lora.target_modules == ("o_proj", "q_proj")


@pytest.mark.parametrize(
    ("over", "limits", "field", "message"),
    [
        (
            {"lora": {"rank": 16}},
            LIMITS,
            "spec.lora.rank",
            "rank 16 exceeds the engine's max rank 8",
        ),
        (
            {"lora": {"rank": 4, "targetModules": ["q_proj", "w_proj"]}},
            LIMITS,
            "spec.lora.targetModules",
            "unknown target modules ['w_proj']",
        ),
        ({}, EngineLimits(8, frozenset({"fc1"})), "spec.lora.targetModules", "neither q_proj"),
        (
            {"task": {"name": "copy", "params": {"lenght": "3"}}},
            LIMITS,
            "spec.task.params.lenght",
            "",
        ),
        (
            {},
            EngineLimits(8, MODULES, WorkLimits(100, 863, 512)),
            "spec.algorithm.promptsPerStep",
            "864 tokens per step exceeds this engine's limit of 863",
        ),
    ],
)
def test_each_engine_side_check_names_its_field(over, limits, field, message) -> None:
    with pytest.raises(InvalidSpecError) as e:
        compile_plan(spec(**over), limits)
    assert e.value.field == field
    assert message in e.value.message


def test_every_problem_is_listed_for_the_local_runner() -> None:
    bad = spec(lora={"rank": 16}, task={"name": "copy", "params": {"lenght": "3"}})
    fields = [e.field for e in plan_problems(bad, EngineLimits(8))]  # modules not known
    assert fields == ["spec.lora.rank", "spec.task.params.lenght"]
    assert plan_problems(spec(lora={"rank": 4, "targetModules": ["nope"]}), EngineLimits(8)) == []


def test_a_client_spec_gets_the_adapter_a_tinker_client_would() -> None:
    s = parse_spec({"lora": {"rank": 4}, "client": {**CLIENT, "seed": 3, "trainMlp": False}})
    plan = compile_plan(s, LIMITS)
    assert plan.client_lora == ClientLora(4, 3, True, False, True)
    config, _ = client_lora_config(ClientLora(4, 3, True, False, True), LIMITS)
    assert plan.lora == config and plan.task is None and plan.step_tokens is None
    off = {**CLIENT, "trainAttn": False, "trainMlp": False, "trainUnembed": False}
    with pytest.raises(InvalidSpecError) as e:
        compile_plan(parse_spec({"lora": {"rank": 4}, "client": off}), LIMITS)
    assert e.value.field == "spec.client"


def test_a_client_lora_config_over_the_max_rank_names_its_field() -> None:
    with pytest.raises(InvalidRequestError) as e:
        client_lora_config(ClientLora(rank=64), LIMITS)
    assert e.value.field == "lora_config.rank"
    assert e.value.message == "rank 64 exceeds the engine's max rank 8"


def test_a_new_publish_block_changes_the_plan_and_its_spec() -> None:
    plan = compile_plan(spec(), LIMITS)
    publish = PublishSpec.model_validate({"everySteps": 5})
    again = plan.republished(publish)
    assert again.publish == again.spec.publish == publish and plan.publish is None


def rank_comparisons(path: Path) -> list[int]:
    """Lines of ``path`` comparing a rank (``rank``, ``x.rank``) with a max rank."""

    def names(node: ast.AST) -> set[str]:
        return {
            n.attr if isinstance(n, ast.Attribute) else n.id
            for n in ast.walk(node)
            if isinstance(n, ast.Attribute | ast.Name)
        }

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            sides = [names(o) for o in operands]
            if any("rank" in s for s in sides) and any("max_rank" in s for s in sides):
                found.append(node.lineno)
    return found


def test_the_rank_is_checked_against_the_max_rank_in_one_place() -> None:
    where = {
        p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if rank_comparisons(p)
    }
    # plan/limits.py checks every spec and client lora_config; lora/model.py is the model's
    # own guard on each slot it sets (a restored checkpoint's too), not a spec check.
    assert where == {"plan/limits.py", "lora/model.py"}


def test_the_rank_finder_finds_a_comparison(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f(spec, max_rank):\n    if spec.lora.rank > max_rank:\n        pass\n")
    assert rank_comparisons(probe) == [2]
