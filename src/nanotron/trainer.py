"""The training loop: build everything from a validated config, then step, log and checkpoint.

One optimizer step:
1. count the target tokens of the whole global batch (all micro-batches, all data-parallel ranks);
2. forward and backward every micro-batch with loss = token-loss sum / that global count;
3. sum gradients over data-parallel ranks (bucket by bucket, during the last backward), take the global
   grad-norm, clip;
4. stop loudly on a non-finite loss or norm, else update the fp32 masters with the LR of this step.
Because of (1) and (2), every split of the global batch into ranks and micro-batches gives the same gradients.
The loss and the per-domain statistics travel as step statistics (``parallel/statistics.py``): summed over
micro-batches by the schedule and over stages and data-parallel ranks in one collective, so every rank knows them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from nanotron.checkpoint.async_saving import AsyncCheckpointer
from nanotron.checkpoint.integrity import read_metadata
from nanotron.checkpoint.manager import (
    TrainingProgress,
    check_same_model,
    first_problem,
    load_optimizer,
    load_rng,
    load_weights,
    verify_on_all_ranks,
)
from nanotron.checkpoint.run_folder import (
    check_metrics_file,
    describe_existing_run,
    remove_partial_saves,
    resolve_checkpoint,
)
from nanotron.checkpoint.run_lock import RunLock
from nanotron.checkpoint.saving import take_snapshot, write_snapshot
from nanotron.config import Config, ConfigError, ExistingCheckpointInit, expand_run_name, validate_config
from nanotron.data.dataset import DataError, PretrainDataset
from nanotron.data.loader import MicroBatchLoader
from nanotron.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from nanotron.divergence import BadStepGuard
from nanotron.errors import CheckpointError
from nanotron.logging import setup_logging
from nanotron.memory import memory_summary
from nanotron.metrics import MetricsWriter, format_duration, peak_flops, peak_memory_gb
from nanotron.models.build import BuildOptions, ModuleConverter, build_model
from nanotron.models.registry import spec_for_config
from nanotron.nn.fp8 import (
    advance_amax_histories,
    discard_step_amaxes,
    fp8_converter,
    refresh_filled_histories,
    report_range_counts,
    warn_if_emulated,
)
from nanotron.optim.clip import GlobalGradNorm, clip_coefficient
from nanotron.optim.lr_schedule import learning_rate_at
from nanotron.optim.optimizer import build_optimizer
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.cross_entropy import vocab_parallel_log_sum_exp, vocab_parallel_token_losses
from nanotron.parallel.data_parallel import check_replicas_agree, sync_tied_copies
from nanotron.parallel.linear_cross_entropy import LinearCrossEntropy, fusable_head
from nanotron.parallel.pipeline_parallel import P2P, PipelineSchedule, StageOutput
from nanotron.parallel.placement import declared_names, logical_parameters
from nanotron.parallel.statistics import Statistics, max_over_ranks, sum_over_all_ranks, sum_over_replicas
from nanotron.preemption import StopRequests
from nanotron.random import seed_everything
from nanotron.trackers import Trackers

logger = logging.getLogger("nanotron.trainer")


class TrainingDivergedError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    domain_losses: dict[str, float]  # mean token loss of each domain present in the step's batch
    skipped: bool = False  # a bad step whose update was skipped (``divergence.py``)
    # the z-loss, the family's metrics (auxiliary losses, expert load), FP8's ranges
    model_metrics: dict = field(default_factory=dict)


def micro_batch_loss(logits: torch.Tensor, micro_batch: dict[str, torch.Tensor], tp_group: dist.ProcessGroup,
                     vocab_size: int, num_domains: int) -> tuple[torch.Tensor, Statistics]:
    """This micro-batch's share of the step loss (its token-loss sum over the global token count, which travels
    with the batch as ``token_count``) and its statistics: that share, and per-domain loss sums and token counts."""
    losses = vocab_parallel_token_losses(logits, micro_batch["labels"], tp_group, vocab_size)
    return loss_and_statistics(losses, micro_batch, num_domains)


def loss_and_statistics(losses: torch.Tensor, micro_batch: dict[str, torch.Tensor],
                        num_domains: int) -> tuple[torch.Tensor, Statistics]:
    """``micro_batch_loss`` from the per-token losses."""
    mask = micro_batch["label_mask"]
    per_sample = torch.where(mask, losses, 0.0).sum(-1)
    loss = per_sample.sum() / micro_batch["token_count"]
    domains = micro_batch["domain_ids"]
    domain_loss_sum = per_domain_sums(per_sample, domains, num_domains)
    domain_tokens = per_domain_sums(mask.sum(-1).float(), domains, num_domains)
    return loss, {"lm_loss": loss, "domain_loss_sum": domain_loss_sum, "domain_tokens": domain_tokens}


def logit_z_loss(logits: torch.Tensor, micro_batch: dict[str, torch.Tensor], tp_group: dist.ProcessGroup,
                 vocab_size: int, coefficient: float) -> torch.Tensor:
    """This micro-batch's share of the z-loss: ``coefficient`` times its sum over target tokens of
    ``logsumexp(logits)**2`` over the step's token count, so that the step's z-loss is the coefficient times the mean
    over the step's target tokens."""
    squares = vocab_parallel_log_sum_exp(logits, tp_group, vocab_size).square()
    return coefficient * torch.where(micro_batch["label_mask"], squares, 0.0).sum() / micro_batch["token_count"]


