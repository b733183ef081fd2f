"""Upstream nanotron's keys that our schema names otherwise, ignores, or lacks, handled before the typed reader.

Users bring the YAML files of upstream nanotron (v0.4 and its later main). ``translate`` rewrites a file's plain data
into our schema's form, so the typed reader stays strict for everything else:

- keys with an upstream meaning we have under another name or shape are rewritten to it (``optimizer_factory``,
  ``recompute_layer`` with ``recompute_granularity``, ``dataset_folder`` as ``{folder: weight}``, the v0.4 ``data``
  section, ``domain_names`` as one comma-separated string, ...);
- keys that change nothing here are dropped and named, all together, in one ``LegacyKeyWarning``: those that have no
  effect whatever their value (``IGNORED_KEYS``), and upstream's fields that nothing here reads (``UNREAD_KEYS``),
  named only for a value other than the one that describes what runs here anyway;
- a feature we do not have is refused in one line naming it, unless its value is the one that means "off" (``1``,
  ``null``, ``false``), which is dropped silently.

torchtitan's count of layers per pipeline chunk (``pipeline_parallel_layers_per_stage``) is read the same way, as
our chunks per stage and layers per chunk.

So the schema has no field that nothing reads: upstream's are accepted here, before it, and never saved.

docs/upstream.md lists every key and what happens to it.
"""

from dataclasses import dataclass, field, fields
from typing import Any

from nanotron.config.optimizer import OptimizerArgs
from nanotron.config.parallelism import Recompute
from nanotron.config.rules import literal_values

MODEL_CONFIG = "model.model_config"

_NO_VALIDATION = "no validation loop reads it (upstream never ran one either)"

# Keys that have no effect here, whatever their value: dropped and named in one warning.
IGNORED_KEYS: dict[str, str] = {
    "general.step": "the step to resume from is read from the checkpoint, not from the config",
    "general.consumed_train_samples": "the consumed samples are read from the checkpoint, not from the config",
    "general.benchmark_csv_path": "the benchmark CSV mode was removed",
    "general.ignore_sanity_checks": "the checks always run (validation before allocation, and the replica check "
                                    "every parallelism.replica_check_interval steps)",
    "tokens.val_check_interval": _NO_VALIDATION,
    "tokens.limit_val_batches": _NO_VALIDATION,
    "tokens.limit_test_batches": _NO_VALIDATION,
    "lighteval": "the trainer launches no lighteval jobs; the evals section runs local tasks in the loop "
                 "(docs/evals.md)",
    "s3_upload": "checkpoints are not uploaded; they stay in checkpoints.checkpoints_path",
    "parallelism.tp_recompute_allgather": "the column-parallel layers of tp_mode REDUCE_SCATTER keep their input "
                                          "shard and re-gather it in the backward; memory and traffic only, the "
                                          "same results",
}


EVERY_VALUE = object()  # an UNREAD_KEYS entry whose every value describes what runs here
_KERNEL_CHOICE = "chooses upstream's kernels, not the results; nanotron picks its own"
# Upstream's fields that nothing here reads, dropped: named in the same warning when a file gives another value than
# the one that describes what runs here anyway (EVERY_VALUE: none does; kernel choices). Older checkpoints and
# configs saved by nanotron hold them at those values.
UNREAD_KEYS: dict[str, tuple[Any, str]] = {
    "tokenizer.tokenizer_max_length": (None, "training reads whole windows of tokens.sequence_length"),
    f"{MODEL_CONFIG}.use_cache": (True, "generation keeps a KV cache unless `nanotron generate --no-cache`"),
    f"{MODEL_CONFIG}.fused_add_norm": (True, "a kernel choice of mamba_ssm; the same maths here"),
    f"{MODEL_CONFIG}.pad_vocab_size_multiple": (8, "model.make_vocab_size_divisible_by pads the vocabulary"),
    f"{MODEL_CONFIG}.ssm_cfg.use_fast_path": (True, "the kernels are chosen by the device (plain torch where none "
                                                    "runs)"),
    **{f"{MODEL_CONFIG}.{key}": (EVERY_VALUE, _KERNEL_CHOICE)
       for key in ("_attn_implementation", "_fused_rotary_emb", "_fused_rms_norm", "_use_qkv_packed",
                   "ring_attn_heads_k_stride")},
    f"{MODEL_CONFIG}.log_attn_probs": (EVERY_VALUE, "nanotron logs no attention probabilities"),
}


