"""Downstream evaluations inside the training loop (the ``evals`` section).

Every ``eval_interval`` optimizer steps and after the last one, the model being trained scores the section's
multiple-choice tasks and held-out folders (``generation/tasks.py``, ``generation/scoring.py``) at the run's layout:
rows of ``tokens.sequence_length`` in batches of ``tokens.micro_batch_size``, through every pipeline stage's chunks
in order without gradients, with the activations' shape the schedule exchanges and context parallelism's split;
data-parallel ranks share the rows. The numbers are those of ``nanotron eval --tasks ... --data ...`` on the step's
checkpoint at the same sequence length.

The tasks and folders are read and tokenized when the run is built, so that a bad file stops the run before the
model exists; an evaluation that fails later is logged (once per message) and training goes on. An evaluation
leaves the model as it found it, buffers included (``buffers_kept``), so a run trains the same with or without one.
The results go into the step's record (``eval/<name>/<metric>`` fields, and ``eval_time_s``, which the step's time
and throughput leave out) and, with every example's choice log-likelihoods, into
``<checkpoints_path>/evals/<step>.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator

import torch

from nanotron.config import Config, ConfigError
from nanotron.data.tokenizer import eos_token_id, load_tokenizer
from nanotron.files import atomic_write_text
from nanotron.generation.evaluate import HFDatasetOptions, check_distinct_names, held_out_rows, open_sources
from nanotron.generation.scoring import RowSums, evaluation_results, stage_row_sums
from nanotron.generation.tasks import task_rows
from nanotron.layout import Axis
from nanotron.models.spec import CausalLM
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.context_parallel import ContextParallelBatches

logger = logging.getLogger("nanotron.trainer")

EVAL_TIME = "eval_time_s"
SCALAR_METRICS = ("acc", "acc_norm", "loss", "perplexity")  # what the step record and the trackers get


@contextlib.contextmanager
def buffers_kept(model: CausalLM) -> Iterator[None]:
    """The model's buffers as they were before: what a forward records in them (FP8's amaxes and range counts of the
    step) belongs to the training steps, never to an evaluation between them."""
    saved = [(buffer, buffer.clone()) for buffer in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


class InLoopEvals:
    """The run's evaluations: read and tokenized at construction (before the model is built), run by ``run``."""

    def __init__(self, config: Config, pc: ParallelContext):
        self.config, self.pc, self.args = config, pc, config.evals
        sequence_length = config.tokens.sequence_length
        name = config.tokenizer.tokenizer_name_or_path
        if self.args.tasks and not name:
            raise ConfigError("evals.tasks are tokenized with the run's tokenizer; set "
                              "tokenizer.tokenizer_name_or_path")
        tokenizer = load_tokenizer(name, config.tokenizer.tokenizer_revision) if self.args.tasks else None
        self.tasks = [task_rows(task, tokenizer, sequence_length, eos_token_id(tokenizer)) for task in self.args.tasks]
        sources = open_sources(self.args.held_out, config.model.model_config.vocab_size, lambda: name,
                               HFDatasetOptions(), pc) if self.args.held_out else []
        self.held_out = held_out_rows(self.args.held_out, sources, sequence_length, self.args.held_out_max_windows)
        check_distinct_names(self.tasks, self.held_out, "an evals.held_out folder")
        self.model: CausalLM | None = None
        self.row_sums: RowSums | None = None
        self.reported: set[str] = set()  # the failures logged so far

    def start(self, model: CausalLM) -> None:
        """Score with ``model``, this rank's stage of the model being trained."""
        pc, config = self.pc, self.config
        self.model = model
        transforms = []
        if pc.size(Axis.CP) > 1:
            transforms.append(ContextParallelBatches(pc.coord(Axis.CP), pc.size(Axis.CP),
                                                     getattr(model, "flash_attention", False)))
        shape = pc.layout.stage_activation_shape(config.model.model_config.hidden_size)
        self.row_sums = stage_row_sums(model, pc, shape, transforms, config.parallelism.pp_timeout_s)

    def due(self, step: int) -> bool:
        interval = self.args.eval_interval
        return step == self.config.tokens.train_steps or (interval is not None and step % interval == 0)

    def run(self, step: int) -> dict:
        """The step record's fields of an evaluation after step ``step`` (none if it failed), written with the
        examples' details to ``evals/<step>.json`` by rank 0."""
        if self.pc.device.type == "cuda":
            torch.cuda.synchronize(self.pc.device)  # the step's own work is not the evaluation's time
        start = time.perf_counter()
        tokens = self.config.tokens
        try:
            with buffers_kept(self.model):
                results = evaluation_results(self.tasks, self.held_out, self.row_sums, self.pc,
                                             tokens.micro_batch_size, tokens.sequence_length)
        except Exception as error:  # noqa: BLE001 - an evaluation never stops the run it watches
            message = f"{type(error).__name__}: {error}".splitlines()[0]
            if message not in self.reported:
                self.reported.add(message)
                logger.error(f"the evaluation after step {step} failed and training goes on: {message}")
            return {}
        seconds = time.perf_counter() - start
        fields = {f"eval/{name}/{metric}": value for name, result in results.items()
                  for metric, value in result.items() if metric in SCALAR_METRICS}
        if self.pc.rank == 0:
            folder = self.config.checkpoints.checkpoints_path / "evals"
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(folder / f"{step}.json", json.dumps(results, indent=1))
            logger.info(f"eval after step {step} ({seconds:.1f}s): "
                        + " | ".join(f"{key.removeprefix('eval/')} {value:.4f}" for key, value in fields.items()))
        return fields | {EVAL_TIME: seconds}
