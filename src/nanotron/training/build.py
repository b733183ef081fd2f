"""Building a run's pieces from its validated config: the data it reads, the pipeline schedule, the fused loss, and
the summary logged before the first step. The model and optimizer are built by ``models/build.py`` and
``optim/optimizer.py``; the trainer puts them together."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from nanotron.checkpoint.manager import first_problem
from nanotron.config import Config, ConfigError, DatasetArgs, DatasetStageArgs, HFDatasetArgs
from nanotron.data.dataset import DataError, PretrainDataset, SampleSource
from nanotron.data.datatrove_folder import DatatroveDataset
from nanotron.data.hf_dataset import HFDataset
from nanotron.data.preprocess import METADATA_FILE_NAME
from nanotron.data.synthetic import SyntheticDataset
from nanotron.data.tokenizer import (
    describe_token,
    eos_token_id,
    load_tokenizer,
    model_token_ids,
    tokenizer_fingerprint,
)
from nanotron.memory import memory_summary
from nanotron.models.registry import spec_for_config
from nanotron.models.spec import CausalLM
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.linear_cross_entropy import LinearCrossEntropy, fusable_head
from nanotron.parallel.pipeline_parallel import P2P, PipelineSchedule, StageOutput
from nanotron.training.hooks import Feature

logger = logging.getLogger("nanotron.trainer")


def load_data(config: Config, pc: ParallelContext,
              features: Sequence[Feature]) -> tuple[dict[str, SampleSource], str | None]:
    """Every data stage's sample source (its mixture and domain names as the features make them) and the tokenizer's
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
        _take_token_ids(config, tokenizer)
    datasets: dict[str, SampleSource] = {}
    for stage in config.data_stages:
        dataset = datasets[stage.name] = _dataset(config, pc, stage, features)
        if dataset.vocab_size > vocab:
            raise DataError(
                f"data stage {stage.name!r} was tokenized with a vocabulary of {dataset.vocab_size} but "
                f"model.model_config.vocab_size is {vocab}; raise vocab_size or re-run nanotron preprocess"
            )
        for domain, fingerprint in zip(domain_sources(stage, dataset), dataset.tokenizer_fingerprints):
            if None not in (expected, fingerprint) and fingerprint != expected:
                raise DataError(
                    f"{domain} was tokenized with another tokenizer than tokenizer.tokenizer_name_or_path "
                    f"({config.tokenizer.tokenizer_name_or_path}); re-run nanotron preprocess with it"
                )
    return datasets, expected


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
    """Per data stage, the id that ends the documents packed in its samples, which document masking cuts them at
    (all None without it): the one its folders record (``nanotron preprocess``, Hugging Face datasets), else the
    tokenizer's (datatrove folders record none), else for synthetic tokens ``model_config.eos_token_id``. Refuses a
    stage without one before the model is allocated."""
    model_config = config.model.model_config
    if not spec_for_config(model_config).document_masking(model_config):
        return dict.fromkeys(datasets)
    name = config.tokenizer.tokenizer_name_or_path
    tokenizer_end = eos_token_id(load_tokenizer(name, config.tokenizer.tokenizer_revision)) if name else None
    ends = {}
    for stage, dataset in datasets.items():
        end = dataset.eos_token_id if dataset.eos_token_id is not None else tokenizer_end
        if end is None and isinstance(dataset, SyntheticDataset):
            end = model_config.eos_token_id
        if end is None:
            raise ConfigError(f"data stage {stage!r}: model.model_config._use_doc_masking cuts samples at the "
                              "end-of-document id, which datatrove folders do not record; set "
                              "tokenizer.tokenizer_name_or_path to the tokenizer that wrote them")
        ends[stage] = end
    return ends


def domain_sources(stage: DatasetStageArgs, dataset: SampleSource) -> list[str]:
    """What each domain of a stage is read from, for messages: its folder, else its dataset's name."""
    if isinstance(stage.data.dataset, DatasetArgs):
        return [str(folder) for folder in stage.data.dataset.dataset_folder]
    return [f"data stage {stage.name!r}: {name}" for name in dataset.domain_names]


def _dataset(config: Config, pc: ParallelContext, stage: DatasetStageArgs,
             features: Sequence[Feature]) -> SampleSource:
    """The stage's sample source, its mixture (``dataset_weights`` or a ``{dataset: weight}`` mapping, as the
    features change it; None: the token shares) and its domain names."""
    source, sequence_length, seed = stage.data.dataset, config.tokens.sequence_length, stage.data.seed
    vocab = config.model.model_config.vocab_size
    if source is None:  # upstream's ``dataset: null``: throughput runs without data
        return SyntheticDataset(vocab, sequence_length, seed)
    if isinstance(source, HFDatasetArgs):
        datasets = _hf_domains(config, source)
        weights = list(datasets.values()) if isinstance(datasets, dict) else None
    else:
        weights = source.dataset_weights
    for feature in features:
        weights = feature.sampling_weights(stage, weights)
    if isinstance(source, HFDatasetArgs):
        dataset = _tokenized_first_on_rank_0(config, pc, source, datasets, weights, seed)
    elif _holds_datatrove_files(source.dataset_folder):
        dataset = _datatrove_read_by_all_ranks(pc, source, weights, sequence_length, seed, source.vocab_size or vocab)
        named = {name for name in dataset.tokenizer_names if name is not None}
        if source.tokenizer_name is not None and named - {source.tokenizer_name}:
            raise DataError(f"data stage {stage.name!r}: the folders were tokenized with {', '.join(sorted(named))} "
                            f"but its tokenizer_name is {source.tokenizer_name}; point dataset_folder at data "
                            "tokenized with it, or correct tokenizer_name")
    else:
        dataset = PretrainDataset(source.dataset_folder, weights, sequence_length, seed)
    for feature in features:
        dataset.domain_names = feature.domain_names(stage, dataset.domain_names)
    return dataset


