"""Selective activation recomputation (`parallelism.recompute: selective`): the same losses and gradients
as without recomputation, the attention kernel run once per layer instead of twice (its output and log-sum-exp are
kept), eager and compiled; the key in the config, the memory planner and the hardware FLOPs."""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from nanotron.config import ConfigError, LlamaConfig, apply_overrides, config_from_dict, load_config
from nanotron.layout import Layout
from nanotron.memory import estimate_memory
from nanotron.models.build import BuildOptions, build_model, padded_vocab_size
from nanotron.models.llama.costs import llama_costs, llama_layer_activations
from nanotron.models.spec import ActivationShape
from nanotron.nn.recompute import ATTENTION_OPS, recompute_in_backward
from nanotron.parallel.context import ParallelContext
from support import ROOT
from support.configs import recompute_config, tiny_config_dict
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
BENCH = ROOT / "examples" / "config_llama1b_bench.yaml"
SELECTIVE = ["parallelism.recompute=selective"]
# Names the profiler gives the attention kernels' forward ops (flex attention's is a Triton template on CUDA).
ATTENTION_OP_NAMES = frozenset(op.name() for op in ATTENTION_OPS if isinstance(op, torch._ops.OpOverload))
def attention_runs(model, ids: torch.Tensor, **inputs) -> int:
    """Attention kernels' forward ops run by one forward and backward, counted by the profiler (which sees the ones
    a compiled graph calls)."""
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if ids.is_cuda else [])]) as prof:
        loss_and_gradients(model, ids, **inputs)
    names = collections.Counter(event.name for event in prof.events())
    return sum(names[name] for name in ATTENTION_OP_NAMES)


def test_eager_selective_recompute_matches_and_runs_attention_once_per_layer():
    model, ids = small_llama(), ids_for(SMALL)
    reference_loss, reference = loss_and_gradients(model, ids)
    runs = {}
    for granularity in (None, "full", "selective"):
        candidate = recomputed(model, granularity)
        with AttentionCalls() as calls:
            loss, gradients = loss_and_gradients(candidate, ids)
        runs[granularity] = calls.count
        assert torch.equal(loss, reference_loss), granularity
        assert_same_gradients(gradients, reference, atol=1e-7)
    layers = SMALL.num_hidden_layers
    assert runs == {None: layers, "full": 2 * layers, "selective": layers}


