"""base_model.TemplateFiles: whether a model has a chat template, read from its files
without transformers, agrees with the tokenizer transformers reads from the same
directory, wherever the template lies (its own file, the tokenizer config, a folder of
named ones) or where there is none."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from loraplex_engine.base_model import TemplateFiles, tokenizer_of
from loraplex_engine.tokens import TokenCodec

from tests.support.model_dirs import without_chat_template

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def in_config(d: Path) -> None:
    config = d / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": TEMPLATE}))


def in_own_file(d: Path) -> None:
    (d / "chat_template.jinja").write_text(TEMPLATE)


def named(d: Path) -> None:
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text(TEMPLATE)


def empty_file(d: Path) -> None:
    (d / "chat_template.jinja").write_text("")


def none(d: Path) -> None:
    pass


CASES: list[Callable[[Path], None]] = [none, in_config, in_own_file, named, empty_file]


@pytest.mark.parametrize("place", CASES, ids=[c.__name__ for c in CASES])
def test_the_files_say_what_the_tokenizer_says(
    place: Callable[[Path], None], tiny_model_dir: Path, tmp_path: Path
) -> None:
    d = without_chat_template(tiny_model_dir, tmp_path / "m")
    place(d)
    read = TokenCodec(tokenizer_of(d)).has_chat_template
    assert TemplateFiles(d).has_chat_template is read
    assert read is (place not in (none, empty_file))
