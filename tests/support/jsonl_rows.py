"""Rows of a jsonl dataset as the tests write them: one ``{"prompt", "answer"}`` object
a line."""

from __future__ import annotations

import json


def jsonl_row(prompt: str, answer: str = "yes") -> str:
    return json.dumps({"prompt": prompt, "answer": answer}) + "\n"
