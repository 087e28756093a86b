"""When to publish, whether a version passes its gate, and where the aliases point: pure
decisions over version numbers and scores (the publisher, versions/publisher.py, does the
I/O).

Aliases: ``latest`` is the engine's (the newest version, always); ``stable`` is the gate's
(each new version whose score passes ``promoteWhen``) unless the spec sets it by hand,
in which case the spec's wins until the entry is removed (the alias then stays where it
is until the next passing version); every other alias is the spec's alone (removed from
the spec = gone). A hand-set alias is applied only to a version that exists; ``stable``
never points at a version that failed its gate, whoever asks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loraplex_engine.spec.eval_scores import EvalResult
from loraplex_engine.spec.publish import LATEST, STABLE, PromoteWhen, PublishSpec


def due(step: int, spec: PublishSpec | None) -> bool:
    """A version is due at this step (``everySteps``); never without a policy."""
    return spec is not None and spec.every_steps is not None and step % spec.every_steps == 0


def scores_of(
    window: Sequence[float], last_eval: EvalResult | None = None, step: int | None = None
) -> dict[str, float]:
    """A version's scores: meanReward from the step rewards since its parent (absent when
    no step ran since, e.g. a publish by hand right after a resume), and evalReward and
    evalPassAtK from ``last_eval`` when it ran at or before the version's ``step``."""
    finite = [r for r in window if math.isfinite(r)]
    out = {"meanReward": sum(finite) / len(finite)} if finite else {}
    if last_eval is not None and (step is None or last_eval.step <= step):
        out |= {"evalReward": last_eval.reward, "evalPassAtK": last_eval.pass_at_k}
    return {k: v for k, v in out.items() if math.isfinite(v)}


def gate(scores: Mapping[str, float], promote_when: PromoteWhen | None) -> bool | None:
    """Whether a version with ``scores`` may become stable: None without a gate; False
    when the gated score is missing."""
    if promote_when is None:
        return None
    value = scores.get(promote_when.score)
    return value is not None and value >= promote_when.at_least


def gate_note(scores: Mapping[str, float], promote_when: PromoteWhen | None) -> str | None:
    """Why a version with ``scores`` fails its gate (None: it passes, or no gate)."""
    if promote_when is None or gate(scores, promote_when):
        return None
    name, bar = promote_when.score, promote_when.at_least
    value = scores.get(name)
    if value is None:
        why = "no eval ran at or before its step" if name != "meanReward" else "no step ran"
        return f"no {name} ({why}): it never becomes stable"
    return f"{name} {value:.6g} < promoteWhen.atLeast {bar:.6g}"


def improves(value: float, best: float | None) -> bool:
    """An eval score beats the best published version's (any score beats none)."""
    return math.isfinite(value) and (best is None or value > best)


def eval_score(result: EvalResult, name: str) -> float:
    """``evalReward`` or ``evalPassAtK`` of an eval."""
    return result.reward if name == "evalReward" else result.pass_at_k


def best_scores(versions: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The highest value of each score among published versions' scores."""
    best: dict[str, float] = {}
    for scores in versions:
        for k, v in scores.items():
            if math.isfinite(v) and (k not in best or v > best[k]):
                best[k] = v
    return best


def token_due(spec: PublishSpec | None, applied: str | None) -> str | None:
    """The requestToken to publish now: the spec's, when it is not the last one applied."""
    token = None if spec is None else spec.request_token
    return token if token is not None and token != applied else None


def next_aliases(
    current: Mapping[str, int],
    hand: Mapping[str, int],
    existing: Sequence[int],
    failed_gate: set[int],
    promoted: int | None = None,
) -> tuple[dict[str, int], list[str]]:
    """The aliases after a publish or a spec edit, and why a hand-set one was not
    applied. ``existing``: the versions on disk, oldest first; ``failed_gate``: those
    among the hand-set targets whose gate failed; ``promoted``: a new version that passed
    its gate (moves stable unless the spec holds it)."""
    have = set(existing)
    out = {a: v for a, v in current.items() if a in (LATEST, STABLE) and v in have}
    problems: list[str] = []
    if existing:
        out[LATEST] = existing[-1]
    if promoted is not None and STABLE not in hand:
        out[STABLE] = promoted
    for alias, v in sorted(hand.items()):
        if v not in have:
            problems.append(f"publish.aliases {alias}: v{v} is not a published version")
            if alias in current and current[alias] in have:
                out[alias] = current[alias]  # stays where it was
        elif alias == STABLE and v in failed_gate:
            problems.append(f"publish.aliases {alias}: v{v} failed its promotion gate")
        else:
            out[alias] = v
    return out, problems


@dataclass(frozen=True)
class AliasMove:
    alias: str
    before: int | None
    after: int | None


def moves(before: Mapping[str, int], after: Mapping[str, int]) -> list[AliasMove]:
    """Each alias that changed, by name."""
    names = sorted(set(before) | set(after))
    return [
        AliasMove(a, before.get(a), after.get(a)) for a in names if before.get(a) != after.get(a)
    ]
