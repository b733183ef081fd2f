"""The training config as typed dataclasses.

Section and field names follow nanotron's YAML so existing configs keep working. The dataclasses only hold values
and normalise spellings (case, dtype aliases, defaults derived from other fields); type checking lives in
`loading.py` and the cross-field rules in `validation.py`, so that every problem can be reported at once.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch


class ConfigError(ValueError):
    """A config that cannot be used as written.

    Carries every problem found (one line each, naming the key and the fix) so users fix them all in one go;
    `source` is the file they came from, when there is one.
    """

    def __init__(self, *problems: str, source: str | Path | None = None):
        self.problems = list(problems)
        self.source = source
        where = f"{source}: " if source is not None else ""
        if len(problems) == 1:
            message = where + problems[0]
        else:
            message = f"{where}{len(problems)} problems:\n" + "\n".join(f"  - {problem}" for problem in problems)
        super().__init__(message)


DEFAULT_RUN_NAME = "%date_%jobid"
RESUME_IF_PRESENT = "auto"
PP_ENGINES = ("afab", "1f1b")
TP_MODES = ("ALL_REDUCE", "REDUCE_SCATTER")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
LR_WARMUP_STYLES = ("linear", "constant")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "1-sqrt")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
WANDB_MODES = ("online", "offline", "disabled")
FP8_RECIPES = ("tensorwise", "rowwise", "delayed")
FP8_FORMATS = ("e4m3", "e5m2")


@dataclass
class GeneralArgs:
    project: str
    run: str | None = None  # None means DEFAULT_RUN_NAME; placeholders are expanded by `expand_run_name`
    seed: int = 42


@dataclass
class CheckpointsArgs:
    checkpoints_path: Path
    checkpoint_interval: int
    save_initial_state: bool = False
    save_final_state: bool = True
    resume_checkpoint_path: Path | None = None
    checkpoints_path_is_shared_file_system: bool = True  # false is refused: saving needs a shared file system
    keep_last_n: int | None = None  # None keeps every checkpoint
    load_optimizer: bool = True  # on resume; False: fresh Adam moments, masters taken from the loaded weights
    # On resume; False: the LR schedule starts again (warmup included) at the resume step.
    load_lr_scheduler: bool = True
    allow_tokenizer_change: bool = False  # resume or init_method.path on data of another tokenizer than its own
    async_save: bool = False  # write checkpoints in the background; training waits only for a snapshot in host memory

    @property
    def resumes_if_present(self) -> bool:
        """``resume_checkpoint_path: auto``: resume from ``checkpoints_path`` when it holds a checkpoint."""
        return self.resume_checkpoint_path is not None and str(self.resume_checkpoint_path) == RESUME_IF_PRESENT


@dataclass
class ParallelismArgs:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    expert_parallel_size: int = 1
    pp_engine: str = "1f1b"
    tp_mode: str = "ALL_REDUCE"
    tp_linear_async_communication: bool = False
    pp_stage_layers: list[int] | None = None  # decoder layers per stage; None: balanced by estimated cost
    pp_timeout_s: float = 600.0  # a pipeline exchange waiting longer than this fails, naming the stage and step
    replica_check_interval: int | None = 100  # steps between weight checksums across data-parallel replicas
    # Recompute each decoder layer's activations in backward (saves memory, ~1/3 more layer FLOPs).
    recompute_layer: bool = False

    def __post_init__(self) -> None:
        # nanotron matched enum names case-insensitively; store one spelling so equal configs compare equal.
        self.pp_engine = self.pp_engine.lower()
        self.tp_mode = self.tp_mode.upper()

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.expert_parallel_size


# The RoPE scaling types of `LlamaConfig.rope_scaling` and the keys each needs besides `rope_type`, named as in
# Hugging Face's config.json: `linear` divides every frequency by `factor` (position interpolation); `llama3`
# (Llama 3.1+) divides only the low frequencies, leaves the high ones and blends the band between them.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass
class LlamaConfig:
    is_llama_config: bool = True  # the marker that selects this class in `model.model_config`
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None means multi-head attention (one kv head per query head)
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleaved: bool = False  # only the Hugging Face (non-interleaved) rotary layout is implemented
    rope_scaling: dict | None = None  # None, or {rope_type: linear | llama3, ...}: see ROPE_SCALING_KEYS
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k and v (Qwen2); the output projection never has one
    hidden_act: str = "silu"
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    pretraining_tp: int = 1  # Hugging Face field; must stay 1
    use_cache: bool = True

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class LlaMoEConfig(LlamaConfig):
    """Llama with mixture-of-experts feed-forward layers (nanotron's ``is_llamoe_config``; Mixtral's architecture).

    Each MoE layer routes every token to ``num_experts_per_tok`` of ``moe_num_experts`` SwiGLU experts of width
    ``intermediate_size``. The first ``moe_first_dense_layers`` layers keep a dense SwiGLU MLP.
    """

    is_llama_config: bool = False
    is_llamoe_config: bool = True
    moe_num_experts: int = 1
    num_experts_per_tok: int = 1
    moe_capacity_factor: float | None = None  # None: dropless; else each expert takes at most factor * tokens * k / E
    moe_aux_loss_coef: float = 0.01  # load-balancing loss (Switch Transformer), per sequence, averaged over layers
    moe_z_loss_coef: float = 0.0  # router z-loss (ST-MoE): mean squared log-sum-exp of the router logits
    moe_normalize_topk: bool = True  # renormalise the top-k probabilities to sum to 1 (Mixtral); False: raw softmax
    moe_first_dense_layers: int = 0

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.moe_first_dense_layers

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]


@dataclass
class MambaSSMArgs:
    """The selective state-space mixer of every Mamba layer (nanotron's and mamba_ssm's ``ssm_cfg``)."""

    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | str = "auto"  # "auto": ceil(d_model / 16)
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init: str = "random"  # or "constant": how dt_proj.weight starts
    dt_scale: float = 1.0
    dt_init_floor: float = 1e-4
    conv_bias: bool = True
    bias: bool = False  # on in_proj and out_proj
    use_fast_path: bool = True  # fused kernels where available; the plain-torch scan otherwise


@dataclass
class MambaConfig:
    """Mamba-1 (Gu & Dao, 2023): pre-norm residual blocks of selective state-space mixers, no attention."""

    is_mamba_config: bool = True
    d_model: int = 2560
    num_hidden_layers: int = 64
    vocab_size: int = 50277
    ssm_cfg: MambaSSMArgs = field(default_factory=MambaSSMArgs)
    rms_norm: bool = True
    rms_norm_eps: float = 1e-5
    residual_in_fp32: bool = True
    fused_add_norm: bool = True  # a kernel choice in mamba_ssm; the same maths here
    pad_vocab_size_multiple: int = 8  # mamba_ssm's padding; here model.make_vocab_size_divisible_by pads
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_id: int | None = 0
    pad_token_id: int | None = 0

    def __post_init__(self) -> None:
        if isinstance(self.ssm_cfg, dict):  # read back from checkpoint.json
            self.ssm_cfg = MambaSSMArgs(**self.ssm_cfg)

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def d_inner(self) -> int:
        return self.ssm_cfg.expand * self.d_model

    @property
    def dt_rank(self) -> int:
        rank = self.ssm_cfg.dt_rank
        return -(-self.d_model // 16) if rank == "auto" else int(rank)


# `model.model_config` is chosen by the `is_<name>_config: true` marker it contains; add new architectures here.
MODEL_CONFIG_CLASSES: dict[str, type] = {"is_llama_config": LlamaConfig, "is_llamoe_config": LlaMoEConfig,
                                         "is_mamba_config": MambaConfig}


@dataclass
class RandomInit:
    std: float


@dataclass
class ExistingCheckpointInit:
    path: Path


@dataclass
class ModelArgs:
    model_config: LlamaConfig | MambaConfig  # or LlamaConfig's subclass LlaMoEConfig
    init_method: RandomInit | ExistingCheckpointInit
    dtype: str = "bfloat16"
    make_vocab_size_divisible_by: int = 1
    ddp_bucket_cap_mb: int = 25
    compile: bool = False  # torch.compile every decoder layer (fuses norms, rotary and SwiGLU on GPUs)
    # Tokens per chunk of the fused LM head + cross-entropy (parallel/linear_cross_entropy.py); 0: logits in full
    loss_chunk_tokens: int = 8192

    def __post_init__(self) -> None:
        dtype = self.dtype.lower()
        self.dtype = DTYPE_ALIASES.get(dtype, dtype)

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class TokenizerArgs:
    tokenizer_name_or_path: str | None = None
    tokenizer_revision: str | None = None
    tokenizer_max_length: int | None = None


@dataclass
class TokensArgs:
    sequence_length: int
    train_steps: int
    micro_batch_size: int
    batch_accumulation_per_replica: int


@dataclass
class LRSchedulerArgs:
    learning_rate: float
    lr_warmup_steps: int = 0
    lr_warmup_style: str = "linear"
    lr_decay_style: str = "cosine"
    lr_decay_starting_step: int | None = None  # None: right after the warmup
    lr_decay_steps: int | None = None  # None: until the last training step
    min_decay_lr: float = 0.0


@dataclass
class OptimizerArgs:
    learning_rate_scheduler: LRSchedulerArgs
    zero_stage: int = 0
    weight_decay: float = 0.0
    weight_decay_exclude_named_params: list[str] | None = None  # None: norms, biases and embeddings are excluded
    clip_grad: float | None = 1.0
    accumulate_grad_in_fp32: bool = True
    adam_eps: float = 1e-8
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    torch_adam_is_fused: bool = True
    skip_bad_steps: int = 0  # bad steps in a row whose update is skipped before the run stops (0: stop at the first)
    loss_spike_factor: float | None = None  # a loss above this times the recent mean counts as a bad step


@dataclass
class DatasetArgs:
    dataset_folder: list[Path]
    dataset_weights: list[float] | None = None  # None: sample the folders in proportion to their sizes


@dataclass
class DataArgs:
    dataset: DatasetArgs
    seed: int = 42
    num_loading_workers: int = 1


@dataclass
class DatasetStageArgs:
    name: str
    start_training_step: int
    data: DataArgs


@dataclass
class WandbArgs:
    project: str
    entity: str | None = None
    mode: str = "online"  # online, offline (written locally, synced later with `wandb sync`) or disabled
    name: str | None = None  # None: general.run
    dir: Path | None = None  # None: checkpoints_path


@dataclass
class LoggingArgs:
    log_level: str = "info"
    log_level_replica: str = "info"
    iteration_step_info_interval: int = 1
    metrics_path: Path | None = None  # None: <checkpoints_path>/metrics.jsonl
    tensorboard_dir: Path | None = None  # also write every step record as TensorBoard scalars here
    wandb: WandbArgs | None = None  # also log every step record to Weights & Biases


@dataclass
class FP8Args:
    """FP8 matmuls in the decoder's linear layers and MoE experts (``nn/fp8.py``); embeddings, the LM head,
    routers, norms and the loss stay in the model dtype, master weights and optimizer state in fp32."""

    enabled: bool = False
    recipe: str = "tensorwise"  # tensorwise or rowwise (per token and feature) from the current amax; delayed
    amax_history_length: int = 16  # delayed: the scale comes from the largest amax of this many last steps
    gradient_format: str = "e5m2"  # of the output gradients; e4m3 for every operand with "e4m3"
    exclude_modules: list[str] = field(default_factory=list)  # regexes of module names kept in the model dtype
    log_out_of_range: bool = False  # log the shares of cast values that saturated or flushed to zero, every step


@dataclass
class DoReMiArgs:
    """DoReMi (Xie et al., 2023): domain weights learned by a small proxy model against a reference model.

    ``domain_weights`` are the reference's fixed mixture (``examples/doremi/train_reference.py``; unset: the
    natural token shares) and the starting point of the proxy's; a larger run pastes the averaged weights of the
    proxy here. ``ref_model_resume_checkpoint_path`` is the trained reference, needed by the proxy only.
    """

    domain_names: list[str] | None = None  # None: the names of the dataset folders
    domain_weights: list[float] | None = None
    ref_model_resume_checkpoint_path: Path | None = None
    step_size: float = 1.0  # of the exponentiated-gradient update of the weights
    smoothing_param: float = 1e-3  # mixes the updated weights with the uniform ones


@dataclass
class ProfilerArgs:
    profiler_export_path: Path | None = None


@dataclass(kw_only=True)
class Config:
    """A whole training run. Keyword-only because optional sections sit between required ones in YAML order."""

    general: GeneralArgs
    checkpoints: CheckpointsArgs
    parallelism: ParallelismArgs = field(default_factory=ParallelismArgs)
    model: ModelArgs
    tokenizer: TokenizerArgs
    optimizer: OptimizerArgs
    tokens: TokensArgs
    data_stages: list[DatasetStageArgs]
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    profiler: ProfilerArgs | None = None
    doremi: DoReMiArgs | None = None
    fp8: FP8Args | None = None

    def __post_init__(self) -> None:
        self.data_stages = sorted(self.data_stages, key=lambda stage: stage.start_training_step)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: data is sharded over dp and expert-parallel ranks alike."""
        p = self.parallelism
        return self.tokens.micro_batch_size * self.tokens.batch_accumulation_per_replica * p.dp * p.expert_parallel_size

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch_size * self.tokens.sequence_length

    def resolved_metrics_path(self) -> Path:
        return self.logging.metrics_path or self.checkpoints.checkpoints_path / "metrics.jsonl"

    def data_stage_at(self, step: int) -> DatasetStageArgs:
        """The stage that feeds optimizer step `step` (1-based): the last one started at or before it."""
        started = [stage for stage in self.data_stages if stage.start_training_step <= step]
        if not started:
            raise ValueError(f"no data stage has started at step {step}; the first stage starts at step 1")
        return max(started, key=lambda stage: stage.start_training_step)