@dataclass(frozen=True)
class Feature:
    """An upstream key that turns on a feature we lack: accepted only with the value that means "off"."""

    name: str  # the feature, as a user would look it up
    off: tuple[Any, ...]  # values that leave it off
    fix: str = ""  # what to write instead, when there is an equivalent ("{value}" stands for the value written)


_DATASET = "data_stages[].data.dataset"
# Keyed by the dotted key with list indices written as [] (data stages) and the model config's fields.
FEATURES: dict[str, Feature] = {
    "parallelism.moe_layer_recompute": Feature(
        "recomputing the MoE layers alone", (False,), "parallelism.recompute: full recomputes whole layers"),
    "metrics_logging": Feature("detailed metrics logging (metrics_logging)", (None,)),
    "data_stages[].sequence_length": Feature(
        "a sequence length per data stage", (None,),
        "remove sequence_length, or set it to null or to tokens.sequence_length (every stage's length here)"),
    f"{_DATASET}.dataset_read_path": Feature("reading the folders from a local copy (dataset_read_path)", (None,)),
    f"{_DATASET}.dataset_max_tokens": Feature("a token budget per folder (dataset_max_tokens)", (None,)),
    f"{_DATASET}.skip_in_stream": Feature("skipping samples in the stream (skip_in_stream)", (False,)),
    f"{_DATASET}.pad_samples_to_global_batch_size": Feature(
        "padding the samples to the global batch (pad_samples_to_global_batch_size)", (False,)),
    f"{_DATASET}.shuffle_files": Feature("shuffling the files of a folder (shuffle_files)", (False,)),
    f"{_DATASET}.use_old_brrr_dataloader": Feature("the brrr data loader (use_old_brrr_dataloader)", (False,)),
    **{f"{MODEL_CONFIG}.{key}": Feature(
        "the interleaved rotary layout", (False,),
        f"remove {key} or set it to false: the Hugging Face layout (rotating the two halves of each head) is the one "
        "implemented") for key in ("rope_interleaved", "interleaved_rotary")},
    f"{MODEL_CONFIG}.pretraining_tp": Feature(
        "splitting the products into pretraining_tp slices", (1,),
        "remove pretraining_tp or set it to 1; tensor parallelism is parallelism.tp"),
    f"{MODEL_CONFIG}.rope_seq_len_interpolation_factor": Feature(
        "position interpolation under this key", (None,),
        "write it as rope_scaling: {{rope_type: linear, factor: {value}}} and remove this key"),
    f"{MODEL_CONFIG}.rms_norm": Feature("LayerNorm in Mamba blocks", (True,), "remove rms_norm or set it to true"),
    f"{MODEL_CONFIG}.moe_config.token_dispatcher_type": Feature(
        "dispatching tokens otherwise than by all-to-all", ("alltoall",),
        "set alltoall (the same results as upstream's allgather: tokens travel to their experts by all-to-all)"),
}

_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
V04_DATA_STAGE_NAME = "main"
# AdamW's settings inside upstream main's ``optimizer_factory``: our flat ``optimizer`` fields of the same names.
ADAMW_FACTORY_FIELDS = ("adam_eps", "adam_beta1", "adam_beta2", "torch_adam_is_fused")
_OPTIMIZER_FIELDS = {f.name for f in fields(OptimizerArgs)}
# Muon's settings inside the factory (ours: upstream has no Muon), beside AdamW's for the parameters Muon leaves.
MUON_FACTORY_FIELDS = tuple(name for name in _OPTIMIZER_FIELDS if name.startswith("muon_"))
FACTORY_FIELDS = ("name", *ADAMW_FACTORY_FIELDS, *sorted(MUON_FACTORY_FIELDS))
# Keys naming one setting in two ways (upstream's current and older spelling, or ours and upstream's).
_SPELLINGS = (*((f"optimizer.{key}", f"optimizer.optimizer_factory.{key}") for key in FACTORY_FIELDS),
              (f"{MODEL_CONFIG}.rope_interleaved", f"{MODEL_CONFIG}.interleaved_rotary"))


@dataclass
class Translation:
    """What ``translate`` found: lines refusing features, and the ignored keys with the reason for each."""

    problems: list[str] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)

    def ignored_warning(self) -> str | None:
        """One line naming every ignored key and why, or None when there are none."""
        if not self.ignored:
            return None
        keys = "; ".join(f"'{key}' ({why})" for key, why in self.ignored.items())
        return f"ignoring {len(self.ignored)} key(s) that have no effect here: {keys}"


