import math

import pytest
import torch
import torch.nn.functional as F

from helpers import run_with_triton_interpreter
from nanotron.config import LlamaConfig
from nanotron.models.build import materialize, padded_vocab_size
from nanotron.models.init import init_parameters
from nanotron.models.llama.costs import llama_costs
from nanotron.models.llama.model import LlamaForCausalLM, llama_init_rule
from nanotron.nn.loss import masked_sum, token_losses
from nanotron.parallel.placement import annotate_placements, logical_parameters

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


def test_the_swiglu_kernel_equals_the_reference_under_triton_s_interpreter():
    run_with_triton_interpreter("from helpers import check_swiglu_kernel; check_swiglu_kernel()")
