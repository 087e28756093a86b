from pathlib import Path

import pytest
from loraplex_engine.dev.tiny_model import PRESETS, build_model
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tiny_model_loads_and_tokenizes_task_text(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer("12 + 7 = 19").input_ids
    assert tokenizer.decode(ids) == "12 + 7 = 19"
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = AutoModelForCausalLM.from_pretrained(build_model(tmp_path / "a"))
    b = AutoModelForCausalLM.from_pretrained(build_model(tmp_path / "b"))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pa.equal(pb), name


def test_unknown_preset_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        build_model(tmp_path, preset="huge")


def test_the_tiny_model_ships_a_chat_template(tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(build_model(tmp_path / "chat"))
    text = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<s>system: be brief\nuser: hi\nassistant:"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_has_a_head_size_vllm_cpu_serves(name: str) -> None:
    # The adapters `make demo` writes must load into vLLM on this CPU (README).
    from loraplex_engine.rollout.vllm.worker_env import CPU_HEAD_SIZES

    preset = PRESETS[name]
    assert preset.hidden_size // preset.num_attention_heads in CPU_HEAD_SIZES


def test_unknown_arch_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        build_model(tmp_path, arch="gpt2")


def test_the_qwen3_chat_model_speaks_the_cookbook_qwen3_instruct_renderer(tmp_path: Path) -> None:
    # tinker-cookbook's own renderer (the recipes' tokens), on the tiny model's tokenizer:
    # <|im_start|>/<|im_end|> one token each, and the same text as the model's template.
    from tinker_cookbook import renderers

    model_dir = build_model(tmp_path / "qwen3", arch="qwen3", chat="qwen3")
    tok = AutoTokenizer.from_pretrained(model_dir)
    plain = AutoTokenizer.from_pretrained(build_model(tmp_path / "plain", arch="qwen3"))
    renderer = renderers.get_renderer("qwen3_instruct", tok)
    messages = [{"role": "user", "content": "say yes"}, {"role": "assistant", "content": "yes"}]
    prompt = renderer.build_generation_prompt(messages[:1])
    assert tok.decode(prompt.to_ints()) == tok.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True
    )
    assert renderer.get_stop_sequences() == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert tok.eos_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.vocab_size == len(tok) == len(plain) + 2
    # the base vocabulary keeps its ids: the two markers come after it
    assert tok("12 + 7 = 19").input_ids == plain("12 + 7 = 19").input_ids


def test_unknown_chat_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown chat 'chatml'"):
        build_model(tmp_path, chat="chatml")
