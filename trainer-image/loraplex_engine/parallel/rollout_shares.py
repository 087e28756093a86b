"""Rollout rows as they cross between ranks (parallel/data_parallel.py decodes them on every rank).

A ``RolloutRequest`` holds two things that cannot be pickled to another process: its
sampling generator (a ``torch.Generator``, one per experiment, shared by its rows) and
its sink (a served completion's stream to an HTTP client). On the wire a request names
its generator by *stream* (the index of the distinct generator among the batch's, first
seen first) and the batch carries each stream's state; a worker rebuilds one generator
per stream, so the rows that shared one still share one. Rows with a sink never leave
rank 0 (row_split.split_rollout pins them there). After decoding, a rank reports the
state of each stream it drew from, and rank 0 moves its own generators to those states:
the experiment's generator advances exactly as if rank 0 had decoded its rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex_engine.rollout.base import Completion, RolloutRequest


@dataclass(frozen=True)
class WireBatch:
    """A rollout batch as every rank receives it."""

    requests: list[RolloutRequest]  # generator and sink dropped
    streams: list[int | None]  # per request: its generator's stream, or None
    states: list[torch.Tensor]  # per stream: its generator's state (a CPU ByteTensor)
    shares: list[list[int]]  # per rank: the request indices it decodes


@dataclass(frozen=True)
class ShareResult:
    """What one rank sends back to rank 0."""

    rows: list[int]
    completions: list[Completion]
    states: dict[int, torch.Tensor]  # stream -> its generator's state after decoding


def stream_ids(
    requests: Sequence[RolloutRequest],
) -> tuple[list[int | None], list[torch.Generator]]:
    """Per request its stream (None: no generator), and the generator of each stream."""
    index: dict[int, int] = {}
    generators: list[torch.Generator] = []
    streams: list[int | None] = []
    for req in requests:
        gen = req.generator
        if gen is None:
            streams.append(None)
            continue
        if id(gen) not in index:
            index[id(gen)] = len(generators)
            generators.append(gen)
        streams.append(index[id(gen)])
    return streams, generators


def to_wire(requests: Sequence[RolloutRequest], shares: list[list[int]]) -> WireBatch:
    streams, generators = stream_ids(requests)
    bare = [dataclasses.replace(r, generator=None, sink=None) for r in requests]
    return WireBatch(bare, streams, [g.get_state() for g in generators], shares)


def from_wire(batch: WireBatch) -> tuple[list[RolloutRequest], list[torch.Generator]]:
    """The requests with one fresh generator per stream (set to rank 0's state)."""
    generators = [torch.Generator().set_state(state) for state in batch.states]
    requests = [
        r if s is None else dataclasses.replace(r, generator=generators[s])
        for r, s in zip(batch.requests, batch.streams, strict=True)
    ]
    return requests, generators


def share_result(
    rows: list[int],
    completions: list[Completion],
    streams: Sequence[int | None],
    generators: Sequence[torch.Generator],
) -> ShareResult:
    """``rows`` decoded into ``completions``, with the state of every stream they drew on."""
    used = sorted({s for i in rows if (s := streams[i]) is not None})
    return ShareResult(rows, completions, {s: generators[s].get_state() for s in used})


def merge(
    results: Sequence[ShareResult], n: int, generators: Sequence[torch.Generator]
) -> list[Completion]:
    """Rank 0: every rank's completions in request order; its generators advanced to the
    states the decoding ranks left them in (a stream is decoded by one rank)."""
    out: list[Completion | None] = [None] * n
    for result in results:
        for row, completion in zip(result.rows, result.completions, strict=True):
            out[row] = completion
        for stream, state in result.states.items():
            generators[stream].set_state(state)
    missing = [i for i, c in enumerate(out) if c is None]
    if missing:
        raise RuntimeError(f"rollout rows {missing[:5]} were decoded by no rank")
    return [c for c in out if c is not None]
