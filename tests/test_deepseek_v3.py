"""The DeepSeek-V3 family (``is_deepseek_v3_config``) against transformers' DeepseekV3ForCausalLM (logits at tp 1
and 2 and ep 2, greedy generation, conversion both ways, sizes checked against the stored tensors), its routing
against transformers' router, its costs, the latent generation cache, the features (document masking, recomputation,
compilation, FP8, ``nanotron generate`` and ``nanotron eval``) against the runs without them, layouts against one
process (tp in both modes, pp, dp, cp, ep, ep x tp) with the balancing bias equal everywhere, an exact resume of the
bias, and every rule of the config named in one line."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from support import ROOT
from support.configs import tiny_config_dict, write_config
from support.distributed import run_distributed, run_distributed_each
from support.hf import (
    PROMPTS,
    away_from_initial_values,
    convert_altered,
    export_back_exactly,
    nanotron_outputs,
    one_process_outputs,
    transformers_outputs,
)
from support.parity import assemble, assert_reference_trains, first_step_then_train
from support.runs import assert_user_error, cli, train_example
from support.tiers import parity_steps

# 4 heads whose queries and keys are 12 features without RoPE and 8 with it, values of 10: no size is
# hidden_size / num_attention_heads; 8 experts in 4 groups, the first layer dense
SHAPE = dict(vocab_size=112, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=4, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, kv_lora_rank=16,
             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=4, topk_group=2,
             first_k_dense_replace=1, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             initializer_range=0.1)
YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}
VARIANTS = {
    # a query latent, YaRN with DeepSeek's mscale, interleaved rotary rows, two shared experts, raw top-k weights
    "latent-query-yarn": {"q_lora_rank": 24, "rope_parameters": YARN, "n_shared_experts": 2,
                          "norm_topk_prob": False},
    # one query projection, plain RoPE in halves, tied embeddings, renormalised weights
    "direct-query": {"q_lora_rank": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
                     "rope_interleave": False, "tie_word_embeddings": True, "routed_scaling_factor": 1.5},
}
NEW_TOKENS = 12


def _save_random(folder: Path, changes: dict) -> Path:
    """A random transformers model with norms away from one and balancing biases away from zero."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = away_from_initial_values(transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**SHAPE | changes)))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["latent-query-yarn",
                                        pytest.param("direct-query", marks=pytest.mark.full_tier)])
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = _save_random(root / "hf", VARIANTS[request.param])
    outcome = cli("convert", "hf-to-nanotron", "--hf-path", hf, "--save-path", root / "nanotron")
    assert outcome.code == 0, outcome.stderr[-3000:]
    return {"name": request.param, "hf": hf, "ckpt": root / "nanotron", "root": root}


