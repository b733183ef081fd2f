"""Which samples every data-parallel rank trains on at every step, and the iterator that loads them.

The global batch of step ``s`` (counted from the start of a data stage) is the contiguous range of global
sample indices ``first_sample + s * global_batch_size + [0, global_batch_size)``. Data-parallel rank ``d``
takes the ``d``-th contiguous block of it, cut into micro-batches. The union over ranks is the global batch for
any data-parallel size, so a run trains on the same samples whatever its layout, and resuming at step ``s``
needs nothing but ``s``.
"""

import atexit
import functools
import itertools
import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from nanotron.data.batch import MicroBatch
from nanotron.data.dataset import DataError, SampleSource
from nanotron.preemption import STOP_SIGNALS

# Signals meant for the training process that reach its loader workers too: schedulers signal every process of a job
# (Slurm's scancel and --signal) or a process group (a terminal's Ctrl-C), and torchrun signals each rank's group.
TRAINER_SIGNALS = (*STOP_SIGNALS, signal.SIGINT)
# How long a failed read waits for a worker to be seen dead: a killed worker's pipes close before it can be reaped.
DEATH_NOTICE_S = 2.0


class LoaderWorkerError(DataError):
    """A data loader worker process died (the out-of-memory killer, say): its rank cannot go on."""


def global_batch_indices(step: int, first_sample: int, global_batch_size: int) -> range:
    """Global sample indices of the ``step``-th (0-based) global batch of a stage starting at ``first_sample``."""
    start = first_sample + step * global_batch_size
    return range(start, start + global_batch_size)


