"""Value and cross-field checks of a Config, run before anything is allocated.

Each failed rule gives one line naming the key(s) involved and the fix, and all of them are raised together, so a
config is fixed in one edit instead of one crash per launch. Whether the trainer implements a given parallel
degree is not checked here: that is the trainer's business.
"""

import importlib.util
import re
from collections.abc import Iterator, Sequence

from nanotron.config.schema import (
    DTYPE_ALIASES,
    DTYPES,
    FP8_FORMATS,
    FP8_RECIPES,
    LOG_LEVELS,
    LR_DECAY_STYLES,
    LR_WARMUP_STYLES,
    PP_ENGINES,
    ROPE_SCALING_KEYS,
    TP_MODES,
    WANDB_MODES,
    CheckpointsArgs,
    Config,
    ConfigError,
    DatasetStageArgs,
    GeneralArgs,
    LlamaConfig,
    LlaMoEConfig,
    LoggingArgs,
    MambaConfig,
    ModelArgs,
    OptimizerArgs,
    ParallelismArgs,
    RandomInit,
    TokenizerArgs,
    TokensArgs,
)


def validate_config(cfg: Config, world_size: int | None = None) -> None:
    """Raise ConfigError listing every problem in `cfg`; with `world_size`, also check it matches the launch."""
    problems = [
        *_general(cfg.general),
        *_checkpoints(cfg.checkpoints),
        *_parallelism(cfg.parallelism),
        *_model(cfg.model),
        *_tokenizer(cfg.tokenizer),
        *_tokens(cfg.tokens),
        *_optimizer(cfg.optimizer, cfg.tokens),
        *_data_stages(cfg.data_stages),
        *_logging(cfg.logging),
        *_doremi(cfg),
        *_fp8(cfg),
        *_model_vs_parallelism(cfg),
    ]
    if world_size is not None:
        problems += _world_size(cfg.parallelism, world_size)
    if problems:
        raise ConfigError(*problems)


def _at_least(key: str, value: float, minimum: float) -> Iterator[str]:
    if value < minimum:
        yield f"{key} must be >= {minimum} (got {value})"


def _positive(key: str, value: float) -> Iterator[str]:
    if not value > 0:  # also catches NaN
        yield f"{key} must be > 0 (got {value})"


def _one_of(key: str, value: str, choices: Sequence[str]) -> Iterator[str]:
    if value not in choices:
        yield f"{key} must be one of {', '.join(choices)} (got {value!r})"


def _general(general: GeneralArgs) -> Iterator[str]:
    if not general.project:
        yield "general.project must not be empty; name the project the runs belong to"
    yield from _at_least("general.seed", general.seed, 0)


def _checkpoints(checkpoints: CheckpointsArgs) -> Iterator[str]:
    yield from _at_least("checkpoints.checkpoint_interval", checkpoints.checkpoint_interval, 1)
    if checkpoints.keep_last_n is not None:
        yield from _at_least("checkpoints.keep_last_n", checkpoints.keep_last_n, 1)
    if not checkpoints.checkpoints_path_is_shared_file_system:
        yield ("checkpoints.checkpoints_path_is_shared_file_system: false is not supported (every rank writes its "
               "shards into checkpoints_path and rank 0 completes the checkpoint); use a folder that all nodes see "
               "and set it to true")


