"""Published versions on a real engine (tiny model, torch rollout): a continual experiment
publishes on its policy, its aliases follow the spec and the gate, a version is served
token for token as peft serves its directory, and a resumed experiment continues the
sequence."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex_engine.spec.errors import NotFoundError
from loraplex_engine.spec.service import PromptJob
from loraplex_engine.store.versions import VersionStore
from peft import PeftModel
from safetensors.torch import load_file

from tests.support.engine_builders import engine, spec
from tests.support.lora_helpers import load_base

NS = "team"
PROMPT = "the answer is"


def _continual(publish: dict[str, Any], **kw: Any):
    kw.setdefault("every", 100)  # checkpoints
    return spec(steps=0, publish=publish, **kw)


def _ticks(eng, n: int) -> None:
    for _ in range(n):
        eng.tick()


def _complete(eng, model: str, max_tokens: int = 6) -> list[int]:
    """One greedy completion, served by the next tick (the caller ticks)."""
    out: list[list[int]] = []
    errors: list[Exception] = []

    def ask() -> None:
        try:
            rows = eng.complete(PromptJob(model, eng.tokenize(PROMPT), max_tokens, 0.0))
            out.append(rows[0].token_ids)
        except Exception as e:
            errors.append(e)

    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    while worker.is_alive():
        eng.tick()
        worker.join(timeout=0.05)
    if errors:
        raise errors[0]
    return out[0]


def _peft_greedy(model_dir: Path, version_dir: Path, prompt_ids: list[int], n: int) -> list[int]:
    peft = PeftModel.from_pretrained(load_base(model_dir), version_dir).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = peft.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def eng(tiny_model_dir, root):
    e = engine(tiny_model_dir, root, max_adapters=6)  # 4 experiments + spare slots
    yield e
    e.close()


def test_a_continual_experiment_publishes_and_serves_its_versions(
    eng, tiny_model_dir, root
) -> None:
    status, _ = eng.put_experiment(f"{NS}.pub", _continual({"everySteps": 2, "keep": 3}), NS, "pub")
    _ticks(eng, 8)
    status = eng.get_experiment(f"{NS}.pub")
    assert status.phase == "Running" and status.step >= 8
    store = VersionStore(root)
    listed = store.list(NS, "pub")
    assert len(listed) == 3 and listed[-1] == status.step // 2  # keep 3 of v1..v4+
    assert [v.version for v in status.versions] == [f"v{n}" for n in listed]
    assert status.aliases == {"latest": f"v{listed[-1]}"}
    newest = store.read(NS, "pub", listed[-1], verify=True)
    assert newest.parent == listed[-2] and newest.step == 2 * listed[-1]
    assert newest.base_model_hash.startswith("sha256:") and "meanReward" in newest.scores
    assert newest.experiment == f"{NS}.pub" and newest.run_id == status.run_id

    weights = load_file(store.path(NS, "pub", listed[0]) / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for k, t in weights.items() if "lora_B" in k)  # it trained
    # Served: @v<N> and :latest, token for token as peft serves the directory.
    prompt_ids = eng.tokenize(PROMPT)
    for model, n in ((f"{NS}.pub@v{listed[0]}", listed[0]), (f"{NS}.pub:latest", listed[-1])):
        served = _complete(eng, model)
        expected = _peft_greedy(tiny_model_dir, store.path(NS, "pub", n), prompt_ids, len(served))
        assert served == expected, model
    slots = len(eng.model.adapters())
    # The served versions stay resident in spare slots (versions/slot_cache.py), each
    # under its content hash, and give their slots back when asked.
    resident = [a for a in eng.model.adapters() if "@" in a]
    assert sorted(resident) == sorted(eng.publisher.slots.resident())
    assert {a.partition("#")[0] for a in resident} == {f"{NS}.pub@v{listed[0]}",
                                                       f"{NS}.pub@v{listed[-1]}"}  # fmt: skip
    with pytest.raises(NotFoundError, match="no alias"):
        eng.complete(PromptJob(f"{NS}.pub:stable", prompt_ids, 4, 0.0))
    with pytest.raises(NotFoundError, match="no version v99"):
        eng.complete(PromptJob(f"{NS}.pub@v99", prompt_ids, 4, 0.0))
    assert len(eng.model.adapters()) == slots


def test_the_gate_promotion_and_rollback(eng) -> None:
    exp_id = f"{NS}.gated"
    passing = {"everySteps": 1, "keep": 10, "promoteWhen": {"atLeast": -1.0}}
    eng.put_experiment(exp_id, _continual(passing), NS, "gated")
    _ticks(eng, 2)
    s = eng.get_experiment(exp_id)
    assert s.aliases["stable"] == s.aliases["latest"] == f"v{len(s.versions)}"
    good = s.aliases["stable"]
    # A gate no version can pass: new versions publish, stable stays.
    failing = {**passing, "promoteWhen": {"atLeast": 5.0}}
    status, created = eng.put_experiment(exp_id, _continual(failing), NS, "gated")
    assert not created and status.step == s.step  # applied in place, not restarted
    _ticks(eng, 2)
    s = eng.get_experiment(exp_id)
    failed = s.versions[-1]
    assert failed.gate_passed is False and s.aliases["stable"] == good
    assert s.aliases["latest"] == failed.version
    # By hand: a failed version never becomes stable; a canary may point at it.
    by_hand = {**failing, "aliases": [{"name": "stable", "version": failed.version},
                                      {"name": "canary", "version": failed.version}]}  # fmt: skip
    eng.put_experiment(exp_id, _continual(by_hand), NS, "gated")
    s = eng.get_experiment(exp_id)
    assert s.aliases["stable"] == good and s.aliases["canary"] == failed.version
    assert s.publish_error and "failed its promotion gate" in s.publish_error
    # Rollback by hand to the first version; then the spec lets go of stable again.
    rollback = {**failing, "aliases": [{"name": "stable", "version": "v1"}]}
    eng.put_experiment(exp_id, _continual(rollback), NS, "gated")
    s = eng.get_experiment(exp_id)
    assert s.aliases == {"latest": failed.version, "stable": "v1"}  # canary gone with the spec
    assert s.publish_error is None


def test_publish_by_hand_and_a_resumed_experiment_continues_the_sequence(
    tiny_model_dir, tmp_path
) -> None:
    first = engine(tiny_model_dir, tmp_path)
    try:
        exp_id = f"{NS}.resumed"
        put = _continual({"keep": 5}, every=2)  # no everySteps: by hand only
        first.put_experiment(exp_id, put, NS, "resumed", run_id="run-a")
        _ticks(first, 2)
        assert first.get_experiment(exp_id).versions == []
        v1 = first.publish_version(exp_id)
        v2 = first.publish_version(exp_id)
        assert (v1.version, v2.version) == ("v1", "v2")
    finally:
        first.close()  # as if killed: no unload, no final checkpoint
    again = engine(tiny_model_dir, tmp_path)
    try:
        status, created = again.put_experiment(exp_id, put, NS, "resumed", run_id="run-a")
        assert created and status.step == 2 and status.aliases == {"latest": "v2"}
        v3 = again.publish_version(exp_id)
        assert v3.version == "v3"
        assert VersionStore(tmp_path).read(NS, "resumed", 3).parent == 2
    finally:
        again.close()


def test_a_quota_refusal_fails_the_publish_not_the_experiment(tiny_model_dir, tmp_path) -> None:
    eng = engine(tiny_model_dir, tmp_path, checkpoint_quota_bytes=1)
    try:
        exp_id = f"{NS}.tight"
        eng.put_experiment(exp_id, _continual({"everySteps": 1}), NS, "tight")
        _ticks(eng, 1)
        s = eng.get_experiment(exp_id)
        assert s.phase == "Running" and s.versions == []
        assert s.publish_error and "quota" in s.publish_error
    finally:
        eng.close()


def test_the_publish_route_edits_in_place(eng) -> None:
    from loraplex_engine.spec.publish import PublishSpec

    exp_id = f"{NS}.edited"
    eng.put_experiment(exp_id, _continual({"everySteps": 1}), NS, "edited")
    _ticks(eng, 2)
    before = eng.get_experiment(exp_id)
    assert before.publish == {"everySteps": 1, "keep": 5, "pinned": [], "aliases": []}
    pin = PublishSpec.model_validate(
        {"everySteps": 1, "aliases": [{"name": "mine", "version": "v1"}]}
    )
    after = eng.update_publish(exp_id, pin)
    assert after.aliases["mine"] == "v1" and after.step == before.step
    assert after.publish is not None and after.publish["aliases"] == [
        {"name": "mine", "version": "v1"}
    ]
    assert eng.update_publish(exp_id, None).publish is None
    _ticks(eng, 1)  # no policy now: nothing more is published
    assert len(eng.get_experiment(exp_id).versions) == len(after.versions)


def _peft_logprobs(model_dir: Path, version_dir: Path | None, prompt: list[int],
                   tokens: list[int]) -> list[float]:  # fmt: skip
    """Each of ``tokens``' log-prob after ``prompt`` (teacher forced) under peft on a
    version's directory (None: the base model)."""
    model = load_base(model_dir)
    if version_dir is not None:
        model = PeftModel.from_pretrained(model, version_dir)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model.eval()(ids).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])
    return picked[:, 0].tolist()


