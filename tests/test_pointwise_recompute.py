"""Pointwise activation recomputation (`parallelism.recompute: pointwise`): a recomputed layer keeps its
input and the outputs of its matmuls and attention op, so its backward reruns only elementwise ops; the same losses
and gradients as without recomputation (one process, and tensor parallelism), eager and compiled; the key in the
config, the memory planner and the hardware FLOPs."""

from __future__ import annotations

import collections
import copy
import dataclasses
import gc
import weakref

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from nanotron.config import LlaMoEConfig, config_from_dict, load_config
from nanotron.memory import estimate_memory
from nanotron.models.build import padded_vocab_size
from nanotron.models.llama.costs import llama_costs, llama_layer_activations
from nanotron.models.moe.costs import moe_layer_activations
from nanotron.models.moe.model import LlaMoEForCausalLM
from nanotron.models.spec import ActivationShape
from nanotron.nn.recompute import MATMUL_OPS, keep_matmul_and_attention_context, recompute_in_backward
from support import ROOT
from support.configs import recompute_config
from support.distributed import run_distributed_each
from support.runs import train_with_flops
from support.small_llama import (
    BATCH,
    SEQ,
    SMALL,
    AttentionCalls,
    assert_same_gradients,
    ids_for,
    loss_and_gradients,
    recomputed,
    small_llama,
)

TINY = ROOT / "examples" / "config_tiny_llama.yaml"
POINTWISE = ["parallelism.recompute=pointwise"]
ONE_LAYER = dataclasses.replace(SMALL, num_hidden_layers=1)
LINEARS_PER_LAYER = 4  # q|k|v, o_proj, gate|up, down_proj


class OpOutputs(TorchDispatchMode):
    """Holds a weak reference to every tensor the ops it sees return, and counts the matmuls among them."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[weakref.ref] = []
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.matmuls += func in MATMUL_OPS
        self.outputs += [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def pointwise_layer_bytes(config, compiled: bool) -> int:
    """What a pointwise-recomputed layer keeps in fp32, written out: its input, the q|k|v, o_proj and gate|up
    outputs, the attention output and its fp32 log-sum-exp (4 bytes per head), and eagerly down_proj's output too."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_token = config.hidden_size + (q + 2 * kv) + config.hidden_size + 2 * config.intermediate_size
    per_token += q + config.num_attention_heads + (0 if compiled else config.hidden_size)
    return BATCH * SEQ * 4 * per_token


def planner_layer_bytes(config, compiled: bool) -> int:
    shape = ActivationShape(tokens=BATCH * SEQ, sequence_length=SEQ, tp=1, value_bytes=4, residual_share=1.0,
                            linear_input_share=1.0, compiled=compiled, recompute="pointwise")
    return llama_layer_activations(config, 0, shape)[0]


def layer_inputs(model) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], set[int]]:
    """A layer's input and rotary tables, and the storages that are not activations (parameters, tables)."""
    hidden = torch.randn(BATCH, SEQ, model.config.hidden_size, requires_grad=True)
    rotary = model.rotary.first_positions(SEQ, hidden.device)
    not_activations = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return hidden, rotary, not_activations | {table.untyped_storage().data_ptr() for table in rotary}


def eager_layer_keeps(layer, hidden, rotary, not_activations: set[int]) -> tuple[int, int, int]:
    """(bytes kept for the backward, matmuls of the forward, matmuls of the backward) of one eager layer.

    Kept: the storages autograd saves (its saved-tensor hooks see a checkpoint's inputs, or everything without one)
    together with those the forward made that outlive it, the output aside: what a checkpoint caches for the
    backward (the outputs its policy keeps) never passes those hooks."""
    saved = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), OpOutputs() as forward:
        out = layer(hidden, rotary)
    gc.collect()
    for tensor in (ref() for ref in forward.outputs):
        if tensor is not None:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    for storage in not_activations | {out.untyped_storage().data_ptr()}:
        saved.pop(storage, None)
    with OpOutputs() as backward:
        out.sum().backward()
    return sum(saved.values()), forward.matmuls, backward.matmuls


