"""Bad steps: a loss or gradient norm that is not finite, or a loss that spikes far above the recent ones.

By default the run stops at the first non-finite value, before anything is saved. With
``optimizer.skip_bad_steps: N`` a bad step's update is skipped instead (its gradients are dropped; the step's data
counts as consumed) and the run stops only after more than N bad steps in a row. ``optimizer.loss_spike_factor: f``
also counts a step as bad when its loss exceeds f times the mean of the last good steps, so that a blow-up is caught
before its weights reach a checkpoint. Judging a step before its update needs the loss and norm on the host first:
one synchronisation per step, paid only when one of the two options is set.
"""

from __future__ import annotations

import logging
import math
from collections import deque

logger = logging.getLogger("nanotron.trainer")

RECENT_STEPS = 20  # good steps whose mean loss a spike is measured against


class TrainingDivergedError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


class BadStepGuard:
    def __init__(self, skip_limit: int, spike_factor: float | None):
        self.skip_limit = skip_limit
        self.spike_factor = spike_factor
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.bad_in_a_row = 0

    @property
    def judges_before_update(self) -> bool:
        return self.skip_limit > 0 or self.spike_factor is not None

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is bad, or None (then its loss joins the recent ones)."""
        reason = None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            reason = f"loss {loss} / grad-norm {grad_norm} is not finite"
        elif self.spike_factor is not None and len(self.recent) >= 3:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.spike_factor * mean:
                reason = (f"loss {loss:.4f} is more than optimizer.loss_spike_factor={self.spike_factor:g} times the "
                          f"mean of the last {len(self.recent)} steps ({mean:.4f})")
        if reason is None:
            self.recent.append(loss)
            self.bad_in_a_row = 0
        else:
            self.bad_in_a_row += 1
        return reason

    @property
    def exhausted(self) -> bool:
        """More bad steps in a row than may be skipped: the run must stop."""
        return self.bad_in_a_row > self.skip_limit

    def skip_or_stop(self, step: int, reason: str) -> None:
        """After a bad step (``judge`` gave its ``reason``): raise ``TrainingDivergedError`` if the run must stop,
        else log that the step's update is skipped."""
        if self.exhausted:
            skipped = self.bad_in_a_row - 1
            raise TrainingDivergedError(
                f"at step {step}: {reason}" + (f", after {skipped} skipped step(s)" if skipped else "") + "; training "
                "diverged. Resume from the last checkpoint before it with a lower "
                "optimizer.learning_rate_scheduler.learning_rate (or raise optimizer.skip_bad_steps)")
        logger.warning(f"step {step}: {reason}; update skipped ({self.bad_in_a_row} in a row, "
                       f"optimizer.skip_bad_steps={self.skip_limit})")
