"""Model directories derived from a built one, for the tests of what a model lacks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def without_chat_template(model_dir: Path, out: Path) -> Path:
    """A copy of the model whose tokenizer has no chat template (the tiny models ship one)."""
    shutil.copytree(model_dir, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = out / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    return out
