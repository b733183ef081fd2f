"""Mamba-1's selective scan, ``s_t = exp(Δ_t A) s_{t-1} + Δ_t B_t x_t`` and ``y_t = C_t · s_t + D x_t``.

``selective_scan_reference`` runs it one step at a time in fp32 (plain torch, every device): the definition, used on
CPUs, for generation with a carried state, and by the tests. On CUDA with Triton, ``selective_scan`` runs a chunked
parallel scan instead. Each program owns one sequence's block of channels and walks the sequence in chunks of
``BLOCK_T`` steps: inside a chunk the recurrence is a parallel associative scan over time of the pairs
(decay, input), whose combination ``(a1, b1), (a2, b2) -> (a1 a2, a2 b1 + b2)`` is the recurrence itself; the
state entering the chunk is folded into its first input, so no fix-up pass is needed. The per-step states
[length, channels, d_state] never reach memory: the forward saves only the state entering each chunk, and the
backward recomputes a chunk's states from it, then runs the adjoint recurrence ``g_t = exp(Δ_{t+1} A) g_{t+1} +
dy_t C_t`` step by step from each chunk's end, chunk by chunk from the sequence's end. Two identities keep the
backward to one pass per chunk: ``exp(Δ_t A) s_{t-1} = s_t - Δ_t B_t x_t`` (no division, no shifted tile), and the
gradients of B, C and A, sums over channels or time, are written per channel block (per sequence, for A) and summed
afterwards, so the result does not depend on the order programs finish in.

Δ's softplus and the mixer's gate stay outside the kernels, in the compiled graph, unlike the authors' CUDA scan:
inside, every [time, channel] operation runs on each of the four lanes that share a channel's states, and with
both fused (the ungated y saved in bf16 for the gate's gradient) the forward took 1.8x and the backward 1.5x as long
at the 130M shape, more than the elementwise passes they saved (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from nanotron.nn.kernels import available, tl, triton, triton_op, wrap_triton


def selective_scan(x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` (fp32) and the last state; the chunked scan on CUDA with Triton when no earlier state is carried
    (training, and the prompt in generation), the reference otherwise. Shapes as ``selective_scan_reference``; the
    chunked scan's ``C · s`` term is rounded to x's dtype (as the authors' CUDA scan does) before ``D x`` is added
    in fp32."""
    if available(x.device) and state is None:
        y, last = chunked_selective_scan(x, delta, A, B, C)
        return y + x * D.float(), last
    return selective_scan_reference(x, delta, A, B, C, D, state)