@pytest.mark.slow  # compiling takes most of the quick tier's slowest test; the eager policy test stays quick
def test_compiled_selective_recompute_matches_and_keeps_only_input_and_attention_outputs():
    """torch.compile traces the selective policy: the compiled backward runs attention's backward from the kept
    output and log-sum-exp, and the layer saves exactly what the memory planner counts (measured on CPU; on CUDA the
    planner adds what a compiled recomputed MLP was measured to keep)."""
    config = dataclasses.replace(SMALL, num_hidden_layers=1)
    model, ids = small_llama(config), ids_for(config)
    reference_loss, reference = loss_and_gradients(model, ids)
    compiled = recomputed(model, "selective", compiled=True)
    loss, gradients = loss_and_gradients(compiled, ids)  # compiles
    torch.testing.assert_close(loss, reference_loss, rtol=0, atol=1e-6)
    assert_same_gradients(gradients, reference, atol=1e-6)
    assert attention_runs(compiled, ids) == 1  # 2 when the policy saves nothing

    layer = compiled.layers["0"]
    hidden = torch.randn(BATCH, SEQ, config.hidden_size, requires_grad=True)
    rotary = compiled.rotary.first_positions(SEQ, hidden.device)
    not_activations = {p.data_ptr() for p in compiled.parameters()} | {table.data_ptr() for table in rotary}
    saved = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in not_activations:
            saved[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(hidden, rotary).sum().backward()  # plain causal attention, as in the model's forward
    shape = ActivationShape(tokens=BATCH * SEQ, sequence_length=SEQ, tp=1, value_bytes=4, residual_share=1.0,
                            linear_input_share=1.0, compiled=False, recompute="selective")
    kept, _ = llama_layer_activations(config, 0, shape)
    q_width = config.num_attention_heads * config.head_dim
    assert sum(saved.values()) == kept == BATCH * SEQ * 4 * (config.hidden_size + q_width + config.num_attention_heads)


def _build_and_run(config: dict) -> dict:
    cfg = config_from_dict(config)
    model = build_model(cfg.model.model_config, ParallelContext(Layout()), BuildOptions.from_config(cfg))
    ids = torch.randint(0, cfg.model.model_config.vocab_size, (2, cfg.tokens.sequence_length),
                        generator=torch.Generator().manual_seed(0))
    with AttentionCalls() as calls:
        loss, gradients = loss_and_gradients(model, ids)
    return {"loss": loss, "gradients": gradients, "attention_runs": calls.count,
            "layers": cfg.model.model_config.num_hidden_layers}


def test_the_config_key_reaches_the_built_model(tiny_data, tmp_path):
    plain = tiny_config_dict(tiny_data, tmp_path)
    selective = apply_overrides(copy.deepcopy(plain), SELECTIVE)  # as scripts/benchmark.py applies --override
    (reference,), (got,) = run_distributed_each(_build_and_run, 1, [{"config": plain}, {"config": selective}])
    assert torch.equal(got["loss"], reference["loss"])
    assert_same_gradients(got["gradients"], reference["gradients"], atol=1e-7)
    assert got["attention_runs"] == reference["attention_runs"] == got["layers"]


@pytest.mark.parametrize("recompute", ["selective", "pointwise"])
def test_recompute_setting_is_case_insensitive_and_checked(recompute):
    assert load_config(TINY, [f"parallelism.recompute={recompute.upper()}"]).parallelism.recompute == recompute
    with pytest.raises(ConfigError, match=r"parallelism.recompute must be one of none, full, selective, pointwise "
                                          r"\(got 'attention'\)"):
        load_config(TINY, ["parallelism.recompute=attention"])
    for value in ("attention", "none"):
        with pytest.raises(ValueError, match=f"recompute '{value}': expected one of full, selective, pointwise"):
            recompute_in_backward(torch.nn.Linear(2, 2), value)


@pytest.mark.parametrize("compiled", [False, True])
def test_memory_planner_counts_the_attention_outputs_selective_recompute_keeps(compiled):
    """Derived from the code (what the policy saves: the attention op's output and fp32 log-sum-exp) and measured on
    CPU by the compiled test above; not measured on a GPU."""
    overrides = ["model.loss_chunk_tokens=0", f"model.compile={compiled}", "parallelism.recompute=full"]
    full = load_config(TINY, overrides)
    selective = load_config(TINY, overrides + ["parallelism.recompute=selective"])
    c, t = full.model.model_config, full.tokens
    tokens, d = t.micro_batch_size * t.sequence_length, 4  # fp32
    attention_outputs = tokens * (d * c.num_attention_heads * c.head_dim + 4 * c.num_attention_heads)
    layers = c.num_hidden_layers
    shape = dict(tokens=tokens, sequence_length=t.sequence_length, tp=1, value_bytes=d, residual_share=1.0,
                 linear_input_share=1.0, compiled=compiled, recompute="full")
    full_kept, full_rebuilt = llama_layer_activations(c, 0, ActivationShape(**shape))
    kept, rebuilt = llama_layer_activations(c, 0, ActivationShape(**shape | {"recompute": "selective"}))
    assert (kept, rebuilt) == (full_kept + attention_outputs, full_rebuilt - attention_outputs)
    (full_stage,), (selective_stage,) = (estimate_memory(cfg, gpu_memory_gb=80).stages for cfg in (full, selective))
    assert selective_stage.activations > full_stage.activations
    assert selective_stage.activations - full_stage.activations <= layers * attention_outputs
    assert "recomputed layers (selective)" in estimate_memory(selective, gpu_memory_gb=80).description


def test_hardware_flops_count_the_recomputed_layers_without_their_attention():
    costs = llama_costs(SMALL, padded_vocab_size=64, sequence_length=32)
    attention = 12 * SMALL.hidden_size * 32 / 2  # per layer and token: scores and weighted sum, causal
    assert costs.attention_flops == (attention,) * SMALL.num_hidden_layers
    layer = costs.layer_flops[0]
    assert costs.hardware_flops_per_token("selective") == pytest.approx(
        costs.flops_per_token + SMALL.num_hidden_layers * (layer - attention) / 3)
    assert costs.hardware_flops_per_token("full") == pytest.approx(costs.flops_per_token + sum(costs.layer_flops) / 3)
    assert costs.hardware_flops_per_token("none") == costs.flops_per_token

    # The 1B shape at 128k tokens: attention is most of a layer, so selective recomputes a small part of it.
    bench = load_config(BENCH, ["tokens.sequence_length=131072", "model.model_config.max_position_embeddings=131072"])
    long = llama_costs(bench.model.model_config, 128256, 131072)
    recomputed = long.hardware_flops_per_token("selective") - long.flops_per_token
    assert recomputed < sum(long.layer_flops) / 3 / 4
    assert recomputed < (long.hardware_flops_per_token("full") - long.flops_per_token) / 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("document_masking", [False, True], ids=["sdpa", "flex"])
def test_cuda_compiled_selective_recompute_matches_no_recompute(document_masking):
    """On a GPU: a compiled layer with selective recomputation gives the gradients of no recomputation, with SDPA's
    causal kernel and with flex attention (document masking); SDPA's kernel runs once per layer."""
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model = small_llama(config, "cuda").to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (2, 1024), generator=torch.Generator().manual_seed(1)).cuda()
    inputs = {}
    if document_masking:
        documents = (torch.arange(1024, device="cuda") // 300).expand(2, -1)
        inputs = {"document_ids": documents, "position_ids": (torch.arange(1024, device="cuda") % 300).expand(2, -1)}
    reference_loss, reference = loss_and_gradients(recomputed(model, None, compiled=True), ids, **inputs)
    compiled = recomputed(model, "selective", compiled=True)
    loss, gradients = loss_and_gradients(compiled, ids, **inputs)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-2, atol=1e-2)
    assert_same_gradients(gradients, reference, atol=2e-2, rtol=2e-2)
    if not document_masking:
        assert attention_runs(compiled, ids) == config.num_hidden_layers


