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
from nanotron.data.datatrove_folder import DatatroveDataset, briefly, not_a_token_folder
from nanotron.data.hf_dataset import HFDataset
from nanotron.data.preprocess import METADATA_FILE_NAME
from nanotron.data.synthetic import SyntheticDataset
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
from nanotron.models.registry import spec_for_config
from nanotron.models.spec import CausalLM
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.linear_cross_entropy import LinearCrossEntropy, fusable_head
from nanotron.parallel.pipeline_parallel import P2P, PipelineSchedule, StageOutput
from nanotron.training.hooks import Feature

logger = logging.getLogger("nanotron.trainer")
_MODEL_TOKENIZER_FIX = ("set tokenizer.tokenizer_name_or_path to the tokenizer that wrote the data, or tokenize "
                        "the data again with {}")
_DECLARED_TOKENIZER_FIX = "point dataset_folder at data tokenized with {}, or correct tokenizer_name"


def load_data(config: Config, pc: ParallelContext,
              features: Sequence[Feature]) -> tuple[dict[str, SampleSource], str | None]:
    """Every data stage's sample source (its mixture and domain names as the features make them) and the tokenizer's
    fingerprint (None without ``tokenizer.tokenizer_name_or_path``); fails before the model is allocated if a stage
    cannot feed it."""
    vocab = config.model.model_config.vocab_size
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
    datasets: dict[str, SampleSource] = {}
    for stage in config.data_stages:
        dataset = datasets[stage.name] = _dataset(config, pc, stage, features)
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
    source = stage.data.dataset
    if isinstance(source, DatasetArgs) and source.tokenizer_name is not None:
        references.append((TokenizerIdentity.find(source.tokenizer_name),
                           f"data_stages[{stage.name!r}].data.dataset.tokenizer_name", _DECLARED_TOKENIZER_FIX))
    records = zip(domain_sources(stage, dataset), dataset.tokenizer_names, dataset.tokenizer_fingerprints)
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
    """Per data stage, the id that ends the documents packed in its samples, which document masking cuts them at
    (all None without it; None too for a stage whose samples carry the document ends their source recorded, the
    ``.ds.index`` files of datatrove folders): the one its folders record (``nanotron preprocess``, Hugging Face
    datasets), else the tokenizer's, else for synthetic tokens ``model_config.eos_token_id``. Refuses a stage without
    one before the model is allocated."""
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
        if dataset.records_document_ends:
            end = None
        elif end is None:
            raise ConfigError(_no_document_end(stage, dataset))
        elif isinstance(dataset, DatatroveDataset):
            logger.warning(f"data stage {stage!r}: files without a .ds.index ({briefly(dataset.files_without_index)}); "
                           f"document masking cuts the documents at the end-of-document id {end} of {name}")
        ends[stage] = end
    return ends


def _no_document_end(stage: str, dataset: SampleSource) -> str:
    """Why document masking cannot cut a stage's samples, and what to set."""
    masking = "model.model_config._use_doc_masking"
    if isinstance(dataset, SyntheticDataset):
        return (f"data stage {stage!r} trains on synthetic tokens (dataset: null), which {masking} cuts at "
                "model.model_config.eos_token_id, but it is null; set eos_token_id, or _use_doc_masking: false")
    return (f"data stage {stage!r}: {masking} needs the ends of the documents, but files have no .ds.index "
            f"({briefly(dataset.files_without_index)}; datatrove writes one unless save_index=False) and no "
            "end-of-document id is known; set tokenizer.tokenizer_name_or_path to the tokenizer that wrote them, or "
            "tokenize them again with their index")


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
        masking = spec_for_config(config.model.model_config).document_masking(config.model.model_config)
        dataset = _datatrove_read_by_all_ranks(pc, source, weights, sequence_length, seed, source.vocab_size or vocab,
                                               document_ends=masking)
    else:
        dataset = PretrainDataset(source.dataset_folder, weights, sequence_length, seed)
    for feature in features:
        dataset.domain_names = feature.domain_names(stage, dataset.domain_names)
    return dataset


def _datatrove_read_by_all_ranks(pc: ParallelContext, source: DatasetArgs, weights: list[float] | None,
                                  sequence_length: int, seed: int, vocab_size: int,
                                  document_ends: bool = False) -> DatatroveDataset:
    """A datatrove stage, each rank checking the ids of its share of every file (datatrove records no id range, so
    the check reads the data: once per run, not once per rank, which from a network file system took minutes for
    every rank of every run); what any rank found stops every rank with its message. ``document_ends``: its samples
    carry the document ends that the folders' indexes record (document masking)."""
    dataset, problem = None, None
    try:
        dataset = DatatroveDataset(source.dataset_folder, weights, sequence_length, seed, vocab_size=vocab_size,
                                   token_size=source.token_size_in_bytes, id_share=(pc.rank, pc.world_size),
                                   document_ends=document_ends)
    except DataError as error:
        problem = str(error)
    problem = first_problem(problem, pc.world_size)
    if problem is not None:
        raise DataError(problem)
    return dataset


def _holds_datatrove_files(folders: Sequence[Path]) -> bool:
    """Whether a stage's folders are datatrove's (``*.ds`` files) rather than ``nanotron preprocess``'s (its
    metadata.json); one stage mixing both kinds is refused, and so is a folder of neither kind."""
    kinds = {_folder_kind(Path(folder)) for folder in folders}
    if {"nanotron", "datatrove"} <= kinds:
        raise DataError("dataset_folder mixes folders of nanotron preprocess (metadata.json) and of datatrove (.ds "
                        "files); give each kind its own data stage, or tokenize them all one way")
    return kinds == {"datatrove"}


def _folder_kind(folder: Path) -> str:
    if (folder / METADATA_FILE_NAME).exists():
        return "nanotron"
    if any(folder.glob("*.ds")):
        return "datatrove"
    if not folder.is_dir():
        raise DataError(f"dataset folder {folder} {'is a file' if folder.exists() else 'does not exist'}; check "
                        "dataset_folder")
    raise DataError(not_a_token_folder(folder))


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
    """The micro-batch schedule of ``pc``'s layout; with pp=1 it is plain gradient accumulation."""
    model_config = config.model.model_config
    shape = pc.layout.stage_activation_shape(model_config.hidden_size)
    dtype = spec_for_config(model_config).activation_dtype(model_config, config.model.torch_dtype())
    p2p = P2P(pc, shape, dtype, config.parallelism.pp_timeout_s)
    return PipelineSchedule(pc, p2p, stage_forward, before_last_backward)


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
    return LinearCrossEntropy(pc.group(Group.TP), config.model.model_config.vocab_size, chunk_tokens,
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
    logger.info(memory_summary(config, pc.coord(Axis.PP), gpu_memory_gb))