def _parallelism(p: ParallelismArgs) -> Iterator[str]:
    for name in ("dp", "pp", "tp", "expert_parallel_size"):
        yield from _at_least(f"parallelism.{name}", getattr(p, name), 1)
    yield from _one_of("parallelism.pp_engine", p.pp_engine, PP_ENGINES)
    yield from _one_of("parallelism.tp_mode", p.tp_mode, TP_MODES)
    if p.tp_linear_async_communication and p.tp_mode == "ALL_REDUCE":
        yield (
            "parallelism.tp_linear_async_communication: true needs parallelism.tp_mode: REDUCE_SCATTER "
            "(only that mode overlaps communication with compute); change one of them"
        )
    yield from _positive("parallelism.pp_timeout_s", p.pp_timeout_s)
    if p.replica_check_interval is not None:
        yield from _at_least("parallelism.replica_check_interval", p.replica_check_interval, 1)
    if p.pp_stage_layers is not None and len(p.pp_stage_layers) != p.pp:
        yield (
            f"parallelism.pp_stage_layers has {len(p.pp_stage_layers)} entries but parallelism.pp is {p.pp}: "
            "give one layer count per pipeline stage"
        )
    if p.pp_stage_layers is not None and any(count < 1 for count in p.pp_stage_layers):
        yield f"parallelism.pp_stage_layers {p.pp_stage_layers}: every stage needs at least one decoder layer"


def _model(model: ModelArgs) -> Iterator[str]:
    if model.dtype not in DTYPES:
        choices = ", ".join([*DTYPES, *DTYPE_ALIASES])
        yield f"model.dtype must be one of {choices} (got {model.dtype!r})"
    yield from _at_least("model.make_vocab_size_divisible_by", model.make_vocab_size_divisible_by, 1)
    yield from _at_least("model.ddp_bucket_cap_mb", model.ddp_bucket_cap_mb, 1)
    yield from _at_least("model.loss_chunk_tokens", model.loss_chunk_tokens, 0)
    if isinstance(model.init_method, RandomInit):
        yield from _positive("model.init_method.std", model.init_method.std)
    if isinstance(model.model_config, MambaConfig):
        yield from _mamba(model.model_config, "model.model_config")
    else:
        yield from _llama(model.model_config, "model.model_config")


def _llama(c: LlamaConfig, key: str | None) -> Iterator[str]:
    """Rules on the values of a Llama config alone; its shapes are ``llama_layout_problems``."""
    k = f"{key}." if key else ""
    if type(c) is LlamaConfig and not c.is_llama_config:
        yield f"{k}is_llama_config must be true for a Llama model config"
    if isinstance(c, LlaMoEConfig):
        yield from _mixture_of_experts(c, k)
    if c.vocab_size >= 1:
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            token_id = getattr(c, name)
            if token_id is not None and not 0 <= token_id < c.vocab_size:
                yield f"{k}{name} ({token_id}) must be in [0, {k}vocab_size) = [0, {c.vocab_size})"
    yield from _positive(f"{k}rms_norm_eps", c.rms_norm_eps)
    yield from _positive(f"{k}rope_theta", c.rope_theta)
    yield from _positive(f"{k}initializer_range", c.initializer_range)
    if c.rope_interleaved:
        yield (
            f"{k}rope_interleaved must be false: only the Hugging Face (non-interleaved) rotary layout is "
            "implemented"
        )
    if c.rope_scaling is not None:
        yield from _rope_scaling(c.rope_scaling, f"{k}rope_scaling")
    if c.hidden_act != "silu":
        yield f"{k}hidden_act must be 'silu' (got {c.hidden_act!r}): the Llama MLP is SwiGLU"
    if c.pretraining_tp != 1:
        yield f"{k}pretraining_tp must be 1 (got {c.pretraining_tp}); use parallelism.tp for tensor parallelism"


def _mamba(c: MambaConfig, key: str | None) -> Iterator[str]:
    """Rules on the values of a Mamba config alone; its shapes are ``mamba_layout_problems``."""
    k = f"{key}." if key else ""
    ssm = c.ssm_cfg
    if not c.is_mamba_config:
        yield f"{k}is_mamba_config must be true for a Mamba model config"
    for name in ("d_state", "d_conv", "expand"):
        yield from _at_least(f"{k}ssm_cfg.{name}", getattr(ssm, name), 1)
    if not (ssm.dt_rank == "auto" or (isinstance(ssm.dt_rank, int) and ssm.dt_rank >= 1)):
        yield f"{k}ssm_cfg.dt_rank must be \"auto\" or an integer >= 1 (got {ssm.dt_rank!r})"
    if not 0 < ssm.dt_min <= ssm.dt_max:
        yield f"{k}ssm_cfg.dt_min ({ssm.dt_min}) and dt_max ({ssm.dt_max}) must satisfy 0 < dt_min <= dt_max"
    yield from _positive(f"{k}ssm_cfg.dt_init_floor", ssm.dt_init_floor)
    yield from _positive(f"{k}ssm_cfg.dt_scale", ssm.dt_scale)
    yield from _one_of(f"{k}ssm_cfg.dt_init", ssm.dt_init, ("random", "constant"))
    if not c.rms_norm:
        yield f"{k}rms_norm must be true: only RMSNorm is implemented for Mamba"
    yield from _positive(f"{k}rms_norm_eps", c.rms_norm_eps)
    yield from _positive(f"{k}initializer_range", c.initializer_range)