def test_tinker_sampling_serves_a_version(eng, tiny_model_dir, root) -> None:
    """The rows ride a training tick's mixed batch, so on this random tiny model (flat,
    near-tied logits) the greedy tokens can differ from a lone row's; what must hold is
    that they were sampled with the version's weights: their log-probs are peft's on the
    version's directory (fp32, batch rounding ~1e-6), far from the base model's."""
    from loraplex_engine.spec.training_service import SampleCall

    from tests.support.client_driver import drive

    exp_id = f"{NS}.tink"
    eng.put_experiment(exp_id, _continual({"everySteps": 1, "keep": 50}), NS, "tink")
    _ticks(eng, 3)
    prompt = eng.tokenize(PROMPT)
    call = SampleCall(prompt, max_tokens=6, temperature=0.0)
    before = eng.model.adapters()
    slots = len(before)
    for model, n in ((f"{exp_id}@v2", 2), (f"{exp_id}:latest", None)):
        # an alias resolves when the call is queued: before the ticks that publish more
        n = n or int(eng.get_experiment(exp_id).aliases["latest"][1:])
        (sampled,) = drive(eng, lambda m=model: eng.clients.sample(NS, m, call))
        row = sampled.rows[0]
        version_dir = VersionStore(root).path(NS, "tink", n)
        want = _peft_logprobs(tiny_model_dir, version_dir, prompt, row.token_ids)
        base = _peft_logprobs(tiny_model_dir, None, prompt, row.token_ids)
        assert row.logprobs == pytest.approx(want, abs=1e-4), model
        assert max(abs(a - b) for a, b in zip(want, base, strict=True)) > 1e-3
    # the versions stay resident (versions/slot_cache.py): v2 and latest's, no more
    assert len(eng.model.adapters()) <= slots + 2
    assert all("@" in a for a in set(eng.model.adapters()) - set(before))
    with pytest.raises(NotFoundError, match="namespace 'other'"):
        eng.clients.sample("other", f"{exp_id}@v1", call)  # another tenant's version: not found


def test_the_latest_version_series(eng) -> None:
    """loraplex_engine_latest_version (the dashboard's version marks) follows latest."""
    import re

    from loraplex_engine.metrics import EngineMetrics

    metrics = EngineMetrics()
    metrics.sync_experiments(eng.list_experiments())
    text = metrics.render().decode()
    latest = eng.get_experiment(f"{NS}.pub").aliases["latest"]
    found = re.search(
        r'^loraplex_engine_latest_version\{experiment="team.pub",namespace="team"\} (\S+)$',
        text,
        re.M,
    )
    assert found and float(found.group(1)) == int(latest[1:])
