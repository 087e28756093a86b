"""The docs speak of the product: no internal issue numbers in README.md or docs/ (a
reader outside the project cannot follow "issue 26" or a bare "#26"; a link to another
project's issue, `owner/repo#123`, is a real reference and stays). docs/datasets.md's
reward table lists exactly the engine's built-in rewards."""

from __future__ import annotations

import re
from pathlib import Path

from loraplex_engine.tasks import REWARD_NAMES
from loraplex_engine.tasks.rewards import BUILTIN_REWARDS

REPO = Path(__file__).resolve().parents[1]
# "issue 26", "Issues 12", a bare "#26" (not "vllm-project/vllm#48421", not "(#anchor)").
INTERNAL = re.compile(r"\bissues? \d+|(?<![\w/.#-])#\d+\b", re.IGNORECASE)


def docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_the_pattern_catches_what_it_should() -> None:
    for leak in ("see issue 26", "(Issue 3 item 4)", "fixed in #26", "PR #1938's"):
        assert INTERNAL.search(leak), leak
    for fine in ("vllm-project/vllm#48421", "[x](#install-on-a-cluster)", "issues: none"):
        assert not INTERNAL.search(fine), fine


def test_no_internal_issue_numbers_in_the_docs() -> None:
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in docs()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if INTERNAL.search(line)
    ]
    assert not found, "internal issue references:\n" + "\n".join(found)


def test_the_datasets_reward_table_lists_the_builtin_rewards() -> None:
    text = (REPO / "docs" / "datasets.md").read_text()
    section = text.split("## Rewards", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([\w-]+)`", section, re.MULTILINE))
    assert rows == set(REWARD_NAMES), (rows, REWARD_NAMES)
    assert set(BUILTIN_REWARDS) <= rows