def selective_scan_reference(x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                             C: torch.Tensor, D: torch.Tensor,
                             state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan one step at a time in fp32.

    ``x``, ``delta`` [batch, length, channels]; ``A`` [channels, d_state]; ``B``, ``C`` [batch, length, d_state];
    ``D`` [channels]; ``state`` [batch, channels, d_state] continues an earlier call (None: zeros). Returns ``y``
    (fp32) and the last state.
    """
    x, delta, B, C = x.float(), delta.float(), B.float(), C.float()
    batch, length, channels = x.shape
    if state is None:
        state = x.new_zeros(batch, channels, A.shape[1])
    decay = torch.exp(delta.unsqueeze(-1) * A)  # [batch, length, channels, d_state]
    inputs = (delta * x).unsqueeze(-1) * B.unsqueeze(2)
    outputs = []
    # unbind, not indexing per step: the backward of each index would write a whole zero tensor (quadratic).
    for decay_t, input_t, C_t in zip(decay.unbind(1), inputs.unbind(1), C.unsqueeze(2).unbind(1)):
        state = decay_t * state + input_t
        outputs.append((state * C_t).sum(-1))
    y = torch.stack(outputs, dim=1) if outputs else x.new_zeros(batch, 0, channels)
    return y + x * D.float(), state


def chunked_selective_scan(x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan without the ``D x`` term, from a zero state, as the Triton kernels compute it (any device Triton
    runs on, its interpreter included): ``y`` [batch, length, channels] in x's dtype and the last state (fp32)."""
    y, _, last = scan_forward(x.contiguous(), delta.contiguous(), A.float().contiguous(), B.contiguous(),
                              C.contiguous())
    return y, last


# (chunk length, channels per program, warps), the chunk shared by both kernels since the forward saves the state
# entering each chunk: of the settings timed on an H200 at the 130M and 1.4B shapes, each kernel on its own, these
# were the fastest for both (docs/benchmarks.md). Tiles of [time, channel x state] on one layout ran 2.5-6x slower
# than these [time, channel, state] ones, and channel-major tiles [channel, time] scanned across lanes with a loop
# over the states ran 1-3x slower.
#
# The chunk loops' stages: above 1 the compiler prefetches the next chunks' loads (asynchronous copies) while a
# chunk computes. The forward ran 12-26% faster with 3. The backward's prefetch buffers take registers (245 against
# 168 on sm_90 as measured, 216 since the decays use exp2), so 8 or 9 one-warp programs fit on a multiprocessor
# instead of 12: prefetching pays only where the grid overflows one wave of 12 per multiprocessor anyway (13% faster
# at the 1.4B shape), and cost 40% where it fits (130M). BACKWARD_STAGES = None decides by the grid;
# scripts/benchmark_scan.py sweeps all five settings.
BLOCK_T, BLOCK_D, NUM_WARPS, FORWARD_STAGES = 8, 8, 1, 3
BACKWARD_STAGES: int | None = None
BACKWARD_PROGRAMS_PER_SM = 12  # resident one-warp backward programs per multiprocessor without prefetching


def backward_stages(programs: int, multiprocessors: int) -> int:
    """The backward's chunk-loop stages for a grid of ``programs`` on ``multiprocessors``: 2 where the programs
    overflow one wave without prefetching, else 1 (``BACKWARD_STAGES`` when set)."""
    if BACKWARD_STAGES is not None:
        return BACKWARD_STAGES
    return 1 if programs <= BACKWARD_PROGRAMS_PER_SM * multiprocessors else 2


if triton is not None:
    # Decays are exp2(Δ · A log2 e): tl.exp multiplies by log2 e on every element itself; with the product hoisted
    # out of the chunk loop, the backward's sm_90 code has 188 fewer multiplications per chunk (1392 instructions
    # instead of 1648, the same 168 registers).
    LOG2_E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def _combine(decay_a, state_a, decay_b, state_b):
        return decay_a * decay_b, decay_b * state_a + state_b

    # The helpers take no pointers, or return no offsets: torch.compile decides which tensors a kernel writes by
    # following each store's address back through the code, and an address computed by a call that also received
    # input pointers marks those inputs as written. The compiled backward then copied x, Δ, A, B and C before every
    # call (78 µs per layer at the 130M shape, 1.9 ms a step).
    @triton.jit
    def _chunk_offsets(seq, t, d, n, length, channels, d_state):
        """Offsets and masks of one chunk's [time, channel] and [time, state] tiles (masked past the ends)."""
        td = seq * length * channels + t[:, None] * channels + d[None, :]
        td_mask = (t[:, None] < length) & (d[None, :] < channels)
        tn = seq * length * d_state + t[:, None] * d_state + n[None, :]
        tn_mask = (t[:, None] < length) & (n[None, :] < d_state)
        return td, td_mask, tn, tn_mask

    @triton.jit
    def _load_chunk(x_ptr, delta_ptr, B_ptr, C_ptr, td, td_mask, tn, tn_mask):
        """One chunk's x, Δ [BLOCK_T, BLOCK_D] and B, C [BLOCK_T, BLOCK_N] in fp32 (zeros past the ends)."""
        x = tl.load(x_ptr + td, mask=td_mask, other=0.0).to(tl.float32)
        delta = tl.load(delta_ptr + td, mask=td_mask, other=0.0).to(tl.float32)
        B = tl.load(B_ptr + tn, mask=tn_mask, other=0.0).to(tl.float32)
        C = tl.load(C_ptr + tn, mask=tn_mask, other=0.0).to(tl.float32)
        return x, delta, B, C

    @triton.jit
    def _chunk_states(x, delta, B, A_log2, entering, first):
        """The states of every step of a chunk [BLOCK_T, BLOCK_D, BLOCK_N] and its inputs Δ B x; ``A_log2`` is
        A · log2(e), so that each decay is one multiplication and one ``exp2``."""
        decay = tl.exp2(delta[:, :, None] * A_log2)
        inputs = (delta * x)[:, :, None] * B[:, None, :]
        _, states = tl.associative_scan((decay, tl.where(first, inputs + decay * entering[None, :, :], inputs)),
                                        0, _combine)
        return states, inputs

    @triton.jit
    def _adjoints(decay_next, from_outputs, adjoint, steps, BLOCK_T: tl.constexpr):
        """The chunk's adjoints, ``g_t = decay_next_t g_{t+1} + from_outputs_t`` from its last step back, and the one
        at its first step (the next chunk back starts from it); ``adjoint`` [BLOCK_D, BLOCK_N] is g at the first step
        of the next chunk.

        An unrolled recurrence rather than a reversed ``tl.associative_scan``: a chunk's steps are in one thread's
        registers either way, but Triton 3.6 lowered the reversed scan with 460 lane shuffles per chunk (of 684 in
        the sm_90 code; the forward scan has none), and without them the backward ran 1.6x faster at the 130M shape
        (docs/benchmarks.md)."""
        g = tl.zeros_like(from_outputs)
        for i in tl.static_range(BLOCK_T - 1, -1, -1):
            row = steps[:, None, None] == i
            adjoint = (tl.sum(tl.where(row, decay_next, 0.0), axis=0) * adjoint
                       + tl.sum(tl.where(row, from_outputs, 0.0), axis=0))
            g = tl.where(row, adjoint[None, :, :], g)
        return g, adjoint

    @triton.jit
    def _channel_block(channels, d_state, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's channels and states: their indices, offsets and mask in [channels, d_state]."""
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        dn = d[:, None] * d_state + n[None, :]
        dn_mask = (d[:, None] < channels) & (n[None, :] < d_state)
        return d, n, dn, dn_mask

    @triton.jit
    def _load_A(A_ptr, dn, dn_mask):
        """A as a [1, BLOCK_D, BLOCK_N] tile.

        A is loaded in three dimensions on purpose: its vectorised load (four fp32 states per thread) becomes the
        register layout of every [time, channel, state] tile, so a sum over the states is four additions in the
        thread and two shuffles across lanes, where the default layout spread the 16 states over 16 lanes and spent
        four shuffles on each. Those sums (y, and the gradients of x and Δ) were the kernels' main cost: with this
        layout and the settings retuned for it, the backward ran 2.1x faster at the 130M shape and 1.5x at 1.4B
        (docs/benchmarks.md)."""
        return tl.load(A_ptr + dn[None, :, :], mask=dn_mask[None, :, :], other=0.0)

    @triton.jit
    def _forward_kernel(x_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, y_ptr, starts_ptr, last_ptr,
                        length, channels, d_state, num_chunks, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
        seq = tl.program_id(0).to(tl.int64)
        d, n, dn, dn_mask = _channel_block(channels, d_state, BLOCK_D, BLOCK_N)
        A = _load_A(A_ptr, dn, dn_mask)
        A_log2 = A * LOG2_E
        steps = tl.arange(0, BLOCK_T)
        first = steps[:, None, None] == 0
        state = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
        for chunk in tl.range(num_chunks, num_stages=NUM_STAGES):
            t = chunk * BLOCK_T + steps
            td, td_mask, tn, tn_mask = _chunk_offsets(seq, t, d, n, length, channels, d_state)
            x, delta, B, C = _load_chunk(x_ptr, delta_ptr, B_ptr, C_ptr, td, td_mask, tn, tn_mask)
            tl.store(starts_ptr + (seq * num_chunks + chunk) * channels * d_state + dn, state, mask=dn_mask)
            states, _ = _chunk_states(x, delta, B, A_log2, state, first)
            tl.store(y_ptr + td, tl.sum(states * C[:, None, :], axis=2).to(y_ptr.dtype.element_ty), mask=td_mask)
            # Steps past the end have decay 1 and input 0, so the chunk's last row is the state leaving it.
            state = tl.sum(tl.where(steps[:, None, None] == BLOCK_T - 1, states, 0.0), axis=0)
        tl.store(last_ptr + seq * channels * d_state + dn, state, mask=dn_mask)

    @triton.jit
    def _backward_kernel(x_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, starts_ptr, dy_ptr,
                         dx_ptr, ddelta_ptr, dA_ptr, dB_ptr, dC_ptr,
                         length, channels, d_state, num_chunks, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
        seq = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        d, n, dn, dn_mask = _channel_block(channels, d_state, BLOCK_D, BLOCK_N)
        A = _load_A(A_ptr, dn, dn_mask)
        A_log2 = A * LOG2_E
        steps = tl.arange(0, BLOCK_T)
        first = steps[:, None, None] == 0
        # Partial sums over this program's channels: [sequence, channel block, length, d_state].
        partial = (seq * tl.num_programs(1) + block) * length * d_state
        adjoint = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)  # g at the first step of the chunk after this one
        dA = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
        for i in tl.range(num_chunks, num_stages=NUM_STAGES):
            chunk = num_chunks - 1 - i
            t = chunk * BLOCK_T + steps
            td, td_mask, tn, tn_mask = _chunk_offsets(seq, t, d, n, length, channels, d_state)
            x, delta, B, C = _load_chunk(x_ptr, delta_ptr, B_ptr, C_ptr, td, td_mask, tn, tn_mask)
            entering = tl.load(starts_ptr + (seq * num_chunks + chunk) * channels * d_state + dn, mask=dn_mask,
                               other=0.0)
            states, inputs = _chunk_states(x, delta, B, A_log2, entering, first)
            dy = tl.load(dy_ptr + td, mask=td_mask, other=0.0).to(tl.float32)
            next_mask = ((t[:, None] + 1) < length) & (d[None, :] < channels)
            delta_next = tl.load(delta_ptr + td + channels, mask=next_mask, other=0.0).to(tl.float32)
            decay_next = tl.exp2(delta_next[:, :, None] * A_log2)
            from_outputs = dy[:, :, None] * C[:, None, :]
            g, adjoint = _adjoints(decay_next, from_outputs, adjoint, steps, BLOCK_T)
            decayed = states - inputs  # exp(Δ_t A) s_{t-1}
            g_B = tl.sum(g * B[:, None, :], axis=2)
            g_decayed = g * decayed
            tl.store(dx_ptr + td, (delta * g_B).to(dx_ptr.dtype.element_ty), mask=td_mask)
            tl.store(ddelta_ptr + td, (x * g_B + tl.sum(g_decayed * A, axis=2)).to(
                ddelta_ptr.dtype.element_ty), mask=td_mask)
            dA += tl.sum(g_decayed * delta[:, :, None], axis=0)
            tl.store(dB_ptr + partial + t[:, None] * d_state + n[None, :],
                     tl.sum(g * (delta * x)[:, :, None], axis=1), mask=tn_mask)
            tl.store(dC_ptr + partial + t[:, None] * d_state + n[None, :],
                     tl.sum(states * dy[:, :, None], axis=1), mask=tn_mask)
        tl.store(dA_ptr + seq * channels * d_state + dn, dA, mask=dn_mask)

    def _grid(x: torch.Tensor) -> tuple[int, int]:
        return x.shape[0], triton.cdiv(x.shape[2], BLOCK_D)

    @triton_op("nanotron::selective_scan_forward", mutates_args={})
    def scan_forward(x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``y`` in x's dtype, the state entering every chunk (saved for the backward) and the last state, both
        fp32."""
        batch, length, channels = x.shape
        d_state = A.shape[1]
        num_chunks = triton.cdiv(length, BLOCK_T)
        y = torch.empty_like(x)
        starts = torch.empty(batch, num_chunks, channels, d_state, device=x.device, dtype=torch.float32)
        last = torch.empty(batch, channels, d_state, device=x.device, dtype=torch.float32)
        wrap_triton(_forward_kernel)[_grid(x)](
            x, delta, A, B, C, y, starts, last, length, channels, d_state, num_chunks, BLOCK_T=BLOCK_T,
            BLOCK_D=BLOCK_D, BLOCK_N=triton.next_power_of_2(d_state), NUM_STAGES=FORWARD_STAGES, num_warps=NUM_WARPS)
        return y, starts, last

    @triton_op("nanotron::selective_scan_backward", mutates_args={})
    def scan_backward(x: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      starts: torch.Tensor, dy: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of x, Δ, A, B and C, each in its input's dtype (A's in fp32)."""
        batch, length, channels = x.shape
        d_state = A.shape[1]
        grid = _grid(x)
        dx, ddelta = torch.empty_like(x), torch.empty_like(delta)
        dA = torch.empty(batch, channels, d_state, device=x.device, dtype=torch.float32)
        dB = torch.empty(batch, grid[1], length, d_state, device=x.device, dtype=torch.float32)
        dC = torch.empty_like(dB)
        stages = 1  # Triton's interpreter on a CPU ignores it
        if x.is_cuda:
            multiprocessors = torch.cuda.get_device_properties(x.device).multi_processor_count
            stages = backward_stages(grid[0] * grid[1], multiprocessors)
        wrap_triton(_backward_kernel)[grid](
            x, delta, A, B, C, starts, dy, dx, ddelta, dA, dB, dC, length, channels, d_state, starts.shape[1],
            BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, BLOCK_N=triton.next_power_of_2(d_state), NUM_STAGES=stages,
            num_warps=NUM_WARPS)
        return dx, ddelta, dA.sum(0), dB.sum(1).to(B.dtype), dC.sum(1).to(C.dtype)

    def _save_for_backward(ctx, inputs, output):
        x, delta, A, B, C = inputs
        _, starts, last = output
        ctx.save_for_backward(x, delta, A, B, C, starts)
        ctx.mark_non_differentiable(starts, last)

    def _scan_gradients(ctx, dy, _dstarts, _dlast):
        x, delta, A, B, C, starts = ctx.saved_tensors
        return scan_backward(x, delta, A, B, C, starts, dy.contiguous())

    # The backward is the op's own autograd formula rather than an autograd.Function around it, so that under
    # torch.compile with recomputed layers the forward kernel is recomputed in the backward like any other op (an
    # autograd.Function's saved tensors were kept: 64% of a block's activations).
    scan_forward.register_autograd(_scan_gradients, setup_context=_save_for_backward)