@pytest.mark.slow  # the quick tier has the block-level comparisons and the bias rule
def test_logits_and_greedy_generation_match_transformers(converted):
    """Prompts of different lengths (left padding), with and without the KV cache; the balancing biases (which
    choose the experts) are read."""
    from safetensors.torch import load_file

    from nanotron.models.moe.model import MoEFeedForward

    ours = one_process_outputs(converted["ckpt"], PROMPTS, NEW_TOKENS)
    theirs = transformers_outputs(converted["hf"], PROMPTS, NEW_TOKENS)
    layers = ours["layers"]
    assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, MoEFeedForward)] == [1, 2]
    stored = load_file(converted["hf"] / "model.safetensors")
    assert torch.equal(layers[2].mlp.expert_bias, stored["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert (ours["logits"] - theirs["logits"]).abs().max() < 1e-4
    assert ours["cached"] == ours["uncached"] == theirs["greedy"]


@pytest.mark.full_tier
@pytest.mark.slow  # the quick tier compares one process with transformers above
def test_logits_match_transformers_at_tp2_and_ep2(converted):
    """tp=2 splits the heads (each rank decompresses its own from the replicated latents) and the experts' widths;
    ep=2 splits the experts."""
    theirs = transformers_outputs(converted["hf"], PROMPTS, 48)
    layouts = [{"tp": 2}, {"ep": 2}]
    for layout, ranks in zip(layouts, run_distributed_each(nanotron_outputs, 2, [
            {"ckpt": str(converted["ckpt"]), "pp": 1, "tp": 1} | layout for layout in layouts]), strict=True):
        for rank in ranks:
            assert (rank["logits"] - theirs["logits"]).abs().max() < 1e-4, layout
            assert rank["cached"] == rank["uncached"] == theirs["greedy"], layout


@pytest.mark.full_tier
def test_generation_at_pp2_is_that_of_one_process(converted):
    """The last stage's logits and every rank's greedy continuations, through the latent cache and without it, as
    one process's, the three layers split over two stages."""
    ours = one_process_outputs(converted["ckpt"], PROMPTS, 48)
    ranks = run_distributed(nanotron_outputs, 2, ckpt=str(converted["ckpt"]), tp=1, pp=2)
    (last,) = [rank for rank in ranks if rank["logits"] is not None]
    torch.testing.assert_close(last["logits"], ours["logits"], rtol=0, atol=1e-6)
    assert ours["cached"] == ours["uncached"]
    for rank in ranks:
        assert rank["cached"] == rank["uncached"] == ours["cached"]


@pytest.mark.slow  # the quick tier has the block-level comparisons and the bias rule
def test_conversion_back_is_exact(converted):
    before, after, exported = export_back_exactly(converted["hf"], converted["ckpt"], converted["root"] / "back",
                                                  PROMPTS[0])
    assert any(name.endswith("mlp.gate.e_score_correction_bias") for name in exported)
    keys = ["q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim",
            "qk_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
            "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "rope_interleave",
            "tie_word_embeddings"]
    assert {key: getattr(after, key) for key in keys} == {key: getattr(before, key) for key in keys}


@pytest.mark.slow  # the quick tier has the block-level comparisons and the bias rule
def test_checkpoint_records_the_deepseek_v3_type(converted):
    model = json.loads((converted["ckpt"] / "checkpoint.json").read_text())["model"]
    assert model["type"] == "deepseek_v3" and model["config"]["qk_rope_head_dim"] == 8


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    return _save_random(tmp_path_factory.mktemp("stored"), VARIANTS["latent-query-yarn"])


def _with_prediction_module(stored: Path, folder: Path, head_copy_offset: float = 0.0) -> Path:
    """``stored`` (a transformers folder, untied) with one multi-token prediction module as DeepSeek's released
    checkpoint stores it: decoder layer ``num_hidden_layers`` (the last layer's tensors, altered), its ``enorm``,
    ``hnorm``, ``eh_proj`` and ``shared_head.norm``, and its copies of the embedding and head (the head's
    shifted by ``head_copy_offset``)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((stored / "config.json").read_text())
    last, module = (f"model.layers.{config['num_hidden_layers'] + offset}." for offset in (-1, 0))
    tensors = load_file(stored / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    hidden = config["hidden_size"]
    extra = {module + name[len(last):]: tensor + 0.01 * torch.randn(tensor.shape, generator=generator)
             for name, tensor in tensors.items() if name.startswith(last)}
    extra |= {module + name: 1 + 0.1 * torch.randn(hidden, generator=generator)
              for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
    extra |= {module + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden, generator=generator),
              module + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
              module + "shared_head.head.weight": tensors["lm_head.weight"] + head_copy_offset}
    folder.mkdir(parents=True)
    save_file(tensors | extra, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    return folder


@pytest.mark.slow  # the quick tier has the block-level comparisons and the bias rule
def test_prediction_modules_convert_both_ways_in_deepseeks_layout(stored, tmp_path):
    """A folder holding a prediction module as DeepSeek's checkpoint does converts to nanotron's modules, back to
    the same tensors bit for bit (which transformers loads, leaving the module unread, with the same logits), and
    again to the same checkpoint (native -> HF -> native); generation ignores the module, as transformers does."""
    hf = _with_prediction_module(stored, tmp_path / "hf")
    ckpt = tmp_path / "nanotron"
    assert cli("convert", "hf-to-nanotron", "--hf-path", hf, "--save-path", ckpt).code == 0
    assert json.loads((ckpt / "checkpoint.json").read_text())["model"]["config"]["num_nextn_predict_layers"] == 1
    native = _stored_tensors(ckpt / "model")
    assert {"mtp.depths.0.eh_proj.weight", "mtp.depths.0.layer.attn.kv_b_proj.weight",
            "mtp.depths.0.layer.mlp.expert_bias", "mtp.depths.0.norm.weight"} <= set(native)
    export_back_exactly(hf, ckpt, tmp_path / "back", PROMPTS[0])
    assert cli("convert", "hf-to-nanotron", "--hf-path", tmp_path / "back", "--save-path", tmp_path / "again").code == 0
    again = _stored_tensors(tmp_path / "again" / "model")
    assert set(again) == set(native) and all(torch.equal(again[name], native[name]) for name in native)
    ours, theirs = one_process_outputs(ckpt, PROMPTS, 4), transformers_outputs(hf, PROMPTS, 4)
    assert (ours["logits"] - theirs["logits"]).abs().max() < 1e-4
    assert ours["cached"] == theirs["greedy"]


@pytest.mark.slow  # the quick tier has the block-level comparisons
def test_a_prediction_modules_own_head_is_refused(stored, tmp_path):
    """nanotron shares the embedding and head with the prediction modules: a module whose copy differs is one error
    line, and nothing is written."""
    hf = _with_prediction_module(stored, tmp_path / "hf", head_copy_offset=0.5)
    outcome = cli("convert", "hf-to-nanotron", "--hf-path", hf, "--save-path", tmp_path / "out")
    assert_user_error(outcome, "model.layers.3.shared_head.head.weight differs from lm_head.weight")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the quick tier has the block-level comparisons
@pytest.mark.parametrize("config_changes, drop, fragment", [
    ({"kv_lora_rank": 8}, None, "'layers.0.attn.kv_a_layernorm.weight' is (16,) in the weights but (8,) in the model"),
    ({"first_k_dense_replace": 2}, None, "'model.layers.1.mlp.gate_proj.weight', which the weights lack"),
    ({}, "layers.1.mlp.gate.e_score_correction_bias", "'model.layers.1.mlp.gate.e_score_correction_bias', which "
                                                      "the weights lack"),
    ({"qk_head_dim": 24}, None, "qk_head_dim (24) must equal qk_nope_head_dim + qk_rope_head_dim = 20"),
    ({"num_key_value_heads": 128}, None, "num_key_value_heads (128) must equal num_attention_heads = 4"),
    ({"attention_bias": True}, None, "attention_bias True is not supported"),
], ids=["latent-rank", "fewer-moe-layers", "no-bias", "qk-head-dim", "kv-heads", "attention-bias"])
def test_declared_sizes_are_checked_against_the_stored_tensors(stored, tmp_path, config_changes, drop, fragment):
    """A config.json whose shapes or derived keys disagree with the weights (or weights without a balancing bias) is
    refused in one line before anything is written."""
    outcome = convert_altered(stored, tmp_path, config_changes, drop)
    assert_user_error(outcome, fragment)
    assert not (tmp_path / "out").exists()


# --- generation: the latent cache ----------------------------------------------------------------------------------

def _small_model(**changes):
    """A DeepSeek-V3 of SHAPE's sizes (fp32) in this process, its weights normal(0, 0.1)."""
    from nanotron.config import DeepseekV3Config
    from nanotron.models.deepseek_v3.model import DeepseekV3ForCausalLM

    keys = {key: value for key, value in SHAPE.items() if key not in ("num_key_value_heads", "pad_token_id")}
    config = DeepseekV3Config(**keys | {"q_lora_rank": 24, "n_shared_experts": 1} | changes)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config, config.vocab_size)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    return model.eval()


def test_the_generation_cache_holds_the_latents_and_gives_the_uncached_logits():
    """Each layer's cache holds, per position, the normed kv latent and the rotated shared key (kv_lora_rank +
    qk_rope_head_dim values: 24 here, against the 4 heads' decompressed keys and values, 4 * (20 + 10) = 120); a
    prompt then one token at a time through the cache, attending over the latents with kv_b_proj absorbed, gives
    the logits of the whole sequence at once through the decompressed keys and values."""
    from nanotron.models.registry import spec_for_config

    model = _small_model()
    ids = torch.randint(3, 112, (2, 9), generator=torch.Generator().manual_seed(0))
    caches = {index: spec_for_config(model.config).inference_cache() for index in model.layers}
    with torch.no_grad():
        whole = model(input_ids=ids)
        steps = [model(input_ids=ids[:, :6], caches=caches)]
        for position in range(6, 9):
            steps.append(model(input_ids=ids[:, position:position + 1], caches=caches,
                               position_ids=torch.full((2, 1), position)))
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)
    for cache in caches.values():
        assert cache.length == 9
        assert cache.latent.shape == (2, 9, SHAPE["kv_lora_rank"])
        assert cache.rotary_key.shape == (2, 9, SHAPE["qk_rope_head_dim"])
        assert sum(tensor.numel() for tensor in vars(cache).values()) == 2 * 9 * (16 + 8)


