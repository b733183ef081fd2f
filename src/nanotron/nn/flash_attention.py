"""FlashAttention-4 (the optional ``flash-attn-4`` package: CuTe DSL kernels for Hopper and Blackwell GPUs), the
attention kernel of ``model.attention_backend: auto`` and ``fa4`` on CUDA, as two torch custom ops.

**What it runs.** Causal attention of queries over keys that start at the sequence's first position, in FA4's own
terms (``nn/attention.py`` states the rule, and ``FlashMask`` the cases of it that FA4 expresses):

- whole sequences, with grouped-query heads (FA4 reads the kv heads itself) and sliding windows of W positions
  (``window_size = (W - 1, 0)``);
- document masking: the documents of each batch row are the sequences of FA4's varlen interface, their boundaries
  (``cu_seqlens``) read from the document ids, which number each document's one run of tokens;
- a context-parallel rank's queries against the gathered keys: each contiguous run of its queries, positions
  ``[a, a + c)``, attends to keys ``[0, a + c)``, and FA4 aligns the last query with the last key when there are
  fewer queries than keys, which is the causal rule (and the window) at those positions.

Padded prompts, a KV cache (generation) and document masking under context parallelism are not expressed: those
run torch's kernels, and ``AttentionMasks`` names each such case once in the log.

**Compiled layers.** The forward (``nanotron::flash_attention``) and its backward
(``nanotron::flash_attention_backward``) are custom ops with fake implementations, so ``torch.compile`` traces a
decoder layer into one graph with the kernel in it, and the op's autograd formula calls FA4's backward on the output
and log-sum-exp the forward returned. Selective recomputation keeps those two outputs (``nn/recompute.py``), as it
keeps SDPA's.

**The kernels.** FA4's forward and backward entry points (``flash_attn.cute.interface._flash_attn_fwd`` and
``_flash_attn_bwd``, those its own autograd function calls), loaded on first use and held in a ``Kernels``: the
extra pins the version whose calling convention this module follows. A CPU never loads them; the tests give a
``Kernels`` of plain torch with the same convention (``tests/test_flash_attention.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

INSTALL = "pip install 'nanotron[fa4]'"
NO_WINDOW = -1  # the ops' window argument without a sliding window


@dataclass(frozen=True)
class Kernels:
    """FA4's forward and backward with its calling convention, and what they run: ``unsupported(device, dtype,
    head_dim)`` is None where they run, else why not."""

    forward: Callable
    backward: Callable
    unsupported: Callable[[torch.device, torch.dtype, int], str | None]


@dataclass(frozen=True)
class FlashMask:
    """The attention rule of one layer in FA4's terms: ``window`` positions (None: every earlier key); either
    ``cu_seqlens`` (int32 [documents + 1], the documents' boundaries over the batch rows laid end to end: whole
    sequences under document masking), or ``query_runs``, the (first position, length) of each contiguous run of the
    queries, whose keys are positions ``0, 1, ...`` of the whole sequence."""

    window: int | None
    cu_seqlens: torch.Tensor | None = None
    query_runs: tuple[tuple[int, int], ...] = ()


_loaded: tuple[Kernels | None, str | None] | None = None  # (kernels, why not), once loaded


def _fa4_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    if device.type != "cuda":
        return f"FA4 runs on CUDA devices, this is {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] < 9:
        return f"FA4 needs a GPU of compute capability 9.0 or later, this one is {capability[0]}.{capability[1]}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FA4 takes bf16 or fp16, the model is {str(dtype).removeprefix('torch.')}"
    if not (8 <= head_dim <= (256 if capability[0] == 9 else 128) and head_dim % 8 == 0):
        return f"FA4 does not take head dimension {head_dim} on this GPU"
    return None


def kernels() -> tuple[Kernels | None, str | None]:
    """FA4's kernels, imported on the first call (the CuTe DSL takes seconds to import), or None and why not."""
    global _loaded
    if _loaded is None:
        try:
            from flash_attn.cute import interface
        except Exception as error:  # not installed, or its CUDA libraries failed to load
            _loaded = None, f"flash_attn.cute did not import ({type(error).__name__}: {error})"
        else:
            _loaded = Kernels(interface._flash_attn_fwd, interface._flash_attn_bwd, _fa4_unsupported), None
    return _loaded


def unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FA4 cannot run the attention of a model of ``dtype`` and ``head_dim`` on ``device``; None: it can."""
    if device.type != "cuda" and _loaded is None:  # no import on a CPU: the tests install their stand-in first
        return f"FA4 runs on CUDA devices, this is {device.type}"
    loaded, why_not = kernels()
    return why_not if loaded is None else loaded.unsupported(device, dtype, head_dim)


def use_flash_attention(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a model's attention runs FA4 (``model.attention_backend``): always with ``fa4`` (config validation
    has checked that it can), never with ``torch``; with ``auto`` where it can, else torch's kernels, and on a CUDA
    device the log says once why (a CPU runs torch's kernels by design)."""
    if backend != "auto":
        return backend == "fa4"
    why_not = unavailable(device, dtype, head_dim)
    if why_not is not None and device.type == "cuda":
        report_fallback("every layer", why_not + f"; {INSTALL} for it")
    return why_not is None


_reported: set[str] = set()


def report_fallback(case: str, why: str) -> None:
    """Logs once per case that attention runs torch's kernels (SDPA, flex attention) instead of FA4, and why."""
    if case not in _reported:
        _reported.add(case)
        logger.warning(f"attention of {case} runs torch's kernels, not FlashAttention-4: {why}")


def document_boundaries(documents: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` (int32) of the documents of ``documents`` [batch, sequence] (ids, each document one run of
    tokens in its row): every document's first token in the rows laid end to end, then the total length. A row's
    first token starts a document, so no document crosses rows."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = starts.flatten().nonzero().flatten()
    return torch.cat([first, first.new_tensor([documents.numel()])]).to(torch.int32)


def _window_sizes(window: int) -> dict[str, int | None]:
    return {"window_size_left": None if window == NO_WINDOW else window - 1,
            "window_size_right": None if window == NO_WINDOW else 0}


def _lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    # FA4's: [heads, tokens] over varlen sequences, else [batch, heads, queries]
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _lengths(cu_seqlens: torch.Tensor | None, max_seqlen: int) -> dict:
    if cu_seqlens is None:
        return {}
    return {"cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens, "max_seqlen_q": max_seqlen,
            "max_seqlen_k": max_seqlen}


@torch.library.custom_op("nanotron::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
                    max_seqlen: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention (FA4's layout: q [batch, queries, heads, d], k and v [batch, keys, kv_heads, d], or
    [tokens, heads, d] with ``cu_seqlens``, sequences of at most ``max_seqlen`` tokens): the output, shaped like q,
    and the log-sum-exp of every query's scores (fp32)."""
    out = q.new_empty(q.shape)
    lse = torch.empty(_lse_shape(q, cu_seqlens is not None), dtype=torch.float32, device=q.device)
    kernels()[0].forward(q, k, v, **_lengths(cu_seqlens, max_seqlen), causal=True, **_window_sizes(window),
                         return_lse=True, out=out, lse=lse)
    return out, lse


@flash_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, window):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, cu_seqlens is not None), dtype=torch.float32)


@torch.library.custom_op("nanotron::flash_attention_backward", mutates_args=())
def flash_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int,
                             window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``flash_attention``'s inputs q, k, v from the gradient of its output."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    kernels()[0].backward(q, k, v, out, grad, lse, None, True, 0.0, **_window_sizes(window),
                          **_lengths(cu_seqlens, max_seqlen), dq=dq, dk=dk, dv=dv)
    return dq, dk, dv


@flash_attention_backward.register_fake
def _(grad, q, k, v, out, lse, cu_seqlens, max_seqlen, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save_for_backward(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, window = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.max_seqlen, ctx.window = max_seqlen, window
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad, _lse_grad):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    return *flash_attention_backward(grad, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.window), None, None, None


flash_attention.register_autograd(_backward, setup_context=_save_for_backward)
FLASH_ATTENTION_OP = torch.ops.nanotron.flash_attention.default


def flash_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlashMask) -> torch.Tensor:
    """``attend`` (``nn/attention.py``: q [batch, heads, queries, d], k and v [batch, kv_heads, keys, d]) through
    FA4, where ``mask`` allows."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # FA4's layout: [batch, positions, heads, d]
    window = NO_WINDOW if mask.window is None else mask.window
    if mask.cu_seqlens is not None:
        batch, length = q.shape[:2]
        out, _ = flash_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), mask.cu_seqlens, length, window)
        return out.unflatten(0, (batch, length)).transpose(1, 2)
    outs, start = [], 0
    for first, length in mask.query_runs:  # the run's queries see keys 0 ... first + length - 1
        end = first + length
        outs.append(flash_attention(q[:, start:start + length], k[:, :end], v[:, :end], None, 0, window)[0])
        start += length
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)).transpose(1, 2)
