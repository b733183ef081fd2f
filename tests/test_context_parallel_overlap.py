"""Context parallelism's key/value exchange overlapped with attention: one collective per group of kv heads, launched
before the attention that waits for it, in forward and backward, with the same outputs and gradients as the
exchange of every head in one collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from nanotron.data.batch import MicroBatch
from nanotron.nn.attention import attend
from nanotron.nn.recompute import keep_attention_context
from nanotron.parallel import context_parallel
from nanotron.parallel.context_parallel import (
    ContextParallelBatches,
    gather_sequence_chunks,
    head_groups,
    overlapped_attention,
    token_indices,
)
from support.distributed import run_distributed

SEQUENCE, WINDOW = 16, 3
DOCUMENTS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * SEQUENCE])


def test_kv_heads_are_cut_into_at_most_four_groups_of_near_equal_sizes():
    assert head_groups(1) == [1]
    assert head_groups(2) == [1, 1]
    assert head_groups(6) == [2, 2, 1, 1]
    assert head_groups(8) == [2, 2, 2, 2]


def _rank_inputs(group: dist.ProcessGroup, q_heads: int, kv_heads: int):
    """This cp rank's tokens of queries, keys and values drawn for the whole sequence (the same on every rank), the
    gradient of the attention output, and the mask of a sliding layer over two samples packing documents."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, SEQUENCE, 8, generator=generator) for heads in (q_heads, kv_heads, kv_heads))
    rows = token_indices(rank, size, SEQUENCE)
    q, k, v = (x.index_select(2, rows) for x in (q, k, v))
    grad = torch.randn(q.shape, generator=generator)
    zeros = torch.zeros(2, SEQUENCE, dtype=torch.long)
    transform = ContextParallelBatches(rank, size)
    part = transform.prepare(MicroBatch(zeros, zeros, zeros == 0, torch.tensor([0, 0]), document_ids=DOCUMENTS))
    mask = transform.model_inputs(part)["masks"].for_window(WINDOW)
    return (q, k, v), grad, mask


def _output_and_gradients(attention, inputs, grad) -> list[torch.Tensor]:
    leaves = [x.clone().requires_grad_() for x in inputs]
    out = attention(*leaves)
    out.backward(grad)
    return [out.detach()] + [leaf.grad for leaf in leaves]


def _every_form() -> dict[str, list[torch.Tensor]]:
    from nanotron.layout import Group, Layout
    from nanotron.parallel.context import ParallelContext

    group = ParallelContext(Layout(cp=2)).group(Group.CP)
    inputs, grad, mask = _rank_inputs(group, q_heads=4, kv_heads=2)

    def one_collective(q, k, v):
        return attend(q, *gather_sequence_chunks(torch.cat([k, v]), group).chunk(2), mask)

    def overlapped(q, k, v):
        return overlapped_attention(q, k, v, mask, group)

    def recomputed(q, k, v, **policy):
        return checkpoint(overlapped, q, k, v, use_reentrant=False, **policy)

    return {"one collective": _output_and_gradients(one_collective, inputs, grad),
            "overlapped": _output_and_gradients(overlapped, inputs, grad),
            "recomputed": _output_and_gradients(recomputed, inputs, grad),
            "selectively recomputed": _output_and_gradients(
                lambda q, k, v: recomputed(q, k, v, context_fn=keep_attention_context), inputs, grad)}


@pytest.fixture(scope="module")
def every_form() -> list[dict[str, list[torch.Tensor]]]:
    return run_distributed(_every_form, 2)


@pytest.mark.parametrize("form", ["overlapped", "recomputed", "selectively recomputed"])
@pytest.mark.slow
def test_overlapped_attention_equals_the_one_collective_exchange(every_form, form):
    """4 query heads over 2 kv heads (two groups), a window and documents, at cp 2: the output and the gradients of
    the queries, keys and values on every rank, also when the layer's activations are recomputed in backward."""
    for rank, results in enumerate(every_form):
        for name, got, want in zip(("output", "dq", "dk", "dv"), results[form], results["one collective"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"rank {rank}: {name}")


def _recorded_order() -> tuple[list[str], list[str]]:
    """The collectives, waits, attentions and attention gradients of one forward and one backward, in the order a
    rank issues them (6 kv heads: four groups)."""
    from nanotron.layout import Group, Layout
    from nanotron.parallel.context import ParallelContext

    group = ParallelContext(Layout(cp=2)).group(Group.CP)
    inputs, grad, mask = _rank_inputs(group, q_heads=12, kv_heads=6)
    events: list[str] = []

    class RecordedWork:
        def __init__(self, name: str, work: dist.Work):
            self.name, self.work = name, work

        def wait(self):
            events.append(f"wait {self.name}")
            return self.work.wait()

    def recorded_collective(kind: str, collective):
        def issue(*args, async_op: bool = False, **kwargs):
            name = f"{kind} {sum(event.startswith(kind) for event in events)}"
            events.append(name if async_op else f"{name} (blocking)")
            work = collective(*args, async_op=async_op, **kwargs)
            return RecordedWork(name, work) if async_op else work
        return issue

    def recorded_attend(q, k, v, mask):
        """``attend``, recording its call and when its keys' and values' gradients (what the group's reduce-scatter
        sends; the queries' stay on the rank) are computed."""
        events.append("attend")
        pending = {"k", "v"}

        def gradient_of(name: str):
            def hook(grad):
                pending.discard(name)
                if not pending:
                    events.append("attention gradients")
            return hook

        for name, x in zip("kv", (k, v)):
            x.register_hook(gradient_of(name))
        return attend(q, k, v, mask)

    originals = dist.all_gather_into_tensor, dist.reduce_scatter_tensor, context_parallel.attend
    dist.all_gather_into_tensor = recorded_collective("gather", dist.all_gather_into_tensor)
    dist.reduce_scatter_tensor = recorded_collective("reduce-scatter", dist.reduce_scatter_tensor)
    context_parallel.attend = recorded_attend
    try:
        q, k, v = (x.requires_grad_() for x in inputs)
        out = overlapped_attention(q, k, v, mask, group)
        forward = events.copy()
        out.backward(grad)
    finally:
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor, context_parallel.attend = originals
    return forward, events[len(forward):]


def test_each_exchange_is_launched_before_the_attention_that_overlaps_it():
    """Forward launches the four groups' gathers before any attention and waits for each just before its group's
    attention; backward launches a group's reduce-scatter before the next group's gradients, and waits at the end."""
    for forward, backward in run_distributed(_recorded_order, 2):
        assert forward == ["gather 0", "gather 1", "gather 2", "gather 3",
                           "wait gather 0", "attend", "wait gather 1", "attend",
                           "wait gather 2", "attend", "wait gather 3", "attend"]
        assert backward == ["attention gradients", "reduce-scatter 0", "attention gradients", "reduce-scatter 1",
                            "attention gradients", "reduce-scatter 2", "attention gradients", "reduce-scatter 3",
                            "wait reduce-scatter 0", "wait reduce-scatter 1", "wait reduce-scatter 2",
                            "wait reduce-scatter 3"]