# --- routing, costs ---------------------------------------------------------------------------------------------

def test_routing_chooses_and_weighs_the_experts_as_transformers_router():
    """Sigmoid scores plus the bias choose within the best groups; the scores alone weigh, renormalised or not,
    times the scaling factor."""
    transformers = pytest.importorskip("transformers")
    from nanotron.models.moe.model import Selection, choose_experts

    torch.manual_seed(0)
    for normalize in (True, False):
        config = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                                               topk_group=2, norm_topk_prob=normalize, routed_scaling_factor=2.5)
        router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
        torch.nn.init.normal_(router.weight)
        router.e_score_correction_bias.normal_(0.0, 0.5)
        hidden = torch.randn(64, 16)
        logits, weights, experts = router(hidden)
        selection = Selection(router.e_score_correction_bias, 4, 2, 2.5)
        _, ours, our_weights = choose_experts(logits.view(1, 64, 16), 3, normalize, selection)
        mine, theirs = ours[0].sort(-1), experts.sort(-1)
        assert torch.equal(mine.values, theirs.values)
        torch.testing.assert_close(our_weights[0].gather(-1, mine.indices), weights.gather(-1, theirs.indices))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_latent_attention_is_transformers_attention(variant):
    """One MLA block with transformers' weights (norms away from one) on a causal sequence: the same output."""
    transformers = pytest.importorskip("transformers")
    from nanotron.config import DeepseekV3Config, model_config_from_dict
    from nanotron.models.deepseek_v3.hf_adapter import DeepseekV3HFAdapter
    from nanotron.models.deepseek_v3.model import DeepseekV3ForCausalLM
    from nanotron.models.registry import check_model_config

    modeling = transformers.models.deepseek_v3.modeling_deepseek_v3
    hf_config = transformers.DeepseekV3Config(**SHAPE | VARIANTS[variant])
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = away_from_initial_values(modeling.DeepseekV3Attention(hf_config, 0)).eval()
    config = model_config_from_dict(DeepseekV3Config, DeepseekV3HFAdapter().config_fields_from_hf(
        hf_config.to_dict()))
    check_model_config(config, 1, "config.json")
    model = DeepseekV3ForCausalLM(config, 112)
    ours = model.layers["0"].attn
    ours.load_state_dict({name: tensor for name, tensor in theirs.state_dict().items()})
    hidden = torch.randn(2, 9, 64)
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    positions = torch.arange(9)[None]
    with torch.no_grad():
        expected, _ = theirs(hidden, modeling.DeepseekV3RotaryEmbedding(hf_config)(hidden, positions), causal)
        got = ours(hidden, model.rotary(torch.arange(9)))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mscale, mscale_all_dim", [(0.707, 1.0), (0, 0)], ids=["deepseek-mscale", "no-mscale"])
def test_yarn_tables_and_softmax_scale_are_those_of_transformers(mscale, mscale_all_dim):
    """YaRN's blended frequencies and attention factor in the cos/sin tables, and DeepSeek's softmax scale."""
    transformers = pytest.importorskip("transformers")
    from nanotron.config import DeepseekV3Config
    from nanotron.models.deepseek_v3.model import softmax_scale_factor
    from nanotron.nn.rotary import RotaryEmbedding

    yarn = YARN | {"mscale": mscale, "mscale_all_dim": mscale_all_dim}
    theirs = transformers.DeepseekV3Config(**SHAPE | {"rope_parameters": dict(yarn)})
    rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(theirs)
    positions = torch.arange(100)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    scaling = {key: value for key, value in yarn.items() if key != "rope_theta"}
    ours = RotaryEmbedding(8, 5000.0, scaling)(positions)
    torch.testing.assert_close(ours, (cos[0], sin[0]), rtol=1e-6, atol=1e-6)
    config = DeepseekV3Config(qk_nope_head_dim=12, qk_rope_head_dim=8, rope_scaling=scaling)
    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(theirs, 0)
    assert softmax_scale_factor(config) * 20 ** -0.5 == pytest.approx(attention.scaling, rel=1e-12)
    assert (softmax_scale_factor(config) == 1.0) == (mscale_all_dim == 0)


