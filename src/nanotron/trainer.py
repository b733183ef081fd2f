"""The training loop: build everything from a validated config, then step, log and checkpoint.

One optimizer step:
1. count the target tokens of the whole global batch (all micro-batches, all data- and context-parallel ranks);
2. forward and backward every micro-batch with loss = token-loss sum / that global count;
3. sum gradients over data-parallel ranks (bucket by bucket, during the last backward), take the global
   grad-norm, clip;
4. update the fp32 masters with the LR of this step. The loss and norm reach the host while the next step is
   queued; a non-finite one stops the run loudly before anything is saved (or, with ``optimizer.skip_bad_steps``,
   is judged before the update, which is then skipped).
Because of (1) and (2), every split of the global batch into ranks and micro-batches gives the same gradients.
The loss and the per-domain statistics travel as step statistics (``parallel/statistics.py``): summed over
micro-batches by the schedule and over stages and data-parallel ranks in one collective, so every rank knows them.

Training features (FP8, DoReMi) are ``features/``: the trainer calls their hooks (``training/hooks.py``) at fixed
points and knows none of them. Its pieces are in ``training/``: building the run (``build.py``), its folder and
checkpoints (``checkpointing.py``), the objective (``loss.py``) and the record of each step (``step_log.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from nanotron.checkpoint.node_folders import take_the_ranks_of_node_folders
from nanotron.config import Config, expand_run_name, validate_config
from nanotron.data.loader import MicroBatchLoader
from nanotron.divergence import BadStepGuard
from nanotron.features import Feature, features_for
from nanotron.layout import Axis, Group, Layout
from nanotron.logging import setup_logging
from nanotron.models.build import BuildOptions, ModuleConverter, build_model
from nanotron.models.registry import spec_for_config
from nanotron.optim.clip import GlobalGradNorm, clip_coefficient
from nanotron.optim.lr_schedule import learning_rate_at
from nanotron.optim.optimizer import build_optimizer
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.context_parallel import context_parallel_masks, split_micro_batch
from nanotron.parallel.data_parallel import check_replicas_agree, sync_tied_copies
from nanotron.parallel.pipeline_parallel import StageOutput
from nanotron.parallel.placement import declared_names, logical_parameters
from nanotron.parallel.statistics import Statistics, sum_over_replicas
from nanotron.preemption import StopRequests
from nanotron.random import seed_everything
from nanotron.training.build import document_ends, fused_head_loss, load_data, log_summary, pipeline_schedule
from nanotron.training.checkpointing import RunCheckpoints
from nanotron.training.loss import StepLoss, logit_z_loss, mean_weights
from nanotron.training.step_log import HostCopy, PendingStep, StepLog, StepResult

logger = logging.getLogger("nanotron.trainer")


class TrainingDivergedError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


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
        self.loader: MicroBatchLoader | None = None  # the current data stage's, while training
        try:
            self._set_up(converters, features)
        except BaseException:
            self.close()  # a failed set-up leaves no lock or process group behind (in-process callers, tests)
            raise

    def _set_up(self, converters: tuple[ModuleConverter, ...], features: Sequence[Feature] | None) -> None:
        config, p = self.config, self.config.parallelism
        validate_config(config, world_size=self.pc.world_size, device=self.pc.device)
        setup_logging(self.pc, config.logging.log_level, config.logging.log_level_replica)
        seed_everything(config.general.seed + self.pc.rank)
        self.features = list(features_for(config) if features is None else features)

        self.checkpoints = RunCheckpoints(config, self.pc)
        self.datasets, self.tokenizer_fingerprint = load_data(config, self.pc, self.features)
        # Per stage; None: no document masking, or samples that carry their documents' ends.
        self.document_ends = document_ends(config, self.datasets)
        model_config = config.model.model_config
        self.auxiliary_losses = spec_for_config(model_config).auxiliary_losses
        self._document_masking = spec_for_config(model_config).document_masking(model_config)
        self.z_loss = spec_for_config(model_config).logit_z_loss(model_config)  # its coefficient; 0: none
        initial = self.checkpoints.initial_checkpoint(self.datasets, self.features)
        self.checkpoints.check_metrics_file(initial)
        converters = (*converters, *(c for feature in self.features for c in feature.converters(self.pc.device)))
        self.model = build_model(model_config, self.pc, BuildOptions.from_config(config), converters)
        self.params = logical_parameters(self.model)
        self.buckets, self.optimizer = build_optimizer(
            self.params, config.optimizer, config.model.ddp_bucket_cap_mb, self.pc.reduction_groups,
            declared_names(self.model, "no_weight_decay_parameters"),
            single_micro_batch=config.tokens.batch_accumulation_per_replica == 1,
        )
        self.grad_norm = GlobalGradNorm(self.buckets, self.pc)
        self.schedule = pipeline_schedule(config, self.pc, self._stage_forward, self._before_last_backward)
        self.loss = next((loss for feature in self.features if (loss := feature.loss()) is not None), StepLoss())
        # Compiling the loss fuses the fp32 upcast of the logits into the softmax instead of materialising it.
        self._loss = torch.compile(self.loss.function) if config.model.compile else self.loss.function
        self._z_loss = torch.compile(logit_z_loss) if config.model.compile else logit_z_loss
        self.head_loss = fused_head_loss(config, self.pc, self.model)
        self.bad_steps = BadStepGuard(config.optimizer.skip_bad_steps, config.optimizer.loss_spike_factor)
        self.progress = self.checkpoints.load_initial_state(initial, self.model, self.optimizer)

        # FLOPs per token over whole causal sequences; under document masking the step log counts each step's pairs
        self.costs = spec_for_config(model_config).costs(model_config, self.model.padded_vocab_size,
                                                         config.tokens.sequence_length)
        self.num_parameters = self.costs.parameters
        self.flops_per_token = self.costs.flops_per_token
        self.hardware_flops_per_token = self.costs.hardware_flops_per_token(p.recompute_layer, p.recompute_granularity)
        self.step_log = StepLog(config, self.pc, self.costs, self.progress.step)
        log_summary(config, self.pc, self.model, self.num_parameters)
        for feature in self.features:
            feature.start(self)

    # --- training --------------------------------------------------------------------------------------------

    def _stage_forward(self, micro_batch: dict[str, torch.Tensor], hidden_states: torch.Tensor | None) -> StageOutput:
        """This pipeline stage's forward; the last stage returns the micro-batch's share of the step loss."""
        logits = self.head_loss is None  # else the last stage returns the head's input, for the fused loss
        # A later stage takes the ids too, for the sequence's length (its rotary tables), not for their values; every
        # stage takes the tokens' positions and document ids, which micro-batches hold under document masking, and
        # under context parallelism the masks of the rank's part of the sequence.
        inputs = {key: micro_batch[key] for key in ("position_ids", "document_ids") if key in micro_batch}
        if self.pc.size(Axis.CP) > 1:
            inputs["masks"] = context_parallel_masks(micro_batch, self.pc.coord(Axis.CP), self.pc.size(Axis.CP),
                                                     getattr(self.model, "flash_attention", False))
        output = self.model(input_ids=micro_batch["input_ids"], hidden_states=hidden_states, head=logits, **inputs)
        auxiliary_loss, statistics = None, {}
        if self.auxiliary_losses is not None:
            auxiliary_loss, statistics = self.auxiliary_losses.collect(self.model, self.config.global_batch_size)
        if not self.pc.is_last_stage:
            return StageOutput(output, statistics, auxiliary_loss)
        vocab_size = self.config.model.model_config.vocab_size
        if logits:
            loss, loss_statistics = self._loss(output, micro_batch, self.pc.group(Group.TP), vocab_size,
                                               self._num_domains)
            if self.z_loss:
                z_loss = self._z_loss(output, micro_batch, self.pc.group(Group.TP), vocab_size, self.z_loss)
                loss, loss_statistics = loss + z_loss, loss_statistics | {"z_loss": z_loss.detach()}
        else:
            z_weights = self.z_loss * mean_weights(micro_batch) if self.z_loss else None
            loss, losses, log_sum_exp = self.head_loss(self.model.lm_head, output, micro_batch["labels"],
                                                       self.loss.token_weights(micro_batch), z_weights)
            loss_statistics = self.loss.statistics(losses, micro_batch, self._num_domains)
            if self.z_loss:
                loss_statistics["z_loss"] = (z_weights * log_sum_exp.square()).sum()
        return StageOutput(loss, statistics | loss_statistics, auxiliary_loss)

    def _before_last_backward(self) -> None:
        """Gradients of the last micro-batch complete the step: buckets may now be reduced as they fill up."""
        self.buckets.final_micro_batch = True

    def _statistics_template(self) -> dict[str, tuple[int, ...]]:
        template = self.loss.template(self._num_domains)
        if self.z_loss:
            template["z_loss"] = ()
        if self.auxiliary_losses is not None:
            template |= self.auxiliary_losses.template(self.config.model.model_config)
        if self._document_masking:
            template["attention_flops"] = ()
        return template

    def _attention_flops(self, batches: list[dict[str, torch.Tensor]]) -> Statistics:
        """Under document masking, the attention FLOPs of this replica's micro-batches (whole sequences), a statistic
        that one rank of each replica holds (the last stage's first context-parallel rank) so that summed over the
        replicas it is the step's; a reduction on the device, which the step log reads when it logs."""
        if not self._document_masking or not self.pc.is_last_stage or self.pc.coord(Axis.CP) != 0:
            return {}
        return {"attention_flops": sum(self.costs.document_attention_flops(mb["position_ids"]) for mb in batches)}

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> Statistics:
        """The step's statistics, the same on every rank (``lm_loss`` is the step's mean token loss); gradients end
        in the buckets, summed over replicas and tied copies."""
        batches = [{k: self._to_device(v) for k, v in mb.items()} for mb in micro_batches]
        attention_flops = self._attention_flops(batches)
        if self.pc.size(Axis.CP) > 1:
            batches = [split_micro_batch(mb, self.pc.coord(Axis.CP), self.pc.size(Axis.CP)) for mb in batches]
        for feature in self.features:
            feature.before_forward_backward(batches)
        token_count = torch.stack([mb["label_mask"].sum() for mb in batches]).sum().float()
        dist.all_reduce(token_count, group=self.pc.group(Group.DENSE_REPLICAS))
        token_count = token_count.clamp(min=1.0)
        batches = [mb | {"token_count": token_count} for mb in batches]

        statistics = self.schedule.run(batches, self.progress.step + 1) | attention_flops
        self.buckets.finish_reduction()
        if self.pc.pipeline_ends is not None:
            sync_tied_copies(self.buckets, self.pc.pipeline_ends)
        return sum_over_replicas(statistics, self._statistics_template(), self.pc)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A batch tensor on the training device. On CUDA through pinned memory: the driver stages a copy from
        pageable memory and can hold the host until the GPU reaches it, which would keep the host from queueing a
        step while the previous one runs."""
        if self.pc.device.type != "cuda" or tensor.device.type != "cpu":
            return tensor.to(self.pc.device)
        return tensor.pin_memory().to(self.pc.device, non_blocking=True)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], lr: float) -> PendingStep:
        """Forward, backward, clip and update, queued without waiting for the GPU: the step's loss, norm and
        statistics travel to the host behind the work that computes them, and ``finish_step`` reads them. The
        training loop queues the next step first, so the GPU does not wait for the host between steps. Unless bad
        steps are to be skipped (``divergence.py``): judging them before the update waits for the loss and norm."""
        statistics = self.forward_backward(micro_batches)
        grad_norm = self.grad_norm()
        step, guard = self.progress.step + 1, self.bad_steps
        readings = HostCopy(statistics | {"grad_norm": grad_norm})
        pending = functools.partial(PendingStep, step, lr, readings, self._domain_names,
                                    attention_flops=self._step_attention_flops(statistics),
                                    judged=guard.judges_before_update)
        if guard.judges_before_update:
            values = readings.values()
            reason = guard.judge(values["lm_loss"].item(), values["grad_norm"].item())
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
        return pending(self._feature_metrics())

    def finish_step(self, pending: PendingStep) -> StepResult:
        """The record of a queued step, read from its host copies (waiting for its work if that still runs). A bad
        step not judged before its update stops the run here: the policy that judges after the update skips none
        (``divergence.py``), and the loop finishes a step before saving it, so nothing of it is saved."""
        values = pending.readings.values()
        loss, norm = values["lm_loss"].item(), values["grad_norm"].item()
        if not pending.judged:
            reason = self.bad_steps.judge(loss, norm)
            if reason is not None:
                self._on_bad_step(pending.step, reason)
        if pending.skipped:
            return StepResult(loss, norm, pending.lr, {}, skipped=True, model_metrics=pending.model_metrics,
                              attention_flops=pending.attention_flops)
        sums, counts = values["domain_loss_sum"].tolist(), values["domain_tokens"].tolist()
        domain_losses = {name: total / count for name, total, count in zip(pending.domain_names, sums, counts)
                         if count}
        model_metrics = dict(pending.model_metrics)
        if self.z_loss:
            model_metrics["z_loss"] = values["z_loss"].item()
        if self.auxiliary_losses is not None:
            model_metrics |= self.auxiliary_losses.metrics(values, self.config.model.model_config)
        return StepResult(loss, norm, pending.lr, domain_losses, model_metrics=model_metrics,
                          attention_flops=pending.attention_flops)

    def _step_attention_flops(self, statistics: Statistics) -> torch.Tensor | None:
        return statistics["attention_flops"] if self._document_masking else None

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
        if self.bad_steps.exhausted:
            skipped = self.bad_steps.bad_in_a_row - 1
            raise TrainingDivergedError(
                f"at step {step}: {reason}" + (f", after {skipped} skipped step(s)" if skipped else "") + "; training "
                "diverged. Resume from the last checkpoint before it with a lower "
                "optimizer.learning_rate_scheduler.learning_rate (or raise optimizer.skip_bad_steps)")
        logger.warning(f"step {step}: {reason}; update skipped ({self.bad_steps.bad_in_a_row} in a row, "
                       f"optimizer.skip_bad_steps={self.bad_steps.skip_limit})")

    def train(self) -> None:
        config = self.config
        if self.progress.step == 0 and config.checkpoints.save_initial_state:
            self.save()
        train_steps = config.tokens.train_steps
        show_bar = self.pc.rank == 0 and sys.stderr.isatty()
        bar = tqdm(total=train_steps, initial=self.progress.step, disable=not show_bar, unit="step", dynamic_ncols=True)
        redirect = logging_redirect_tqdm([logging.getLogger("nanotron")]) if show_bar else contextlib.nullcontext()
        try:
            with redirect, self._profiler() as profiler, StopRequests() as stop:
                self._loop(bar, profiler, stop)
        finally:
            self._close_loader()  # whatever ended the loop: its workers would outlive it
            for feature in self.features:
                feature.after_training()
        self.wait_for_saves()
        bar.close()
        self.step_log.close()
        logger.info(f"training finished at step {self.progress.step}")

    def _loop(self, bar: tqdm, profiler, stop: StopRequests) -> None:
        """Steps until ``tokens.train_steps`` or an agreed stop request, saving on the way. Each step is finished
        (read, judged, logged) once the next one is queued, or at once where it is saved, stopped at or the last."""
        config, train_steps = self.config, self.config.tokens.train_steps
        loader, loader_stage = None, None
        start_step, start_time = self.progress.step, time.perf_counter()
        window = {"start": start_time, "steps": 0}  # the steps finished since the last logged one
        pending: PendingStep | None = None

        def finish(done: PendingStep) -> None:
            result = self.finish_step(done)
            self.step_log.count(result)
            window["steps"] += 1
            if done.step % config.logging.iteration_step_info_interval == 0 or done.step == train_steps:
                now = time.perf_counter()
                self.step_log.write(result, done.step, self.progress.consumed_tokens, len(done.domain_names) > 1,
                                    (now - window["start"]) / window["steps"],
                                    (now - start_time) / (done.step - start_step))
                window.update(start=now, steps=0)

        for step in range(self.progress.step + 1, train_steps + 1):
            stage = config.data_stage_at(step)
            if stage.name != loader_stage:
                loader, loader_stage = self._loader(stage), stage.name
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
            if profiler is not None:
                profiler.step()
            saved = step % config.checkpoints.checkpoint_interval == 0 or (
                step == train_steps and config.checkpoints.save_final_state
            )
            stopping = stop.agreed(self.pc.host_group)
            if saved or stopping or step == train_steps:
                finish(pending)
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

    def _loader(self, stage) -> MicroBatchLoader:
        """The micro-batches of ``stage`` from where training stands, in place of the previous stage's (whose workers
        end); the step statistics follow its domains."""
        t = self.config.tokens
        self._domain_names = self.datasets[stage.name].domain_names
        self._num_domains = len(self._domain_names)
        self._close_loader()
        self.loader = MicroBatchLoader(
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
        return self.loader

    def _close_loader(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader = None

    def _profiler(self):
        path = self.config.profiler.profiler_export_path if self.config.profiler else None
        if path is None:
            return contextlib.nullcontext()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.pc.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(skip_first=3, wait=1, warmup=1, active=2, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(Path(path) / f"rank{self.pc.rank}")),
        )

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
