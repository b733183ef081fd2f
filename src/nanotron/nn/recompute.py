"""Activation recomputation of a module, without changing its place in the module tree: whole (``full``), all but
the attention kernels' outputs (``selective``), or all but the outputs of its matrix products and attention kernels
(``pointwise``)."""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from nanotron.nn.flash_attention import FLASH_ATTENTION_OP

aten = torch.ops.aten
# The ops whose outputs (the attention output and its log-sum-exp, which their backward reads) selective recomputation
# keeps: every fused SDPA kernel, FlashAttention-4's op, and flex attention's higher-order op (its backward runs on
# CUDA only). SDPA's math path is not one op: it decomposes into matmuls and a softmax whose backward needs the
# quadratic probabilities, so it is recomputed like the rest of the layer.
ATTENTION_OPS = frozenset(
    op for op in (
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        FLASH_ATTENTION_OP,
        getattr(torch.ops.higher_order, "flex_attention", None),
    ) if op is not None
)

# The matrix products linear layers and experts dispatch to (those this torch has): nearly all of a layer's FLOPs
# besides attention's. (SDPA's math path runs bmm too: pointwise keeps its quadratic scores, where no recomputation
# keeps the probabilities.) A kept output must not be modified in place afterwards, or the recomputed forward would
# modify the kept tensor again: tensor parallelism's forward all-reduce sums a row-parallel product into a copy.
MATMUL_OPS = frozenset(
    getattr(aten, name).default
    for name in ("mm", "addmm", "bmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm") if hasattr(aten, name)
)
POINTWISE_KEPT_OPS = ATTENTION_OPS | MATMUL_OPS
# nanotron's own Triton ops (``triton_op("nanotron::...")``): Mamba's convolution and scan. Matched by namespace, since
# they are registered only where their kernels can run (nn/kernels.py).
KERNEL_NAMESPACE = "nanotron"
GRANULARITIES = ("full", "selective", "pointwise")  # parallelism.recompute_granularity's values


def _keep_attention_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_matmul_and_attention_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    kept = op in POINTWISE_KEPT_OPS or getattr(op, "namespace", None) == KERNEL_NAMESPACE
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention_context() -> tuple[Any, Any]:
    """``checkpoint``'s ``context_fn`` for selective recomputation: a fresh pair of contexts per call."""
    return create_selective_checkpoint_contexts(_keep_attention_outputs)


def keep_matmul_and_attention_context() -> tuple[Any, Any]:
    """``checkpoint``'s ``context_fn`` for pointwise recomputation: a fresh pair of contexts per call."""
    return create_selective_checkpoint_contexts(_keep_matmul_and_attention_outputs)


def recompute_in_backward(module: nn.Module, granularity: str = "full") -> nn.Module:
    """Make ``module`` keep only its inputs for backward (and, ``selective``, its attention kernels' outputs;
    ``pointwise``, those and its matrix products' outputs) and run its forward again there to rebuild the rest.

    A decoder layer's activations (norm outputs, q/k/v, attention output, the SwiGLU intermediates) dominate
    training memory; dropping them costs one more forward of the layer, about a third more of its FLOPs. At long
    sequences most of that forward is attention (its FLOPs grow with the sequence, the rest's do not), and keeping
    its output and log-sum-exp (a few bytes per token and head) saves recomputing it: ``selective`` reruns the
    norms, projections, RoPE and MLP only (torch's selective activation checkpointing). ``pointwise`` also keeps
    what the matmuls output (q|k|v, gate|up, the projections' outputs) and reruns only the elementwise ops between
    them (norms, RoPE, SwiGLU's product, residual adds, casts): almost no FLOPs, while the norms' and RoPE's
    outputs and the SwiGLU output, which the layer would otherwise keep too, are rebuilt from the kept tensors. Its
    nanotron Triton ops (Mamba's convolution and scan) are kept as well, so that a Mamba block does not scan twice.

    The module is patched in place (its ``forward`` becomes an instance attribute) instead of being wrapped, so
    parameter names, state dicts and checkpoints stay those of the plain model, and ``module.compile()`` still
    applies: torch.compile traces non-reentrant checkpointing, with its selective policy, and recomputes inside the
    compiled backward. With grad disabled (generation, evaluation) the original forward runs directly: nothing would
    be saved anyway, and checkpointing would only add overhead. Calling this again replaces the granularity.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"recompute granularity {granularity!r}: expected one of {', '.join(GRANULARITIES)}")
    forward = functools.partial(_forward_recomputed_in_backward, granularity=granularity)
    module.forward = types.MethodType(forward, module)
    return module


def compile_layer(module: nn.Module) -> None:
    """``module.compile()`` for a module that may recompute its forward in the backward.

    A mixture-of-experts block records its router's auxiliary terms on itself during the forward (``self.record``).
    torch.compile refuses such a side effect inside a checkpointed region, because eager checkpointing would replay
    it when recomputing; it then gives up on the whole layer, which runs eagerly under the recomputation policy's
    dispatch mode at under half the speed (measured on the mixtral preset). The record is read after the forward
    and the recomputation would store the same values again, so not replaying it changes nothing; allowing it is a
    process-wide dynamo setting, set here where layers are compiled (where torch has it: newer than the floor)."""
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    module.compile()


def _forward_recomputed_in_backward(self: nn.Module, *args: Any, granularity: str, **kwargs: Any) -> Any:
    # The class's forward, looked up at call time: a deep copy of the module rebinds this method to the copy.
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    # The policy named here, not looked up in a table or passed through: torch.compile traces a context_fn only when
    # it sees the function itself (and fails on torch's own noop_context_fn, hence no context_fn for full).
    if granularity == "selective":
        policy = {"context_fn": keep_attention_context}
    elif granularity == "pointwise":
        policy = {"context_fn": keep_matmul_and_attention_context}
    else:
        policy = {}
    return checkpoint(forward, self, *args, use_reentrant=False, **policy, **kwargs)