def _same_dtype(a: Any, b: Any) -> bool:
    def canonical(value: Any) -> Any:
        return _DTYPE_ALIASES.get(value.lower(), value.lower()) if isinstance(value, str) else value
    return canonical(a) == canonical(b)


def translate(raw: Any) -> tuple[Any, Translation]:
    """``raw`` (plain YAML data) rewritten into our schema's form, and what was refused or ignored on the way.

    Never modifies ``raw``; anything that is not the expected shape is left for the typed reader to report.
    """
    found = Translation()
    if not isinstance(raw, dict):
        return raw, found
    raw = _copy(raw)
    _data_section(raw, found)
    _stage_sequence_lengths(raw)
    _walk_features(raw, "", "", found)
    for key in IGNORED_KEYS:
        _drop_ignored(raw, key, found)
    for key, (runs_anyway, why) in UNREAD_KEYS.items():
        parent, _, name = key.rpartition(".")
        section = _section(raw, parent)
        if section is None or name not in section:
            continue
        value = section.pop(name)
        if runs_anyway is not EVERY_VALUE and value != runs_anyway:
            found.ignored[key] = why
    for rewrite in (_optimizer_factory, _recompute, _layers_per_chunk, _init_method, _model_config, _datasets,
                    _domain_names):
        rewrite(raw, found)
    return raw, found


def translate_model_config(raw: Any) -> tuple[Any, Translation]:
    """A model config on its own (checkpoint.json's ``model.config``) as ``translate`` rewrites it inside a file:
    older checkpoints hold upstream fields that the schema no longer has."""
    translated, found = translate({"model": {"model_config": raw}})
    return translated["model"]["model_config"], found


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _section(raw: dict, dotted: str) -> dict | None:
    node: Any = raw
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _drop_ignored(raw: dict, dotted: str, found: Translation) -> None:
    parent, _, name = dotted.rpartition(".")
    section = _section(raw, parent) if parent else raw
    if section is not None and name in section:
        del section[name]
        found.ignored[dotted] = IGNORED_KEYS[dotted]


def _walk_features(node: Any, pattern: str, dotted: str, found: Translation) -> None:
    """Drop every FEATURES key in its "off" value; refuse it in any other, naming the feature."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk_features(item, f"{pattern}[]", f"{dotted}[{i}]", found)
        return
    if not isinstance(node, dict):
        return
    for name in list(node):
        key_pattern, key = (f"{pattern}.{name}", f"{dotted}.{name}") if pattern else (str(name), str(name))
        feature = FEATURES.get(key_pattern)
        if feature is None:
            _walk_features(node[name], key_pattern, key, found)
            continue
        value = node.pop(name)
        if not any(value == off and type(value) is type(off) for off in feature.off):
            shown = "" if isinstance(value, (dict, list)) else f" ({_yaml(value)})"
            fix = feature.fix.format(value=_yaml(value)) or f"remove {name} or set it to {_yaml(feature.off[0])}"
            found.problems.append(f"{key}{shown}: {feature.name} is not available yet; {fix}")


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _data_section(raw: dict, found: Translation) -> None:
    """v0.4's one ``data`` section is a single data stage from step 1."""
    if "data" not in raw:
        return
    if "data_stages" in raw:
        found.problems.append("data and data_stages are both set: data is the older form of one stage starting at "
                              "step 1; keep data_stages and remove data")
        del raw["data"]
        return
    raw["data_stages"] = [{"name": V04_DATA_STAGE_NAME, "start_training_step": 1, "data": raw.pop("data")}]


def _stage_sequence_lengths(raw: dict) -> None:
    """A stage's ``sequence_length`` equal to ``tokens.sequence_length`` is the length every stage has here: dropped
    like ``null``; another length is a feature we lack (``FEATURES``)."""
    length = (_section(raw, "tokens") or {}).get("sequence_length")
    stages = raw.get("data_stages")
    for stage in stages if isinstance(stages, list) else []:
        if (isinstance(stage, dict) and "sequence_length" in stage and not isinstance(length, bool)
                and stage["sequence_length"] == length and type(stage["sequence_length"]) is type(length)):
            del stage["sequence_length"]