def per_domain_sums(values: torch.Tensor, domains: torch.Tensor, num_domains: int) -> torch.Tensor:
    """The sums of per-sample ``values`` over the samples of each domain, through a one-hot mask rather than
    ``index_add_``: deterministic (no atomics on GPUs), and compiled alike on every device (the CPU compiler fails
    on an ``index_add_`` into a one-element tensor)."""
    in_domain = domains[:, None] == torch.arange(num_domains, device=values.device)
    return torch.where(in_domain, values[:, None], 0.0).sum(0)


class Trainer:
    """Trains the model that ``config`` describes; ``converters`` change its modules before weights exist (e.g.
    swap linears for other implementations)."""

    # A micro-batch's loss and statistics from the last stage's logits, compiled with the model (model.compile):
    # a subclass that trains on another loss sets its own here.
    loss_function = staticmethod(micro_batch_loss)

    def __init__(self, config: Config, converters: tuple[ModuleConverter, ...] = ()):
        self.config = expand_run_name(config)
        p = config.parallelism
        self.pc = ParallelContext(tp=p.tp, pp=p.pp, dp=p.dp, ep=p.expert_parallel_size)
        self.run_lock: RunLock | None = None  # rank 0's, taken by ``_prepare_run_folder``
        try:
            self._set_up(converters)
        except BaseException:
            self.close()  # a failed set-up leaves no lock or process group behind (in-process callers, tests)
            raise

    def _set_up(self, converters: tuple[ModuleConverter, ...]) -> None:
        config, p = self.config, self.config.parallelism
        validate_config(config, world_size=self.pc.world_size)
        setup_logging(self.pc, config.logging.log_level, config.logging.log_level_replica)
        seed_everything(config.general.seed + self.pc.rank)

        self.resume_from = self._prepare_run_folder()
        self.tokenizer_fingerprint = self._check_tokenizer_and_data()
        model_config = config.model.model_config
        self.auxiliary_losses = spec_for_config(model_config).auxiliary_losses
        self.z_loss = spec_for_config(model_config).logit_z_loss(model_config)
        self.initial_checkpoint = self._initial_checkpoint()
        self._check_metrics_file()
        if config.fp8 is not None and config.fp8.enabled:
            warn_if_emulated(self.pc.device)
            converters = (*converters, fp8_converter(config.fp8))
        self.model = build_model(model_config, self.pc, BuildOptions.from_config(config), converters)
        self.params = logical_parameters(self.model)
        self.buckets, self.optimizer = build_optimizer(
            self.params, config.optimizer, config.model.ddp_bucket_cap_mb, self.pc.reduction_groups,
            declared_names(self.model, "no_weight_decay_parameters"),
        )
        self.grad_norm = GlobalGradNorm(self.buckets, self.pc)
        self.schedule = self._pipeline_schedule()
        # Compiling the loss fuses the fp32 upcast of the logits into the softmax instead of materialising it.
        self._loss = torch.compile(self.loss_function) if config.model.compile else self.loss_function
        self._z_loss = torch.compile(logit_z_loss) if config.model.compile else logit_z_loss
        self.head_loss = self._fused_head_loss()
        self.progress = TrainingProgress()
        self.bad_steps = BadStepGuard(config.optimizer.skip_bad_steps, config.optimizer.loss_spike_factor)
        self.protected_checkpoints: set[str] = set()  # the newest checkpoint from before a bad step
        self.async_saver = AsyncCheckpointer(self.pc) if config.checkpoints.async_save else None
        self._load_initial_state()

        costs = spec_for_config(model_config).costs(model_config, self.model.padded_vocab_size,
                                                    config.tokens.sequence_length)
        self.num_parameters = costs.parameters
        self.flops_per_token = costs.flops_per_token
        self.hardware_flops_per_token = costs.hardware_flops_per_token(p.recompute_layer)
        self.peak_flops = peak_flops(self.pc.device, config.model.torch_dtype())
        self.metrics = (
            MetricsWriter(config.resolved_metrics_path(), resume_step=self.progress.step) if self.pc.rank == 0 else None
        )
        self.trackers = Trackers(config) if self.pc.rank == 0 else None
        self._log_summary()

    # --- set-up ----------------------------------------------------------------------------------------------

    def _check_tokenizer_and_data(self) -> str | None:
        """Fail before allocating the model if a data stage cannot feed it."""
        config = self.config
        vocab = config.model.model_config.vocab_size
        expected = None
        if config.tokenizer.tokenizer_name_or_path:
            tokenizer = load_tokenizer(config.tokenizer.tokenizer_name_or_path, config.tokenizer.tokenizer_revision)
            expected = tokenizer_fingerprint(tokenizer)
            if tokenizer.get_vocab_size() > vocab:
                raise ConfigError(
                    f"model.model_config.vocab_size ({vocab}) is smaller than the tokenizer's vocabulary "
                    f"({tokenizer.get_vocab_size()}, {config.tokenizer.tokenizer_name_or_path}); raise vocab_size"
                )
        self.datasets: dict[str, PretrainDataset] = {}
        for stage in config.data_stages:
            dataset = self._dataset(stage)
            if dataset.vocab_size > vocab:
                raise DataError(
                    f"data stage {stage.name!r} was tokenized with a vocabulary of {dataset.vocab_size} but "
                    f"model.model_config.vocab_size is {vocab}; raise vocab_size or re-run nanotron preprocess"
                )
            for folder, fingerprint in zip(stage.data.dataset.dataset_folder, dataset.tokenizer_fingerprints):
                if expected is not None and fingerprint != expected:
                    raise DataError(
                        f"{folder} was tokenized with another tokenizer than tokenizer.tokenizer_name_or_path "
                        f"({config.tokenizer.tokenizer_name_or_path}); re-run nanotron preprocess with it"
                    )
        return expected

    def _dataset(self, stage) -> PretrainDataset:
        if stage.name not in self.datasets:
            doremi = self.config.doremi
            self.datasets[stage.name] = PretrainDataset(
                stage.data.dataset.dataset_folder, self._sampling_weights(stage), self.config.tokens.sequence_length,
                stage.data.seed)
            if doremi is not None and doremi.domain_names is not None:
                self.datasets[stage.name].domain_names = list(doremi.domain_names)
        return self.datasets[stage.name]

    def _sampling_weights(self, stage) -> list[float] | None:
        """The stage's mixture: ``dataset_weights``, else ``doremi.domain_weights``, else (None) the token shares."""
        weights = stage.data.dataset.dataset_weights
        if weights is None and self.config.doremi is not None:
            weights = self.config.doremi.domain_weights
        return weights

    def _prepare_run_folder(self) -> Path | None:
        """Lock and check the run folder before anything is built; the checkpoint to resume from, if any.

        Rank 0 first takes the folder's lock (``run_lock.py``), before the folder is read: a second run on it is
        refused. Starting from scratch over an earlier run would overwrite its checkpoints and metrics, so it is
        refused unless the config resumes (``resume_checkpoint_path``, or ``auto``: resume if there is a
        checkpoint). Rank 0 also removes what interrupted saves left; every rank gets its verdict, and only then
        looks at the folder itself.
        """
        root = Path(self.config.checkpoints.checkpoints_path)
        problem = None
        if self.pc.rank == 0:
            try:
                self.run_lock = RunLock.take(root)
                existing = describe_existing_run(root)
                if self._resume_choice(root) is None and existing is not None:
                    raise ConfigError(
                        f"checkpoints.checkpoints_path {root} already holds a run ({existing}); continue it with "
                        "checkpoints.resume_checkpoint_path: auto (or its path), or start over in another "
                        "checkpoints_path")
                remove_partial_saves(root)
            except (ConfigError, CheckpointError) as error:
                problem = str(error)
        problem = first_problem(problem, self.pc.world_size)
        if problem is not None:
            raise ConfigError(problem)
        return self._resume_choice(root)

    def _resume_choice(self, root: Path) -> Path | None:
        checkpoints = self.config.checkpoints
        if checkpoints.resumes_if_present:
            return root if describe_existing_run(root) is not None else None
        return checkpoints.resume_checkpoint_path

    def _check_metrics_file(self) -> None:
        """Refuse, on every rank, a ``logging.metrics_path`` that holds another run's metrics (rank 0 writes it)."""
        problem = None
        if self.pc.rank == 0:
            resumed = self.initial_checkpoint[0] if self.resume_from is not None else None
            try:
                check_metrics_file(self.config.resolved_metrics_path(), Path(self.config.checkpoints.checkpoints_path),
                                   resumed)
            except ConfigError as error:
                problem = str(error)
        problem = first_problem(problem, self.pc.world_size)
        if problem is not None:
            raise ConfigError(problem)

    def _initial_checkpoint(self) -> tuple[Path, dict] | None:
        """The checkpoint to resume from or to take the initial weights from, checked before the model exists:
        complete and uncorrupted (checksums, the reading shared by all ranks), the same architecture, and trained
        on data from the same tokenizer."""
        init = self.config.model.init_method
        if self.resume_from is not None:
            path = self.resume_from
        elif isinstance(init, ExistingCheckpointInit):
            path = init.path
        else:
            return None
        checkpoint = resolve_checkpoint(path)
        metadata = read_metadata(checkpoint)
        verify_on_all_ranks(checkpoint, metadata, self.pc)
        check_same_model(checkpoint, metadata, self.config.model.model_config)
        if self.resume_from is not None and metadata["step"] >= self.config.tokens.train_steps:
            raise ConfigError(
                f"the checkpoint {checkpoint} is at step {metadata['step']} and tokens.train_steps is "
                f"{self.config.tokens.train_steps}: nothing left to train; raise tokens.train_steps"
            )
        self._check_same_tokenizer(checkpoint, metadata.get("tokenizer_fingerprint"))
        return checkpoint, metadata

    def _check_same_tokenizer(self, checkpoint: Path, trained_with: str | None) -> None:
        """Token ids only mean something with their tokenizer: training weights further (resumed, or taken by
        ``model.init_method.path``) on data from another one is refused, whatever its vocabulary size."""
        if trained_with is None or self.config.checkpoints.allow_tokenizer_change:
            return
        for stage in self.config.data_stages:
            for folder, fingerprint in zip(stage.data.dataset.dataset_folder,
                                           self._dataset(stage).tokenizer_fingerprints):
                if fingerprint != trained_with:
                    raise DataError(
                        f"{folder} was tokenized with another tokenizer than the one {checkpoint} was trained on "
                        "(tokenizer fingerprints differ); use data tokenized with the checkpoint's tokenizer (its "
                        "tokenizer/ folder), or set checkpoints.allow_tokenizer_change: true to train on it on purpose")

    def _load_initial_state(self) -> None:
        checkpoints = self.config.checkpoints
        if self.initial_checkpoint is None:
            return
        checkpoint, metadata = self.initial_checkpoint
        load_weights(checkpoint, self.model, self.pc, metadata)
        refresh_filled_histories(self.model)  # loaded FP8 amax histories scale the first step
        if self.resume_from is not None:
            if metadata["optimizer_step"] > 0 and checkpoints.load_optimizer:
                load_optimizer(checkpoint, self.optimizer, self.model, self.pc, metadata)
            else:
                self.optimizer.sync_masters_from_model()
            schedule_start = metadata["lr_schedule_start_step"] if checkpoints.load_lr_scheduler else metadata["step"]
            self.progress = TrainingProgress(metadata["step"], dict(metadata["consumed_samples"]), schedule_start,
                                             metadata.get("domain_weights"))
            if not load_rng(checkpoint, self.pc):
                logger.warning("random states re-derived from the seed: the checkpoint has no rank at this position")
            saved_layout = {k: v for k, v in metadata["layout"].items() if k != "zero_stage"}
            if saved_layout != self.pc.sizes or metadata["layout"]["zero_stage"] != self.config.optimizer.zero_stage:
                logger.info(f"checkpoint layout {metadata['layout']} resharded to {self.pc.sizes}, "
                            f"zero_stage {self.config.optimizer.zero_stage}")
            fresh = [what for what, kept in (("optimizer state", checkpoints.load_optimizer),
                                             ("LR schedule", checkpoints.load_lr_scheduler)) if not kept]
            logger.info(f"resumed from {checkpoint} at step {self.progress.step}"
                        + (f" (fresh {' and '.join(fresh)})" if fresh else ""))
        else:
            self.optimizer.sync_masters_from_model()
            logger.info(f"initial weights loaded from {checkpoint} (optimizer, schedule and data start fresh)")

    def _pipeline_schedule(self) -> PipelineSchedule:
        """The micro-batch schedule; with pp=1 it is plain gradient accumulation."""
        c, p = self.config, self.config.parallelism
        sequence = c.tokens.sequence_length // (p.tp if p.tp_mode == "REDUCE_SCATTER" else 1)
        model_config = c.model.model_config
        shape = (c.tokens.micro_batch_size, sequence, model_config.hidden_size)
        dtype = spec_for_config(model_config).activation_dtype(model_config, c.model.torch_dtype())
        p2p = P2P(self.pc, shape, dtype, p.pp_timeout_s)
        return PipelineSchedule(self.pc, p.pp_engine, p2p, self._stage_forward, self._before_last_backward)

    def _fused_head_loss(self) -> LinearCrossEntropy | None:
        """The LM head and the loss in one, chunk by chunk (``model.loss_chunk_tokens``), on the last stage; None:
        the model returns the logits and ``_loss`` takes them."""
        chunk_tokens = self.config.model.loss_chunk_tokens
        if chunk_tokens == 0 or not self.pc.is_last_stage:
            return None
        if not fusable_head(self.model.lm_head):
            logger.warning("model.loss_chunk_tokens is ignored: a converter gave the LM head another matmul (or it "
                           "has a bias), which the fused loss would bypass; the logits are computed in full")
            return None
        return LinearCrossEntropy(self.pc.groups["tp"], self.config.model.model_config.vocab_size, chunk_tokens,
                                  compiled=self.config.model.compile)

    def _before_last_backward(self) -> None:
        """Gradients of the last micro-batch complete the step: buckets may now be reduced as they fill up."""
        self.buckets.final_micro_batch = True

    def _log_summary(self) -> None:
        c = self.config
        t = c.tokens
        overlapping = c.parallelism.tp > 1 and c.parallelism.tp_linear_async_communication
        if overlapping and self.pc.device.type == "cuda" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
            logger.warning("tp_linear_async_communication overlaps best with CUDA_DEVICE_MAX_CONNECTIONS=1")
        logger.info(
            f"model: {self.num_parameters / 1e6:.2f}M parameters, dtype {c.model.dtype}, "
            f"padded vocab {self.model.padded_vocab_size}, device {self.pc.device}"
        )
        logger.info(
            f"global batch: {c.global_batch_size} sequences x {t.sequence_length} tokens = "
            f"{c.global_batch_tokens} tokens per step (micro_batch_size {t.micro_batch_size} x "
            f"batch_accumulation_per_replica {t.batch_accumulation_per_replica} x dp {c.parallelism.dp} x "
            f"expert_parallel_size {c.parallelism.expert_parallel_size})"
        )
        on_cuda = self.pc.device.type == "cuda"
        gpu_memory_gb = torch.cuda.get_device_properties(self.pc.device).total_memory / 1e9 if on_cuda else None
        logger.info(memory_summary(c, self.pc.coord("pp"), gpu_memory_gb))

    # --- training --------------------------------------------------------------------------------------------

    def _stage_forward(self, micro_batch: dict[str, torch.Tensor], hidden_states: torch.Tensor | None) -> StageOutput:
        """This pipeline stage's forward; the last stage returns the micro-batch's share of the step loss."""
        logits = self.head_loss is None  # else the last stage returns the head's input, for the fused loss
        # A later stage takes the ids too, for the sequence's length (its rotary tables), not for their values.
        output = self.model(input_ids=micro_batch["input_ids"], hidden_states=hidden_states, head=logits)
        auxiliary_loss, statistics = None, {}
        if self.auxiliary_losses is not None:
            auxiliary_loss, statistics = self.auxiliary_losses.collect(self.model, self.config.global_batch_size)
        if not self.pc.is_last_stage:
            return StageOutput(output, statistics, auxiliary_loss)
        vocab_size = self.config.model.model_config.vocab_size
        if logits:
            loss, loss_statistics = self._loss(output, micro_batch, self.pc.groups["tp"], vocab_size,
                                               self._num_domains)
            if self.z_loss:
                z_loss = self._z_loss(output, micro_batch, self.pc.groups["tp"], vocab_size, self.z_loss)
                loss, loss_statistics = loss + z_loss, loss_statistics | {"z_loss": z_loss.detach()}
        else:
            z_weights = self.z_loss * self._token_weights_of_mean(micro_batch) if self.z_loss else None
            loss, losses, log_sum_exp = self.head_loss(self.model.lm_head, output, micro_batch["labels"],
                                                       self._token_weights(micro_batch), z_weights)
            loss_statistics = self._loss_statistics(losses, micro_batch)
            if self.z_loss:
                loss_statistics["z_loss"] = (z_weights * log_sum_exp.square()).sum()
        return StageOutput(loss, statistics | loss_statistics, auxiliary_loss)

    def _token_weights(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each token's weight in the objective, ``sum(weights * token losses)``, for the fused loss: the label mask
        over the step's token count, so the objective is ``micro_batch_loss``'s."""
        return self._token_weights_of_mean(micro_batch)

    @staticmethod
    def _token_weights_of_mean(micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The label mask over the step's token count: summed with these weights, per-token values give their mean
        over the step's target tokens (the language-model loss; the z-loss, whatever ``_token_weights`` are)."""
        return micro_batch["label_mask"] / micro_batch["token_count"]

    def _loss_statistics(self, losses: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> Statistics:
        """The statistics of a micro-batch from its per-token losses."""
        return loss_and_statistics(losses, micro_batch, self._num_domains)[1]

    def _statistics_template(self) -> dict[str, tuple[int, ...]]:
        template = {"lm_loss": (), "domain_loss_sum": (self._num_domains,), "domain_tokens": (self._num_domains,)}
        if self.auxiliary_losses is not None:
            template |= self.auxiliary_losses.template(self.config.model.model_config)
        if self.z_loss:
            template["z_loss"] = ()
        return template

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]]) -> Statistics:
        """The step's statistics, the same on every rank (``lm_loss`` is the step's mean token loss); gradients end
        in the buckets, summed over replicas and tied copies."""
        batches = [{k: v.to(self.pc.device, non_blocking=True) for k, v in mb.items()} for mb in micro_batches]
        token_count = torch.stack([mb["label_mask"].sum() for mb in batches]).sum().float()
        dist.all_reduce(token_count, group=self.pc.groups["dp_ep"])
        token_count = token_count.clamp(min=1.0)
        batches = [mb | {"token_count": token_count} for mb in batches]

        statistics = self.schedule.run(batches, self.progress.step + 1)
        self.buckets.finish_reduction()
        if "pipeline_ends" in self.pc.groups:
            sync_tied_copies(self.buckets, self.pc.groups["pipeline_ends"])
        return sum_over_replicas(statistics, self._statistics_template(), self.pc)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], lr: float) -> StepResult:
        """Forward, backward, clip and update; the statistics and norm are read back (a host sync) only after the
        update is queued, so the GPU never waits for the host in the middle of a step, unless bad steps are to be
        skipped (``divergence.py``), which needs them before the update. A bad step the policy does not skip stops
        the run before anything is saved: the in-memory state of that step is discarded with the process."""
        statistics = self.forward_backward(micro_batches)
        grad_norm = self.grad_norm()
        step, guard = self.progress.step + 1, self.bad_steps
        if guard.judges_before_update:
            loss_value, norm_value = statistics["lm_loss"].item(), grad_norm.item()
            reason = guard.judge(loss_value, norm_value)
            if reason is not None:
                self.buckets.zero()
                discard_step_amaxes(self.model)
                self._on_bad_step(step, reason)
                return StepResult(loss_value, norm_value, lr, {}, skipped=True, model_metrics=self._fp8_ranges())
        clip = self.config.optimizer.clip_grad
        self.optimizer.step(lr, clip_coefficient(grad_norm, clip) if clip is not None else None)
        self.buckets.zero()
        advance_amax_histories(self.model, lambda amaxes: max_over_ranks(amaxes, self.pc))
        if not guard.judges_before_update:
            loss_value, norm_value = statistics["lm_loss"].item(), grad_norm.item()
            reason = guard.judge(loss_value, norm_value)
            if reason is not None:
                self._on_bad_step(step, reason)
        sums, counts = statistics["domain_loss_sum"].tolist(), statistics["domain_tokens"].tolist()
        domain_losses = {name: total / count for name, total, count in zip(self._domain_names, sums, counts) if count}
        model_metrics = self._fp8_ranges()
        if self.z_loss:
            model_metrics["z_loss"] = statistics["z_loss"].item()
        if self.auxiliary_losses is not None:
            model_metrics |= self.auxiliary_losses.metrics(statistics, self.config.model.model_config)
        return StepResult(loss_value, norm_value, lr, domain_losses, model_metrics=model_metrics)

    def _fp8_ranges(self) -> dict:
        """With ``fp8.log_out_of_range``, the step's shares of FP8-cast values saturated and flushed (collective)."""
        fp8 = self.config.fp8
        if fp8 is None or not (fp8.enabled and fp8.log_out_of_range):
            return {}
        return report_range_counts(self.model, lambda counts: sum_over_all_ranks(counts, self.pc), self.pc.device)

    def _on_bad_step(self, step: int, reason: str) -> None:
        """Keep the newest checkpoint from before the trouble out of pruning, then skip the step or stop."""
        root = Path(self.config.checkpoints.checkpoints_path)
        if self.bad_steps.bad_in_a_row == 1 and describe_existing_run(root) is not None:
            self.protected_checkpoints.add(resolve_checkpoint(root).name)
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
        loader, loader_stage = None, None
        start_step, start_time = self.progress.step, time.perf_counter()
        window_start, window_steps = start_time, 0
        with redirect, self._profiler() as profiler, StopRequests() as stop:
            for step in range(self.progress.step + 1, train_steps + 1):
                stage = config.data_stage_at(step)
                if stage.name != loader_stage:
                    loader, loader_stage = self._loader(stage), stage.name
                    logger.info(f"data stage {stage.name!r} from step {step}")
                start = self.progress.lr_schedule_start
                lr = learning_rate_at(step - start, config.optimizer.learning_rate_scheduler, train_steps - start)
                result = self.train_step(loader.next_step(), lr)
                self.progress.step = step
                interval = config.parallelism.replica_check_interval
                if interval is not None and step % interval == 0:
                    check_replicas_agree(self.buckets, step)
                self.progress.consumed_samples[stage.name] = (
                    self.progress.consumed_samples.get(stage.name, 0) + config.global_batch_size
                )
                window_steps += 1
                bar.update(1)
                if profiler is not None:
                    profiler.step()
                if step % config.logging.iteration_step_info_interval == 0 or step == train_steps:
                    if self.pc.device.type == "cuda":
                        torch.cuda.synchronize(self.pc.device)
                    now = time.perf_counter()
                    self._log_step(result, (now - window_start) / window_steps,
                                   (now - start_time) / (step - start_step))
                    window_start, window_steps = now, 0
                saved = step % config.checkpoints.checkpoint_interval == 0 or (
                    step == train_steps and config.checkpoints.save_final_state
                )
                if saved:
                    self.save()
                if stop.agreed(self.pc.device):
                    if not saved:
                        self.save()
                    self.wait_for_saves()
                    logger.warning(f"{stop.signal_name} received: stopped after step {step} with a checkpoint; "
                                   "run again with checkpoints.resume_checkpoint_path: auto to continue")
                    break
        self.wait_for_saves()
        bar.close()
        if self.metrics is not None:
            self.metrics.close()
            self.trackers.close()
        logger.info(f"training finished at step {self.progress.step}")

    def _loader(self, stage) -> MicroBatchLoader:
        """The micro-batches of ``stage`` from where training stands; the step statistics follow its domains."""
        t = self.config.tokens
        self._domain_names = self._dataset(stage).domain_names
        self._num_domains = len(self._domain_names)
        return MicroBatchLoader(
            self._dataset(stage),
            first_sample=self.progress.consumed_samples.get(stage.name, 0),
            start_step=0,
            micro_batch_size=t.micro_batch_size,
            accumulation=t.batch_accumulation_per_replica,
            dp_rank=self.pc.coord("dp") * self.pc.size("ep") + self.pc.coord("ep"),
            dp_size=self.pc.size("dp_ep"),
            num_workers=stage.data.num_loading_workers,
        )

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

    def _log_step(self, result: StepResult, step_seconds: float, mean_step_seconds: float) -> None:
        if self.pc.rank != 0:  # every rank holds the step's statistics; rank 0 logs at logging.log_level
            return
        config, step = self.config, self.progress.step
        tokens_per_sec = config.global_batch_tokens / step_seconds
        per_gpu = tokens_per_sec / self.pc.world_size
        tflops = per_gpu * self.flops_per_token / 1e12
        hardware_tflops = per_gpu * self.hardware_flops_per_token / 1e12
        record = {
            "step": step,
            "lm_loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "consumed_tokens": self.progress.total_consumed_samples * config.tokens.sequence_length,
            "step_time_s": step_seconds,
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_gpu": per_gpu,
            "tflops_per_gpu": tflops,
            "hardware_tflops_per_gpu": hardware_tflops,
            "peak_memory_gb": peak_memory_gb(self.pc.device),
        }
        if self.peak_flops is not None:
            record["mfu"] = tflops * 1e12 / self.peak_flops
        if self._num_domains > 1:
            record["domain_losses"] = result.domain_losses
        if result.skipped:
            record["skipped_update"] = True
        record |= result.model_metrics
        eta = mean_step_seconds * (config.tokens.train_steps - step)
        mfu = f"{100 * record['mfu']:.1f}%" if "mfu" in record else "n/a"
        hardware = f" (hw {hardware_tflops:.2f})" if self.hardware_flops_per_token != self.flops_per_token else ""
        logger.info(
            f"step {step}/{config.tokens.train_steps} | loss {result.loss:.4f} | lr {result.lr:.3e} | "
            f"grad_norm {result.grad_norm:.3f} | {tokens_per_sec:,.0f} tok/s ({per_gpu:,.0f}/gpu) | "
            f"{tflops:.2f} TFLOP/s{hardware} | MFU {mfu} | mem {record['peak_memory_gb']:.2f} GB | "
            f"ETA {format_duration(eta)}"
            + ("".join(f" | {name} {loss:.4f}" for name, loss in result.domain_losses.items())
               if self._num_domains > 1 else "")
            + "".join(f" | {name.removeprefix('moe_')} {value:.4g}" for name, value in result.model_metrics.items()
                      if isinstance(value, float))
        )
        self.metrics.write(record)
        self.trackers.log(record)

    def save(self) -> None:
        """Checkpoint the current step, in the foreground or (``checkpoints.async_save``) in the background."""
        if self.async_saver is None:
            snapshot = take_snapshot(self.config, self.model, self.optimizer, self.progress, self.pc,
                                     self.tokenizer_fingerprint)
            write_snapshot(snapshot, self.pc, protected=self.protected_checkpoints)
        else:
            self.async_saver.save(lambda: take_snapshot(self.config, self.model, self.optimizer, self.progress, self.pc,
                                                        self.tokenizer_fingerprint, self.async_saver.buffers),
                                  self.protected_checkpoints)

    def wait_for_saves(self) -> None:
        if self.async_saver is not None:
            self.async_saver.wait()

    def close(self) -> None:
        """Leave no process group and no lock behind; the lock goes even if the process group cannot."""
        try:
            self.pc.destroy()
        finally:
            if self.run_lock is not None:
                self.run_lock.release()
