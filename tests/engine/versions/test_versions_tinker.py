"""The official tinker SDK samples a published version and an alias from a real
``loraplex-engine serve --tinker-keys`` (docs/versions.md): the key's own namespace only."""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker
from loraplex_engine.store.versions import VersionStore
from tinker import types

from tests.support.server_process import EngineServer, wait_until
from tests.support.server_specs import put_body, small_spec

KEY = "tml-versions-0123456789abcdef"
EXP = "demo.cont"


def test_the_sdk_samples_a_version_and_an_alias(tiny_model_dir: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"demo {KEY}\n")
    root = tmp_path / "ckpt"
    srv = EngineServer(tiny_model_dir, root, max_adapters=3, workdir=tmp_path,
                       extra_args=["--tinker-keys", str(keys)])  # fmt: skip
    with srv, srv.client() as api:
        spec = small_spec(max_steps=0) | {"publish": {"everySteps": 1, "keep": 100}}
        assert api.put(f"/v1/experiments/{EXP}", json=put_body(EXP, spec)).status_code == 201
        wait_until(lambda: len(VersionStore(root).list("demo", "cont")) >= 2, timeout=120)
        # The card a gateway looks a model up by (GET /v1/models/{id}): any version name.
        for name in (f"{EXP}@v1", f"{EXP}:latest"):
            card = api.get(f"/v1/models/{name}")
            assert card.status_code == 200 and card.json()["id"] == name, card.text
        assert api.get(f"/v1/models/{EXP}@v999").status_code == 404
        assert api.get("/v1/models/demo.nothing").status_code == 404
        service = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
        prompt = types.ModelInput.from_ints([1, 17, 42, 99])
        greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
        for path in (f"tinker://{EXP}@v1", f"tinker://{EXP}:latest"):  # the SDK's scheme
            sampler = service.create_sampling_client(model_path=path)
            seq = sampler.sample(prompt, num_samples=1, sampling_params=greedy).result()
            assert len(seq.sequences[0].tokens) == 4, path
        with pytest.raises(Exception, match="namespace"):
            service.create_sampling_client(model_path="tinker://other.cont@v1").sample(
                prompt, num_samples=1, sampling_params=greedy
            ).result()
