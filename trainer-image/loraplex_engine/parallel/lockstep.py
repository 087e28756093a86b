"""The ranks of a sharded base in step: every sharded forward is a collective, so while
any rank has work, every rank runs one (a real one or a dummy of the same shape)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class Lockstep:
    """Keeps the ranks' sharded forwards (collectives) in step.

    Each round every rank says whether it has real work (one tiny ``all_reduce(MAX)``);
    while any rank has, every rank runs one forward: a real one, or a dummy one of the
    same shape of collectives on a rank out of work (what ``synced_gpus`` does in
    transformers' ``generate``). ``flags`` carry what else must agree in a round (e.g.
    whether any rank needs the KL reference forward).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rounds = 0  # rounds this rank took part in (tests)

    def agree(self, *flags: bool) -> list[bool]:
        """Each flag OR-ed over the ranks."""
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.rounds += 1
        return [bool(v) for v in t.tolist()]

    def step(self) -> None:
        """Before a real forward: tell the ranks this one is still working."""
        self.agree(True)

    def drain(self, dummy: Callable[[], None]) -> int:
        """Out of work: run ``dummy`` as long as another rank still works; how many."""
        n = 0
        while self.agree(False)[0]:
            dummy()
            n += 1
        return n

    # ---- the update's micro-batches (train/step.py: fused_backward, score_rows) -------

    def micro_batch(self, with_ref: bool) -> bool:
        """Before a real micro-batch: this rank trains; whether any rank's micro-batch of
        the round runs the KL reference forward (then every rank's does: one more)."""
        return self.agree(True, with_ref)[1]

    def drain_micro_batches(self, dummy: Callable[[bool], None]) -> int:
        """Out of rows: ``dummy(with_ref)`` (a micro-batch's collectives with no effect) per
        round another rank still trains, with the reference forward when that rank's has
        one; how many."""
        n = 0
        while True:
            more, with_ref = self.agree(False, False)
            if not more:
                return n
            dummy(with_ref)
            n += 1
