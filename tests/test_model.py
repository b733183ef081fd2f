"""The Llama model: shapes, padded vocabulary, tied embeddings, attention against a reference, the masked loss,
initial weights as a function of seed and name; and the seams a model family plugs into: the registry, module
converters swapping a linear's matmul, and persistent buffers in checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nanotron.config import LlamaConfig
from nanotron.models.build import materialize, padded_vocab_size
from nanotron.models.init import init_parameters
from nanotron.models.llama.costs import llama_costs
from nanotron.models.llama.model import LlamaForCausalLM, llama_init_rule
from nanotron.nn.loss import masked_sum, token_losses
from nanotron.parallel.placement import annotate_placements, logical_parameters
from support.configs import tiny_config_dict
from support.distributed import run_distributed_each
from support.kernels import run_with_triton_interpreter

COORDS = {"pp": 0, "dp": 0, "ep": 0, "tp": 0}
SIZES = {"pp": 1, "dp": 1, "ep": 1, "tp": 1}


def make_model(seed=0, tie=True, kv_heads=2, dtype=torch.float32) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=tie)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, padded_vocab_size(100, 8, 1))
    materialize(model, torch.device("cpu"), dtype)
    annotate_placements(model)
    init_parameters(logical_parameters(model), seed, lambda name: llama_init_rule(name, config, 0.02), COORDS,
                    SIZES)
    return model


def test_shapes_and_padded_vocab():
    model = make_model()
    logits = model(input_ids=torch.randint(0, 100, (3, 10)))
    assert logits.shape == (3, 10, 104)
    assert padded_vocab_size(100, 8, 2) == 112


def test_causal_masking():
    model = make_model()
    ids = torch.randint(0, 100, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 100
    a, b = model(input_ids=ids), model(input_ids=changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def reference_attention(layer, x):
    """Straightforward multi-head attention with explicit kv-head repetition and HF rotate-half RoPE."""
    attn = layer.attn
    batch, seq, _ = x.shape
    nh, nkv, d = 4, 2, 8
    q, k, v = attn.qkv_proj(x).split([nh * d, nkv * d, nkv * d], dim=-1)
    q = q.view(batch, seq, nh, d).transpose(1, 2)
    k = k.view(batch, seq, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, 1)
    v = v.view(batch, seq, nkv, d).transpose(1, 2).repeat_interleave(nh // nkv, 1)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(seq).float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rot(t):
        return t * cos + torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1) * sin

    scores = rot(q) @ rot(k).transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, nh * d)
    return attn.o_proj(out)


def test_attention_matches_explicit_reference():
    model = make_model()
    layer = model.layers["0"]
    x = torch.randn(2, 7, 32)
    rotary = model.rotary(torch.arange(7))
    torch.testing.assert_close(layer.attn(x, rotary), reference_attention(layer, x), rtol=1e-5, atol=1e-6)


def test_tied_embeddings_share_storage_and_untied_do_not():
    tied, untied = make_model(tie=True), make_model(tie=False)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert "lm_head.weight" not in logical_parameters(tied)
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    assert "lm_head.weight" in logical_parameters(untied)


def test_init_is_a_function_of_seed_and_name():
    a, b, c = make_model(seed=1), make_model(seed=1), make_model(seed=2)
    pa, pb, pc = logical_parameters(a), logical_parameters(b), logical_parameters(c)
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    assert not torch.equal(pa["layers.0.attn.qkv_proj.weight"], pc["layers.0.attn.qkv_proj.weight"])
    # Layers get different streams: identical shapes, different values.
    assert not torch.equal(pa["layers.0.mlp.down_proj.weight"], pa["layers.1.mlp.down_proj.weight"])
    assert torch.equal(pa["norm.weight"], torch.ones(32))
    # Residual output projections are scaled down by sqrt(2 * layers).
    assert pa["layers.0.attn.o_proj.weight"].std().item() == pytest.approx(0.02 / 2, rel=0.15)
    assert pa["layers.0.attn.qkv_proj.weight"].std().item() == pytest.approx(0.02, rel=0.15)


def test_loss_ignores_masked_tokens_and_all_masked_is_zero():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, :3] = True
    expected = F.cross_entropy(logits[0, :3], labels[0, :3], reduction="sum")
    torch.testing.assert_close(masked_sum(token_losses(logits, labels), mask), expected)
    nothing = masked_sum(token_losses(logits, labels), torch.zeros_like(mask))
    nothing.backward()
    assert nothing.item() == 0.0 and torch.isfinite(logits.grad).all() and logits.grad.abs().sum() == 0


def test_bf16_model_runs_and_counts_parameters():
    model = make_model(dtype=torch.bfloat16, tie=False)
    assert model(input_ids=torch.randint(0, 100, (1, 4))).dtype == torch.bfloat16
    costs = llama_costs(model.config, model.padded_vocab_size, sequence_length=16)
    assert costs.parameters == sum(p.numel() for p in logical_parameters(model).values())


def test_swiglu_backward_reference_matches_autograd():
    from nanotron.nn.swiglu import swiglu, swiglu_backward_reference

    gate_up, grad = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    leaf = gate_up.clone().requires_grad_()
    gate, up = leaf.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(grad)
    torch.testing.assert_close(swiglu_backward_reference(gate_up, grad), leaf.grad)
    through_function = gate_up.clone().requires_grad_()
    swiglu(through_function).backward(grad)  # on CPU the autograd function uses the reference
    torch.testing.assert_close(through_function.grad, leaf.grad)


@pytest.mark.slow
def test_the_swiglu_kernel_equals_the_reference_under_triton_s_interpreter():
    run_with_triton_interpreter("from support.kernels import check_swiglu_kernel; check_swiglu_kernel()")


# --- the registry, module converters, the linear matmul and buffers -------------------------------------------------

def test_registry_finds_llama_by_name_config_and_hf_model_type():
    from nanotron.config import LlamaConfig
    from nanotron.errors import CheckpointError
    from nanotron.models.registry import LLAMA, spec_for_config, spec_for_hf_model_type, spec_named
    from nanotron.models.spec import CausalLM

    assert spec_named("llama", "here") is spec_for_config(LlamaConfig()) is LLAMA
    assert spec_for_hf_model_type("llama", "x") is LLAMA
    with torch.device("meta"):
        assert isinstance(LLAMA.model_class(LlamaConfig(num_hidden_layers=1), 32000), CausalLM)
    for name, hf_type in (("llamoe", "mixtral"), ("mamba", "mamba")):
        assert spec_named(name, "here") is spec_for_hf_model_type(hf_type, "x")
    with pytest.raises(CheckpointError, match="holds a 'rwkv' model, which this version cannot build"):
        spec_named("rwkv", "ckpt/5")
    with pytest.raises(CheckpointError, match="describes a 'gpt2' model; supported model_type values: deepseek_v3, "
                                              "llama, mamba, mixtral, qwen2"):
        spec_for_hf_model_type("gpt2", "hf/config.json")


def counting_matmul(counts: dict):
    import torch.nn.functional as F

    def matmul(x, weight, bias=None):
        counts["calls"] = counts.get("calls", 0) + 1
        return F.linear(x, weight, bias)

    return matmul


def swap_matmuls(model) -> None:
    """A converter in the way FP8 would plug in: every linear but the LM head gets another matmul; the final norm
    gets a persistent buffer (scaling state)."""
    from nanotron.nn.linear import Linear
    from nanotron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    model.counts = {}
    for name, module in model.named_modules():
        if isinstance(module, (Linear, ColumnParallelLinear, RowParallelLinear)) and not name.endswith("lm_head"):
            module.matmul = counting_matmul(model.counts)
    if model.norm is not None:
        model.norm.register_buffer("scale_history", torch.zeros(4))


def _train_with_converter(config: dict, converted: bool, resume_buffer: bool = False) -> dict:
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config), converters=(swap_matmuls,) if converted else ())
    losses = []
    loader = trainer.loader(trainer.config.data_stages[0])
    for step in range(1, 4):
        losses.append(trainer.finish_step(trainer.train_step(loader.next_step(), 1e-3)).loss)
        trainer.progress.step = step
    result = {"losses": losses, "calls": getattr(trainer.model, "counts", {}).get("calls", 0)}
    if converted and trainer.model.norm is not None:
        result["loaded_buffer"] = trainer.model.norm.scale_history.tolist()
        trainer.model.norm.scale_history.copy_(torch.arange(4.0))
    trainer.save()
    return result


@pytest.mark.slow
def test_converted_linears_train_like_the_plain_model_and_buffers_are_checkpointed(tiny_data, tmp_path):
    """At tp=2 in sequence-parallel mode with overlap, a converter's matmul runs in every converted layer (the
    overlapped path steps aside) and gives the same losses; the buffer it adds is saved and restored on resume."""
    parallelism = {"tp": 2, "tp_mode": "REDUCE_SCATTER", "tp_linear_async_communication": True}
    plain, converted = (tiny_config_dict(tiny_data, tmp_path / name, parallelism=parallelism)
                        for name in ("plain", "converted"))
    resumed = tiny_config_dict(tiny_data, tmp_path / "converted", parallelism=parallelism,
                               checkpoints={"checkpoint_interval": 1000,
                                            "resume_checkpoint_path": str(tmp_path / "converted")})
    runs = run_distributed_each(_train_with_converter, 2, [
        {"config": plain, "converted": False}, {"config": converted, "converted": True},
        {"config": resumed | {"tokens": resumed["tokens"] | {"train_steps": 40}}, "converted": True},
    ])
    (plain_run, _), (converted_run, _), (resumed_run, _) = runs
    assert converted_run["calls"] == 3 * 2 * 2 * 4  # steps x micro-batches x layers x linears (the head is left)
    assert plain_run["calls"] == 0
    torch.testing.assert_close(converted_run["losses"], plain_run["losses"], rtol=1e-6, atol=0)
    assert converted_run["loaded_buffer"] == [0.0] * 4  # a fresh run starts from zeros
    assert resumed_run["loaded_buffer"] == [0.0, 1.0, 2.0, 3.0]  # the resumed one from the checkpoint
