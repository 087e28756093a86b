from pathlib import Path

import pytest
from loraplex_engine.local.manifests import load_manifests, parse_manifests
from loraplex_engine.spec.errors import ManifestError
from loraplex_engine.tasks import JsonlTask, build_task

REPO = Path(__file__).resolve().parents[3]

GOOD = """
apiVersion: loraplex.dev/v1alpha1
kind: LoRAExperiment
metadata: {name: exp1, namespace: team-a}
spec:
  task: {name: copy}
---
apiVersion: loraplex.dev/v1alpha1
kind: LoRAExperiment
metadata: {name: exp2}
spec:
  lora: {rank: 4}
  task: {name: target-token, params: {target: "no"}}
---
"""


def doc(body: str, name: str = "bad") -> str:
    return (
        f"apiVersion: loraplex.dev/v1alpha1\nkind: LoRAExperiment\n"
        f"metadata: {{name: {name}}}\n{body}"
    )


def test_good_manifests_parse_in_order() -> None:
    out = parse_manifests(GOOD)
    assert [m.id for m in out] == ["team-a.exp1", "default.exp2"]
    assert out[1].spec.lora.rank == 4 and out[1].spec.task.params == {"target": "no"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (doc("spec:\n  task: {name: chess}"), "document 0 ('bad'): spec.task.name:"),
        (doc("spec:\n  lora: {rank: 300}\n  task: {name: copy}"), "spec.lora.rank:"),
        (doc("spec:\n  lora: {rnak: 3}\n  task: {name: copy}"), "spec.lora.rnak: unknown field"),
        (doc("spec: {}"), "spec.task: set exactly one of spec.task"),
        (doc("spec:\n  client: {modelId: 's1:train:0'}"), "spec.client: the local runner trains"),
        (doc(""), "document 0 ('bad'): spec: required"),
        (doc("spec:\n  task: {name: copy, params: {lenght: '3'}}"), "spec.task.params.lenght"),
        (GOOD.replace("kind: LoRAExperiment", "kind: EnginePool", 1), "document 0 ('exp1'): kind"),
        (GOOD.replace("v1alpha1", "v2", 1), "apiVersion: must be loraplex.dev/v1alpha1"),
        (doc("spec:\n  task: {name: copy}", name="Bad_Name"), "metadata.name: must be"),
        ("kind: LoRAExperiment\napiVersion: loraplex.dev/v1alpha1\nspec: {}", "metadata"),
        ("- 1\n- 2", "document 0: (document): must be a mapping"),
        ("a: [1,", "invalid YAML"),
        ("", "no documents"),
    ],
)
def test_bad_documents_are_rejected_naming_document_and_field(text: str, expected: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifests(text)
    assert expected in str(info.value)


def test_engine_limits_checked_up_front() -> None:
    with pytest.raises(
        ManifestError, match=r"document 1 \('exp2'\): spec.lora.rank: rank 4 exceeds"
    ):
        parse_manifests(GOOD.replace("exp1, namespace: team-a", "exp1"), max_rank=2)
    with pytest.raises(ManifestError, match=r"spec\.lora\.targetModules"):
        parse_manifests(GOOD, known_modules=["q_proj"])


def test_duplicates_and_all_problems_reported_together() -> None:
    text = GOOD + GOOD.replace("team-a", "team-b") + doc("spec:\n  task: {name: chess}")
    with pytest.raises(ManifestError) as info:
        parse_manifests(text, source="x.yaml")
    problems = info.value.problems
    assert len(problems) == 2
    assert "document 3 ('exp2'): metadata.name: duplicate 'default.exp2'" in problems[0]
    assert "document 4 ('bad')" in problems[1]
    assert str(info.value).startswith("x.yaml: 2 problem(s)")


def test_demo_sample_is_valid() -> None:
    out = load_manifests(REPO / "samples" / "local" / "demo.yaml", max_rank=64)
    assert len(out) == 4
    assert len({m.spec.algorithm.learning_rate for m in out}) > 1
    assert len({m.spec.algorithm.seed for m in out}) == 4
    assert {m.spec.engine_pool for m in out} == {"local"}
    assert sum(m.spec.task.name == "target-token" for m in out) >= 2


def test_smollm2_demo_sample_is_valid_and_its_dataset_loads() -> None:
    path = REPO / "samples" / "local" / "demo-smollm2.yaml"
    out = load_manifests(path, max_rank=64)
    assert [m.name for m in out] == ["short-reply", "say-yes"]
    assert all(m.spec.task.chat_template for m in out)  # an instruct model: its own turns
    assert len({m.spec.algorithm.seed for m in out}) == 2
    yes = next(m for m in out if m.name == "say-yes").spec.task
    task = build_task(yes.name, yes.params, str(path.parent / yes.dataset), yes.reward)
    assert isinstance(task, JsonlTask)
    rows = [task.row(i) for i in range(len(task))]
    assert len(rows) == 12 and {r.answer for r in rows} == {"Yes"}
    assert task.reward(rows[0], "Yes") == 1.0
    assert task.reward(rows[0], "Yes, it is.") < 0.5


def test_gsm8k_sample_is_valid_and_its_rows_score() -> None:
    """samples/local/gsm8k-smollm2.yaml: the three ways into the GSM8K workload, and its
    GSM8K-format rows read through the columns it maps, scored by the gsm8k answer."""
    from loraplex_engine.tasks.math_answer import number_matches

    path = REPO / "samples" / "local" / "gsm8k-smollm2.yaml"
    out = load_manifests(path, max_rank=64)
    assert [m.name for m in out] == ["gsm8k-easy", "gsm8k-calculator", "gsm8k-rows"]
    easy, calc, rows = (m.spec.task for m in out)
    assert easy.reward == "math-verify" and calc.environment is not None
    assert calc.environment.name == "gsm8k-calculator"
    columns = rows.dataset_options.columns
    assert rows.dataset is not None
    task = JsonlTask(path.parent / rows.dataset, columns=(columns.prompt, columns.answer))
    first = task.row(0)
    assert first.text.endswith("have now?") and "\n#### " in first.answer
    assert number_matches("#### " + first.answer.rsplit("#### ", 1)[1], first.answer)


def test_gsm8k_learning_sample_is_valid() -> None:
    path = REPO / "samples" / "local" / "gsm8k-smollm2-learn.yaml"
    (m,) = load_manifests(path, max_rank=64)
    assert m.spec.task.name == "gsm8k" and m.spec.task.reward == "math-verify"
    assert m.spec.evaluation is not None and m.spec.evaluation.temperature == 0.0