def _optimizer_factory(raw: dict, found: Translation) -> None:
    """Upstream main's ``optimizer_factory: {name: adamW, adam_*, torch_adam_is_fused}`` selects AdamW with its
    settings, our flat ``name`` and ``adam_*`` fields (``name: muon`` with ``muon_*`` selects Muon, and the ``adam_*``
    settings then serve the parameters Muon leaves); ``null`` is no factory. Older files give the flat fields, some
    both: they must be the same values as read (``1e-8`` and ``1.0e-8`` agree). Another key inside the factory is
    refused, an optimizer-section field (``zero_stage``) with the place it belongs, as upstream's strict reader
    refuses it."""
    optimizer = _section(raw, "optimizer")
    if optimizer is None or "optimizer_factory" not in optimizer:
        return
    factory = optimizer.pop("optimizer_factory")
    if factory is None:
        return
    if not isinstance(factory, dict):
        found.problems.append(f"optimizer.optimizer_factory: expected a mapping {{name: adamW, "
                              f"{', '.join(ADAMW_FACTORY_FIELDS)}}} or null (got {_yaml(factory)})")
        return
    factory = dict(factory)
    name = factory.get("name", "adamW")
    if not (isinstance(name, str) and name.lower() in ("adamw", "muon")):
        found.problems.append(f"optimizer.optimizer_factory.name ({name}): the optimizers are adamW and muon")
        return
    for key, value in factory.items():
        inside = f"optimizer.optimizer_factory.{key}"
        if key not in FACTORY_FIELDS:
            where = (f"a setting of the optimizer section; write it as optimizer.{key}" if key in _OPTIMIZER_FIELDS
                     else "not a setting of AdamW or Muon; remove it")
            found.problems.append(f"{inside} is misplaced: optimizer_factory holds name, AdamW's "
                                  f"{', '.join(ADAMW_FACTORY_FIELDS)} and Muon's muon_*, and {key} is {where}")
        elif key in optimizer and not _same_setting(optimizer[key], value):
            found.problems.append(f"optimizer.{key} ({_yaml(optimizer[key])}) and {inside} ({_yaml(value)}) "
                                  f"disagree; keep one of them, or set both with --override optimizer.{key}=<value>")
        else:
            optimizer.setdefault(key, value)


def _same_setting(a: Any, b: Any) -> bool:
    """Whether two YAML values of a number or boolean field read as the same value: YAML 1.1 reads ``1e-8`` as a
    string and ``1.0e-8`` as a number, and the typed reader takes both as 1e-08."""
    def read(value: Any) -> Any:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return value
        return value
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    a, b = read(a), read(b)
    if isinstance(a, str) and isinstance(b, str):  # names: ``adamW`` and ``adamw`` are one optimizer
        return a.lower() == b.lower()
    return a == b


def _recompute(raw: dict, found: Translation) -> None:
    """Upstream's ``recompute_layer`` (a bool) and ``recompute_granularity`` (what a recomputed layer rebuilds; it
    takes effect only with ``recompute_layer: true``) are our one ``recompute`` setting."""
    parallelism = _section(raw, "parallelism")
    if parallelism is None or not {"recompute_layer", "recompute_granularity"} & parallelism.keys():
        return
    layer = parallelism.pop("recompute_layer", False)
    granularity = parallelism.pop("recompute_granularity", "full")
    if "recompute" in parallelism:
        found.problems.append("parallelism.recompute and upstream's recompute_layer / recompute_granularity are both "
                              "set; keep recompute (none, full, selective or pointwise)")
        return
    granularities = [value for value in literal_values(Recompute) if value != "none"]
    if not (isinstance(granularity, str) and granularity.lower() in granularities):
        found.problems.append(f"parallelism.recompute_granularity must be one of {', '.join(granularities)} (got "
                              f"{granularity!r})")
    elif not isinstance(layer, bool):
        found.problems.append(f"parallelism.recompute_layer: expected a boolean (true/false), got {_yaml(layer)}")
    elif not layer and granularity.lower() != "full":
        found.problems.append(f"parallelism.recompute_granularity: {granularity} takes effect only with "
                              "parallelism.recompute_layer: true; set recompute_layer to true, or remove "
                              "recompute_granularity")
    else:
        parallelism["recompute"] = granularity.lower() if layer else "none"


