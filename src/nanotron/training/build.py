"""Building a run's pieces from its validated config: the data it reads, the pipeline schedule, the fused loss, and
the summary logged before the first step. The model and optimizer are built by ``models/build.py`` and
``optim/optimizer.py``; the trainer puts them together."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

from nanotron.config import Config, ConfigError
from nanotron.data.dataset import DataError, PretrainDataset
from nanotron.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from nanotron.memory import memory_summary
from nanotron.models.registry import spec_for_config
from nanotron.models.spec import CausalLM
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.linear_cross_entropy import LinearCrossEntropy, fusable_head
from nanotron.parallel.pipeline_parallel import P2P, PipelineSchedule, StageOutput
from nanotron.training.hooks import Feature

logger = logging.getLogger("nanotron.trainer")


def load_data(config: Config, features: Sequence[Feature]) -> tuple[dict[str, PretrainDataset], str | None]:
    """Every data stage's dataset (its mixture and domain names as the features make them) and the tokenizer's
    fingerprint (None without ``tokenizer.tokenizer_name_or_path``); fails before the model is allocated if a stage
    cannot feed it."""
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
    datasets: dict[str, PretrainDataset] = {}
    for stage in config.data_stages:
        dataset = datasets[stage.name] = _dataset(config, stage, features)
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
    return datasets, expected


def _dataset(config: Config, stage, features: Sequence[Feature]) -> PretrainDataset:
    """The stage's mixture: ``dataset_weights`` as the features change it, else (None) the token shares."""
    weights = stage.data.dataset.dataset_weights
    for feature in features:
        weights = feature.sampling_weights(stage, weights)
    dataset = PretrainDataset(stage.data.dataset.dataset_folder, weights, config.tokens.sequence_length,
                              stage.data.seed)
    for feature in features:
        dataset.domain_names = feature.domain_names(stage, dataset.domain_names)
    return dataset


def pipeline_schedule(config: Config, pc: ParallelContext,
                      stage_forward: Callable[[dict[str, torch.Tensor], torch.Tensor | None], StageOutput],
                      before_last_backward: Callable[[], None]) -> PipelineSchedule:
    """The micro-batch schedule; with pp=1 it is plain gradient accumulation."""
    p = config.parallelism
    sequence = config.tokens.sequence_length // (p.tp if p.tp_mode == "REDUCE_SCATTER" else 1)
    model_config = config.model.model_config
    shape = (config.tokens.micro_batch_size, sequence, model_config.hidden_size)
    dtype = spec_for_config(model_config).activation_dtype(model_config, config.model.torch_dtype())
    p2p = P2P(pc, shape, dtype, p.pp_timeout_s)
    return PipelineSchedule(pc, p.pp_engine, p2p, stage_forward, before_last_backward)


def fused_head_loss(config: Config, pc: ParallelContext, model: CausalLM) -> LinearCrossEntropy | None:
    """The LM head and the loss in one, chunk by chunk (``model.loss_chunk_tokens``), on the last stage; None: the
    model returns the logits and the loss function takes them."""
    chunk_tokens = config.model.loss_chunk_tokens
    if chunk_tokens == 0 or not pc.is_last_stage:
        return None
    if not fusable_head(model.lm_head):
        logger.warning("model.loss_chunk_tokens is ignored: a converter gave the LM head another matmul (or it "
                       "has a bias), which the fused loss would bypass; the logits are computed in full")
        return None
    return LinearCrossEntropy(pc.groups["tp"], config.model.model_config.vocab_size, chunk_tokens,
                              compiled=config.model.compile)


def log_summary(config: Config, pc: ParallelContext, model: CausalLM, num_parameters: int) -> None:
    """The model, the global batch and the memory estimate, before the first step."""
    t = config.tokens
    overlapping = config.parallelism.tp > 1 and config.parallelism.tp_linear_async_communication
    if overlapping and pc.device.type == "cuda" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        logger.warning("tp_linear_async_communication overlaps best with CUDA_DEVICE_MAX_CONNECTIONS=1")
    logger.info(
        f"model: {num_parameters / 1e6:.2f}M parameters, dtype {config.model.dtype}, "
        f"padded vocab {model.padded_vocab_size}, device {pc.device}"
    )
    logger.info(
        f"global batch: {config.global_batch_size} sequences x {t.sequence_length} tokens = "
        f"{config.global_batch_tokens} tokens per step (micro_batch_size {t.micro_batch_size} x "
        f"batch_accumulation_per_replica {t.batch_accumulation_per_replica} x dp {config.parallelism.dp} x "
        f"expert_parallel_size {config.parallelism.expert_parallel_size})"
    )
    gpu_memory_gb = torch.cuda.get_device_properties(pc.device).total_memory / 1e9 if pc.device.type == "cuda" else None
    logger.info(memory_summary(config, pc.coord("pp"), gpu_memory_gb))
