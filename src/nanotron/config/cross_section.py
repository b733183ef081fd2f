"""The rules that tie two or more sections together, so that no one section's ``problems()`` can check them.

They need the model and the layout at once (shapes split over tensor, pipeline and expert-parallel ranks; the
sequence against the positions and the tensor-parallel split), the schedule and the run length, or the DoReMi
domains and the dataset folders of every stage. They name no model family (what a family supports is asked of its
config, ``config/family.py``) and no kind of data source (a source's settings are asked for the keys they have).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from nanotron.config.optimizer import LR_KEY
from nanotron.config.rules import MODEL_CONFIG_KEY
from nanotron.layout import Layout
from nanotron.pipeline_schedules import SCHEDULES

if TYPE_CHECKING:
    from nanotron.config.config import Config


def cross_section_problems(cfg: Config) -> Iterator[str]:
    yield from _schedule_vs_run_length(cfg)
    yield from _doremi_vs_data_stages(cfg)
    yield from _model_vs_parallelism(cfg)
    yield from _documents_vs_data_stages(cfg)
    yield from _conversations_vs_model(cfg)
    yield from _context_parallelism(cfg)
    yield from _pipeline_schedule(cfg)
    if getattr(cfg.model.init_method, "use_mup", False) and cfg.optimizer.name == "muon":
        yield ("model.init_method.use_mup: true sets each matrix's AdamW learning rate (spectral µP), but "
               "optimizer.name: muon scales its own updates; keep one of them")
    qk_clip_refusal = cfg.model.model_config.qk_clip_refusal() if cfg.optimizer.muon_qk_clip_threshold else None
    if qk_clip_refusal is not None:
        yield (f"optimizer.muon_qk_clip_threshold bounds attention logits by scaling each head's query and key rows, "
               f"but {qk_clip_refusal}; remove the key")
    if cfg.parallelism.tp_partial_sums_in_fp32 and cfg.fp8 is not None and cfg.fp8.enabled:
        yield ("parallelism.tp_partial_sums_in_fp32: true sums the products of bf16 and fp16 linears in fp32, but FP8 "
               "linears (fp8.enabled) round theirs to their own output dtype: disable one of them")


def _schedule_vs_run_length(cfg: Config) -> Iterator[str]:
    """The default decay length must not be negative. (A warmup longer than the run is a warning, given by the
    loader: upstream allows it for runs trained in parts.)"""
    lr, train_steps = cfg.optimizer.learning_rate_scheduler, cfg.tokens.train_steps
    if lr.lr_decay_starting_step is not None and lr.lr_decay_steps is None and lr.lr_decay_starting_step > train_steps:
        yield (
            f"{LR_KEY}.lr_decay_starting_step ({lr.lr_decay_starting_step}) is after tokens.train_steps "
            f"({train_steps}), so the default decay length would be negative; set {LR_KEY}.lr_decay_steps"
        )


def _doremi_vs_data_stages(cfg: Config) -> Iterator[str]:
    """DoReMi has one domain per dataset folder of every data stage, and owns the stages' mixture."""
    d = cfg.doremi
    if d is None:
        return
    for stage in cfg.data_stages:
        dataset = stage.data.dataset
        if isinstance(getattr(dataset, "hf_dataset_or_datasets", None), str) and d.domain_names:
            continue  # upstream's DoReMi layout: one save_to_disk folder per domain name inside the dataset folder
        domains = stage.data.num_domains
        for key, values in (("domain_names", d.domain_names), ("domain_weights", d.domain_weights)):
            if values is not None and len(values) != domains:
                yield (f"doremi.{key} has {len(values)} entries but data_stages[{stage.name!r}] has {domains} "
                       "dataset folders (one domain each); give one per folder")
        if d.domain_weights is not None and getattr(stage.data.dataset, "dataset_weights", None) is not None:
            yield (f"doremi.domain_weights and data_stages[{stage.name!r}].data.dataset.dataset_weights are both "
                   "set; keep one of them")


def _model_vs_parallelism(cfg: Config) -> Iterator[str]:
    """Shapes that must split evenly over the parallel ranks, and sequence limits."""
    c, p, tokens = cfg.model.model_config, cfg.parallelism, cfg.tokens
    key = MODEL_CONFIG_KEY
    if p.pp_stage_layers is not None and sum(p.pp_stage_layers) != c.num_hidden_layers:
        yield (
            f"parallelism.pp_stage_layers {p.pp_stage_layers} adds up to {sum(p.pp_stage_layers)} but "
            f"{key}.num_hidden_layers is {c.num_hidden_layers}: every layer must be on exactly one stage"
        )
    yield from c.layout_problems(p.tp, key=key, sequence_length=tokens.sequence_length)
    ep, moe = p.expert_parallel_size, c.moe
    if ep > 1 and moe is None:
        yield (f"parallelism.expert_parallel_size ({ep}) needs a mixture-of-experts model ({key} with "
               "is_llamoe_config: true, or is_qwen2_config or is_qwen3_config: true with a moe_config); set it to 1 "
               "for this model")
    elif ep >= 1 and moe is not None and moe.num_experts >= 1 and moe.num_experts % ep:
        yield (f"{key}.{moe.num_experts_key} ({moe.num_experts}) must be divisible by "
               f"parallelism.expert_parallel_size ({ep}): every expert-parallel rank holds the same number of whole "
               "experts")
    yield from Layout.from_config(cfg).problems()  # the sequence against the cp and tp splits
    chunks = p.pp * p.virtual_pipeline_size
    if c.num_hidden_layers < chunks:
        yield (
            f"{key}.num_hidden_layers ({c.num_hidden_layers}) must be >= parallelism.pp x virtual_pipeline_size "
            f"({p.pp} x {p.virtual_pipeline_size}): every pipeline stage's chunk needs at least one layer; lower "
            "virtual_pipeline_size or pp"
        )