def _layers_per_chunk(raw: dict, found: Translation) -> None:
    """torchtitan's ``pipeline_parallel_layers_per_stage`` (k decoder layers in every virtual stage) is
    ``virtual_pipeline_size`` = layers / (pp k) chunks per stage of ``pp_stage_layers`` k layers each."""
    parallelism = _section(raw, "parallelism")
    if parallelism is None or "pipeline_parallel_layers_per_stage" not in parallelism:
        return
    per_chunk = parallelism.pop("pipeline_parallel_layers_per_stage")
    layers, pp = (_section(raw, MODEL_CONFIG) or {}).get("num_hidden_layers"), parallelism.get("pp", 1)
    key = "parallelism.pipeline_parallel_layers_per_stage"
    if {"virtual_pipeline_size", "pp_stage_layers"} & parallelism.keys():
        found.problems.append(f"{key} and parallelism.virtual_pipeline_size or pp_stage_layers are both set; keep "
                              "one of them")
    elif not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (per_chunk, layers, pp)) \
            or layers % (pp * per_chunk):
        found.problems.append(f"{key} ({_yaml(per_chunk)}) must split {MODEL_CONFIG}.num_hidden_layers "
                              f"({_yaml(layers)}) into parallelism.pp ({_yaml(pp)}) x a whole number of chunks of "
                              "that many layers; change it, or set parallelism.virtual_pipeline_size instead")
    else:
        chunks = layers // per_chunk
        parallelism["virtual_pipeline_size"], parallelism["pp_stage_layers"] = chunks // pp, [per_chunk] * chunks


def other_spellings(dotted: str) -> tuple[str, ...]:
    """The other keys that upstream files may give the setting ``dotted`` under, which must agree with it: an
    override of one of them sets them all (``loading.apply_overrides``)."""
    for group in _SPELLINGS:
        if dotted in group:
            return tuple(key for key in group if key != dotted)
    return ()


def _init_method(raw: dict, found: Translation) -> None:
    """``scaling_method: NUM_LAYERS`` is our random init; ``use_mup`` (spectral µP) and Mamba's own keys are init
    methods of their own (``config/model.py``), read as written."""
    init = _section(raw, "model.init_method")
    if init is None or "scaling_method" not in init:
        return
    method = init.pop("scaling_method")
    if method != "NUM_LAYERS":
        found.problems.append(
            f"model.init_method.scaling_method ({method}): only NUM_LAYERS is available (residual output "
            "projections at std / sqrt(2 * num_hidden_layers)); write NUM_LAYERS or remove it")


def _model_config(raw: dict, found: Translation) -> None:
    """Upstream's flex-attention mask is a kernel choice, but one that names documents needs document masking on; a
    Mamba config's own dtype must be the model's."""
    config = _section(raw, MODEL_CONFIG)
    if config is None:
        return
    mask = config.pop("flex_attention_mask", None)
    if mask in ("document", "sliding_window_document") and config.get("_use_doc_masking") is not True:
        found.problems.append(f"{MODEL_CONFIG}.flex_attention_mask: {mask} masks documents, which "
                              f"{MODEL_CONFIG}._use_doc_masking switches on: set _use_doc_masking: true, or "
                              "flex_attention_mask: null")
    if config.get("is_mamba_config") is True and "dtype" in config:
        layers = config.pop("dtype")
        model = _section(raw, "model") or {}
        if not _same_dtype(layers, model.get("dtype", "bfloat16")):
            found.problems.append(f"{MODEL_CONFIG}.dtype ({layers!r}): Mamba layers in another dtype than "
                                  f"model.dtype ({model.get('dtype', 'bfloat16')!r}) are not available; remove it "
                                  "or make it equal")


def _datasets(raw: dict, found: Translation) -> None:
    """``dataset_folder: {folder: weight, ...}`` is the folders and their ``dataset_weights``."""
    stages = raw.get("data_stages")
    for i, stage in enumerate(stages if isinstance(stages, list) else []):
        dataset = _section(stage, "data.dataset") if isinstance(stage, dict) else None
        if dataset is None or not isinstance(dataset.get("dataset_folder"), dict):
            continue
        mapping = dataset["dataset_folder"]
        if dataset.get("dataset_weights") is not None:
            found.problems.append(f"data_stages[{i}].data.dataset: dataset_folder is a {{folder: weight}} mapping and "
                                  "dataset_weights is set too; give the weights once")
            continue
        dataset["dataset_folder"], dataset["dataset_weights"] = list(mapping), list(mapping.values())


def _domain_names(raw: dict, found: Translation) -> None:
    doremi = _section(raw, "doremi")
    if doremi is not None and isinstance(doremi.get("domain_names"), str):
        doremi["domain_names"] = [name.strip() for name in doremi["domain_names"].split(",") if name.strip()]