def rank_micro_batches(indices: range, dp_rank: int, dp_size: int, micro_batch_size: int,
                       accumulation: int) -> list[range]:
    """The ``accumulation`` micro-batches of ``micro_batch_size`` samples that ``dp_rank`` takes from ``indices``."""
    per_rank = micro_batch_size * accumulation
    if len(indices) != dp_size * per_rank:
        raise DataError(f"the global batch of {len(indices)} samples cannot be split into dp_size {dp_size} x "
                        f"micro_batch_size {micro_batch_size} x accumulation {accumulation} = "
                        f"{dp_size * per_rank} samples; make the global batch size equal to that product")
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
    block = indices[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [block[micro * micro_batch_size:(micro + 1) * micro_batch_size] for micro in range(accumulation)]


def packed_documents(ends: torch.Tensor) -> dict[str, torch.Tensor]:
    """The documents packed in each sample, from ``ends`` [batch, seq] (bool: True on the last token of every
    document, be it an end-of-document token or a document end that the data records), as datatrove and upstream
    nanotron count them: the last token belongs to the document it ends, and the next token starts another.

    ``document_ids`` number the documents of a sample from 0; ``position_ids`` restart at 0 at the start of the sample
    and after each document's last token; ``label_mask`` leaves out the target that follows it (the next document's
    first token, which nothing inside that document can predict).
    """
    index = torch.arange(ends.shape[1]).expand_as(ends)
    starts = torch.ones_like(ends)
    starts[:, 1:] = ends[:, :-1]
    first_of_document = torch.where(starts, index, 0).cummax(dim=1).values
    return {"position_ids": index - first_of_document, "document_ids": ends.cumsum(dim=1) - ends.long(),
            "label_mask": ~ends}


def _to_micro_batch(samples: dict[str, torch.Tensor], end_of_document: int | None) -> MicroBatch:
    """Inputs and next-token labels from windows of ``sequence_length + 1`` tokens; under document masking the
    documents packed in them too (``packed_documents``): where the samples carry the document ends their source
    recorded (``SampleSource.records_document_ends``), else where the ``end_of_document`` id stands. Samples that mark
    the tokens trained on (``trained``, supervised fine-tuning's) count only those as targets."""
    tokens = samples["tokens"]
    input_ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    fields = {"label_mask": torch.ones_like(labels, dtype=torch.bool)}
    if "document_ends" in samples:
        fields |= packed_documents(samples["document_ends"][:, :-1])
    elif end_of_document is not None:
        fields |= packed_documents(input_ids == end_of_document)
    if "trained" in samples:
        fields["label_mask"] = fields["label_mask"] & samples["trained"][:, 1:]
    return MicroBatch(input_ids, labels, domain_ids=samples["domain_ids"], **fields)


class _RankMicroBatches(Dataset):
    """Micro-batch ``k`` of one rank, counted from the start step, as a map-style dataset.

    Indexing by ``k`` (rather than iterating) lets a multi-worker DataLoader, which returns items in sampler
    order, produce exactly the sequence a single process would.
    """

    def __init__(self, dataset: SampleSource, first_sample: int, start_step: int, micro_batch_size: int,
                 accumulation: int, dp_rank: int, dp_size: int, end_of_document: int | None):
        self.dataset = dataset
        self.end_of_document = end_of_document
        self.first_sample = first_sample
        self.start_step = start_step
        self.micro_batch_size = micro_batch_size
        self.accumulation = accumulation
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    def __getitem__(self, k: int) -> MicroBatch | DataError:
        """The micro-batch, or the ``DataError`` that reading it met (a file changed since it was checked), returned
        so that a worker passes it on as it is: the DataLoader would raise it again wrapped in the worker's
        traceback, lines where the user is owed one."""
        step, micro = divmod(k, self.accumulation)
        global_batch_size = self.dp_size * self.micro_batch_size * self.accumulation
        indices = global_batch_indices(self.start_step + step, self.first_sample, global_batch_size)
        micro_batches = rank_micro_batches(indices, self.dp_rank, self.dp_size, self.micro_batch_size,
                                           self.accumulation)
        try:
            return _to_micro_batch(self.dataset.samples(micro_batches[micro]), self.end_of_document)
        except DataError as error:
            return error


def _leave_trainer_signals_to_the_trainer(worker_id: int) -> None:
    """Loader workers ignore the trainer's signals: one dying of a stop signal would crash its rank in the step the
    rank finishes before saving. The rank ends its workers when its loader goes (end of a data stage or of the
    process); a worker whose rank died notices and exits."""
    for number in TRAINER_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


def _end_workers(workers: list[multiprocessing.Process]) -> None:
    """Kill loader workers and wait for them. They hold nothing but read-only memory maps and batches in flight, and
    ignore SIGTERM (``_leave_trainer_signals_to_the_trainer``), with which the interpreter's exit ends daemon processes
    before joining them: a worker left to that exit keeps its rank waiting forever."""
    for worker in workers:
        if worker.is_alive():
            worker.kill()
    for worker in workers:
        worker.join()


def _how_it_ended(worker: multiprocessing.Process) -> str:
    code = worker.exitcode
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


class MicroBatchLoader:
    """This data-parallel rank's micro-batches, step after step, from ``start_step`` of a data stage on.

    Each micro-batch is a ``MicroBatch`` (``data/batch.py``) of ``micro_batch_size`` samples of ``S`` tokens; under
    document masking (``_to_micro_batch``) with its ``position_ids`` and ``document_ids``, computed here (in the
    workers, off the training loop) and read by every pipeline stage. With ``num_workers > 0`` worker processes load
    ahead of the training loop; the batches are identical to those of ``num_workers = 0``. ``close`` ends the workers;
    so does the exit of the process, also where an exception left the loader referenced (by its traceback) until then.
    """

    def __init__(self, dataset: SampleSource, *, first_sample: int, start_step: int, micro_batch_size: int,
                 accumulation: int, dp_rank: int, dp_size: int, num_workers: int = 0,
                 end_of_document: int | None = None):
        for name, value, minimum in (("first_sample", first_sample, 0), ("start_step", start_step, 0),
                                     ("micro_batch_size", micro_batch_size, 1), ("accumulation", accumulation, 1),
                                     ("dp_size", dp_size, 1), ("num_workers", num_workers, 0)):
            if value < minimum:
                raise DataError(f"{name} must be at least {minimum}, got {value}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.accumulation = accumulation
        self.step = start_step  # the stage step that next_step() returns
        micro_batches = _RankMicroBatches(dataset, first_sample, start_step, micro_batch_size, accumulation,
                                          dp_rank, dp_size, end_of_document)
        self._iterator: Iterator[MicroBatch | DataError]
        self._workers: list[multiprocessing.Process] = []
        if num_workers == 0:
            self._iterator = map(micro_batches.__getitem__, itertools.count())
        else:
            before, sigchld = set(multiprocessing.active_children()), signal.getsignal(signal.SIGCHLD)
            # batch_size=None: every item already is a micro-batch; the sampler just counts k = 0, 1, 2, ...
            self._iterator = iter(DataLoader(micro_batches, batch_size=None, sampler=range(sys.maxsize),
                                             num_workers=num_workers, prefetch_factor=2,
                                             worker_init_fn=_leave_trainer_signals_to_the_trainer))
            self._workers = [p for p in multiprocessing.active_children() if p not in before]
            # Runs before multiprocessing's own exit handler (registered earlier), which would wait on them forever.
            self._end_at_exit = functools.partial(_end_workers, self._workers)
            atexit.register(self._end_at_exit)
            # torch's SIGCHLD handler raises a dead worker's error wherever the process is (in a collective, a save,
            # the report of another error); without it, next_step notices the death when it reads, and names it.
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGCHLD, sigchld)

    def next_step(self) -> list[MicroBatch]:
        """The ``accumulation`` micro-batches of the next step."""
        try:
            micro_batches = [next(self._iterator) for _ in range(self.accumulation)]
        except Exception:
            dead = self._dead_worker()
            if dead is None:
                raise
            raise LoaderWorkerError(
                f"data loader worker (pid {dead.pid}) {_how_it_ended(dead)}; the run stopped without saving this "
                "step. If the system ran out of memory, lower data_stages[].data.num_loading_workers (0 loads in the "
                "training process); continue with checkpoints.resume_checkpoint_path: auto") from None
        for micro_batch in micro_batches:
            if isinstance(micro_batch, DataError):
                raise micro_batch
        self.step += 1
        return micro_batches

    def close(self) -> None:
        """End the worker processes now (the end of a data stage or of training, or an error in a step)."""
        if self._workers:
            atexit.unregister(self._end_at_exit)
            _end_workers(self._workers)

    def _dead_worker(self) -> multiprocessing.Process | None:
        deadline = time.monotonic() + DEATH_NOTICE_S
        while True:
            dead = next((worker for worker in self._workers if worker.exitcode is not None), None)
            if dead is not None or time.monotonic() > deadline:
                return dead
            time.sleep(0.05)