def test_each_step_moves_the_bias_towards_balance_by_its_speed_unless_skipped():
    """bias += speed * sign(mean load - load) per MoE layer, from the step's summed loads (rows by MoE layer)."""
    from nanotron.config import DeepseekV3Config
    from nanotron.features.expert_balance import ExpertBalance
    from nanotron.models.deepseek_v3.model import DeepseekV3ForCausalLM
    from nanotron.training.hooks import Run

    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16, n_routed_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
                              first_k_dense_replace=1, bias_update_speed=0.25)
    model = DeepseekV3ForCausalLM(config, 64)
    feature = ExpertBalance(config.moe)
    feature.start(Run(model, None, None, None, Path()))
    loads = torch.tensor([[3.0, 1.0, 2.0, 2.0], [0.0, 0.0, 0.0, 8.0]], dtype=torch.float64)
    feature.after_step(1, {"moe_tokens_per_expert": loads}, skipped=False)
    feature.after_step(2, {"moe_tokens_per_expert": loads * 5}, skipped=True)
    assert torch.equal(model.layers["1"].mlp.expert_bias, torch.tensor([-0.25, 0.25, 0.0, 0.0]))
    assert torch.equal(model.layers["2"].mlp.expert_bias, torch.tensor([0.25, 0.25, 0.25, -0.25]))


def _costs_config(**changes):
    """2 layers (the first dense) of hidden size 32, 8 experts of 16 and 2 shared ones, a vocabulary of 64."""
    from nanotron.config import DeepseekV3Config

    return DeepseekV3Config(**dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
                                   qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, n_shared_experts=2,
                                   num_experts_per_tok=2, moe_intermediate_size=16, n_group=4, topk_group=2,
                                   first_k_dense_replace=1) | changes)


def test_costs_count_every_parameter_and_the_experts_a_token_uses():
    from nanotron.models.registry import spec_for_config

    for q_lora_rank in (None, 24):
        config = _costs_config(q_lora_rank=q_lora_rank)
        spec = spec_for_config(config)
        with torch.device("meta"):
            model = spec.model_class(config, 64)
        costs = spec.costs(config, 64, 16)
        assert costs.parameters == sum(param.numel() for param in model.parameters())
    used = 2 * 3 * 32 * 16 + 32 * 8 + 3 * 32 * 32  # k experts, the router, the shared experts (no gate)
    assert costs.layer_flops[1] - costs.layer_flops[0] == 6 * (used - 3 * 32 * 48)
    assert costs.attention_pair_flops[0] == 6 * 4 * (20 + 10)  # q.k over 20 features, values of 10, per head


def test_costs_count_the_prediction_modules_beside_the_head():
    """Two prediction modules: every parameter of the built model, and per module the FLOPs of a layer like the last
    (experts), eh_proj and one more head pass, on the head (the pipeline split puts them on the last stage)."""
    from nanotron.models.deepseek_v3.costs import prediction_activations
    from nanotron.models.registry import spec_for_config
    from nanotron.models.spec import ActivationShape

    config = _costs_config(num_nextn_predict_layers=2)
    spec = spec_for_config(config)
    with torch.device("meta"):
        model = spec.model_class(config, 64)
    costs, without = spec.costs(config, 64, 16), spec.costs(replace(config, num_nextn_predict_layers=0), 64, 16)
    assert costs.parameters == sum(param.numel() for param in model.parameters())
    module = costs.layer_flops[-1] + 6 * (2 * 32 * 32 + 64 * 32)  # the last layer's, eh_proj, the head
    assert costs.head_flops == pytest.approx(without.head_flops + 2 * module)
    assert costs.flops_per_token == pytest.approx(without.flops_per_token + 2 * module)
    assert costs.layer_flops == without.layer_flops
    shape = ActivationShape(tokens=16, sequence_length=16, tp=1, value_bytes=4, residual_share=1.0,
                            linear_input_share=1.0, compiled=False)
    assert prediction_activations(config, shape, lambda c, layer, s: (1000 * layer, layer)) == (
        1000 * (2 + 3) + 2 * 5 * 4 * 32 * 16, 3)


# --- multi-token prediction's loss -------------------------------------------------------------------------------

