"""The typed boundary between HTTP and engine (issue 25 item 4).

The HTTP layer (server/ but for the process start-up, serve.py, and its flags) depends on
the wire types, the errors and the service protocol (spec/service.py) alone: no torch, no
engine internals. Proved at run time (a process that cannot import them builds the app
and serves every kind of route) and from the source (every import, a function's own
included, so a rarely taken branch cannot cross it either). And a request that only needs
the model's name does not compute the capacity answer (memory, CUDA, the memory plan).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fastapi.testclient import TestClient
from loraplex_engine.server.app import create_app

from tests.support.app_client import AUTH, TOKEN, put
from tests.support.fake_engine import FakeEngine

PACKAGE = Path(__file__).resolve().parents[3] / "trainer-image" / "loraplex_engine"
STARTUP = {"serve", "serve_ranks", "flags"}  # process start-up: may import both sides
HTTP_MODULES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
    for p in [*PACKAGE.glob("server/*.py"), *PACKAGE.glob("server/openai/*.py")]
    if p.stem not in STARTUP | {"__init__"}
)
# What the HTTP layer may reach of the engine package (packages' __init__ run too).
ALLOWED = {
    "loraplex_engine",
    "loraplex_engine.server",
    "loraplex_engine.server.openai",
    *HTTP_MODULES,
    "loraplex_engine.spec",  # the contract (layers.py): imports no other layer
    "loraplex_engine.spec.service",  # the protocol and the served-completion values
    "loraplex_engine.spec.api_types",  # status, capacity, checkpoint: the wire types
    "loraplex_engine.spec.experiment",  # the PUT body's spec
    "loraplex_engine.spec.schema",
    "loraplex_engine.spec.checkpoint",  # the spec's blocks in their own modules
    "loraplex_engine.spec.client",
    "loraplex_engine.spec.algorithm",
    "loraplex_engine.spec.tracking",
    "loraplex_engine.spec.plugins",
    "loraplex_engine.spec.params",  # the params' bounds (pydantic only)
    "loraplex_engine.spec.echo",  # a bounded prefix of a tenant's text in a message
    "loraplex_engine.spec.tinker_limits",  # the Tinker door's default bounds
    "loraplex_engine.spec.data_options",  # task.datasetOptions
    "loraplex_engine.spec.eval",  # the spec's eval block
    "loraplex_engine.spec.eval_scores",
    "loraplex_engine.spec.publish",  # the spec's publish block
    "loraplex_engine.spec.errors",
    "loraplex_engine.metrics",
    # app.py mounts the Tinker routes only given --tinker-keys; their own boundary
    # (numpy and the SDK's protobuf allowed, still no torch) is checked below.
    "loraplex_engine.server.tinker",
    "loraplex_engine.server.tinker.routes",
}
BLOCKED = {"torch", "transformers", "vllm", "safetensors", "peft", "numpy"}

# The Tinker protocol (server/tinker/, mounted by app.py only with --tinker-keys) is HTTP-side
# too: its arrays cross as numpy (spec/training_service.py) and its wire is the tinker SDK's
# protobuf, but it reaches no torch and no engine internal either.
TINKER_MODULES = sorted(
    ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
    for p in PACKAGE.glob("server/tinker/*.py")
)
# versions/names.py: the version model names a sampler may take (pure parsing).
TINKER_ALLOWED = ALLOWED | {
    *TINKER_MODULES,
    "loraplex_engine.spec.training_service",
    "loraplex_engine.spec.tinker_paths",  # tinker:// paths and reserved names (pure)
    "loraplex_engine.versions",
    "loraplex_engine.versions.names",
}
TINKER_BLOCKED = BLOCKED - {"numpy"}

# Runs in a fresh interpreter where importing torch or an engine internal raises.
SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, json, sys

    allowed, blocked, HTTP_MODULES = json.loads(sys.argv[1])
    ALLOWED, BLOCKED = set(allowed), set(blocked)

    class Boundary(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in BLOCKED or (top == "loraplex_engine" and name not in ALLOWED):
                raise ImportError(f"the HTTP layer imported {name}")
            return None

    sys.meta_path.insert(0, Boundary())
    for name in HTTP_MODULES:
        importlib.import_module(name)

    from fastapi.testclient import TestClient
    from loraplex_engine.spec.api_types import Capacity, MemoryUse
    from loraplex_engine.spec.errors import NotFoundError
    from loraplex_engine.server.app import create_app
    from loraplex_engine.spec.service import ServedRow

    class Engine:
        model_name = "base"
        context_tokens = 64

        def is_ready(self): return True
        def list_experiments(self): return []
        def get_experiment(self, exp_id): raise NotFoundError(f"no experiment {exp_id}")
        def tokenize(self, prompt):
            return [ord(c) for c in prompt] if isinstance(prompt, str) else list(prompt)
        def detokenize(self, ids): return "".join(map(chr, ids))
        def chat_prompt(self, messages): return self.tokenize(messages[-1]["content"])
        def capacity(self):
            return Capacity(model="base", rollout_backend="torch", max_adapters=1,
                            max_rank=8, dtype="float32", gradient_checkpointing=False,
                            used_slots=0, experiments=[],
                            memory=MemoryUse(rss_bytes=1, device_bytes=0))
        def complete(self, job):
            ids = self.tokenize("ok, done")
            for row in range(job.n):  # half streamed as decoded, the rest in the answer
                for t in ids[:4]:
                    if job.on_token is not None:
                        job.on_token(row, t, -0.5, {t: -0.5} if job.top_logprobs else None)
            top = [{t: -0.5} for t in ids] if job.top_logprobs else None
            return [ServedRow(ids, [-0.5] * len(ids), top, "stop") for _ in range(job.n)]

    client = TestClient(create_app(Engine(), None), raise_server_exceptions=False)
    text = {"model": "base", "prompt": "hi", "n": 2, "logprobs": 1, "stop": ["done"]}
    chat = {"model": "base", "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True, "top_logprobs": 1}
    include = {"stream": True, "stream_options": {"include_usage": True}}
    for method, path, body, status in [
        ("GET", "/v1/models", None, 200),
        ("GET", "/v1/models/base", None, 200),
        ("GET", "/v1/models/gone", None, 404),
        ("GET", "/v1/capacity", None, 200),
        ("GET", "/metrics", None, 200),
        ("POST", "/v1/completions", text, 200),
        ("POST", "/v1/completions", {**text, **include}, 200),
        ("POST", "/v1/completions", {**text, "model": "gone"}, 404),
        ("POST", "/v1/chat/completions", chat, 200),
        ("POST", "/v1/chat/completions", {**chat, **include}, 200),
        ("PUT", "/v1/experiments/default.a", {"name": "a", "spec": {}}, 422),
    ]:
        r = client.request(method, path, json=body)
        assert r.status_code == status, (path, r.status_code, r.text)
    assert not BLOCKED & {m.partition(".")[0] for m in sys.modules}
    print("served")
    """
)


