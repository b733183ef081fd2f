"""Mamba's costs: logical parameters and training FLOPs per token (MFU, the pipeline split), and what a compiled
block keeps for the backward (the memory planner)."""

from __future__ import annotations

from nanotron.config import ConfigError, MambaConfig
from nanotron.models.spec import ActivationShape, ModelCosts
from nanotron.nn.selective_scan import BLOCK_T as SCAN_CHUNK


def mamba_costs(c: MambaConfig, padded_vocab_size: int, sequence_length: int) -> ModelCosts:
    """6 FLOPs per weight and token for the projections and the depthwise conv (the 6N convention), plus the scan:
    per token, channel and state about 7 FLOPs forward (decay exp and multiply, input term, state update, output
    product), taken as 3x that for forward and backward, i.e. ``21 · d_inner · d_state`` per token and layer. As
    for Llama (``decoder_costs``), the LM head counts and the input-embedding lookup does not."""
    ssm, d_inner = c.ssm_cfg, c.d_inner
    layer = (c.d_model * 2 * d_inner + (2 * d_inner if ssm.bias else 0)
             + d_inner * ssm.d_conv + (d_inner if ssm.conv_bias else 0)
             + d_inner * (c.dt_rank + 2 * ssm.d_state) + c.dt_rank * d_inner + d_inner
             + d_inner * ssm.d_state + d_inner + d_inner * c.d_model + (c.d_model if ssm.bias else 0) + c.d_model)
    lm_head = padded_vocab_size * c.d_model
    parameters = c.num_hidden_layers * layer + lm_head * (1 if c.tie_word_embeddings else 2) + c.d_model
    layer_flops = 6.0 * layer + 21.0 * d_inner * ssm.d_state
    return ModelCosts(parameters=parameters, layer_flops=(layer_flops,) * c.num_hidden_layers,
                      head_flops=6.0 * lm_head,
                      flops_per_token=c.num_hidden_layers * layer_flops + 6.0 * (c.d_model + lm_head))


def mamba_layer_activations(c: MambaConfig, layer: int, shape: ActivationShape) -> tuple[int, int]:
    """(kept, transient) of one compiled Mamba block per micro-batch on one rank (``ModelSpec.layer_activations``).

    With h = d_model, e = d_inner / tp (this rank's channels), r = dt_rank, n = d_state and d the model dtype's
    bytes, the block keeps per token:

    - the residual stream it reads (fp32 with ``residual_in_fp32``) and the in_proj input (d·h),
    - in_proj's output x|z, the conv/SiLU output (the scan's x), dt_proj's output, the scan's output y and the
      gated out_proj input: 6d·e (the conv kernels read x inside in_proj's output: no padded copy),
    - Δ in fp32 (4e), and the state entering every chunk of ``SCAN_CHUNK`` steps (fp32: 4n·e / ``SCAN_CHUNK``),
    - x_proj's output dt|B|C and the scan's contiguous copies of B and C: d·(r + 4n),

    and per block the fp32 A (4e·n). Measured per layer on an H200 (130M and 1.4B shapes, bf16): within 0.02%,
    when y was fp32; with y in the model dtype the step peaks fell by the 2e per token this count drops, to within
    0.1% of it. A recomputed block keeps its input (measured). Pointwise-recomputed (``nn/recompute.py``) it also
    keeps its matmuls' outputs the backward reads and its Triton ops' outputs: x|z, the conv output, dt|B|C,
    dt_proj's output, y and the chunk states (derived from the code, not measured: on CPU the scan and convolution
    run plain torch, which is recomputed). No transient is added for the backward: at both
    shapes, with and without recomputation, the step peaks came within 0.3% of the count without one (the loss's
    backward, which runs first, needs more). Eager blocks peaked up to 14% above this count: they are refused.
    """
    if not shape.compiled:
        raise ConfigError("the memory planner models compiled Mamba blocks only (model.compile: true): eager ones "
                          "peaked up to 14% above its count on an H200, for want of a model of their backward")
    d, tokens = shape.value_bytes, shape.tokens
    h, e, r, n = c.d_model, c.d_inner // shape.tp, c.dt_rank, c.ssm_cfg.d_state
    residual = (4 if c.residual_in_fp32 else d) * h * shape.residual_share
    chunk_states = 4 * n * e / SCAN_CHUNK
    per_token = residual + d * h * shape.linear_input_share + 6 * d * e + 4 * e + chunk_states + d * (r + 4 * n)
    full = int(tokens * per_token + 4 * e * n)
    if shape.recompute == "none":
        return full, 0
    kept = residual + (d * (5 * e + r + 2 * n) + chunk_states if shape.recompute == "pointwise" else 0)
    return int(tokens * kept), int(full - tokens * (kept - residual))
