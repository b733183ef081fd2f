"""DoReMi's domain weights: the exponentiated-gradient update, their history file and its average (``nanotron doremi
average``); the feature that trains with them is ``features/doremi.py``.

Xie et al. (2023), Algorithm 1. After each proxy step, with ``λ_i`` the mean excess loss of domain ``i`` over the
reference (per-token ``max(ℓ_proxy - ℓ_ref, 0)``, averaged over the domain's tokens in the step's global batch):

    α' = softmax(log α + η λ)          (η = doremi.step_size)
    α  = (1 - c) α' + c / k            (c = doremi.smoothing_param, k domains)

A domain absent from a step has ``λ_i = 0``: its weight only follows the normalisation and the smoothing. The
weights a larger model should train with are the average of ``α`` over the proxy's steps.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from nanotron.config import ConfigError
from nanotron.files import atomic_write_text

HISTORY_FILE = "domain_weights.jsonl"


def updated_weights(weights: Sequence[float], excess_sums: Sequence[float], token_counts: Sequence[float],
                    step_size: float, smoothing: float) -> list[float]:
    """The weights after one step whose domains had these excess-loss sums over these token counts."""
    excess = [total / count if count > 0 else 0.0 for total, count in zip(excess_sums, token_counts)]
    logits = [math.log(weight) + step_size * value for weight, value in zip(weights, excess)]
    top = max(logits)
    exponentials = [math.exp(logit - top) for logit in logits]
    total = sum(exponentials)
    return [(1 - smoothing) * value / total + smoothing / len(weights) for value in exponentials]


class WeightHistory:
    """``domain_weights.jsonl``: one ``{"step": s, "weights": {name: w}}`` line per step, the weights step ``s``
    sampled and weighted its batch with. A resumed run first drops the lines of steps after its checkpoint."""

    def __init__(self, path: Path, resume_step: int):
        self.path = Path(path)
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if line.strip()
                    and _record(line, self.path)["step"] <= resume_step]
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a")

    def write(self, step: int, names: Sequence[str], weights: Sequence[float]) -> None:
        self.file.write(json.dumps({"step": step, "weights": dict(zip(names, weights))}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _record(line: str, path: Path) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not (isinstance(record, dict) and isinstance(record.get("step"), int)
            and isinstance(record.get("weights"), dict)):
        raise ConfigError(f"{path}: {line[:80]!r} is not a domain-weights record "
                          '({"step": s, "weights": {name: w}}); give the domain_weights.jsonl of a DoReMi run')
    return record


def average_weights(history: Path) -> dict[str, float]:
    """The mean of every step's weights in a history file, by domain name (in the file's order)."""
    path = Path(history)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; give the domain_weights.jsonl in a DoReMi run's checkpoints_path")
    records = [_record(line, path) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ConfigError(f"{path} holds no steps yet; train the proxy first")
    names = list(records[0]["weights"])
    if any(list(record["weights"]) != names for record in records):
        raise ConfigError(f"{path} mixes runs with different domains; give the history of one run")
    return {name: sum(record["weights"][name] for record in records) / len(records) for name in names}