def test_the_http_layer_serves_without_torch_or_engine_internals() -> None:
    import json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), *sys.path])}
    args = json.dumps([sorted(ALLOWED), sorted(BLOCKED), HTTP_MODULES])
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, args], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "served", r.stderr[-3000:]


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (``from a import b``: a and a.b)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_no_import_in_the_http_source_crosses_the_boundary() -> None:
    crossing = {}
    for name in HTTP_MODULES:
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        found = imports_of(path)
        engine = {m for m in found if m.startswith("loraplex_engine.")}
        # ``from loraplex_engine.x import Name``: the module is checked, not the name.
        engine = {m for m in engine if m in ALLOWED or m.rpartition(".")[0] not in ALLOWED}
        bad = {m for m in found if m.partition(".")[0] in BLOCKED} | (engine - ALLOWED)
        if bad:
            crossing[name] = sorted(bad)
    assert crossing == {}


TINKER_SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, json, sys

    allowed, blocked, modules = json.loads(sys.argv[1])
    ALLOWED, BLOCKED = set(allowed), set(blocked)

    class Boundary(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in BLOCKED or (top == "loraplex_engine" and name not in ALLOWED):
                raise ImportError(f"the Tinker layer imported {name}")
            return None

    sys.meta_path.insert(0, Boundary())
    for name in modules:
        importlib.import_module(name)
    assert not BLOCKED & {m.partition(".")[0] for m in sys.modules}
    print("imported")
    """
)


def test_the_tinker_layer_imports_without_torch_or_engine_internals() -> None:
    import json

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), *sys.path])}
    args = json.dumps([sorted(TINKER_ALLOWED), sorted(TINKER_BLOCKED), TINKER_MODULES])
    r = subprocess.run(
        [sys.executable, "-c", TINKER_SCRIPT, args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "imported", r.stderr[-3000:]


def test_no_import_in_the_tinker_source_crosses_the_boundary() -> None:
    assert "loraplex_engine.server.tinker.routes" in TINKER_MODULES
    crossing = {}
    for name in TINKER_MODULES:
        found = imports_of(PACKAGE.parent / (name.replace(".", "/") + ".py"))
        engine = {m for m in found if m.startswith("loraplex_engine.")}
        engine = {
            m for m in engine if m in TINKER_ALLOWED or m.rpartition(".")[0] not in TINKER_ALLOWED
        }
        bad = {m for m in found if m.partition(".")[0] in TINKER_BLOCKED}
        bad |= engine - TINKER_ALLOWED
        if bad:
            crossing[name] = sorted(bad)
    assert crossing == {}


def test_the_boundary_checks_cover_the_http_modules() -> None:
    assert "loraplex_engine.server.app" in HTTP_MODULES
    assert "loraplex_engine.server.openai.choices" in HTTP_MODULES
    assert "loraplex_engine.server.serve" not in HTTP_MODULES


def test_reading_the_model_name_computes_no_capacity() -> None:
    engine = FakeEngine()
    hi = [{"role": "user", "content": "x"}]
    with TestClient(create_app(engine, TOKEN), raise_server_exceptions=False) as client:
        assert put(client, "default.a").status_code == 201
        asks = [
            ("GET", "/v1/models", None, 200),
            ("GET", "/v1/models/fake-base", None, 200),
            ("GET", "/v1/models/default.a", None, 200),
            ("GET", "/v1/models/default.gone", None, 404),
            ("POST", "/v1/completions", {"model": "fake-base", "prompt": "x"}, 200),
            ("POST", "/v1/completions", {"model": "default.a", "prompt": "x"}, 200),
            ("POST", "/v1/completions", {"model": "gone", "prompt": "x", "stream": True}, 404),
            ("POST", "/v1/chat/completions", {"model": "default.a", "messages": hi}, 200),
        ]
        for method, path, body, status in asks:
            r = client.request(method, path, json=body, headers=AUTH)
            assert r.status_code == status, (path, r.text)
        assert engine.capacity_calls == 0
        assert client.get("/v1/capacity", headers=AUTH).status_code == 200
        assert engine.capacity_calls == 1  # the count counts