def _prediction_reference(model, batch, depths: int, scale: float) -> torch.Tensor:
    """DeepSeek-V3's multi-token prediction loss in plain torch, position by position: depth k reads token i + k and
    predicts token i + k + 1 where it lies in the sequence and in position i's document and the batch counts it;
    each depth's loss over its count of targets, their sum times ``scale / depths``. The model's own decoder layers
    and masks are used as they are (tested against transformers above)."""
    import torch.nn.functional as F

    from nanotron.nn.attention import AttentionMasks

    rows, length = batch.input_ids.shape
    hidden, rotary, masks = model.decode(batch.input_ids, None, batch.position_ids, None, None, batch.document_ids,
                                         None)
    masks = AttentionMasks.of_sequence(length, hidden.device, documents=batch.document_ids)
    tokens = torch.cat([batch.input_ids, batch.labels[:, -1:]], dim=1)  # token j at column j
    total = 0.0
    for k in range(1, depths + 1):
        depth = model.mtp.depths[str(k - 1)]
        ahead = torch.stack([torch.stack([tokens[b, min(i + k, length)] for i in range(length)])
                             for b in range(rows)])
        embedded = F.embedding(ahead, model.embed_tokens.weight)
        norm = lambda x, module: F.rms_norm(x, (x.shape[-1],), module.weight, module.eps)  # noqa: E731
        hidden = depth.layer(F.linear(torch.cat([norm(hidden, depth.hnorm), norm(embedded, depth.enorm)], -1),
                                      depth.eh_proj.weight), rotary, masks.for_window(None))
        logits = F.linear(norm(hidden, depth.norm), model.lm_head.weight)
        losses, count = [], 0
        for b in range(rows):
            for i in range(length - k):
                inside = bool(batch.label_mask[b, i + k]) and bool(
                    batch.document_ids[b, i] == batch.document_ids[b, i + k])
                if inside:
                    losses.append(F.cross_entropy(logits[b, i], tokens[b, i + k + 1]))
                    count += 1
        total = total + torch.stack(losses).sum() / count
    return scale / depths * total


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused-head"])
def test_prediction_loss_is_the_plain_torch_one(fused):
    """Two depths over two samples of two documents each, a target left out: the transform, the modules and the step
    term give the plain-torch loss and gradients, through the language-model loss's head (logits, or fused with the
    loss)."""
    import torch.distributed as dist

    from nanotron.config import DeepseekV3Config
    from nanotron.data.batch import MicroBatch
    from nanotron.data.loader import packed_documents
    from nanotron.models.deepseek_v3.mtp_loss import MultiTokenBatches, MultiTokenLoss
    from nanotron.models.registry import spec_for_config
    from nanotron.parallel.linear_cross_entropy import LinearCrossEntropy
    from nanotron.training.objective import LanguageModelLoss, StageOutputs

    config = DeepseekV3Config(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                              num_attention_heads=2, q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4,
                              qk_rope_head_dim=4, v_head_dim=4, n_routed_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=8, n_group=1, topk_group=1, first_k_dense_replace=0,
                              max_position_embeddings=16, num_nextn_predict_layers=2, mtp_loss_scaling_factor=0.3,
                              _use_doc_masking=True)
    torch.manual_seed(0)
    model = spec_for_config(config).model_class(config, 32)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.3 + (1.0 if param.dim() == 1 else 0.0))
    tokens = torch.randint(1, 32, (2, 13))
    ends = torch.zeros(2, 12, dtype=torch.bool)
    ends[0, 4], ends[1, 7] = True, True
    batch = MicroBatch(tokens[:, :-1], tokens[:, 1:], torch.ones(2, 12, dtype=torch.bool), torch.zeros(2),
                       **{name: value for name, value in packed_documents(ends).items() if name != "label_mask"})
    batch.label_mask = packed_documents(ends)["label_mask"]
    batch.label_mask[1, 10] = False
    transform = MultiTokenBatches(2)
    batch = transform.prepare(batch)
    batch.set_token_counts(batch.target_counts().float())
    # depth k: 12 - k targets per sample, less those that cross an end or land on the left-out target
    assert batch.extras["ahead_token_counts"].tolist() == [17.0, 13.0]
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    head = LinearCrossEntropy(dist.group.WORLD, 32, 5, compiled=False) if fused else None
    language_model = LanguageModelLoss(["main"], dist.group.WORLD, 32, head=head)
    output = model(batch.input_ids, position_ids=batch.position_ids, document_ids=batch.document_ids,
                   head=not fused, **transform.model_inputs(batch))
    stage = StageOutputs(model, output, last=True)
    language_model.compute(stage, batch)
    loss, statistics = MultiTokenLoss(config).compute(stage, batch)
    grads = torch.autograd.grad(loss, [model.mtp.depths["0"].eh_proj.weight, model.embed_tokens.weight])
    expected = _prediction_reference(model, batch, 2, 0.3)
    expected_grads = torch.autograd.grad(expected, [model.mtp.depths["0"].eh_proj.weight, model.embed_tokens.weight])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert statistics["mtp_loss"].sum() * 0.3 / 2 == pytest.approx(loss.item(), rel=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


# --- training, and layouts against one process ------------------------------------------------------------------

GLOBAL_BATCH = 16
MTP_BIAS = "mtp.depths.0.layer.mlp.expert_bias"  # the prediction module's layer has experts like the last layer
STEPS = parity_steps(short=10)
# 3 layers (a pipeline split [1, 2]), the first dense; 8 experts in 4 groups with a shared expert; YaRN; a bias
# fast enough to change the routing within the steps
# Trained with one multi-token prediction module, embeddings untied as DeepSeek-V3's: under pp the last stage holds
# its copy of the embedding for the module
TINY = {"is_deepseek_v3_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "max_position_embeddings": 64,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "bias_update_speed": 0.01, "aux_loss_alpha": 0.01,
        "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}


def _training_config(tiny_data, run: Path, *, tp: int = 1, mode: str = "REDUCE_SCATTER", pp: int = 1, dp: int = 1,
                     cp: int = 1, ep: int = 1, zero: int = 0, engine: str = "1f1b", virtual: int = 1,
                     layers: int = 3) -> dict:
    """The tiny model at a layout; ``layers`` 4 gives interleaved 1F1B a layer per chunk at pp=2, v=2."""
    base = tiny_config_dict(tiny_data, run)
    parallelism = {"dp": dp, "tp": tp, "pp": pp, "context_parallel_size": cp, "expert_parallel_size": ep,
                   "tp_mode": mode, "pp_engine": engine, "virtual_pipeline_size": virtual}
    if pp > 1 and virtual == 1:
        parallelism["pp_stage_layers"] = [1, layers - 1]
    return tiny_config_dict(
        tiny_data, run, model=base["model"] | {"model_config": TINY | {"num_hidden_layers": layers}},
        parallelism=parallelism, optimizer={"zero_stage": zero},
        tokens={"train_steps": STEPS, "micro_batch_size": 4,
                "batch_accumulation_per_replica": GLOBAL_BATCH // (4 * dp * ep)},
        checkpoints={"checkpoint_interval": 1000, "save_final_state": False})


def _reference(tiny_data, root: Path, layers: int) -> dict:
    """One process: first-step gradients, the curves every layout must give and the balancing biases at the end."""
    (result,) = run_distributed_each(first_step_then_train, 1, [
        {"config": _training_config(tiny_data, root, layers=layers)}])[0]
    return result


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory) -> dict:
    return _reference(tiny_data, tmp_path_factory.mktemp("reference"), layers=3)


@pytest.fixture(scope="module")
def four_layer_reference(tiny_data, tmp_path_factory) -> dict:
    """The reference of the 4-layer model, which interleaved 1F1B at pp=2 cuts into its 4 chunks."""
    return _reference(tiny_data, tmp_path_factory.mktemp("four_layer_reference"), layers=4)


def _assert_layouts_match(reference: dict, tiny_data, tmp_path, world: int, layouts: dict[str, dict]) -> None:
    """Each layout's first-step gradients as the reference's (unless ZeRO shards them), its losses (next-token and
    multi-token prediction's) and grad-norms within 1e-5 of the reference's over every step, and its balancing
    biases those of the reference on every rank; the reference trains (both losses fall) and its biases (every
    expert layer's, the prediction module's included) moved. The layouts run the reference's number of layers."""
    assert_reference_trains(reference["metrics"], STEPS)
    assert reference["metrics"][-1]["mtp_loss"] < reference["metrics"][0]["mtp_loss"] - 0.5
    biases = reference["buffers"]
    layers = 1 + max(int(name.split(".")[1]) for name in biases if name.startswith("layers."))
    assert set(biases) == {f"layers.{i}.mlp.expert_bias" for i in range(1, layers)} | {MTP_BIAS}
    assert all(bias.abs().sum() > 0 for bias in biases.values())
    calls = [{"config": _training_config(tiny_data, tmp_path / name, layers=layers, **layout)}
             for name, layout in layouts.items()]
    expected = assemble([reference], "grads")
    for name, ranks in zip(layouts, run_distributed_each(first_step_then_train, world, calls), strict=True):
        assert ranks[0]["sharded"] == (layouts[name].get("zero", 0) > 0), name
        if not ranks[0]["sharded"]:  # ZeRO reduces each gradient onto its shard: no rank holds it whole
            got = assemble(ranks, "grads")
            assert set(got) == set(expected), name
            for tensor, grad in expected.items():
                torch.testing.assert_close(got[tensor], grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {tensor}")
        curve = next(rank["metrics"] for rank in ranks if rank["metrics"])
        for ref, other in zip(reference["metrics"], curve, strict=True):
            for key in ("lm_loss", "mtp_loss", "grad_norm", "moe_load_balancing_loss"):
                assert other[key] == pytest.approx(ref[key], rel=1e-5), (name, ref["step"], key)
        for rank in ranks:
            for tensor, bias in rank["buffers"].items():
                assert torch.equal(bias, biases[tensor]), (name, tensor)


@pytest.mark.slow
def test_tp2_in_sequence_parallel_mode_matches_one_process(reference, tiny_data, tmp_path):
    _assert_layouts_match(reference, tiny_data, tmp_path, 2, {"tp2_rs": {"tp": 2}})


@pytest.mark.full_tier
@pytest.mark.parametrize("world, layout", [
    (2, {"tp": 2, "mode": "ALL_REDUCE"}), (2, {"pp": 2}), (2, {"pp": 2, "engine": "zb_h1"}), (2, {"dp": 2}),
    (2, {"cp": 2}), (2, {"ep": 2}), (4, {"ep": 2, "tp": 2}),
], ids=["tp2_ar", "pp2", "pp2_zb_h1", "dp2", "cp2", "ep2", "ep2_tp2"])  # zb_h1: the head's backward split in two
def test_each_layout_matches_one_process(reference, tiny_data, tmp_path, world, layout):
    _assert_layouts_match(reference, tiny_data, tmp_path, world, {"layout": layout})


@pytest.mark.parametrize("layout", [
    pytest.param({"dp": 2, "zero": 3}, marks=pytest.mark.slow),  # multi-rank: out of the quick tier
    pytest.param({"dp": 2, "zero": 1}, marks=pytest.mark.full_tier),
    pytest.param({"pp": 2, "engine": "zb_h1"}, marks=pytest.mark.full_tier),
    pytest.param({"pp": 2, "engine": "afab"}, marks=pytest.mark.full_tier),
    pytest.param({"pp": 2, "engine": "interleaved_1f1b", "virtual": 2}, marks=pytest.mark.full_tier),
], ids=str)
def test_zero_stages_and_pipeline_schedules_match_one_process(request, tiny_data, tmp_path, layout):
    """dp=2 with the optimizer state (ZeRO-1) or everything (ZeRO-3) sharded, and pp=2 under ZB-H1, AFAB and
    interleaved 1F1B (two chunks a stage: the 4-layer model's reference)."""
    fixture = "four_layer_reference" if layout.get("virtual", 1) > 1 else "reference"
    _assert_layouts_match(request.getfixturevalue(fixture), tiny_data, tmp_path, 2, {"layout": layout})


def _stored_tensors(model: Path, selected=lambda name: True) -> dict[str, torch.Tensor]:
    """The logical tensors of a checkpoint's ``model`` folder whose names are ``selected``, as stored."""
    from nanotron.checkpoint.logical_tensors import LogicalTensorReader

    reader = LogicalTensorReader(model)
    tensors = {}
    for name in sorted(name for name in reader.names() if selected(name)):
        tensors[name] = torch.empty(reader.logical_shape(name))
        reader.read_into(name, tuple(slice(0, n) for n in tensors[name].shape), tensors[name])
    return tensors


def _stored_biases(run: Path) -> dict[str, torch.Tensor]:
    """The balancing biases of a run's latest checkpoint, as stored."""
    latest = run / (run / "latest.txt").read_text().strip() / "model"
    return _stored_tensors(latest, lambda name: name.endswith("expert_bias"))


@pytest.mark.slow  # the quick tier has the block-level comparisons and the bias rule
def test_a_resumed_run_continues_exactly_with_the_balancing_biases(tiny_data, tmp_path):
    """2 steps, then 2 more from its checkpoint, give the 4 steps of a straight run: losses, grad-norms, expert loads
    and the biases, which every step moves by exactly bias_update_speed per expert (or not at all)."""
    from support.runs import metrics, train_through_cli

    def config(run: str, steps: int) -> dict:
        config = _training_config(tiny_data, tmp_path / run)
        config["tokens"] |= {"train_steps": steps, "batch_accumulation_per_replica": 1}
        config["optimizer"]["learning_rate_scheduler"] |= {"lr_warmup_steps": 1, "lr_decay_steps": 3}
        config["checkpoints"] |= {"resume_checkpoint_path": "auto", "save_final_state": True}
        return config

    train_through_cli(config("straight", 4), tmp_path / "straight.yaml")
    train_through_cli(config("resumed", 2), tmp_path / "first.yaml")
    halfway = _stored_biases(tmp_path / "resumed")
    train_through_cli(config("resumed", 4), tmp_path / "second.yaml")
    keys = ("step", "lm_loss", "mtp_loss", "grad_norm", "moe_expert_load")
    expected, got = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [[m[key] for key in keys] for m in got] == [[m[key] for key in keys] for m in expected]
    straight, resumed = _stored_biases(tmp_path / "straight"), _stored_biases(tmp_path / "resumed")
    assert set(straight) == {"layers.1.mlp.expert_bias", "layers.2.mlp.expert_bias", MTP_BIAS}
    for name, bias in straight.items():
        assert torch.equal(resumed[name], bias) and not torch.equal(halfway[name], bias), name
        steps = bias / TINY["bias_update_speed"]
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 4, name


# --- features: document masking, recomputation, compilation ----------------------------------------------------

def test_a_packed_sample_gives_the_loss_and_gradients_of_its_documents_alone():
    """float64, as test_doc_masking.py's families: three documents packed (the last cut by the window's end) against
    each run as its own sequence, through the latent attention (YaRN, interleaved rotary rows) and the experts: the
    same loss and gradients, to the fp32 rounding of the router's scores (which weigh the experts)."""
    from support.documents import assert_packed_sample_is_its_documents_alone

    yarn = {key: value for key, value in YARN.items() if key != "rope_theta"}
    model = _small_model(_use_doc_masking=True, rope_scaling=yarn).double().train()
    assert_packed_sample_is_its_documents_alone(model, (7, 11, 9), 9, SHAPE["vocab_size"], loss_rel=1e-10,
                                                grad_rtol=1e-7, grad_atol=1e-8)


def _feature_config(tiny_data, run: Path, recompute: str = "none", compiled: bool = False) -> dict:
    """The tiny DeepSeek-V3 for 3 steps under document masking, recomputed and compiled as asked."""
    config = _training_config(tiny_data, run)
    config["model"]["model_config"]["_use_doc_masking"] = True
    config["model"]["compile"] = compiled
    config["parallelism"]["recompute"] = recompute
    config["tokens"] |= {"train_steps": 3, "batch_accumulation_per_replica": 2}
    config["optimizer"]["learning_rate_scheduler"] |= {"lr_warmup_steps": 1, "lr_decay_steps": 2}
    return config


@pytest.fixture(scope="module")
def eager_curve(tiny_data, tmp_path_factory) -> list[dict]:
    from support.runs import train_in_process

    return train_in_process(_feature_config(tiny_data, tmp_path_factory.mktemp("eager")))


@pytest.mark.parametrize("recompute, compiled", [
    ("selective", False),
    pytest.param("full", False, marks=pytest.mark.full_tier),
    pytest.param("pointwise", False, marks=pytest.mark.full_tier),
    pytest.param("none", True, marks=pytest.mark.full_tier),
    pytest.param("pointwise", True, marks=pytest.mark.full_tier),
], ids=["selective", "full", "pointwise", "compiled", "compiled-pointwise"])
def test_recomputation_and_compilation_leave_training_unchanged_under_document_masking(
        eager_curve, tiny_data, tmp_path, recompute, compiled):
    """fp32, 3 steps of 2 micro-batches: the losses, grad-norms and balance losses of the eager run without
    recomputation, to 1e-6 (recomputation reruns the routing and the latents in the backward)."""
    from support.runs import train_in_process

    curve = train_in_process(_feature_config(tiny_data, tmp_path / "run", recompute, compiled))
    assert len(curve) == len(eager_curve) == 3
    for expected, got in zip(eager_curve, curve, strict=True):
        for key in ("lm_loss", "grad_norm", "moe_load_balancing_loss"):
            assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-6), (expected["step"], key)


# --- features: FP8 -----------------------------------------------------------------------------------------------

@pytest.mark.slow  # the quick tier has the cache's own check; test_fp8.py checks the products themselves
def test_fp8_converts_every_projection_and_expert_but_the_router_and_trains_as_its_twin(tiny_data, tmp_path):
    """Under fp8.enabled (emulated on the CPU) every linear of the decoder layers takes FP8 products, MLA's
    compressions included (as DeepSeek-V3 trained: its report keeps only the embedding, the output head, the MoE
    gating, the norms and the attention core in BF16), and so do the routed and the shared experts; the router keeps
    the model dtype. The run trains within 2% of its twin without FP8."""
    from support.runs import train_fp8_twins

    _, fp8 = train_fp8_twins(lambda run: _training_config(tiny_data, run), tmp_path)
    attention = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    expected = {f"layers.{i}.attn.{name}" for i in range(3) for name in attention}
    assert fp8["linears"] == expected | {"layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj"}
    assert fp8["experts"] == {f"layers.{i}.mlp.{group}" for i in (1, 2) for group in ("experts", "shared_expert")}


def test_fp8_exclude_modules_keeps_the_compressions_in_the_model_dtype_as_docs_config_says():
    """``fp8.exclude_modules: ['_a_proj']`` (docs/config.md) leaves exactly q_a_proj and kv_a_proj_with_mqa out."""
    from nanotron.config import FP8Args
    from nanotron.nn.fp8 import FP8Matmul, fp8_converter

    model = _small_model()
    fp8_converter(FP8Args(enabled=True, exclude_modules=["_a_proj"]))(model)
    kept = {name for name, module in model.named_modules()
            if hasattr(module, "matmul") and not isinstance(module.matmul, FP8Matmul)}
    attention = {name for name in kept if ".attn." in name}
    assert attention == {f"layers.{i}.attn.{name}" for i in range(3) for name in ("q_a_proj", "kv_a_proj_with_mqa")}


# --- a trained checkpoint: generate and eval -------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> dict:
    from support.trained_checkpoint import train_with_evals

    root = tmp_path_factory.mktemp("trained")
    return train_with_evals(_training_config(tiny_data, root / "run"), tiny_data, root)


@pytest.mark.slow  # the quick tier has the cache's own check
def test_nanotron_generate_on_a_checkpoint_gives_the_same_text_with_and_without_the_cache(trained, tmp_path):
    """Through the latent cache and through whole recomputation."""
    from support.trained_checkpoint import assert_generation_is_the_same_without_the_cache

    assert_generation_is_the_same_without_the_cache(trained["run"], tmp_path)


@pytest.mark.slow  # the quick tier has the cache's own check
def test_nanotron_eval_on_a_checkpoint_gives_the_in_loop_scores(trained, tiny_data, tmp_path):
    from support.trained_checkpoint import assert_eval_gives_the_in_loop_scores

    assert_eval_gives_the_in_loop_scores(trained, tiny_data, tmp_path)


# --- the example config -----------------------------------------------------------------------------------------

@pytest.mark.slow  # the quick tier has the block-level comparisons and the bias rule
def test_the_example_trains_on_the_quickstart_data_as_written(tiny_data, tmp_path):
    """examples/config_tiny_deepseek_v3.yaml with the quickstart's paths swapped for the test corpus's, 2 steps, its
    own parallelism (ep 2), its multi-token prediction module logging mtp_loss."""
    records = train_example(ROOT / "examples" / "config_tiny_deepseek_v3.yaml", tiny_data, tmp_path)
    assert [record["step"] for record in records] == [1, 2]
    assert all(math.isfinite(record["lm_loss"]) and record["moe_load_balancing_loss"] > 0 for record in records)
    assert all(math.isfinite(record["mtp_loss"]) for record in records)


# --- rules ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_changes, parallelism, fragments", [
    ({"qk_rope_head_dim": 7}, {}, ("model.model_config.qk_rope_head_dim (7) must be even",)),
    ({"kv_lora_rank": 0}, {}, ("model.model_config.kv_lora_rank must be >= 1",)),
    ({"topk_group": 5}, {}, ("model.model_config.topk_group (5) must be in [1, model.model_config.n_group] = [1, 4]",)),
    ({"n_group": 3}, {}, ("model.model_config.n_group (3) must divide model.model_config.n_routed_experts (8)",)),
    ({"num_experts_per_tok": 5}, {}, ("num_experts_per_tok (5) must be in [1, topk_group * n_routed_experts / "
                                      "n_group] = [1, 4]",)),
    ({}, {"expert_parallel_size": 3}, ("n_routed_experts (8) must be divisible", "expert_parallel_size (3)")),
    ({"first_k_dense_replace": 3}, {}, ("first_k_dense_replace (3) must be in [0, model.model_config."
                                        "num_hidden_layers)",)),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, {}, ("rope_scaling misses original_max_position_"
                                                                  "embeddings",)),
    ({"num_nextn_predict_layers": -1}, {}, ("model.model_config.num_nextn_predict_layers must be >= 0 (got -1)",)),
    ({"mtp_loss_scaling_factor": -0.1}, {}, ("model.model_config.mtp_loss_scaling_factor must be >= 0 (got -0.1)",)),
], ids=["rope-dim", "kv-rank", "topk-group", "n-group", "top-k", "ep", "dense-layers", "yarn-keys", "mtp-depth",
        "mtp-weight"])
def test_bad_config_is_one_error_line_naming_the_key(tiny_data, tmp_path, model_changes, parallelism, fragments):
    config = _training_config(tiny_data, tmp_path / "run")
    config["model"]["model_config"] |= model_changes
    config["parallelism"] |= parallelism
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, *fragments)
    assert not (tmp_path / "run").exists()
