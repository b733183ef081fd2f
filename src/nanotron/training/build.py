"""Building a run's pieces from its validated config: the data it reads, the model with its optimizer, the pipeline
schedule, the summary logged before the first step and the profiler. The model and optimizer themselves are built by
``models/build.py`` and ``optim/optimizer.py`` (``trained_model`` joins them, with ZeRO-3's sharding), the step by
``training/step.py``; the trainer puts them together."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from nanotron.checkpoint.manager import first_problem
from nanotron.config import Config, ConfigError, DatasetStageArgs
from nanotron.data.dataset import DataError, SampleSource
from nanotron.data.sources import Ranks, SourceContext, build_source
from nanotron.data.tokenizer import (
    TokenizerIdentity,
    describe_token,
    eos_token_id,
    load_tokenizer,
    model_token_ids,
    tokenizer_fingerprint,
)
from nanotron.layout import Axis, Group
from nanotron.memory import memory_summary
from nanotron.models.build import (
    BuildOptions,
    ModuleConverter,
    build_model,
    parameter_initializer,
    parameter_lr_scales,
)
from nanotron.models.spec import CausalLM
from nanotron.nn.max_logits import record_max_logits
from nanotron.optim.muon import muon_parameters
from nanotron.optim.optimizer import MixedPrecisionAdamW, build_optimizer
from nanotron.optim.qk_clip import QKClip
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.data_parallel import GradientBuckets
from nanotron.parallel.parameter_sharding import ShardedUnits, parameter_units
from nanotron.parallel.pipeline_parallel import P2P, Chunk, PipelineSchedule
from nanotron.parallel.placement import declared_names, logical_parameters
from nanotron.parallel.statistics import Statistics
from nanotron.training.hooks import Feature

logger = logging.getLogger("nanotron.trainer")
_MODEL_TOKENIZER_FIX = ("set tokenizer.tokenizer_name_or_path to the tokenizer that wrote the data, or tokenize "
                        "the data again with {}")
_DECLARED_TOKENIZER_FIX = "point dataset_folder at data tokenized with {}, or correct tokenizer_name"


def load_data(config: Config, pc: ParallelContext,
              features: Sequence[Feature]) -> tuple[dict[str, SampleSource], str | None]:
    """Every data stage's sample source (``data/sources.py``; its mixture and domain names as the features make them)
    and the tokenizer's fingerprint (None without ``tokenizer.tokenizer_name_or_path``); fails before the model is
    allocated if a stage cannot feed it."""
    model_config = config.model.model_config
    vocab, tokenizer_end = model_config.vocab_size, None
    model_tokenizer = None
    if config.tokenizer.tokenizer_name_or_path:
        tokenizer = load_tokenizer(config.tokenizer.tokenizer_name_or_path, config.tokenizer.tokenizer_revision)
        model_tokenizer = TokenizerIdentity(config.tokenizer.tokenizer_name_or_path, tokenizer_fingerprint(tokenizer))
        if tokenizer.get_vocab_size() > vocab:
            raise ConfigError(
                f"model.model_config.vocab_size ({vocab}) is smaller than the tokenizer's vocabulary "
                f"({tokenizer.get_vocab_size()}, {config.tokenizer.tokenizer_name_or_path}); raise vocab_size"
            )
        _take_token_ids(config, tokenizer)
        tokenizer_end = eos_token_id(tokenizer) if model_config.document_masking else None
    datasets: dict[str, SampleSource] = {}
    for stage in config.data_stages:
        dataset = datasets[stage.name] = _stage_source(config, pc, stage, features, tokenizer_end)
        if dataset.vocab_size > vocab:
            raise DataError(
                f"data stage {stage.name!r} was tokenized with a vocabulary of {dataset.vocab_size} but "
                f"model.model_config.vocab_size is {vocab}; raise vocab_size or re-run nanotron preprocess"
            )
        # The tokenizers' files may be on some machines of the run only: every rank stops if any rank found a problem.
        problem = first_problem(tokenizer_problem(stage, dataset, model_tokenizer), pc.world_size)
        if problem is not None:
            raise DataError(problem)
    return datasets, None if model_tokenizer is None else model_tokenizer.fingerprint


def _stage_source(config: Config, pc: ParallelContext, stage: DatasetStageArgs, features: Sequence[Feature],
                  tokenizer_end: int | None) -> SampleSource:
    """The stage's sample source, built by its kind's row of ``data/sources.py``, with the features' mixture and
    domain names."""
    model_config, doremi = config.model.model_config, config.doremi

    def mixture(weights: list[float] | None) -> list[float] | None:
        for feature in features:
            weights = feature.sampling_weights(stage, weights)
        return weights

    context = SourceContext(
        sequence_length=config.tokens.sequence_length, seed=stage.data.seed, vocab_size=model_config.vocab_size,
        ranks=Ranks(pc.rank, pc.world_size, first_problem),
        stage=stage.name, tokenizer=config.tokenizer.tokenizer_name_or_path,
        document_masking=model_config.document_masking, tokenizer_eos_token_id=tokenizer_end,
        model_eos_token_id=model_config.eos_token_id,
        mixture=mixture, domain_names=None if doremi is None else doremi.domain_names)
    dataset = build_source(stage.data.dataset, context)
    for feature in features:
        dataset.domain_names = feature.domain_names(stage, dataset.domain_names)
    return dataset


def tokenizer_problem(stage: DatasetStageArgs, dataset: SampleSource,
                      model_tokenizer: TokenizerIdentity | None) -> str | None:
    """Why a stage's data cannot be trained with the model's tokenizer or with the tokenizer its ``tokenizer_name``
    declares (None if it can): a domain tokenized with another one (``TokenizerIdentity.same_as``: by content where
    both files are on this machine, else by name). The model's tokenizer is often a local copy of the one that wrote
    the data: where the data's cannot be found here to compare and the names differ, a warning says so and training
    goes on. A declared ``tokenizer_name`` must match by name then."""
    references = []
    if model_tokenizer is not None:
        references.append((model_tokenizer, "tokenizer.tokenizer_name_or_path", _MODEL_TOKENIZER_FIX))
    declared = getattr(stage.data.dataset, "tokenizer_name", None)  # datatrove folders' (upstream's Nanoset)
    if declared is not None:
        references.append((TokenizerIdentity.find(declared),
                           f"data_stages[{stage.name!r}].data.dataset.tokenizer_name", _DECLARED_TOKENIZER_FIX))
    records = zip(dataset.domain_sources, dataset.tokenizer_names, dataset.tokenizer_fingerprints)
    for domain, name, fingerprint in records:
        if name is None and fingerprint is None:
            continue  # the source records no tokenizer
        recorded = TokenizerIdentity(name, fingerprint)
        for reference, key, fix in references:
            same = recorded.same_as(reference)
            if same is None and reference is model_tokenizer:
                logger.warning(f"{domain} was tokenized with {recorded}, whose files are not on this machine: its "
                               f"content was not compared with {key} ({reference})")
            elif not same:
                how = ("their tokenizer.json files differ" if same is False else
                       "the names differ, and the files of one are not on this machine to compare")
                return (f"{domain} was tokenized with {recorded} but {key} is {reference}, another tokenizer "
                        f"({how}); {fix.format(reference)}")
    return None


def _take_token_ids(config: Config, tokenizer) -> None:
    """Set ``model_config``'s bos and eos ids to the tokenizer's where they are left at the schema's defaults, which
    checkpoints and exports then carry (``model_token_ids``); refuse one written as an ordinary token of it."""
    model_config = config.model.model_config
    ids, ordinary = model_token_ids(tokenizer, model_config)
    if ordinary:
        name = ordinary[0]
        written, own = (describe_token(tokenizer, token_id) for token_id in (getattr(model_config, name), ids[name]))
        raise ConfigError(f"model.model_config.{name} ({written}) is an ordinary token of the tokenizer "
                          f"({config.tokenizer.tokenizer_name_or_path}), not a special one; set it to the tokenizer's "
                          f"own, {own}, or leave it out to take that")
    for name, token_id in ids.items():
        setattr(model_config, name, token_id)


def document_ends(config: Config, datasets: dict[str, SampleSource]) -> dict[str, int | None]:
    """Per data stage, the id that ends the documents packed in its samples, which document masking cuts them at: its
    source's (``data/sources.py``, which refuses a stage without one). All None without document masking; None too
    for a stage whose samples carry the document ends their source recorded (the ``.ds.index`` files of datatrove
    folders)."""
    masking = config.model.model_config.document_masking
    return {stage: None if not masking or dataset.records_document_ends else dataset.eos_token_id
            for stage, dataset in datasets.items()}


def pipeline_schedule(config: Config, pc: ParallelContext, chunks: Sequence[Chunk],
                      before_last_backward: Callable[[], None],
                      before_first_backward: Callable[[Statistics], None]) -> PipelineSchedule:
    """The micro-batch schedule of ``pc``'s layout over this stage's model ``chunks``; with pp=1 it is plain gradient
    accumulation (every forward first where the layout says so)."""
    model_config = config.model.model_config
    shape = pc.layout.stage_activation_shape(model_config.hidden_size)
    dtype = model_config.activation_dtype(config.model.torch_dtype())
    p2p = P2P(pc, shape, dtype, config.parallelism.pp_timeout_s)
    return PipelineSchedule(pc, p2p, chunks, before_last_backward, before_first_backward)


class TrainedModel(NamedTuple):
    model: CausalLM
    buckets: GradientBuckets
    optimizer: MixedPrecisionAdamW
    units: ShardedUnits | None  # ZeRO-3 over more than one rank: what gathers and releases the model's units


def trained_model(config: Config, pc: ParallelContext, converters: Sequence[ModuleConverter] = ()) -> TrainedModel:
    """The model this rank trains, its gradient buckets and its optimizer. Under ZeRO-3 the model is built without
    weights, the buckets give each parameter its storage and initial values a bucket at a time, keep their shards and
    free the rest, and the model's units are gathered and released around their use (``ShardedUnits``). With
    QK-clip the attention cores record their logits' maxima for the optimizer (``optim/qk_clip.py``)."""
    model_config, options = config.model.model_config, BuildOptions.from_config(config)
    sharded = config.optimizer.zero_stage == 3
    threshold = config.optimizer.muon_qk_clip_threshold
    if threshold is not None:
        converters = (*converters, functools.partial(record_max_logits, compiled=options.compile))
    model = build_model(model_config, pc, options, converters, initialize=not sharded)
    shards = pc.shard_groups
    buckets, optimizer = build_optimizer(
        logical_parameters(model), config.optimizer, config.model.ddp_bucket_cap_mb,
        {axes: group for axes, (group, _) in shards.items()}, declared_names(model, "no_weight_decay_parameters"),
        single_micro_batch=config.tokens.batch_accumulation_per_replica == 1,
        replicas={axes: replicas for axes, (_, replicas) in shards.items()},
        units=parameter_units(model) if sharded else None,
        initialize=parameter_initializer(model_config, pc, options) if sharded else None,
        lr_scales=parameter_lr_scales(model_config, options),
        matrices=muon_parameters(model, config.optimizer.muon_named_params) if config.optimizer.name == "muon"
        else frozenset(), tp_group=pc.group(Group.TP),
        qk_clip=QKClip(model, threshold, pc) if threshold is not None else None,
    )
    units = ShardedUnits(model, buckets) if any(bucket.sharded_params for bucket in buckets.buckets) else None
    return TrainedModel(model, buckets, optimizer, units)


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
    logger.info(memory_summary(config, pc.coord(Axis.PP), gpu_memory_gb))


def profiler(config: Config, pc: ParallelContext):
    """The torch profiler of a run with ``profiler.profiler_export_path``, a context whose ``step()`` the loop calls
    after every step (a trace per rank in that folder, of the 6th and 7th steps the run trains); else a context that
    gives None."""
    path = config.profiler.profiler_export_path if config.profiler else None
    if path is None:
        return contextlib.nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if pc.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(skip_first=3, wait=1, warmup=1, active=2, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(Path(path) / f"rank{pc.rank}")),
    )
