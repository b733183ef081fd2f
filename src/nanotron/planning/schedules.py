"""Pipeline schedules as the planner sees them: the idle share of a step (the bubble) and the model chunks a rank
holds, by schedule name.

With ``p`` stages, ``m`` micro-batches a step and ``v`` chunks per rank, a stage idles while the pipeline fills and
drains. In units of the ideal time ``m × (forward + backward)`` of a micro-batch:

| schedule           | bubble                | source                                                              |
| ------------------ | --------------------- | ------------------------------------------------------------------- |
| ``afab``, ``1f1b`` | (p − 1) / m           | GPipe (Huang et al., 2019); 1F1B (Narayanan et al., 2021)           |
| ``interleaved_1f1b`` | (p − 1) / (v · m)   | Narayanan et al., 2021, section 2.2                                 |
| ``zb_h1``          | (p − 1) / (3 · m)     | Qi et al., 2023 (zero bubble): (p − 1)(F + B − W) with F = B = W    |
| ``zbv``            | 0 (two chunks)        | Qi et al., 2023: (p − 1)(F + B − 2W) with F = B = W                 |

The zero-bubble rows assume the paper's equal forward, input-gradient and weight-gradient times; a layer whose
weight gradient costs less than its input gradient leaves a bubble. ``available`` says which schedules training
runs today (``parallelism.pp_engine``): the others are planned, and the planner marks their rows so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nanotron.config.parallelism import PipelineEngine
from nanotron.config.rules import literal_values


@dataclass(frozen=True)
class Schedule:
    name: str
    bubble: Callable[[int, int, int], float]  # (stages, micro-batches, chunks) -> idle share of the ideal time
    chunks: int = 1  # model chunks per rank (virtual stages)

    @property
    def available(self) -> bool:
        return self.name in literal_values(PipelineEngine)


SCHEDULES = {
    schedule.name: schedule for schedule in (
        Schedule("afab", lambda p, m, v: (p - 1) / m),
        Schedule("1f1b", lambda p, m, v: (p - 1) / m),
        Schedule("interleaved_1f1b", lambda p, m, v: (p - 1) / (v * m), chunks=2),
        Schedule("zb_h1", lambda p, m, v: (p - 1) / (3 * m)),
        Schedule("zbv", lambda p, m, v: 0.0, chunks=2),
    )
}


def schedule_of(name: str) -> Schedule:
    """The planner's model of schedule ``name`` (a ``KeyError`` names the known ones)."""
    if name not in SCHEDULES:
        raise KeyError(f"no bubble model for the pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def bubble(name: str, stages: int, micro_batches: int) -> float:
    """The idle share of a step under schedule ``name`` (0 with one stage)."""
    if stages == 1:
        return 0.0
    schedule = schedule_of(name)
    return schedule.bubble(stages, micro_batches, schedule.chunks)
