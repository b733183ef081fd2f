"""The ``evals`` section: downstream evaluations run inside the training loop (``training/evals.py``).

Multiple-choice tasks are read from local files (``generation/tasks.py``: jsonl or parquet with context, choices and
gold columns, or a Hugging Face ``save_to_disk`` folder) and scored by the log-likelihood of each choice; held-out
folders get their loss and perplexity per domain, as ``nanotron eval --data`` gives them. Names follow upstream's
``lighteval.tasks`` where it has the key (``max_samples``, ``num_fewshot`` in its task strings).
"""

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nanotron.config.rules import at_least


@dataclass
class EvalTaskArgs:
    """One multiple-choice task: ``path`` a file or a folder holding its examples; ``name`` the task's name in
    metrics.jsonl (default: the path's stem)."""

    path: Path
    name: str | None = None
    num_fewshot: int = 0  # solved examples put before each question, drawn with ``fewshot_seed``
    fewshot_seed: int = 1234
    max_samples: int | None = None  # the first examples of the file only
    max_tokens: int | None = None  # a token budget: examples are scored in order while their tokens fit it
    target_delimiter: str = " "  # between the context and each choice (lm-eval-harness's default)
    fewshot_delimiter: str = "\n\n"  # between solved examples

    @property
    def task_name(self) -> str:
        return self.name or self.path.stem

    def problems(self, key: str) -> Iterator[str]:
        if not self.task_name:
            yield f"{key}.name must not be empty"
        yield from at_least(f"{key}.num_fewshot", self.num_fewshot, 0)
        if self.max_samples is not None:
            yield from at_least(f"{key}.max_samples", self.max_samples, 1)
        if self.max_tokens is not None:
            yield from at_least(f"{key}.max_tokens", self.max_tokens, 1)


@dataclass
class EvalsArgs:
    """Evaluations every ``eval_interval`` optimizer steps (None: only after the last step) and after the last step,
    at the run's layout and sequence length, with the training micro-batch size."""

    eval_interval: int | None = None
    tasks: list[EvalTaskArgs] = field(default_factory=list)
    held_out: list[Path] = field(default_factory=list)  # folders of any kind training reads: loss per domain
    held_out_max_windows: int = 64  # windows read from the start of each held-out folder

    def problems(self) -> Iterator[str]:
        if self.eval_interval is not None:
            yield from at_least("evals.eval_interval", self.eval_interval, 1)
        yield from at_least("evals.held_out_max_windows", self.held_out_max_windows, 1)
        if not self.tasks and not self.held_out:
            yield "evals has no tasks and no held_out folders; list at least one, or remove the section"
        for index, task in enumerate(self.tasks):
            yield from task.problems(f"evals.tasks[{index}]")
        names = [task.task_name for task in self.tasks]
        for name in sorted({name for name in names if names.count(name) > 1}):
            yield f"evals.tasks: two tasks are named {name!r}; give each a distinct name"
