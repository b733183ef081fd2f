"""A chunk's backward split into the input's gradient (I) and the weights' (W), as zero-bubble schedules run it
(``parallel/split_backward.py``): which weights wait for W, and that the two halves give the whole backward's
gradients, for plain, tensor-parallel and FP8 linears; what cannot split runs whole in I; the executor runs W later."""

from __future__ import annotations

import pytest
import torch

from nanotron.parallel.split_backward import backward_input
from support.distributed import run_distributed
from support.small_llama import SEQ, SMALL, ids_for, small_llama


def _middle_chunk_backward(model, ids: torch.Tensor, split: bool) -> tuple[torch.Tensor, dict, list[str], int]:
    """The model as an inner chunk (hidden states in, from the embedding), a loss on its output, backward whole or
    split. Returns the input's gradient, the weights' gradients, the order in which weights got them (``|W|`` where
    W starts) and how many weights waited for W."""
    model.zero_grad(set_to_none=True)
    names = {id(p): name for name, p in model.named_parameters()}
    hidden = model.embed_tokens(ids).detach().requires_grad_()
    embedding, model.embed_tokens = model.embed_tokens, None
    events: list[str] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: events.append(names[id(p)])) for p in model.parameters()]
    try:
        loss = model(input_ids=ids, hidden_states=hidden).float().logsumexp(-1).mean()
        if split:
            deferred = backward_input([loss], [None], hidden, list(model.parameters()))
            events.append("|W|")
            deferred.run()
        else:
            loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.embed_tokens = embedding
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    waited = len(events) - events.index("|W|") - 1 if split else 0
    return hidden.grad, grads, events, waited


def _assert_split_equals_whole(model, ids: torch.Tensor) -> list[str]:
    whole_input, whole, _, _ = _middle_chunk_backward(model, ids, split=False)
    split_input, split, events, _ = _middle_chunk_backward(model, ids, split=True)
    assert torch.equal(split_input, whole_input)
    assert split.keys() == whole.keys() and all(torch.equal(split[name], whole[name]) for name in whole), [
        name for name in whole if not torch.equal(split[name], whole[name])]
    return events


def test_every_weight_of_a_llama_chunk_waits_for_w_and_the_halves_give_the_whole_backward():
    events = _assert_split_equals_whole(small_llama(), ids_for(SMALL))
    assert events[0] == "|W|"  # I computed the input's gradient alone
    linears = {"attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}
    assert {f"layers.{i}.{linear}.weight" for i in range(2) for linear in linears} <= set(events[1:])
    assert "lm_head.weight" in events and "norm.weight" in events


def test_fp8_linears_compute_each_half_once():
    """FP8's linear computes only the products asked for: the same gradients, and each cast counted once."""
    from nanotron.config import FP8Args
    from nanotron.nn.fp8 import FP8RangeCounts, fp8_converter

    model = small_llama()
    fp8_converter(FP8Args(enabled=True, log_out_of_range=True))(model)
    counts = [module for module in model.modules() if isinstance(module, FP8RangeCounts)]
    assert counts
    _middle_chunk_backward(model, ids_for(SMALL), split=False)
    whole_counts = [c.counts.clone() for c in counts]
    for c in counts:
        c.counts.zero_()
    events = _assert_split_equals_whole(model, ids_for(SMALL))
    assert "layers.0.attn.qkv_proj.weight" in events[events.index("|W|"):]
    # the whole backward's counts, once over (the split call ran both backwards again: halve them)
    for c, whole in zip(counts, whole_counts, strict=True):
        assert torch.equal(c.counts - whole, whole)


@pytest.mark.parametrize("grouped", [True, False])
def test_grouped_experts_defer_their_weights_and_an_expert_loop_runs_them_in_the_input_half(grouped):
    """The experts' grouped GEMM takes every expert's weight in one product: it waits for W. The loop over experts
    (no grouped GEMM) reaches each weight through one product per expert: its gradient comes in I. Either way the
    halves give the whole backward's gradients."""
    from nanotron.config import LlaMoEConfig
    from nanotron.models.moe.model import GroupedExperts, LlaMoEForCausalLM

    torch.manual_seed(0)
    config = LlaMoEConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          moe_num_experts=4, num_experts_per_tok=2)
    model = LlaMoEForCausalLM(config, 64)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    for experts in model.modules():
        if isinstance(experts, GroupedExperts):
            experts.grouped_mm = grouped
    events = _assert_split_equals_whole(model, ids_for(config))
    later = events[events.index("|W|") + 1:]
    experts = {f"layers.0.mlp.experts.{name}" for name in ("gate_up_proj", "down_proj")}
    assert (experts <= set(later)) == grouped and (experts.isdisjoint(later)) != grouped
    assert "layers.0.attn.qkv_proj.weight" in later


