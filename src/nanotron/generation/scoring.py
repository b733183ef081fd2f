"""Log-likelihood scoring of token rows at any layout, and the metrics of multiple-choice tasks and held-out text.

A row (``tasks.Row``) is scored by the sum of the log-probabilities of its last ``scored`` tokens given the tokens
before them. Rows go through the model in batches of ``rows_per_batch``, padded on the right to ``sequence_length``
(causal attention keeps the padding out of every real token's prediction), without gradients: through every pipeline
stage's model chunks in order, each stage sending its activations on (``stage_row_sums``); under context
parallelism each rank reads its tokens of every row (``ContextParallelBatches``). The data-parallel ranks (and the
expert-parallel ones, which read their own samples) take turns at the batches, every rank running the same number
of them (expert parallelism exchanges tokens between them); the sums are added over pipeline stages, data, expert
and context ranks in one all-reduce (tensor-parallel ranks hold the same sums), so every rank returns every row's.

Metrics, as lm-eval-harness defines them: ``acc`` counts the examples whose gold choice has the highest
log-likelihood, ``acc_norm`` those whose gold choice has the highest log-likelihood per character of the choice
(the first choice wins ties); held-out text gets the mean loss over its target tokens and its exponential.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from nanotron.data.batch import BatchTransform, MicroBatch
from nanotron.generation.tasks import Row, TaskRows
from nanotron.layout import Axis, Group
from nanotron.models.build import stage_chunks
from nanotron.models.spec import CausalLM
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.cross_entropy import vocab_parallel_token_losses
from nanotron.parallel.pipeline_parallel import P2P

# (ids, labels, mask) [rows, sequence] -> each row's sum of masked target log-probabilities on the stage holding the
# LM head (this rank's tokens of it), None on the other stages.
RowSums = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def row_batch(rows: Sequence[Row], size: int, sequence_length: int) -> tuple[torch.Tensor, ...]:
    """``size`` rows of ``sequence_length`` tokens (ids, labels, scored mask), padded with zeros and no scored token."""
    ids = torch.zeros(size, sequence_length, dtype=torch.long)
    labels, mask = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    for index, row in enumerate(rows):
        length = len(row.tokens) - 1
        ids[index, :length] = torch.tensor(row.tokens[:-1])
        labels[index, :length] = torch.tensor(row.tokens[1:])
        mask[index, length - row.scored:length] = True
    return ids, labels, mask


def stage_row_sums(model: CausalLM, pc: ParallelContext, activation_shape: tuple[int, int, int],
                   transforms: Sequence[BatchTransform] = (), timeout_s: float = 600.0) -> RowSums:
    """The ``RowSums`` of this rank's stage ``model``: its chunks in model order, activations of
    ``activation_shape`` exchanged with the other stages (the layout's, ``Layout.stage_activation_shape``, for a
    training model), each batch through ``transforms`` first (context parallelism's)."""
    dtype = model.config.activation_dtype(next(model.parameters()).dtype)
    p2p = P2P(pc, activation_shape, dtype, timeout_s)
    layout, stage = pc.layout, pc.coord(Axis.PP)
    chunks = list(zip(layout.chunks_of(stage), stage_chunks(model), strict=True))

    def row_sums(ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        batch = MicroBatch(ids, labels, mask, torch.zeros(len(ids), dtype=torch.long)).to(pc.device)
        for transform in transforms:
            batch = transform.prepare(batch)
        inputs = batch.model_inputs()
        for transform in transforms:
            inputs |= transform.model_inputs(batch)
        out = None
        for chunk, view in chunks:
            if chunk > 0 and layout.stage_of(chunk - 1) != stage:
                out = p2p.recv_from(layout.stage_of(chunk - 1))
            out = view(input_ids=batch.input_ids, hidden_states=out, **inputs)
            if chunk < layout.chunks - 1 and layout.stage_of(chunk + 1) != stage:
                p2p.send_to(out, layout.stage_of(chunk + 1))
        if model.lm_head is None:
            return None
        losses = vocab_parallel_token_losses(out, batch.labels, pc.group(Group.TP), model.config.vocab_size)
        return -(losses.double() * batch.label_mask).sum(-1)

    return row_sums


@torch.no_grad()
def log_likelihoods(rows: Sequence[Row], row_sums: RowSums, pc: ParallelContext, rows_per_batch: int,
                    sequence_length: int) -> torch.Tensor:
    """Every row's log-likelihood (float64, on the CPU), the same on every rank."""
    shard, shards = pc.layout.sample_shard(pc.coordinates), pc.size(Group.SAMPLE_SHARDS)
    totals = torch.zeros(len(rows), dtype=torch.float64, device=pc.device)
    for turn in range(math.ceil(len(rows) / (rows_per_batch * shards))):
        first = (turn * shards + shard) * rows_per_batch
        batch = rows[first:first + rows_per_batch]
        sums = row_sums(*row_batch(batch, rows_per_batch, sequence_length))
        if sums is not None and batch:
            totals[first:first + len(batch)] += sums[:len(batch)]
    dist.all_reduce(totals, group=pc.group(Group.STATISTICS))
    return totals.cpu()


def choice_metrics(task: TaskRows, lls: torch.Tensor) -> dict:
    """``acc``, ``acc_norm`` and the examples' choice log-likelihoods of a task from its rows' ``lls``."""
    per_example = [lls[start:end].tolist() for start, end in zip(task.starts, task.starts[1:])]
    correct = normed = 0
    for example, scores in zip(task.examples, per_example):
        correct += max(range(len(scores)), key=lambda i: (scores[i], -i)) == example.gold
        per_char = [score / max(len(choice), 1) for score, choice in zip(scores, example.choices)]
        normed += max(range(len(per_char)), key=lambda i: (per_char[i], -i)) == example.gold
    count = len(task.examples)
    return {"acc": correct / count, "acc_norm": normed / count, "examples": count,
            "loglikelihoods": per_example, "gold": [example.gold for example in task.examples]}


def held_out_metrics(rows: Sequence[Row], lls: torch.Tensor) -> dict:
    """The mean loss over a held-out source's target tokens, its perplexity and the number of tokens."""
    tokens = sum(row.scored for row in rows)
    loss = -lls.sum().item() / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": tokens}


def window_rows(read: Callable[[int, int], Sequence[int]], starts: Sequence[int], sequence_length: int) -> list[Row]:
    """Held-out windows as rows: ``sequence_length + 1`` tokens from each start, every prediction scored."""
    return [Row(tuple(int(t) for t in read(start, sequence_length + 1)), sequence_length) for start in starts]


def evaluation_results(tasks: Sequence[TaskRows], held_out: dict[str, list[Row]], row_sums: RowSums,
                       pc: ParallelContext, rows_per_batch: int, sequence_length: int) -> dict[str, dict]:
    """Each task's and each held-out source's metrics, by name (the same on every rank)."""
    def scored(rows: Sequence[Row]) -> torch.Tensor:
        return log_likelihoods(rows, row_sums, pc, rows_per_batch, sequence_length)

    results = {task.name: choice_metrics(task, scored(task.rows)) for task in tasks}
    return results | {name: held_out_metrics(rows, scored(rows)) for name, rows in held_out.items()}
