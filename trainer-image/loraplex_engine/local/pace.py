"""The progress output's pace: seconds per step (over the last few steps) and an ETA,
steps left × that. Printed from the first step on (a GSM8K step can take minutes)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loraplex_engine.spec.api_types import ExperimentStatus

RECENT_STEPS = 5


@dataclass
class Pace:
    """Wall seconds between the ticks that stepped, the last ``RECENT_STEPS`` of them."""

    last: float
    seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    steps: int = 0

    def stepped(self, now: float) -> None:
        self.seconds.append(now - self.last)
        self.last = now
        self.steps += 1

    @property
    def per_step(self) -> float | None:
        return sum(self.seconds) / len(self.seconds) if self.seconds else None

    def line(self, statuses: list[ExperimentStatus]) -> str:
        """`` 3.2 s/step, ETA 1m 04s`` (the experiment with most steps left), or ''."""
        per_step = self.per_step
        if per_step is None:
            return ""
        running = [s for s in statuses if s.phase == "Running"]
        if any(not s.max_steps for s in running):
            return f"  {per_step:.2f} s/step"
        left = max((s.max_steps - s.step for s in running if s.max_steps), default=0)
        return f"  {per_step:.2f} s/step, ETA {duration(left * per_step)}"


def duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"