def test_eager_pointwise_recompute_keeps_input_matmul_and_attention_outputs_and_reruns_no_matmul():
    model, ids = small_llama(), ids_for(SMALL)
    reference_loss, reference = loss_and_gradients(model, ids)
    candidate = recomputed(model, "pointwise")
    with AttentionCalls() as calls:
        loss, gradients = loss_and_gradients(candidate, ids)
    assert torch.equal(loss, reference_loss)
    assert_same_gradients(gradients, reference, atol=1e-7)
    assert calls.count == SMALL.num_hidden_layers  # the attention output is kept, not recomputed

    one_layer = small_llama(ONE_LAYER)
    hidden, rotary, not_activations = layer_inputs(one_layer)
    measured = {granularity: eager_layer_keeps(recomputed(one_layer, granularity).layers["0"], hidden, rotary,
                                               not_activations)
                for granularity in (None, "full", "pointwise")}
    kept, forward_matmuls, backward_matmuls = measured["pointwise"]
    assert kept == planner_layer_bytes(ONE_LAYER, compiled=False) == pointwise_layer_bytes(ONE_LAYER, compiled=False)
    assert kept < measured[None][0]
    assert forward_matmuls == LINEARS_PER_LAYER
    # The backward's own products only (two per linear), as without recomputation; full recomputation reruns the
    # forward's.
    assert backward_matmuls == measured[None][2] == 2 * LINEARS_PER_LAYER < measured["full"][2]


def test_eager_pointwise_moe_layer_keeps_what_the_planner_counts():
    """A mixture-of-experts layer keeps the router's logits and every expert's products, whatever the routing."""
    config = LlaMoEConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, moe_num_experts=4,
                          num_experts_per_tok=2)
    torch.manual_seed(0)
    model = LlaMoEForCausalLM(config, config.vocab_size)
    hidden, rotary, not_activations = layer_inputs(model)
    plain, _, _ = eager_layer_keeps(copy.deepcopy(model).layers["0"], hidden, rotary, not_activations)
    layer = recompute_in_backward(copy.deepcopy(model).layers["0"], "pointwise")
    kept, _, _ = eager_layer_keeps(layer, hidden, rotary, not_activations)
    shape = ActivationShape(tokens=BATCH * SEQ, sequence_length=SEQ, tp=1, value_bytes=4, residual_share=1.0,
                            linear_input_share=1.0, compiled=False, recompute="pointwise")
    counted, _ = moe_layer_activations(config, 0, shape)
    assert 0 <= kept - counted < 64  # the block's record of the step's routing (a few scalars) is not an activation
    assert kept < plain


PROBE_RUNS = collections.Counter()


@torch.library.custom_op("nanotron::pointwise_recompute_probe", mutates_args=())
def _probe(x: torch.Tensor) -> torch.Tensor:
    """sin, as an op in nanotron's namespace like its Triton ops (which are registered only where they can run),
    counting its runs."""
    PROBE_RUNS["runs"] += 1
    return x.sin()


