"""The training loop: build everything from a validated config, then step, log and checkpoint.

One optimizer step: the step program (``training/step.py``) runs the forward and backward of the step's
micro-batches, with loss = token-loss sum / the global batch's count of target tokens, and returns the step's
statistics, the same on every rank; then the global grad-norm, clipping, and the update of the fp32 masters with the
LR of this step. The loss and norm reach the host while the next step is queued; a non-finite one stops the run
loudly before anything is saved (or, with ``optimizer.skip_bad_steps``, is judged before the update, which is then
skipped).

The trainer names no objective, batch transform or training feature: the run's parts hand them in (``training/step.py``
says who hands in what), and features (``features/``) are called through their hooks (``training/hooks.py``) at
fixed points. Its pieces are in ``training/``: building the run (``build.py``), its folder and checkpoints
(``checkpointing.py``), the step (``step.py``, ``objective.py``) and the record of each step (``step_log.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from collections.abc import Sequence

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from nanotron.checkpoint.node_folders import take_the_ranks_of_node_folders
from nanotron.config import Config, DatasetStageArgs, expand_run_name, validate_config
from nanotron.data.batch import MicroBatch
from nanotron.data.loader import MicroBatchLoader
from nanotron.divergence import BadStepGuard
from nanotron.features import Feature, features_for
from nanotron.layout import Group, Layout
from nanotron.logging import setup_logging
from nanotron.models.build import ModuleConverter
from nanotron.models.registry import spec_for_config
from nanotron.nn.flash_attention import device_problems
from nanotron.optim.clip import GlobalGradNorm, clip_coefficient
from nanotron.optim.lr_schedule import learning_rate_at
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.data_parallel import check_replicas_agree
from nanotron.parallel.placement import logical_parameters
from nanotron.parallel.statistics import Statistics
from nanotron.preemption import StopRequests
from nanotron.random import seed_everything
from nanotron.training.build import document_ends, load_data, log_summary, profiler, trained_model
from nanotron.training.checkpointing import RunCheckpoints
from nanotron.training.evals import EVAL_TIME, InLoopEvals
from nanotron.training.hooks import Run
from nanotron.training.objective import LOSS
from nanotron.training.step import StepProgram
from nanotron.training.step_log import HostCopy, PendingStep, StepLog, StepResult

logger = logging.getLogger("nanotron.trainer")


class Trainer:
    """Trains the model that ``config`` describes; ``converters`` change its modules before weights exist (e.g.
    swap linears for other implementations); ``features`` are the run's training features (default: those the
    config asks for, ``features_for``)."""

    def __init__(self, config: Config, converters: tuple[ModuleConverter, ...] = (),
                 features: Sequence[Feature] | None = None):
        self.config = expand_run_name(config)
        take_the_ranks_of_node_folders(config.checkpoints)  # node-local checkpoints: whatever order the nodes join in
        self.pc = ParallelContext(Layout.from_config(config))
        self.checkpoints: RunCheckpoints | None = None  # the run folder's lock, taken first by ``_set_up``
        self._stage_loader: MicroBatchLoader | None = None  # the current data stage's, while training
        try:
            self._set_up(converters, features)
        except BaseException:
            self.close()  # a failed set-up leaves no lock or process group behind (in-process callers, tests)
            raise

    def _set_up(self, converters: tuple[ModuleConverter, ...], features: Sequence[Feature] | None) -> None:
        config = self.config
        validate_config(config, self.pc.world_size, device_problems(config.model, self.pc.device))
        setup_logging(self.pc, config.logging.log_level, config.logging.log_level_replica)
        seed_everything(config.general.seed + self.pc.rank)
        self.features = list(features_for(config) if features is None else features)

        self.checkpoints = RunCheckpoints(config, self.pc)
        self.datasets, self.tokenizer_fingerprint = load_data(config, self.pc, self.features)
        self.evals = InLoopEvals(config, self.pc) if config.evals is not None else None  # read before the model
        # Per stage; None: no document masking, or samples that carry their documents' ends.
        self.document_ends = document_ends(config, self.datasets)
        model_config = config.model.model_config
        initial = self.checkpoints.initial_checkpoint(self.datasets, self.features)
        self.checkpoints.check_metrics_file(initial)
        converters = (*converters, *(c for feature in self.features for c in feature.converters(self.pc.device)))
        self.model, self.buckets, self.optimizer, self.sharded_units = trained_model(config, self.pc, converters)
        self.params = logical_parameters(self.model)
        if self.evals is not None:
            self.evals.start(self.model)
        self.grad_norm = GlobalGradNorm(self.buckets, self.pc)
        # FLOPs per token over whole causal sequences; under document masking the step log counts each step's pairs
        self.costs = spec_for_config(model_config).costs(model_config, self.model.padded_vocab_size,
                                                         config.tokens.sequence_length)
        self.program = StepProgram.build(config, self.pc, self.model, self.buckets, self.datasets, self.features,
                                         self.costs)
        self.bad_steps = BadStepGuard(config.optimizer.skip_bad_steps, config.optimizer.loss_spike_factor)
        self.progress = self.checkpoints.load_initial_state(initial, self.model, self.optimizer)

        self.num_parameters, self.flops_per_token = self.costs.parameters, self.costs.flops_per_token
        self.step_log = StepLog(config, self.pc, self.costs, self.progress.step)
        log_summary(config, self.pc, self.model, self.num_parameters)
        run = Run(self.model, self.pc, config, self.progress, config.checkpoints.checkpoints_path)
        for feature in self.features:
            feature.start(run)

    # --- training --------------------------------------------------------------------------------------------

    def train_step(self, micro_batches: list[MicroBatch], lr: float) -> PendingStep:
        """Forward, backward, clip and update, queued without waiting for the GPU: the step's loss, norm and
        statistics travel to the host behind the work that computes them, and ``finish_step`` reads them. The
        training loop queues the next step first, so the GPU does not wait for the host between steps. Unless bad
        steps are to be skipped (``divergence.py``): judging them before the update waits for the loss and norm."""
        step, guard = self.progress.step + 1, self.bad_steps
        statistics = self.program.run(micro_batches, step)
        grad_norm = self.grad_norm()
        readings = HostCopy(statistics | {"grad_norm": grad_norm})
        pending = functools.partial(PendingStep, step, lr, readings, judged=guard.judges_before_update)
        if guard.judges_before_update:
            values = readings.values()
            reason = guard.judge(values[LOSS].item(), values["grad_norm"].item())
            if reason is not None:
                self.buckets.zero()
                self._after_optimizer_step(skipped=True)
                self._on_bad_step(step, reason)
                self._after_step(step, statistics, skipped=True)
                return pending(self._feature_metrics(), skipped=True)
        clip = self.config.optimizer.clip_grad
        self.optimizer.step(lr, clip_coefficient(grad_norm, clip) if clip is not None else None)
        self.buckets.zero()
        self._after_optimizer_step(skipped=False)
        self._after_step(step, statistics, skipped=False)
        return pending(self._feature_metrics() | self.optimizer.metrics())

    def finish_step(self, pending: PendingStep) -> StepResult:
        """The record of a queued step, read from its host copies (waiting for its work if that still runs). A bad
        step not judged before its update stops the run here: the policy that judges after the update skips none
        (``divergence.py``), and the loop finishes a step before saving it, so nothing of it is saved."""
        values = pending.readings.values()
        loss, norm = values[LOSS].item(), values["grad_norm"].item()
        if not pending.judged:
            reason = self.bad_steps.judge(loss, norm)
            if reason is not None:
                self._on_bad_step(pending.step, reason)
        domain_losses, metrics = self.program.report(pending.step, values, pending.skipped)
        return StepResult(loss, norm, pending.lr, domain_losses, skipped=pending.skipped,
                          model_metrics=pending.model_metrics | metrics, statistics=values)

    def _after_optimizer_step(self, skipped: bool) -> None:
        for feature in self.features:
            feature.after_optimizer_step(skipped)

    def _after_step(self, step: int, statistics: Statistics, skipped: bool) -> None:
        for feature in self.features:
            feature.after_step(step, statistics, skipped)

    def _feature_metrics(self) -> dict:
        return {key: value for feature in self.features for key, value in feature.metrics().items()}

    def _on_bad_step(self, step: int, reason: str) -> None:
        """Keep the newest checkpoint from before the trouble out of pruning, then skip the step or stop."""
        if self.bad_steps.bad_in_a_row == 1:
            self.checkpoints.protect_latest()
        self.bad_steps.skip_or_stop(step, reason)

    def train(self) -> None:
        config = self.config
        if self.progress.step == 0 and config.checkpoints.save_initial_state:
            self.save()
        train_steps = config.tokens.train_steps
        show_bar = self.pc.rank == 0 and sys.stderr.isatty()
        bar = tqdm(total=train_steps, initial=self.progress.step, disable=not show_bar, unit="step", dynamic_ncols=True)
        redirect = logging_redirect_tqdm([logging.getLogger("nanotron")]) if show_bar else contextlib.nullcontext()
        try:
            with redirect, profiler(self.config, self.pc) as torch_profiler, StopRequests() as stop:
                self._loop(bar, torch_profiler, stop)
        finally:
            self._close_loader()  # whatever ended the loop: its workers would outlive it
            for feature in self.features:
                feature.after_training()
        self.wait_for_saves()
        bar.close()
        self.step_log.close()
        logger.info(f"training finished at step {self.progress.step}")

    def _loop(self, bar: tqdm, torch_profiler, stop: StopRequests) -> None:
        """Steps until ``tokens.train_steps`` or an agreed stop request, saving on the way. Each step is finished
        (read, judged, logged) once the next one is queued, or at once where it is saved, stopped at or the last."""
        config, train_steps = self.config, self.config.tokens.train_steps
        loader, loader_stage = None, None
        start_step = self.progress.step
        # since the first step and the last logged one (the steps finished since), evaluations' time left out
        window = {"run": time.perf_counter(), "start": time.perf_counter(), "steps": 0}
        pending: PendingStep | None = None

        def finish(done: PendingStep, evaluation: dict | None = None) -> None:
            result = self.finish_step(done)
            self.step_log.count(result)
            window["steps"] += 1
            if evaluation:
                window["run"] += evaluation[EVAL_TIME]
                window["start"] += evaluation[EVAL_TIME]
            if (done.step % config.logging.iteration_step_info_interval == 0 or done.step == train_steps
                    or evaluation):
                now = time.perf_counter()
                self.step_log.write(result, done.step, self.progress.consumed_tokens,
                                    (now - window["start"]) / window["steps"],
                                    (now - window["run"]) / (done.step - start_step), evaluation or {})
                window.update(start=now, steps=0)

        for step in range(self.progress.step + 1, train_steps + 1):
            stage = config.data_stage_at(step)
            if stage.name != loader_stage:
                self._close_loader()  # its workers end
                loader = self._stage_loader = self.loader(stage)
                loader_stage = stage.name
                logger.info(f"data stage {stage.name!r} from step {step}")
            start = self.progress.lr_schedule_start
            lr = learning_rate_at(step - start, config.optimizer.learning_rate_scheduler, train_steps - start)
            queued = self.train_step(loader.next_step(), lr)
            if pending is not None:
                finish(pending)  # the previous step, while this one runs
            pending = queued
            self.progress.step = step
            interval = config.parallelism.replica_check_interval
            if interval is not None and step % interval == 0:
                check_replicas_agree(self.buckets, step)
            self.progress.consumed_samples[stage.name] = (
                self.progress.consumed_samples.get(stage.name, 0) + config.global_batch_size
            )
            self.progress.consumed_tokens += config.global_batch_tokens
            bar.update(1)
            if torch_profiler is not None:
                torch_profiler.step()
            saved = step % config.checkpoints.checkpoint_interval == 0 or (
                step == train_steps and config.checkpoints.save_final_state
            )
            stopping = stop.agreed(self.pc.host_group)
            evaluation = self.evals.run(step) if self.evals is not None and self.evals.due(step) else None
            if saved or stopping or step == train_steps or evaluation is not None:
                finish(pending, evaluation)
                pending = None
            if saved:
                self.save()
            if stopping:
                if not saved:
                    self.save()
                self.wait_for_saves()
                logger.warning(f"{stop.signal_name} received: stopped after step {step} with a checkpoint; "
                               "run again with checkpoints.resume_checkpoint_path: auto to continue")
                return

    def loader(self, stage: DatasetStageArgs) -> MicroBatchLoader:
        """The micro-batches of ``stage`` from where training stands."""
        t = self.config.tokens
        return MicroBatchLoader(
            self.datasets[stage.name],
            first_sample=self.progress.consumed_samples.get(stage.name, 0),
            start_step=0,
            micro_batch_size=t.micro_batch_size,
            accumulation=t.batch_accumulation_per_replica,
            dp_rank=self.pc.layout.sample_shard(self.pc.coordinates),
            dp_size=self.pc.size(Group.SAMPLE_SHARDS),
            num_workers=stage.data.num_loading_workers,
            end_of_document=self.document_ends[stage.name],
        )

    def _close_loader(self) -> None:
        if self._stage_loader is not None:
            self._stage_loader.close()
            self._stage_loader = None

    def save(self) -> None:
        """Checkpoint the current step, in the foreground or (``checkpoints.async_save``) in the background."""
        self.checkpoints.save(self.model, self.optimizer, self.progress, self.tokenizer_fingerprint, self.features)

    def wait_for_saves(self) -> None:
        self.checkpoints.wait()

    def close(self) -> None:
        """Leave no process group and no lock behind; the lock goes even if the process group cannot."""
        try:
            self.pc.destroy()
        finally:
            if self.checkpoints is not None:
                self.checkpoints.close()