class _WholeGradients(torch.autograd.Function):
    """``x * w`` computing both gradients at once, as a compiled layer's graph or a kernel's op does."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


def test_what_cannot_split_runs_whole_in_the_input_half():
    """A weight a custom function takes whole (a compiled layer, a Triton kernel's op: Mamba's scan on GPUs), or
    one used by several products (Mamba's causal convolution on the CPU, shifted multiply-adds), gets its gradient
    in I; the linears around them wait for W."""
    from nanotron.config import MambaConfig
    from nanotron.models.mamba.model import MambaForCausalLM

    torch.manual_seed(0)
    config = MambaConfig(d_model=32, num_hidden_layers=1, vocab_size=64, tie_word_embeddings=False)
    model = MambaForCausalLM(config, 64)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    events = _assert_split_equals_whole(model, ids)
    now, later = events[:events.index("|W|")], events[events.index("|W|") + 1:]
    assert now == ["layers.0.mixer.conv1d.weight"]
    assert "layers.0.mixer.in_proj.weight" in later and "layers.0.mixer.out_proj.weight" in later

    x, w, v = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True), torch.randn(4, 4)
    v.requires_grad_()
    deferred = backward_input([(_WholeGradients.apply(x, w) @ v).sum()], [None], x, [w, v])
    assert w.grad is not None and v.grad is None  # w in I, v (a matmul's) waits
    deferred.run()
    assert v.grad is not None


def _tensor_parallel_split(mode: str) -> dict:
    from nanotron.layout import Layout
    from nanotron.models.build import BuildOptions, build_model
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(tp=2, sequence_parallel=mode == "REDUCE_SCATTER"))
    model = build_model(SMALL, pc, BuildOptions(dtype=torch.float32, seed=3, tp_mode=mode, sequence_length=SEQ))
    ids = ids_for(SMALL)
    whole_input, whole, _, _ = _middle_chunk_backward(model, ids, split=False)
    split_input, split, events, _ = _middle_chunk_backward(model, ids, split=True)
    return {"equal": torch.equal(split_input, whole_input) and all(torch.equal(split[n], whole[n]) for n in whole),
            "later": events[events.index("|W|") + 1:]}


@pytest.mark.parametrize("mode", ["ALL_REDUCE", "REDUCE_SCATTER"])
def test_tensor_parallel_linears_defer_their_weights(mode):
    for result in run_distributed(_tensor_parallel_split, 2, mode=mode):
        assert result["equal"]
        for linear in ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):  # column and row
            assert f"layers.0.{linear}.weight" in result["later"], mode


def _zero_bubble_pipeline(pp: int, engine: str) -> dict:
    """x + x W0 on chunk 0, then (· W1)² on chunk 1, over 4 micro-batches; the actions run and when each weight got
    its gradient."""
    from nanotron.layout import Axis, Layout
    from nanotron.parallel import pipeline_parallel
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.pipeline_parallel import P2P, Chunk, PipelineSchedule, StageOutput

    pc = ParallelContext(Layout(pp=pp, pp_engine=engine))
    generator = torch.Generator().manual_seed(0)
    w0, w1 = (torch.randn(8, 8, generator=generator).requires_grad_() for _ in range(2))
    micro_batches = [{"x": torch.randn(2, 4, 8, generator=generator)} for _ in range(4)]
    log: list[str] = []
    for name, weight in (("w0", w0), ("w1", w1)):
        weight.register_post_accumulate_grad_hook(lambda _, name=name: log.append(f"grad {name}"))

    def first(micro_batch, hidden):
        return StageOutput(micro_batch["x"] + micro_batch["x"] @ w0)

    def second(micro_batch, hidden):
        if hidden is None:
            hidden = first(micro_batch, None).output
        loss = (hidden @ w1).square().mean()
        return StageOutput(None, {"loss": loss}, (loss,))

    chunk = {(1, 0): Chunk(second, [w0, w1]), (2, 0): Chunk(first, [w0]), (2, 1): Chunk(second, [w1])}
    chunks = [chunk[pp, pc.coord(Axis.PP)]]
    act = pipeline_parallel._StepRun.act
    pipeline_parallel._StepRun.act = lambda run, *args: (log.append(str(args[0])), act(run, *args))
    try:
        PipelineSchedule(pc, P2P(pc, (2, 4, 8), torch.float32, 60.0), chunks, lambda: None).run(micro_batches, 1)
    finally:
        pipeline_parallel._StepRun.act = act
    return {"w0": w0.grad, "w1": w1.grad, "log": log}


def test_the_executor_runs_weight_gradients_in_w_slots_and_matches_one_process():
    """ZB-H1 at pp 2: the last stage's weight gradient of each micro-batch arrives in its W action, one backward
    after its I (stage 1 defers one); the first stage's chunk has no input to differentiate, so it gets its weight
    gradient in I. The gradients are one process's."""
    (single,) = run_distributed(_zero_bubble_pipeline, 1, pp=1, engine="1f1b")
    first, last = run_distributed(_zero_bubble_pipeline, 2, pp=2, engine="zb_h1")
    torch.testing.assert_close(first["w0"], single["w0"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(last["w1"], single["w1"], rtol=1e-6, atol=1e-7)
    assert last["log"][:6] == ["1F0", "1I0", "1F1", "1I1", "1W0", "grad w1"]
    assert all(after == "grad w1" for before, after in zip(last["log"], last["log"][1:]) if before.startswith("1W"))
    assert not any(before.startswith("1I") and after == "grad w1"
                   for before, after in zip(last["log"], last["log"][1:]))
    assert [entry for entry in first["log"] if "0I" in entry or entry == "grad w0"][:2] == ["0I0", "grad w0"]