def _documents_vs_data_stages(cfg: Config) -> Iterator[str]:
    """Document masking reads the documents' positions, which upstream's ``return_positions: false`` turns off."""
    if not cfg.model.model_config.document_masking:
        return
    for stage in cfg.data_stages:
        if not getattr(stage.data.dataset, "return_positions", True):  # token folders' (upstream's Nanoset)
            yield (f"data_stages[{stage.name!r}].data.dataset.return_positions is false, but "
                   f"{MODEL_CONFIG_KEY}._use_doc_masking needs the positions of the documents in each sample: set "
                   "return_positions: true, or _use_doc_masking: false")


def _conversations_vs_model(cfg: Config) -> Iterator[str]:
    """Chat conversations (a stage with ``train_on``) are rendered and tokenized when the run starts, and packed as
    documents that attention keeps apart."""
    for stage in cfg.data_stages:
        if getattr(stage.data.dataset, "train_on", None) is None:
            continue
        key = f"data_stages[{stage.name!r}].data.dataset"
        if not cfg.tokenizer.tokenizer_name_or_path:
            yield (f"{key} holds chat conversations, which are tokenized when the run starts: set "
                   "tokenizer.tokenizer_name_or_path to the model's tokenizer")
        if not cfg.model.model_config.attention:
            yield (f"{key} holds chat conversations, packed as documents that attention keeps apart, but "
                   f"{MODEL_CONFIG_KEY} has no attention layers; fine-tune a model with attention")


def _context_parallelism(cfg: Config) -> Iterator[str]:
    """What does not compose with context parallelism yet is refused by name (how the sequence splits over cp is the
    layout's rule, ``Layout.problems``)."""
    c, p, key = cfg.model.model_config, cfg.parallelism, MODEL_CONFIG_KEY
    cp = p.context_parallel_size
    if cp <= 1:
        return
    refusal = c.context_parallel_refusal(key)
    if refusal is not None:
        yield f"parallelism.context_parallel_size ({cp}) needs an attention model: {refusal}; set it to 1"
    moe = c.moe
    if moe is not None and moe.capacity_factor is not None:
        yield (f"{key}.moe_capacity_factor ({moe.capacity_factor}): the experts' capacity drops assignments by "
               "their order in the whole micro-batch, which no rank holds under parallelism.context_parallel_size "
               f"({cp}); set moe_capacity_factor: null (dropless), or context_parallel_size: 1")
    if cfg.doremi is not None:
        yield (f"doremi with parallelism.context_parallel_size ({cp}) is not supported yet: DoReMi's reference "
               "losses are per whole sequence; set context_parallel_size: 1")


def _pipeline_schedule(cfg: Config) -> Iterator[str]:
    """What a schedule with split backwards, or with both ends of the model on one stage, cannot run is refused by
    name (the schedule's own rules on chunks and micro-batches are the layout's, ``Layout.problems``)."""
    p = cfg.parallelism
    if p.pp == 1:
        return
    engine, split = p.pp_engine, SCHEDULES[p.pp_engine].splits_backward
    if split and p.recompute != "none":
        yield (f"parallelism.pp_engine: {engine} splits each backward into the input's and the weights' gradients, "
               f"which parallelism.recompute ({p.recompute}) would recompute twice (selective and pointwise cannot "
               "at all); set recompute: none, or use pp_engine: interleaved_1f1b or 1f1b")
    if split and cfg.model.compile:
        yield (f"parallelism.pp_engine: {engine} splits each backward into the input's and the weights' gradients, "
               "which a compiled layer computes in one graph; set model.compile: false, or use pp_engine: "
               "interleaved_1f1b or 1f1b")
    if SCHEDULES[engine].v_shape and cfg.model.model_config.tie_word_embeddings:
        yield (f"parallelism.pp_engine: {engine} puts the first and the last model chunk on stage 0, where "
               f"{MODEL_CONFIG_KEY}.tie_word_embeddings would give the one weight two gradients per micro-batch, "
               "which the gradient buckets do not take yet; set tie_word_embeddings: false, or use pp_engine: "
               "interleaved_1f1b")