@pytest.mark.slow
def test_selective_training_matches_and_reports_its_hardware_flops(tiny_data, tmp_path):
    plain = recompute_config(tiny_data, tmp_path / "plain", "none")
    selective = recompute_config(tiny_data, tmp_path / "selective", "selective")
    (reference,), (got,) = run_distributed_each(train_with_flops, 1, [{"config": plain}, {"config": selective}])
    for expected, step in zip(reference["metrics"], got["metrics"], strict=True):
        assert step["lm_loss"] == pytest.approx(expected["lm_loss"], rel=0, abs=1e-6), step["step"]
        assert step["grad_norm"] == pytest.approx(expected["grad_norm"], rel=0, abs=1e-6), step["step"]
    config = config_from_dict(selective)
    model = config.model.model_config
    vocab = padded_vocab_size(model.vocab_size, config.model.make_vocab_size_divisible_by, 1)
    costs = llama_costs(model, vocab, config.tokens.sequence_length)
    assert got["model_flops"] == reference["model_flops"] == costs.flops_per_token
    assert got["hardware_flops"] == costs.hardware_flops_per_token("selective")
    assert reference["model_flops"] < got["hardware_flops"] < costs.hardware_flops_per_token("full")


@pytest.mark.slow
def test_selective_recompute_with_tensor_and_pipeline_parallelism(tiny_data, tmp_path):
    """The tensor-parallel layers' collectives run again in the recomputed forward, under the selective policy."""
    plain = recompute_config(tiny_data, tmp_path / "plain", "none")
    selective = recompute_config(tiny_data, tmp_path / "selective", "selective", tp=2, pp=2, tp_mode="REDUCE_SCATTER",
                                 tp_linear_async_communication=True)
    ((reference,),) = run_distributed_each(train_with_flops, 1, [{"config": plain}])
    (runs,) = run_distributed_each(train_with_flops, 4, [{"config": selective}])
    (metrics,) = [run["metrics"] for run in runs if run["metrics"]]
    for expected, got in zip(reference["metrics"], metrics, strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), got["step"]