def mamba_layout_problems(c: MambaConfig, tp: int, *, key: str | None = "model.model_config",
                          tp_key: str = "parallelism.tp", **_) -> list[str]:
    """The shape rules of a Mamba model at ``tp`` tensor-parallel ranks (see ``llama_layout_problems``; a sequence
    length needs no rule: the model has no position limit)."""
    k = f"{key}." if key else ""
    problems = [problem for name in ("vocab_size", "d_model", "num_hidden_layers")
                for problem in _at_least(f"{k}{name}", getattr(c, name), 1)]
    if not problems and tp >= 1 and c.d_inner % tp:
        problems.append(f"{k}d_model ({c.d_model}) x {k}ssm_cfg.expand ({c.ssm_cfg.expand}) = {c.d_inner} channels "
                        f"must be divisible by {tp_key} ({tp}): each TP rank holds whole channels")
    if tp > 1 and c.ssm_cfg.bias:
        problems.append(f"{k}ssm_cfg.bias: true is not supported with {tp_key} ({tp}) > 1 (a row-parallel "
                        "out_proj bias would be added on every rank); set it to false or use tp 1")
    return problems


def mamba_problems(c: MambaConfig, tp: int = 1, *, key: str | None = "model.model_config", **layout) -> list[str]:
    """Every rule of a Mamba config at ``tp`` ranks (generation, evaluation and conversion check configs with it)."""
    return [*_mamba(c, key), *mamba_layout_problems(c, tp, key=key, **layout)]


def _mixture_of_experts(c: LlaMoEConfig, k: str) -> Iterator[str]:
    if c.is_llama_config or not c.is_llamoe_config:
        yield f"{k}is_llamoe_config must be true (and is_llama_config absent) for a mixture-of-experts config"
    yield from _at_least(f"{k}moe_num_experts", c.moe_num_experts, 1)
    if not 1 <= c.num_experts_per_tok <= max(c.moe_num_experts, 1):
        yield (f"{k}num_experts_per_tok ({c.num_experts_per_tok}) must be in [1, {k}moe_num_experts] = "
               f"[1, {c.moe_num_experts}]: each token goes to that many distinct experts")
    if c.moe_capacity_factor is not None:
        yield from _positive(f"{k}moe_capacity_factor", c.moe_capacity_factor)
    yield from _at_least(f"{k}moe_aux_loss_coef", c.moe_aux_loss_coef, 0)
    yield from _at_least(f"{k}moe_z_loss_coef", c.moe_z_loss_coef, 0)
    if c.num_hidden_layers >= 1 and not 0 <= c.moe_first_dense_layers < c.num_hidden_layers:
        yield (f"{k}moe_first_dense_layers ({c.moe_first_dense_layers}) must be in [0, {k}num_hidden_layers) = "
               f"[0, {c.num_hidden_layers}): at least the last layer is a mixture of experts")


