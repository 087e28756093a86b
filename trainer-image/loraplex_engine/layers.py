"""The engine's layers, as data: every folder (and root module) of the package, bottom to
top. A module may import only from its own folder and from those listed before it (a
function's own import counts; one under ``if TYPE_CHECKING:`` does not, as it runs
never). tests/engine/test_layers.py holds every import to this order and checks
docs/architecture.md's table against it; nothing imports this module.

Within a layer the order is the allowed direction too: ``tasks`` may import ``data``,
never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layer:
    name: str
    why: str  # what the layer is for, one line (the docs' table)
    folders: tuple[tuple[str, str], ...]  # (folder or root module, what it holds), bottom up


LAYERS: tuple[Layer, ...] = (
    Layer(
        "contract",
        "what every layer may import, importing none of them: no torch, no concern",
        (
            ("layers", "this order"),
            ("spec", "the LoRAExperiment spec and its blocks, API types, errors, services"),
            ("logs", "structured logs"),
            ("settings", "the engine's settings: one typed definition of every flag"),
        ),
    ),
    Layer(
        "model",
        "one frozen base model with many LoRA slots",
        (
            ("lora", "multi-LoRA layers, routing, the wrapped model, precision"),
            ("tokens", "the tokenizer's codec"),
            ("base_model", "a base model directory, read before its weights load"),
        ),
    ),
    Layer(
        "concerns",
        "one job each, importing the contract, the model and the concerns before them",
        (
            ("tenancy", "trust and egress, data files, reward exchanges, limits, admissions"),
            ("data", "datasets: sources, openers, formats, the bounded reader, the spool"),
            ("tasks", "prompts, answers and rewards; the GSM8K generator"),
            ("plugins", "installed plug-ins: discovery, the host of a worker, rewards"),
            ("rollout", "sampling: the torch backend, the vLLM backend and worker"),
            ("train", "the update: rows, the fused step, losses, optimiser"),
            ("environments", "multi-turn episodes, the plug-in worker, attaching plug-ins"),
            ("workloads", "first-party plug-ins: math reward, calculator environment"),
            ("evaluation", "spec.eval's eval set and its rows in the tick"),
            ("memory", "what fits: the planner and the engine's own plan"),
            ("parallel", "ranks: data parallel, the sharded base, lockstep, launch"),
            ("tracking", "step metrics to MLflow, W&B and TensorBoard"),
            ("plan", "a spec compiled against the engine: every engine-side check, once"),
            ("experiment", "one loaded experiment, built from its plan"),
            ("store", "runs and checkpoints on disk"),
            ("versions", "published adapter versions: policy, publisher, names, slots"),
            ("completion_jobs", "completion requests as queued rollout rows"),
            ("clients", "models a client trains itself (Tinker)"),
            ("dev", "the tiny model, GGUF import, the time-sliced arm: only on request"),
        ),
    ),
    Layer(
        "core",
        "composes the concerns: one engine, its tick",
        (
            ("tick", "one step of every experiment, pipelined or not; fair and time share"),
            ("metrics", "Prometheus metrics"),
            ("engine", "the Engine: every part composed"),
        ),
    ),
    Layer(
        "http",
        "the engine's HTTP API over the EngineService",
        (("server", "the app, OpenAI and Tinker protocols, serve and its ranks"),),
    ),
    Layer(
        "entry",
        "command lines",
        (
            ("local", "`loraplex-engine run`: manifests on one local engine"),
            ("cli", "`loraplex-engine`: serve, run, plan"),
        ),
    ),
)


def order() -> dict[str, int]:
    """Each folder's rank, bottom 0: an import may only go to a lower rank."""
    names = [name for layer in LAYERS for name, _ in layer.folders]
    return {name: i for i, name in enumerate(names)}


def layer_of() -> dict[str, str]:
    return {name: layer.name for layer in LAYERS for name, _ in layer.folders}
