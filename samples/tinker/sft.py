"""Supervised fine-tuning and sampling with the official ``tinker`` SDK against a loraplex
engine (docs/tinker.md). Against `make demo`'s tiny model (random weights) it teaches the
model to answer two questions, then samples the answers from the published weights.

    loraplex-engine serve --model .cache/models/tiny-llama --tinker-keys keys.txt \\
        --insecure-no-auth --checkpoint-root out/tinker-ckpt --port 8000
    TINKER_API_KEY=tml-demo-0123456789abcdef python samples/tinker/sft.py --url http://127.0.0.1:8000

Options: ``--steps`` (default 40), ``--rank`` (8), ``--lr`` (0.005), ``--seed`` (0).
It prints the loss every 5 steps and the sampled answers; it exits 1 if an answer is not
the one taught (tests/engine/server/tinker/test_tinker_sample.py runs it against a real serve).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import tinker
from tinker import types

EXAMPLES = [
    ("What is the capital of France? Answer:", " Paris."),
    ("Say hello: ", "hello world"),
]


def datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    """Next-token prediction on the answer after the prompt: weight 0 on the prompt."""
    p = tokenizer.encode(prompt, add_special_tokens=False)
    a = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
    tokens = p + a
    weights = np.array([0.0] * (len(p) - 1) + [1.0] * len(a), dtype=np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], dtype=np.int64)),
            "weights": types.TensorData.from_numpy(weights),
        },
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    # The API key comes from TINKER_API_KEY (a line of the engine's --tinker-keys file).
    service = tinker.ServiceClient(base_url=args.url)
    caps = tinker.RestClient(base_url=args.url).get_server_capabilities().result()
    base = caps.supported_models[0].model_name  # the engine serves one base model
    print(f"base model: {base}")
    training = service.create_lora_training_client(
        base_model=base, rank=args.rank, seed=args.seed
    ).result()
    tokenizer = training.get_tokenizer()
    data = [datum(tokenizer, q, a) for q, a in EXAMPLES]
    weight = sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in data)

    adam = types.AdamParams(learning_rate=args.lr)
    for step in range(args.steps):
        # Both sent before either is awaited: the engine runs them in one tick.
        fb = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(adam)
        loss = fb.result().metrics["loss:sum"] / weight
        opt.result()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss per token {loss:.4f}")

    sampler = training.save_weights_and_get_sampling_client(name="sft-final").result()
    greedy = types.SamplingParams(max_tokens=16, temperature=0.0)
    ok = True
    for question, answer in EXAMPLES:
        prompt = types.ModelInput.from_ints(tokenizer.encode(question, add_special_tokens=False))
        seq = sampler.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
        text = tokenizer.decode(seq.tokens, skip_special_tokens=True)
        print(f"{question!r} -> {text!r} ({seq.stop_reason})")
        ok = ok and text == answer
    print(f"saved: {training.save_state('sft-final').result().path}")
    service.close("success").result()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