def _rope_scaling(scaling: dict, key: str) -> Iterator[str]:
    """One line for a wrong type or wrong keys (the values are only checked once the keys are right)."""
    types = ", ".join(ROPE_SCALING_KEYS)
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_SCALING_KEYS:
        yield (f"{key}.rope_type must be one of {types} (got {rope_type!r}); write e.g. {{rope_type: linear, "
               "factor: 2.0}, or set rope_scaling to null for plain RoPE")
        return
    needed = ROPE_SCALING_KEYS[rope_type]
    missing = [name for name in needed if name not in scaling]
    unknown = sorted(str(name) for name in scaling if name != "rope_type" and name not in needed)
    if missing or unknown:
        wrong = ", ".join([*(f"misses {name}" for name in missing), *(f"has unknown key {name}" for name in unknown)])
        yield f"{key} {wrong}: rope_type {rope_type} takes exactly the keys rope_type, {', '.join(needed)}"
        return
    numbers = {name: value for name, value in scaling.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    if not numbers.get("factor", 0) >= 1:
        yield f"{key}.factor must be a number >= 1 (got {scaling['factor']!r}): the context grows by this factor"
    if rope_type == "llama3":
        low, high = numbers.get("low_freq_factor", 0), numbers.get("high_freq_factor", 0)
        if not 0 < low < high:
            yield (f"{key}.low_freq_factor ({scaling['low_freq_factor']!r}) and high_freq_factor "
                   f"({scaling['high_freq_factor']!r}) must be numbers with 0 < low_freq_factor < high_freq_factor "
                   "(Llama 3.1: 1.0 and 4.0)")
        original = scaling["original_max_position_embeddings"]
        if not (isinstance(original, int) and not isinstance(original, bool) and original >= 1):
            yield (f"{key}.original_max_position_embeddings must be an integer >= 1 (got {original!r}): the "
                   "context length the model was pretrained with (Llama 3.1: 8192)")


def llama_layout_problems(c: LlamaConfig, tp: int, *, key: str | None = "model.model_config",
                          tp_key: str = "parallelism.tp", sequence_length: int | None = None,
                          sequence_key: str = "tokens.sequence_length") -> list[str]:
    """The shape rules of a Llama model split over ``tp`` tensor-parallel ranks, one line per broken rule.

    Training (config validation), generation, evaluation and conversion all check these before building anything,
    so that a model that cannot be split stops with one line naming the numbers instead of a shape error inside a
    layer. ``key`` prefixes the config fields (None: bare field names), ``tp_key`` and ``sequence_key`` name where
    the tensor-parallel size and the sequence length come from. The vocabulary needs no rule: it is padded to a
    multiple of tp.
    """
    k = f"{key}." if key else ""
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings")
    problems = [problem for name in sizes for problem in _at_least(f"{k}{name}", getattr(c, name), 1)]
    if problems:
        return problems
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    if c.hidden_size % heads:
        problems.append(f"{k}hidden_size ({c.hidden_size}) must be divisible by {k}num_attention_heads ({heads}) so "
                        "that every head has the same size")
    elif c.head_dim % 2:
        problems.append(f"{k}hidden_size / {k}num_attention_heads = {c.head_dim} must be even: rotary embeddings "
                        "rotate pairs of head dimensions")
    if heads % kv_heads:
        problems.append(f"{k}num_attention_heads ({heads}) must be divisible by {k}num_key_value_heads ({kv_heads}): "
                        "each kv head serves a whole group of heads")
    if tp >= 1 and (heads % tp or (kv_heads % tp and tp % kv_heads)):
        fits = [str(n) for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
        problems.append(f"{tp_key} ({tp}) must divide {k}num_attention_heads ({heads}), and divide or be a multiple of "
                        f"{k}num_key_value_heads ({kv_heads}): each TP rank holds whole heads, and a kv head is either "
                        f"split off whole or replicated over the ranks that share it; set {tp_key} to one of "
                        f"{', '.join(fits)}")
    if tp >= 1 and c.intermediate_size % tp:
        problems.append(f"{k}intermediate_size ({c.intermediate_size}) must be divisible by {tp_key} ({tp}): the MLP "
                        "is split column-wise over TP ranks")
    if sequence_length is not None and sequence_length > c.max_position_embeddings:
        problems.append(f"{sequence_key} ({sequence_length}) exceeds {k}max_position_embeddings "
                        f"({c.max_position_embeddings}); raise max_position_embeddings or shorten the sequences")
    return problems


def llama_problems(c: LlamaConfig, tp: int = 1, *, key: str | None = "model.model_config", **layout) -> list[str]:
    """Every rule of a Llama config at ``tp`` ranks: its values, then its shapes (``llama_layout_problems``, which
    takes the other keyword arguments). Generation, evaluation and conversion check configs read from files
    with it."""
    return [*_llama(c, key), *llama_layout_problems(c, tp, key=key, **layout)]


def _tokenizer(tokenizer: TokenizerArgs) -> Iterator[str]:
    if tokenizer.tokenizer_max_length is not None:
        yield from _at_least("tokenizer.tokenizer_max_length", tokenizer.tokenizer_max_length, 1)


def _tokens(tokens: TokensArgs) -> Iterator[str]:
    for name in ("sequence_length", "train_steps", "micro_batch_size", "batch_accumulation_per_replica"):
        yield from _at_least(f"tokens.{name}", getattr(tokens, name), 1)


def _optimizer(opt: OptimizerArgs, tokens: TokensArgs) -> Iterator[str]:
    if opt.zero_stage not in (0, 1):
        yield f"optimizer.zero_stage must be 0 (off) or 1 (optimizer states sharded over dp) (got {opt.zero_stage})"
    yield from _at_least("optimizer.weight_decay", opt.weight_decay, 0)
    if opt.clip_grad is not None:
        yield from _positive("optimizer.clip_grad", opt.clip_grad)
    yield from _positive("optimizer.adam_eps", opt.adam_eps)
    yield from _at_least("optimizer.skip_bad_steps", opt.skip_bad_steps, 0)
    if opt.loss_spike_factor is not None and not opt.loss_spike_factor > 1:
        yield (f"optimizer.loss_spike_factor must be > 1 (got {opt.loss_spike_factor}): it multiplies the recent mean "
               "loss; use e.g. 2.0, or null to detect no spikes")
    for name in ("adam_beta1", "adam_beta2"):
        beta = getattr(opt, name)
        if not 0 <= beta < 1:
            yield f"optimizer.{name} must be in [0, 1) (got {beta})"
    for i, pattern in enumerate(opt.weight_decay_exclude_named_params or []):
        try:
            re.compile(pattern)
        except re.error as e:
            yield f"optimizer.weight_decay_exclude_named_params[{i}] ({pattern!r}) is not a valid regex: {e}"

    key = "optimizer.learning_rate_scheduler"
    lr = opt.learning_rate_scheduler
    yield from _positive(f"{key}.learning_rate", lr.learning_rate)
    yield from _one_of(f"{key}.lr_warmup_style", lr.lr_warmup_style, LR_WARMUP_STYLES)
    yield from _one_of(f"{key}.lr_decay_style", lr.lr_decay_style, LR_DECAY_STYLES)
    yield from _at_least(f"{key}.lr_warmup_steps", lr.lr_warmup_steps, 0)
    if lr.lr_warmup_steps > tokens.train_steps:
        yield (
            f"{key}.lr_warmup_steps ({lr.lr_warmup_steps}) must be <= tokens.train_steps ({tokens.train_steps}); "
            "shorten the warmup or train longer"
        )
    if not 0 <= lr.min_decay_lr <= lr.learning_rate:
        yield f"{key}.min_decay_lr ({lr.min_decay_lr}) must be in [0, learning_rate] = [0, {lr.learning_rate}]"
    if lr.lr_decay_steps is not None:
        yield from _at_least(f"{key}.lr_decay_steps", lr.lr_decay_steps, 0)
    if lr.lr_decay_starting_step is not None:
        if lr.lr_decay_starting_step < lr.lr_warmup_steps:
            yield (
                f"{key}.lr_decay_starting_step ({lr.lr_decay_starting_step}) must be >= {key}.lr_warmup_steps "
                f"({lr.lr_warmup_steps}): decay starts after the warmup"
            )
        if lr.lr_decay_steps is None and lr.lr_decay_starting_step > tokens.train_steps:
            yield (
                f"{key}.lr_decay_starting_step ({lr.lr_decay_starting_step}) is after tokens.train_steps "
                f"({tokens.train_steps}), so the default decay length would be negative; set {key}.lr_decay_steps"
            )


def _data_stages(stages: list[DatasetStageArgs]) -> Iterator[str]:
    if not stages:
        yield "data_stages must list at least one stage (one of them with start_training_step: 1)"
        return
    names = [stage.name for stage in stages]
    starts = [stage.start_training_step for stage in stages]
    for name in sorted({name for name in names if names.count(name) > 1}):
        yield f"data_stages: the name {name!r} is used by more than one stage; give each stage its own name"
    for start in sorted({start for start in starts if starts.count(start) > 1}):
        yield f"data_stages: more than one stage has start_training_step {start}; give each stage its own start"
    if 1 not in starts:
        yield "data_stages: one stage must have start_training_step: 1 (the first training step)"
    for stage in stages:
        key = f"data_stages[{stage.name!r}]"
        if not stage.name:
            yield f"{key}.name must not be empty"
        # A stage may start after tokens.train_steps: a run trained in parts (train_steps raised on each resume)
        # keeps the whole schedule in its config.
        if stage.start_training_step < 1:
            yield f"{key}.start_training_step ({stage.start_training_step}) must be >= 1 (steps count from 1)"
        yield from _at_least(f"{key}.data.seed", stage.data.seed, 0)
        yield from _at_least(f"{key}.data.num_loading_workers", stage.data.num_loading_workers, 0)
        dataset = stage.data.dataset
        if not dataset.dataset_folder:
            yield f"{key}.data.dataset.dataset_folder must name at least one folder"
        if dataset.dataset_weights is not None:
            if len(dataset.dataset_weights) != len(dataset.dataset_folder):
                yield (
                    f"{key}.data.dataset.dataset_weights has {len(dataset.dataset_weights)} entries but "
                    f"dataset_folder has {len(dataset.dataset_folder)}; give one weight per folder"
                )
            for i, weight in enumerate(dataset.dataset_weights):
                yield from _positive(f"{key}.data.dataset.dataset_weights[{i}]", weight)


def _logging(logging: LoggingArgs) -> Iterator[str]:
    yield from _one_of("logging.log_level", logging.log_level, LOG_LEVELS)
    yield from _one_of("logging.log_level_replica", logging.log_level_replica, LOG_LEVELS)
    yield from _at_least("logging.iteration_step_info_interval", logging.iteration_step_info_interval, 1)
    if logging.wandb is not None:
        yield from _one_of("logging.wandb.mode", logging.wandb.mode, WANDB_MODES)
        if not logging.wandb.project:
            yield "logging.wandb.project must not be empty; name the W&B project the runs go to"
    for key, module, extra in (("logging.tensorboard_dir", "tensorboard", "tensorboard"),
                               ("logging.wandb", "wandb", "wandb")):
        if getattr(logging, key.split(".")[1]) is not None and importlib.util.find_spec(module) is None:
            yield f"{key} is set but the {module} package is not installed; pip install -e \".[{extra}]\" or unset it"


def _fp8(cfg: Config) -> Iterator[str]:
    if cfg.fp8 is None:
        return
    yield from _one_of("fp8.recipe", cfg.fp8.recipe, FP8_RECIPES)
    yield from _one_of("fp8.gradient_format", cfg.fp8.gradient_format, FP8_FORMATS)
    if cfg.fp8.amax_history_length < 1:
        yield f"fp8.amax_history_length must be at least 1, got {cfg.fp8.amax_history_length}"
    for i, pattern in enumerate(cfg.fp8.exclude_modules):
        try:
            re.compile(pattern)
        except re.error as e:
            yield f"fp8.exclude_modules[{i}] ({pattern!r}) is not a valid regex: {e}"


def _doremi(cfg: Config) -> Iterator[str]:
    d = cfg.doremi
    if d is None:
        return
    yield from _positive("doremi.step_size", d.step_size)
    if not 0 <= d.smoothing_param <= 1:
        yield f"doremi.smoothing_param must be in [0, 1] (got {d.smoothing_param})"
    for stage in cfg.data_stages:
        folders = len(stage.data.dataset.dataset_folder)
        for key, values in (("domain_names", d.domain_names), ("domain_weights", d.domain_weights)):
            if values is not None and len(values) != folders:
                yield (f"doremi.{key} has {len(values)} entries but data_stages[{stage.name!r}] has {folders} "
                       "dataset folders (one domain each); give one per folder")
        if d.domain_weights is not None and stage.data.dataset.dataset_weights is not None:
            yield (f"doremi.domain_weights and data_stages[{stage.name!r}].data.dataset.dataset_weights are both "
                   "set; keep one of them")
    if d.domain_weights is not None:
        if any(not weight >= 0 for weight in d.domain_weights):
            yield f"doremi.domain_weights must all be >= 0 (got {d.domain_weights})"
        elif abs(sum(d.domain_weights) - 1) > 1e-3:
            yield (f"doremi.domain_weights must sum to 1 (they sum to {sum(d.domain_weights):.6g}); paste the "
                   "output of `nanotron doremi average` or normalise them")


def _model_vs_parallelism(cfg: Config) -> Iterator[str]:
    """Shapes that must split evenly over the parallel ranks, and sequence limits."""
    c, p, tokens = cfg.model.model_config, cfg.parallelism, cfg.tokens
    key = "model.model_config"
    if p.pp_stage_layers is not None and sum(p.pp_stage_layers) != c.num_hidden_layers:
        yield (
            f"parallelism.pp_stage_layers {p.pp_stage_layers} adds up to {sum(p.pp_stage_layers)} but "
            f"{key}.num_hidden_layers is {c.num_hidden_layers}: every layer must be on exactly one stage"
        )
    if isinstance(c, MambaConfig):
        yield from mamba_layout_problems(c, p.tp, key=key)
    else:
        yield from llama_layout_problems(c, p.tp, key=key, sequence_length=tokens.sequence_length)
    ep = p.expert_parallel_size
    if ep > 1 and not isinstance(c, LlaMoEConfig):
        yield (f"parallelism.expert_parallel_size ({ep}) needs a mixture-of-experts model ({key} with "
               "is_llamoe_config: true); set it to 1 for this model")
    elif ep >= 1 and isinstance(c, LlaMoEConfig) and c.moe_num_experts >= 1 and c.moe_num_experts % ep:
        yield (f"{key}.moe_num_experts ({c.moe_num_experts}) must be divisible by parallelism.expert_parallel_size "
               f"({ep}): every expert-parallel rank holds the same number of whole experts")
    if p.tp >= 1 and p.tp_mode == "REDUCE_SCATTER" and tokens.sequence_length % p.tp:
        yield (
            f"tokens.sequence_length ({tokens.sequence_length}) must be divisible by parallelism.tp ({p.tp}) "
            "with parallelism.tp_mode: REDUCE_SCATTER, which splits activations along the sequence"
        )
    if c.num_hidden_layers < p.pp:
        yield (
            f"{key}.num_hidden_layers ({c.num_hidden_layers}) must be >= parallelism.pp ({p.pp}): "
            "every pipeline stage needs at least one layer"
        )


def _world_size(p: ParallelismArgs, world_size: int) -> Iterator[str]:
    if p.world_size != world_size:
        yield (
            f"parallelism.dp ({p.dp}) * parallelism.pp ({p.pp}) * parallelism.tp ({p.tp}) * "
            f"parallelism.expert_parallel_size ({p.expert_parallel_size}) = {p.world_size}, but {world_size} "
            "processes were launched; make the product equal the number of processes "
            "(`torchrun --nproc_per_node` times the number of nodes)"
        )
