"""Rewards: built-in verifiers and a client for an external HTTP reward service.

Every reward scores a *batch* of items (one HTTP round trip per experiment and
tick). Any failure raises ``RewardError``; the loop fails only the experiment
that owns the reward.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from loraplex_engine.spec.errors import ExchangeError, RewardError, TaskError
from loraplex_engine.tenancy.reward_exchange import (
    MAX_REWARD_ANSWER_BYTES,
    REWARD_TIMEOUT_S,
    RewardClient,
)
from loraplex_engine.tenancy.trust import RewardEgress


@dataclass(frozen=True)
class RewardItem:
    prompt: str
    completion: str
    answer: str
    columns: Mapping[str, str] = field(default_factory=dict)  # a dataset row's others


class Reward(Protocol):
    name: str

    def score(self, items: Sequence[RewardItem]) -> list[float]: ...


# --- built-in scoring functions: (completion, answer) -> score in [0, 1] ---


def exact_match(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def contains(completion: str, answer: str) -> float:
    return float(answer.strip() in completion)


def prefix_overlap(completion: str, answer: str) -> float:
    """Share of the answer's characters reproduced in place at the completion's start."""
    want = answer.strip()
    got = completion.lstrip()
    if not want:
        return float(not got)
    return sum(a == b for a, b in zip(want, got, strict=False)) / len(want)


def word_fraction(completion: str, answer: str) -> float:
    """Share of whitespace-separated words equal to the answer (dense partial credit)."""
    words = completion.split()
    if not words:
        return 0.0
    return sum(w == answer.strip() for w in words) / len(words)


def coverage(completion: str, answer: str) -> float:
    """Share of the completion's non-space characters covered by copies of the answer.

    Dense partial credit that is still verifiable: a random policy that emits the
    answer once among noise scores a little; saying only the answer scores 1.
    """
    want = answer.strip()
    total = sum(not ch.isspace() for ch in completion)
    if not want or total == 0:
        return 0.0
    return min(1.0, completion.count(want) * sum(not ch.isspace() for ch in want) / total)


ScoreFn = Callable[[str, str], float]

BUILTIN_REWARDS: dict[str, ScoreFn] = {
    "exact-match": exact_match,
    "contains": contains,
    "prefix-overlap": prefix_overlap,
    "word-fraction": word_fraction,
    "coverage": coverage,
}


@dataclass(frozen=True)
class BuiltinReward:
    """Wraps a per-item scoring function as a batched ``Reward``."""

    name: str
    fn: ScoreFn

    def score(self, items: Sequence[RewardItem]) -> list[float]:
        scores = (self.fn(it.completion, it.answer) for it in items)
        return [check_score(s, i, self.name) for i, s in enumerate(scores)]


def check_score(value: Any, index: int, source: str) -> float:
    # bool is an int subclass; a True/False "score" is almost surely a bug upstream.
    # The value's type, never the value: an answer's content does not reach status.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(
            f"reward {source}: score {index} is not a number (a {type(value).__name__})"
        )
    try:
        score = float(value)  # an int too large for a float raises OverflowError
    except OverflowError:
        score = math.inf
    if not math.isfinite(score):
        raise RewardError(f"reward {source}: score {index} is not finite")
    return score


class HttpReward:
    """POST ``{"items": [{prompt, completion, answer}]}`` → ``{"scores": [float]}``.

    With ``egress`` every request resolves the host, checks the addresses (tenancy/trust.py) and
    connects to the checked one, so a DNS answer that changes after admission cannot
    point the request elsewhere. Redirects are never followed, and an error names the
    status or failure only: no byte of the answer reaches the experiment's status. Each
    exchange has a deadline of ``timeout`` seconds in all and an answer of at most
    ``max_bytes`` (tenancy/reward_exchange.py); ``close()`` ends one in flight."""

    name = "http"

    def __init__(
        self,
        url: str,
        timeout: float = REWARD_TIMEOUT_S,
        egress: RewardEgress | None = None,
        max_bytes: int = MAX_REWARD_ANSWER_BYTES,
    ):
        self.url = url
        self.timeout = timeout
        self.egress = egress
        self._client = RewardClient(timeout, max_bytes)

    def close(self) -> None:
        self._client.close()

    def score(self, items: Sequence[RewardItem]) -> list[float]:
        if not items:
            return []
        body = {
            "items": [
                {"prompt": it.prompt, "completion": it.completion, "answer": it.answer}
                for it in items
            ]
        }
        data = self._post(body)
        scores = data.get("scores") if isinstance(data, dict) else None
        if not isinstance(scores, list):
            raise RewardError(f"reward service {self.url}: answer has no 'scores' list")
        if len(scores) != len(items):
            raise RewardError(
                f"reward service {self.url}: {len(scores)} scores for {len(items)} items"
            )
        return [check_score(s, i, f"service {self.url}") for i, s in enumerate(scores)]

    def _post(self, body: dict[str, Any]) -> Any:
        url, sni = self.url, None
        host_header = urlsplit(self.url).netloc.rpartition("@")[2]  # userinfo never in Host
        if self.egress is not None:
            try:
                target = self.egress.check(self.url)
            except TaskError as exc:
                raise RewardError(f"reward service {self.url}: {exc.message}") from None
            assert target is not None  # check() resolves or raises
            url, host_header, sni = target.pinned_url, target.host_header, target.sni_hostname
        headers = [("Host", host_header), ("Content-Type", "application/json")]
        try:
            status, answer = self._client.post(url, json.dumps(body).encode(), headers, sni)
        except ExchangeError as exc:
            raise RewardError(f"reward service {self.url} {exc}") from None
        if status != 200:
            raise RewardError(f"reward service {self.url} answered HTTP {status}")
        try:
            return json.loads(answer)
        except (ValueError, RecursionError) as exc:  # RecursionError: [[[[...]]]] a mebibyte deep
            raise RewardError(f"reward service {self.url} answered invalid JSON") from exc


def make_reward(
    name: str,
    url: str | None = None,
    timeout: float = REWARD_TIMEOUT_S,
    egress: RewardEgress | None = None,
) -> Reward:
    """A reward by spec name (a built-in, or ``http`` with ``url``, sent as ``egress``
    allows: None = anywhere)."""
    if name == "http":
        if not url:
            raise ValueError("reward http needs a rewardUrl")
        return HttpReward(url, timeout, egress=egress)
    if name not in BUILTIN_REWARDS:
        raise ValueError(f"unknown reward {name!r}; known: {sorted(BUILTIN_REWARDS)} or http")
    return BuiltinReward(name, BUILTIN_REWARDS[name])