_probe.register_autograd(lambda ctx, grad: grad * ctx.saved_tensors[0].cos(),
                         setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


def test_pointwise_recompute_keeps_the_outputs_of_nanotrons_own_ops():
    """A Mamba block's scan and convolution are nanotron's Triton ops: kept, so that the backward does not rerun
    them."""
    x = torch.randn(8, requires_grad=True)

    def squared_probe(x: torch.Tensor) -> torch.Tensor:
        return _probe(x * 2) ** 2  # the square's backward reads the op's output

    runs = {}
    for name, policy in (("full", {}), ("pointwise", {"context_fn": keep_matmul_and_attention_context})):
        PROBE_RUNS.clear()
        out = checkpoint(squared_probe, x, use_reentrant=False, **policy)
        (gradient,) = torch.autograd.grad(out.sum(), x)
        runs[name] = PROBE_RUNS["runs"]
        torch.testing.assert_close(gradient, 2 * torch.sin(4 * x), rtol=1e-6, atol=1e-6)  # d/dx sin²(2x)
    assert runs == {"full": 2, "pointwise": 1}


@pytest.mark.slow  # compiling takes most of it; the eager test covers the policy in the quick tier
def test_compiled_pointwise_recompute_matches_and_keeps_what_the_planner_counts():
    """torch.compile traces the pointwise policy: the compiled layer saves its input, the matmuls' outputs that the
    backward reads (not down_proj's: the compiler drops it) and the attention outputs, and its backward runs no
    forward matmul again."""
    model, ids = small_llama(ONE_LAYER), ids_for(ONE_LAYER)
    reference_loss, reference = loss_and_gradients(model, ids)
    compiled = recomputed(model, "pointwise", compiled=True)
    loss, gradients = loss_and_gradients(compiled, ids)  # compiles
    torch.testing.assert_close(loss, reference_loss, rtol=0, atol=1e-6)
    assert_same_gradients(gradients, reference, atol=1e-6)

    hidden, rotary, not_activations = layer_inputs(compiled)
    saved = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in not_activations:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = compiled.layers["0"](hidden, rotary)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out.sum().backward()
    assert sum(saved.values()) == planner_layer_bytes(ONE_LAYER, True) == pointwise_layer_bytes(ONE_LAYER, True)
    assert collections.Counter(event.name for event in prof.events())["aten::mm"] == 2 * LINEARS_PER_LAYER


@pytest.fixture(scope="module")
def single_process_runs(tiny_data, tmp_path_factory) -> dict[str, dict]:
    """Training without recomputation and with pointwise recomputation, on one process."""
    root = tmp_path_factory.mktemp("pointwise")
    configs = {"plain": recompute_config(tiny_data, root / "plain", "none"),
               "pointwise": recompute_config(tiny_data, root / "pointwise", "pointwise")}
    results = run_distributed_each(train_with_flops, 1, [{"config": config} for config in configs.values()])
    return {name: {"config": config, **result} for (name, config), (result,) in zip(configs.items(), results)}


def assert_same_training(reference: list[dict], metrics: list[dict], **tolerance: float) -> None:
    for expected, got in zip(reference, metrics, strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], **tolerance), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], **tolerance), got["step"]


@pytest.mark.slow
def test_pointwise_training_matches_and_adds_no_hardware_flops(single_process_runs):
    reference, got = single_process_runs["plain"], single_process_runs["pointwise"]
    metrics = reference["metrics"]
    assert metrics[-1]["lm_loss"] < metrics[0]["lm_loss"] - 0.3 and all(m["grad_norm"] > 0 for m in metrics)
    assert_same_training(metrics, got["metrics"], rel=0, abs=1e-6)
    config = config_from_dict(got["config"])
    model = config.model.model_config
    vocab = padded_vocab_size(model.vocab_size, config.model.make_vocab_size_divisible_by, 1)
    costs = llama_costs(model, vocab, config.tokens.sequence_length)
    assert got["hardware_flops"] == got["model_flops"] == reference["hardware_flops"] == costs.flops_per_token
    assert costs.hardware_flops_per_token("pointwise") == costs.flops_per_token
    assert costs.masked_flops_per_token(1000, 1e9, "pointwise") == costs.masked_flops_per_token(1000, 1e9)


@pytest.mark.slow
def test_pointwise_recompute_with_tensor_parallelism_all_reduce(single_process_runs, tiny_data, tmp_path):
    """The row-parallel linears' outputs are kept and all-reduced in the forward: summed in place, the recomputed
    forward would have summed them again."""
    config = recompute_config(tiny_data, tmp_path, "pointwise", tp=2, tp_mode="ALL_REDUCE")
    (runs,) = run_distributed_each(train_with_flops, 2, [{"config": config}])
    (metrics,) = [run["metrics"] for run in runs if run["metrics"]]
    assert_same_training(single_process_runs["plain"]["metrics"], metrics, rel=1e-5)


