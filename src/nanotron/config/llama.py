"""The Llama family's config (Llama 2/3, Qwen2-style attention biases), RoPE scaling, and their rules.

``problems`` checks the values alone; ``layout_problems`` the shapes at a tensor-parallel size and sequence
length, which training validation, generation, evaluation and conversion all check before building anything.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

from nanotron.config.family import FamilyFacts
from nanotron.config.rules import MODEL_CONFIG_KEY, at_least, positive, prefix

# The RoPE scaling types of `LlamaConfig.rope_scaling` and the keys each needs besides `rope_type`, named as in
# Hugging Face's config.json: `linear` divides every frequency by `factor` (position interpolation); `llama3`
# (Llama 3.1+) divides only the low frequencies, leaves the high ones and blends the band between them; `yarn`
# (DeepSeek-V3) blends them between the `beta_fast` and `beta_slow` rotations and scales the rotated features by
# YaRN's mscale (`mscale`, `mscale_all_dim`: 0 where the model's config.json has none; `nn/rotary.py`).
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
}
# The activations of the gated MLP, ``down(act(gate(x)) * up(x))``, named as transformers' ``hidden_act``: ``silu``
# (SwiGLU), ``gelu`` (exact, erf), ``gelu_pytorch_tanh`` (tanh approximation) and ``relu``.
HiddenAct = Literal["silu", "gelu", "gelu_pytorch_tanh", "relu"]


@dataclass
class LlamaConfig(FamilyFacts):
    """Llama's architecture; its context is ``max_position_embeddings`` (``FamilyFacts``)."""

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
    rope_scaling: dict | None = None  # None, or {rope_type: linear | llama3, ...}: see ROPE_SCALING_KEYS
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k and v (Qwen2); the output projection never has one
    hidden_act: HiddenAct = "silu"  # the gated MLP's activation (and its experts'); silu: SwiGLU
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    # Extending the context changes max_position_embeddings and usually the RoPE theta or scaling with it.
    resume_may_change: ClassVar[frozenset[str]] = frozenset({
        "max_position_embeddings", "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id", "pad_token_id",
        "initializer_range"})

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def context_length(self) -> int | None:
        return self.max_position_embeddings

    def _marker_problems(self, k: str) -> Iterator[str]:
        if not self.is_llama_config:
            yield f"{k}is_llama_config must be true for a Llama model config"

    def problems(self, key: str | None = MODEL_CONFIG_KEY) -> Iterator[str]:
        """Rules on the values alone (``key`` prefixes the field names; None: bare names)."""
        k = prefix(key)
        yield from self._marker_problems(k)
        if self.vocab_size >= 1:
            for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
                token_id = getattr(self, name)
                if token_id is not None and not 0 <= token_id < self.vocab_size:
                    yield f"{k}{name} ({token_id}) must be in [0, {k}vocab_size) = [0, {self.vocab_size})"
        yield from positive(f"{k}rms_norm_eps", self.rms_norm_eps)
        yield from positive(f"{k}rope_theta", self.rope_theta)
        yield from positive(f"{k}initializer_range", self.initializer_range)
        if self.rope_scaling is not None:
            yield from rope_scaling_problems(self.rope_scaling, f"{k}rope_scaling")

    def layout_problems(self, tp: int, *, key: str | None = MODEL_CONFIG_KEY, tp_key: str = "parallelism.tp",
                        sequence_length: int | None = None,
                        sequence_key: str = "tokens.sequence_length") -> list[str]:
        """The shape rules of the model split over ``tp`` tensor-parallel ranks, one line per broken rule.

        A model that cannot be split stops with one line naming the numbers instead of a shape error inside a
        layer. ``key`` prefixes the config fields (None: bare field names), ``tp_key`` and ``sequence_key`` name
        where the tensor-parallel size and the sequence length come from. The vocabulary needs no rule: it is
        padded to a multiple of tp.
        """
        k = prefix(key)
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings")
        problems = [problem for name in sizes for problem in at_least(f"{k}{name}", getattr(self, name), 1)]
        if problems:
            return problems
        heads, kv_heads = self.num_attention_heads, self.num_key_value_heads
        problems += self._head_size_problems(k)
        if heads % kv_heads:
            problems.append(f"{k}num_attention_heads ({heads}) must be divisible by {k}num_key_value_heads "
                            f"({kv_heads}): each kv head serves a whole group of heads")
        if tp >= 1 and (heads % tp or (kv_heads % tp and tp % kv_heads)):
            fits = [str(n) for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
            problems.append(f"{tp_key} ({tp}) must divide {k}num_attention_heads ({heads}), and divide or be a "
                            f"multiple of {k}num_key_value_heads ({kv_heads}): each TP rank holds whole heads, and a "
                            "kv head is either split off whole or replicated over the ranks that share it; set "
                            f"{tp_key} to one of {', '.join(fits)}")
        if tp >= 1 and self.intermediate_size % tp:
            problems.append(f"{k}intermediate_size ({self.intermediate_size}) must be divisible by {tp_key} ({tp}): "
                            "the MLP is split column-wise over TP ranks")
        if sequence_length is not None and sequence_length > self.max_position_embeddings:
            problems.append(f"{sequence_key} ({sequence_length}) exceeds {k}max_position_embeddings "
                            f"({self.max_position_embeddings}); raise max_position_embeddings or shorten the "
                            "sequences")
        return problems


    def _head_size_problems(self, k: str) -> list[str]:
        """The rules of the head size, ``hidden_size / num_attention_heads`` (variants with their own head size
        override this)."""
        if self.hidden_size % self.num_attention_heads:
            return [f"{k}hidden_size ({self.hidden_size}) must be divisible by {k}num_attention_heads "
                    f"({self.num_attention_heads}) so that every head has the same size"]
        if self.head_dim % 2:
            return [f"{k}hidden_size / {k}num_attention_heads = {self.head_dim} must be even: rotary embeddings "
                    "rotate pairs of head dimensions"]
        return []


def rope_scaling_problems(scaling: dict, key: str) -> Iterator[str]:
    """One line for a wrong type or wrong keys (the values are only checked once the keys are right). The mapping
    keeps Hugging Face's form, so its ``rope_type`` is checked here rather than by a Literal field."""
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
    if rope_type == "yarn":
        yield from _yarn_problems(scaling, numbers, key)
    if rope_type == "llama3":
        low, high = numbers.get("low_freq_factor", 0), numbers.get("high_freq_factor", 0)
        if not 0 < low < high:
            yield (f"{key}.low_freq_factor ({scaling['low_freq_factor']!r}) and high_freq_factor "
                   f"({scaling['high_freq_factor']!r}) must be numbers with 0 < low_freq_factor < high_freq_factor "
                   "(Llama 3.1: 1.0 and 4.0)")
    if rope_type in ("llama3", "yarn"):
        original = scaling["original_max_position_embeddings"]
        if not (isinstance(original, int) and not isinstance(original, bool) and original >= 1):
            yield (f"{key}.original_max_position_embeddings must be an integer >= 1 (got {original!r}): the "
                   "context length the model was pretrained with (Llama 3.1: 8192, DeepSeek-V3: 4096)")


def _yarn_problems(scaling: dict, numbers: dict, key: str) -> Iterator[str]:
    fast, slow = numbers.get("beta_fast", 0), numbers.get("beta_slow", 0)
    if not 0 < slow < fast:
        yield (f"{key}.beta_fast ({scaling['beta_fast']!r}) and beta_slow ({scaling['beta_slow']!r}) must be numbers "
               "with 0 < beta_slow < beta_fast (YaRN's and DeepSeek-V3's: 32 and 1)")
    for name in ("mscale", "mscale_all_dim"):
        if not numbers.get(name, -1) >= 0:
            yield f"{key}.{name} must be a number >= 0 (got {scaling[name]!r}); 0: the model has none"