def _datatrove_read_by_all_ranks(pc: ParallelContext, source: DatasetArgs, weights: list[float] | None,
                                  sequence_length: int, seed: int, vocab_size: int) -> DatatroveDataset:
    """A datatrove stage, each rank checking the ids of its share of every file (datatrove records no id range, so
    the check reads the data: once per run, not once per rank, which from a network file system took minutes for
    every rank of every run); what any rank found stops every rank with its message."""
    dataset, problem = None, None
    try:
        dataset = DatatroveDataset(source.dataset_folder, weights, sequence_length, seed, vocab_size=vocab_size,
                                   token_size=source.token_size_in_bytes, id_share=(pc.rank, pc.world_size))
    except DataError as error:
        problem = str(error)
    problem = first_problem(problem, pc.world_size)
    if problem is not None:
        raise DataError(problem)
    return dataset


def _holds_datatrove_files(folders: Sequence[Path]) -> bool:
    """Whether a stage's folders are datatrove's (``*.ds`` files) rather than ``nanotron preprocess``'s (its
    metadata.json); one stage mixing both kinds is refused."""
    kinds = {"nanotron" if (Path(folder) / METADATA_FILE_NAME).exists() else
             "datatrove" if any(Path(folder).glob("*.ds")) else None for folder in folders}
    if {"nanotron", "datatrove"} <= kinds:
        raise DataError("dataset_folder mixes folders of nanotron preprocess (metadata.json) and of datatrove (.ds "
                        "files); give each kind its own data stage, or tokenize them all one way")
    return kinds == {"datatrove"}


def _hf_domains(config: Config, source: HFDatasetArgs) -> str | dict[str, float]:
    """The Hugging Face datasets of a stage: ``hf_dataset_or_datasets`` as written, except in upstream's DoReMi
    layout (one folder and ``doremi.domain_names``), where each domain is the ``save_to_disk`` folder of its name
    inside that folder."""
    datasets, doremi = source.hf_dataset_or_datasets, config.doremi
    if isinstance(datasets, str) and doremi is not None and doremi.domain_names:
        return {str(Path(datasets) / name): 1.0 for name in doremi.domain_names}
    return datasets


def _tokenized_first_on_rank_0(config: Config, pc: ParallelContext, source: HFDatasetArgs,
                               datasets: str | dict[str, float], weights: list[float] | None,
                               seed: int) -> HFDataset:
    """A Hugging Face dataset, tokenized by rank 0 into its cache while the other ranks wait, then opened by them
    from the cache: one tokenization per run, not one per rank. A failure on rank 0 stops every rank with its
    message."""
    tokenizer = config.tokenizer.tokenizer_name_or_path
    if not tokenizer:
        raise ConfigError("a data stage reading hf_dataset_or_datasets needs tokenizer.tokenizer_name_or_path: the "
                          "text is tokenized when the run starts")
    if weights is not None:
        names = list(datasets) if isinstance(datasets, dict) else [datasets]
        datasets = dict(zip(names, weights, strict=True))

    def open_dataset() -> HFDataset:
        return HFDataset(datasets, tokenizer, config.tokens.sequence_length, seed,
                         splits=source.hf_dataset_splits, text_column=source.text_column_name,
                         config_name=source.hf_dataset_config_name,
                         num_proc=source.dataset_processing_num_proc_per_process,
                         overwrite_cache=source.dataset_overwrite_cache)

    dataset, problem = None, None
    if pc.rank == 0:
        try:
            dataset = open_dataset()
        except DataError as error:
            problem = str(error)
    problem = first_problem(problem, pc.world_size)
    if problem is not None:
        raise DataError(problem)
    return dataset if dataset is not None else open_dataset()


def pipeline_schedule(config: Config, pc: ParallelContext,
                      stage_forward: Callable[[dict[str, torch.Tensor], torch.Tensor | None], StageOutput],
                      before_last_backward: Callable[[], None]) -> PipelineSchedule:
    """The micro-batch schedule; with pp=1 it is plain gradient accumulation."""
    p = config.parallelism
    # Each context-parallel rank holds 1/cp of the sequence; sequence parallelism splits that over TP.
    sequence = config.tokens.sequence_length // p.context_parallel_size // (p.tp if p.tp_mode == "REDUCE_SCATTER"
                                                                            else 1)
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