@pytest.mark.slow
def test_pointwise_recompute_with_sequence_and_pipeline_parallelism(single_process_runs, tiny_data, tmp_path):
    """The sequence-parallel collectives, the overlapped column-parallel backward and 1F1B's late backwards."""
    config = recompute_config(tiny_data, tmp_path, "pointwise", tp=2, pp=2, tp_mode="REDUCE_SCATTER",
                              tp_linear_async_communication=True)
    (runs,) = run_distributed_each(train_with_flops, 4, [{"config": config}])
    (metrics,) = [run["metrics"] for run in runs if run["metrics"]]
    assert_same_training(single_process_runs["plain"]["metrics"], metrics, rel=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_memory_planner_counts_what_a_pointwise_layer_keeps(compiled):
    overrides = ["model.loss_chunk_tokens=0", f"model.compile={compiled}"]
    plain = load_config(TINY, overrides)
    selective = load_config(TINY, overrides + ["parallelism.recompute=selective"])
    pointwise = load_config(TINY, overrides + POINTWISE)
    c, t = pointwise.model.model_config, pointwise.tokens
    tokens, d = t.micro_batch_size * t.sequence_length, 4  # fp32
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    kept_too_without = tokens * (d * (q + 2 * kv) + d * q + 4 * c.num_attention_heads + 2 * d * c.intermediate_size)
    own = tokens * d * (2 * c.hidden_size + (0 if compiled else c.hidden_size))  # input, o_proj's, eagerly down's
    shape = dict(tokens=tokens, sequence_length=t.sequence_length, tp=1, value_bytes=d, residual_share=1.0,
                 linear_input_share=1.0, compiled=compiled)
    full, transient = llama_layer_activations(c, 0, ActivationShape(**shape, recompute="none"))
    assert llama_layer_activations(c, 0, ActivationShape(**shape, recompute="pointwise")) == (
        kept_too_without + own, full + transient - kept_too_without)
    stages = {name: estimate_memory(cfg, gpu_memory_gb=80).stages[0].activations
              for name, cfg in (("plain", plain), ("selective", selective), ("pointwise", pointwise))}
    assert stages["selective"] < stages["pointwise"] < stages["plain"]
    assert "recomputed layers (pointwise)" in estimate_memory(pointwise, gpu_memory_gb=80).description


def test_compiled_recomputed_moe_layer_is_one_graph_with_the_router_losses():
    """A mixture-of-experts block records its router's auxiliary terms on itself. In a checkpointed region
    torch.compile refused that side effect and left the whole layer eager (under half the speed on the GPU), so the
    compiled layer must trace as one graph, and its loss with the auxiliary terms must backpropagate as eager."""
    config = LlaMoEConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, moe_num_experts=4,
                          num_experts_per_tok=2)
    torch.manual_seed(0)
    model = LlaMoEForCausalLM(config, config.vocab_size).to(torch.bfloat16)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    model.layers["0"].mlp.experts.grouped_mm = True  # the GPU's path: one grouped product, no host sync
    hidden, rotary, _ = layer_inputs(model)
    hidden = hidden.detach().to(torch.bfloat16)
    rotary = tuple(r.to(torch.bfloat16) for r in rotary)

    def loss_and_grads(layer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = hidden.clone().requires_grad_()
        out = layer(x, rotary)
        record = layer.mlp.record
        loss = out.float().square().mean() + 0.3 * record.balance + 0.1 * record.z
        loss.backward()
        return loss.detach(), {"input": x.grad} | {n: p.grad for n, p in layer.named_parameters()}

    reference_loss, reference = loss_and_grads(copy.deepcopy(model).layers["0"])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    loss, gradients = loss_and_grads(recomputed(model, "pointwise", compiled=True).layers["0"])
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(loss, reference_loss, rtol=1e-2, atol=1e-3)
    assert reference["mlp.router.weight"].abs().sum() > 0  # the auxiliary terms reach the router
    assert_same_gradients(gradients, reference, atol=2e-2, rtol=2e-2)
