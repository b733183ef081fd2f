"""Training curves from ``metrics.jsonl`` files: ``nanotron plot``.

One image, one panel per metric over steps (loss, learning rate, gradient norm, throughput, MFU, a mixture of experts'
expert load and load-balancing loss, per-domain losses and domain weights, and each metric of the evaluations in the
loop, ``eval/<name>/<metric>``, when the records carry them), several runs on the same axes so they can be compared
at a glance. The image's format follows the output's extension, one of ``IMAGE_SUFFIXES``. matplotlib is an optional
extra (``pip install -e ".[plot]"``): training never needs it, so it is imported only here, and only its
object-oriented API with the Agg canvas is used, which needs no display and changes no global backend.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

logger = logging.getLogger(__name__)

# (record key, panel title): drawn when at least one run's records carry the key.
PANELS = [
    ("lm_loss", "loss"),
    ("lr", "learning rate"),
    ("grad_norm", "gradient norm"),
    ("tokens_per_sec", "tokens/s"),
    ("mfu", "MFU"),
    ("moe_max_expert_load", "MoE: busiest expert / even share"),
    ("moe_load_balancing_loss", "MoE load-balancing loss"),
]
EVAL_PREFIX = "eval/"  # the fields of evaluations in the loop (``training/evals.py``): one panel each
# Records holding one value per domain (multi-folder runs, DoReMi): one curve per domain.
DOMAIN_PANELS = [("domain_losses", "loss per domain"), ("domain_weights", "domain weights")]
IMAGE_SUFFIXES = (".png", ".pdf", ".svg")  # what matplotlib writes with no other library
PANEL_SIZE = (6.0, 3.5)  # inches per panel; two panels a row
DPI = 100


class PlotError(Exception):
    """A metrics file or a plot request that cannot be drawn; the message names the file and the fix."""


def read_metrics(path: Path) -> list[dict]:
    """The step records of one metrics file.

    A run killed while writing leaves a torn last line: it is skipped with a warning, as training does on resume.
    Any other line that is not a record with ``step`` and ``lm_loss`` means the file is not a metrics file (or is
    damaged), which is an error rather than a silently wrong curve.
    """
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path}: no such metrics file (give the metrics.jsonl of a run, or its run folder)")
    lines = [(number, line) for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if line.strip()]
    records = []
    for index, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if index == len(lines) - 1 and records:
                logger.warning(f"{path}: skipped the torn last line {number} ({line[:60]!r})")
                continue
            raise PlotError(f"{path}: line {number} is not valid JSON ({line[:60]!r})") from None
        if not (isinstance(record, dict) and isinstance(record.get("step"), int)
                and isinstance(record.get("lm_loss"), (int, float))):
            raise PlotError(f"{path}: line {number} is not a metrics record with 'step' and 'lm_loss' "
                            f"({line[:60]!r})")
        records.append(record)
    if not records:
        raise PlotError(f"{path}: no metrics records (has the run logged a step yet?)")
    return records


def run_name(path: Path) -> str:
    """A run is known by its folder: ``checkpoints/tiny_llama/metrics.jsonl`` is ``tiny_llama``."""
    if path.is_dir():
        return path.name
    return path.parent.name if path.name == "metrics.jsonl" and path.parent.name else path.stem


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start), so the curve starts at step one."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [float(v) for _, v in points]


def plot_runs(paths: list[Path], output: Path, smooth: int | None = None, names: list[str] | None = None) -> Path:
    """Draw every run's curves into one image at ``output`` (its format: the extension's) and return its path."""
    if names is not None and len(names) != len(paths):
        raise PlotError(f"--names gives {len(names)} name(s) for {len(paths)} metrics file(s)")
    if smooth is not None and smooth < 1:
        raise PlotError(f"--smooth must be at least 1 step, not {smooth}")
    runs = {}
    for i, path in enumerate(paths):
        runs[names[i] if names else run_name(path)] = read_metrics(path)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError('nanotron plot needs matplotlib: pip install -e ".[plot]"') from None

    panels = [(key, title) for key, title in PANELS if any(key in r for rs in runs.values() for r in rs)]
    evaluated = sorted({key for rs in runs.values() for r in rs for key in r if key.startswith(EVAL_PREFIX)})
    panels += [(key, "eval: " + key.removeprefix(EVAL_PREFIX)) for key in evaluated]
    per_domain = [(key, title) for key, title in DOMAIN_PANELS
                  if any(isinstance(r.get(key), dict) for rs in runs.values() for r in rs)]
    count = len(panels) + len(per_domain)
    rows, cols = math.ceil(count / 2), min(count, 2)
    figure = Figure(figsize=(PANEL_SIZE[0] * cols, PANEL_SIZE[1] * rows), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, cols, squeeze=False).flat
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (key, title) in zip(axes, panels):
        for colour, (name, records) in zip(colours, runs.items()):
            steps, values = _series(records, key)
            if not steps:  # this run does not record the metric (MFU off GPU): no empty legend entry
                continue
            if key == "lm_loss" and smooth:
                ax.plot(steps, values, color=colour, alpha=0.3, linewidth=1)
                ax.plot(steps, moving_average(values, smooth), color=colour, label=f"{name} (mean of {smooth})")
            else:
                ax.plot(steps, values, color=colour, label=name)
        ax.set_title(title)
    for ax, (key, title) in zip(axes[len(panels):], per_domain):
        for colour, (name, records) in zip(colours, runs.items()):
            values = [(r["step"], r[key]) for r in records if isinstance(r.get(key), dict)]
            domains = sorted({d for _, by_domain in values for d in by_domain})
            for index, domain in enumerate(domains):
                points = [(s, v[domain]) for s, v in values if isinstance(v.get(domain), (int, float))]
                # One run: a colour per domain. Several: a colour per run, a line style per domain.
                style = {"color": f"C{index % 10}"} if len(runs) == 1 else {
                    "color": colour, "linestyle": ["-", "--", ":", "-."][index % 4]}
                ax.plot([s for s, _ in points], [v for _, v in points], **style,
                        label=f"{name}: {domain}" if len(runs) > 1 else domain)
        ax.set_title(title)
    for ax in figure.axes[:count]:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in figure.axes[count:]:
        ax.set_visible(False)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, format=output.suffix[1:].lower())
    return output
