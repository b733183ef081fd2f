"""Mamba-1 (Gu & Dao, 2023) as a pure PyTorch model: an embedding, pre-norm residual blocks of selective
state-space mixers, a final norm and a tied LM head, laid out like Hugging Face's ``MambaForCausalLM``.

A mixer, on hidden states ``h`` [batch, length, d_model] with ``d_inner = expand · d_model`` channels:

    x | z = in_proj(h)                                   the channels and their gate
    x = silu(causal depthwise conv1d(x))                 kernel d_conv, over time
    dt | B | C = x_proj(x)                               input-dependent: dt_rank, d_state, d_state wide
    Δ = softplus(dt_proj(dt))                            per channel, with dt_proj's bias
    s_t = exp(Δ_t A) s_{t-1} + Δ_t B_t x_t,  y_t = C_t · s_t + D x_t      A = -exp(A_log), per channel and state
    out = out_proj(y · silu(z))

The scan runs in fp32 (``nn/selective_scan.py``: a chunked parallel scan on CUDA, a loop over time elsewhere), and
the convolution with its SiLU on channels-last activations (``nn/causal_conv1d.py``: Triton kernels on CUDA); A_log
and D are kept in fp32 and out of weight decay. Generation carries, per layer, the last ``d_conv - 1`` conv inputs
and the scan state (``MambaCache``), so every new token costs the same whatever the length of the context.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanotron.config import MambaConfig, MambaInit
from nanotron.models.init import constant, normal, uniform
from nanotron.models.spec import Initializer, tie_embeddings
from nanotron.nn.causal_conv1d import CausalConv1d
from nanotron.nn.linear import Linear
from nanotron.nn.rmsnorm import RMSNorm
from nanotron.nn.selective_scan import selective_scan


class MambaCache:
    """One layer's recurrent state during generation: the conv's last inputs and the scan state."""

    def __init__(self):
        self.conv_inputs: torch.Tensor | None = None  # [batch, d_conv - 1, d_inner]
        self.state: torch.Tensor | None = None  # [batch, d_inner, d_state], fp32


class MambaMixer(nn.Module):
    fp32_parameters = ("A_log", "D")
    no_weight_decay_parameters = ("A_log", "D")

    def __init__(self, config: MambaConfig):
        super().__init__()
        ssm, d_inner = config.ssm_cfg, config.d_inner
        self.d_state, self.d_conv, self.dt_rank = ssm.d_state, ssm.d_conv, config.dt_rank
        self.in_proj = Linear(config.d_model, 2 * d_inner, bias=ssm.bias, chunks=(d_inner, d_inner))
        self.conv1d = CausalConv1d(d_inner, ssm.d_conv, bias=ssm.conv_bias)
        self.x_proj = Linear(d_inner, self.dt_rank + 2 * ssm.d_state, bias=False)
        self.dt_proj = Linear(self.dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(d_inner, ssm.d_state))
        self.D = nn.Parameter(torch.empty(d_inner))
        self.out_proj = Linear(d_inner, config.d_model, bias=ssm.bias)

    def forward(self, h: torch.Tensor, valid: torch.Tensor | None = None,
                cache: MambaCache | None = None) -> torch.Tensor:
        """``valid`` [batch, length] marks real tokens (left padding in generation contributes nothing)."""
        x, z = self.in_proj(h).split(list(self.in_proj.output_chunks), dim=-1)
        if valid is not None:
            x = x * valid.unsqueeze(-1).to(x.dtype)
        earlier = None if cache is None else cache.conv_inputs  # None: zeros, the start of a sequence
        if cache is not None:
            start = x.new_zeros(x.shape[0], self.d_conv - 1, x.shape[2]) if earlier is None else earlier
            cache.conv_inputs = torch.cat([start, x], dim=1)[:, x.shape[1]:]
        x = self.conv1d(x, earlier)
        if valid is not None:
            x = x * valid.unsqueeze(-1).to(x.dtype)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(dt).float())
        y, state = selective_scan(x, delta, -torch.exp(self.A_log.float()), B, C, self.D,
                                  None if cache is None else cache.state)
        if cache is not None:
            cache.state = state
        return self.out_proj((y * F.silu(z.float())).to(h.dtype))


class MambaBlock(nn.Module):
    def __init__(self, config: MambaConfig):
        super().__init__()
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.mixer = MambaMixer(config)

    def forward(self, hidden_states: torch.Tensor, valid: torch.Tensor | None = None,
                cache: MambaCache | None = None) -> torch.Tensor:
        # With residual_in_fp32 the residual stream stays fp32 from the first block on; each block normalises it
        # in the weights' dtype, as mamba_ssm and transformers do.
        residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
        mixed = self.mixer(self.norm(hidden_states.to(self.norm.weight.dtype)), valid, cache)
        return residual + mixed


class MambaForCausalLM(nn.Module):
    """The ``CausalLM`` of the Mamba family; ``position_ids`` are ignored (the scan is ordered by itself)."""

    def __init__(self, config: MambaConfig, padded_vocab_size: int):
        super().__init__()
        self.config = config
        self.padded_vocab_size = padded_vocab_size
        self.embed_tokens: nn.Embedding | None = nn.Embedding(padded_vocab_size, config.d_model)
        self.layers = nn.ModuleDict({str(i): MambaBlock(config) for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.d_model, config.rms_norm_eps)
        self.lm_head: Linear | None = Linear(config.d_model, padded_vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        tie_embeddings(self)

    def forward(self, input_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                caches: dict[str, MambaCache] | None = None, head: bool = True) -> torch.Tensor:
        """``attention_mask`` (generation's [batch, 1, queries, keys]) only tells which fed tokens are real: those
        the last query, always a real token, may see. ``head=False`` returns the LM head's input instead of the
        logits (see ``CausalLM.forward``)."""
        if self.embed_tokens is not None:
            hidden_states = self.embed_tokens(input_ids)
        valid = None
        if attention_mask is not None:
            valid = attention_mask[:, 0, -1, attention_mask.shape[-1] - hidden_states.shape[1]:]
        for index, layer in self.layers.items():
            hidden_states = layer(hidden_states, valid, None if caches is None else caches[index])
        if self.norm is not None:
            hidden_states = self.norm(hidden_states.to(self.norm.weight.dtype))
        if self.lm_head is not None and head:
            hidden_states = self.lm_head(hidden_states)
        return hidden_states


def mamba_init_rule(name: str, config: MambaConfig, std: float) -> Initializer:
    """The reference initialisation (``init_method: {std}``): S4D-real A (``A_log[c, n] = log(n + 1)``), D = 1,
    dt_proj's bias the inverse softplus of a log-uniform step in [dt_min, dt_max] (floored at dt_init_floor),
    dt_proj's weight uniform (or constant) at ``dt_rank^-0.5 · dt_scale``, out_proj scaled by 1/sqrt(num_layers)
    like a residual output, norms at one, other biases at zero, other matrices normal(0, std)."""
    ssm = config.ssm_cfg
    state_space = _state_space_rule(name, config)
    if state_space is not None:
        return state_space
    if name.endswith("dt_proj.bias"):
        def dt_bias(t: torch.Tensor, g: torch.Generator) -> None:
            low, high = math.log(ssm.dt_min), math.log(ssm.dt_max)
            dt = torch.exp(torch.rand(t.shape, generator=g, device=t.device) * (high - low) + low)
            dt = dt.clamp(min=ssm.dt_init_floor)
            t.copy_(dt + torch.log(-torch.expm1(-dt)))
        return dt_bias
    if name.endswith(".bias"):
        return constant(0.0)
    if name.endswith("out_proj.weight"):
        return normal(std / config.num_hidden_layers ** 0.5)
    return normal(std)


def upstream_mamba_init_rule(name: str, config: MambaConfig, init: MambaInit) -> Initializer:
    """Upstream nanotron's Mamba initialisation (``init_method: {initializer_range, rescale_prenorm_residual,
    n_residuals_per_layer}``, examples/mamba at its main branch), on the logical tensors: the projections and the
    convolution PyTorch's default kaiming-uniform, ``U(±1/sqrt(fan_in))``, out_proj then divided by
    ``sqrt(n_residuals_per_layer · num_layers)`` with ``rescale_prenorm_residual``; the convolution's and dt_proj's
    biases ``U(±1/sqrt(fan_in))``; the embedding normal(0, initializer_range); A, D, dt_proj's weight and the norms
    as in the reference initialisation."""
    state_space = _state_space_rule(name, config)
    if state_space is not None:
        return state_space
    if name.endswith("embed_tokens.weight"):
        return normal(init.initializer_range)
    if name.endswith("conv1d.bias"):
        return uniform(config.ssm_cfg.d_conv ** -0.5)
    if name.endswith("dt_proj.bias"):
        return uniform(config.dt_rank ** -0.5)
    if name.endswith(".bias"):
        return constant(0.0)
    scale = 1.0
    if name.endswith("out_proj.weight") and init.rescale_prenorm_residual:
        scale = (init.n_residuals_per_layer * config.num_hidden_layers) ** -0.5
    return lambda t, g: t.uniform_(-1.0, 1.0, generator=g).mul_(scale * math.prod(t.shape[1:]) ** -0.5)


def _state_space_rule(name: str, config: MambaConfig) -> Initializer | None:
    """What both initialisations give the norms, A, D and dt_proj's weight (None for the other parameters)."""
    ssm = config.ssm_cfg
    if name.endswith("norm.weight"):
        return constant(1.0)
    if name.endswith("A_log"):
        return lambda t, g: t.copy_(torch.log(torch.arange(1, t.shape[1] + 1, dtype=t.dtype)).expand_as(t))
    if name.endswith(".D"):
        return constant(1.0)
    if name.endswith("dt_proj.weight"):
        bound = config.dt_rank ** -0.5 * ssm.dt_scale
        return constant(bound) if ssm.dt_init == "constant" else uniform(bound)
    return None
