"""The Qwen3 family (``is_qwen3_config``): Qwen3 and Qwen3-MoE against transformers' Qwen3ForCausalLM and
Qwen3MoeForCausalLM (logits at tp 1 and 2 and ep 2, greedy generation, conversion both ways, sizes checked against
the stored tensors), the q/k norms' placement and costs, layouts against one process (tp in both modes, pp, dp, cp,
ep, ep x tp), the example configs, and every rule of the config named in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from support import ROOT
from support.configs import tiny_config_dict, write_config
from support.distributed import run_distributed_each
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

# head_dim 24 is not hidden_size / num_attention_heads = 16: the head size is decoupled
SHAPE = dict(vocab_size=112, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, max_position_embeddings=128, rope_theta=5000.0, bos_token_id=1,
             eos_token_id=2, pad_token_id=0, initializer_range=0.1)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
WINDOW = 3
# transformers class prefix, config changes, and the layers that should be mixtures of experts and slide once
# converted
VARIANTS = {
    # sliding windows shorter than the prompts on the two last layers, untied embeddings
    "dense": ("Qwen3", {"use_sliding_window": True, "sliding_window": WINDOW,
                        "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2}, [], [2, 3]),
    # every second layer has experts, renormalised top-k weights, tied embeddings
    "moe-sparse-step": ("Qwen3Moe", EXPERTS | {"decoder_sparse_step": 2, "norm_topk_prob": True,
                                               "tie_word_embeddings": True}, [1, 3], []),
    # a dense first layer, raw top-k weights, every layer sliding (Qwen3-MoE's only window)
    "moe-mlp-only": ("Qwen3Moe", EXPERTS | {"mlp_only_layers": [0], "use_sliding_window": True,
                                            "sliding_window": WINDOW}, [1, 2, 3], [0, 1, 2, 3]),
}
NEW_TOKENS = 12


def _save_random(prefix: str, folder: Path, changes: dict) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**SHAPE | changes)
    away_from_initial_values(getattr(transformers, f"{prefix}ForCausalLM")(config)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request, tmp_path_factory):
    prefix, changes, moe_layers, sliding = VARIANTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf = _save_random(prefix, root / "hf", changes)
    outcome = cli("convert", "hf-to-nanotron", "--hf-path", hf, "--save-path", root / "nanotron")
    assert outcome.code == 0, outcome.stderr[-3000:]
    return {"name": request.param, "hf": hf, "ckpt": root / "nanotron", "moe_layers": moe_layers,
            "sliding": sliding, "root": root}


def test_logits_and_greedy_generation_match_transformers(converted):
    """Prompts of different lengths (left padding), with and without the KV cache, windows shorter than them."""
    from nanotron.models.moe.model import MoEFeedForward

    ours = one_process_outputs(converted["ckpt"], PROMPTS, NEW_TOKENS)
    theirs = transformers_outputs(converted["hf"], PROMPTS, NEW_TOKENS)
    layers = ours["layers"]
    assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, MoEFeedForward)] == converted["moe_layers"]
    assert [i for i, layer in enumerate(layers) if layer.attn.window == WINDOW] == converted["sliding"]
    assert (ours["logits"] - theirs["logits"]).abs().max() < 1e-4
    assert ours["cached"] == ours["uncached"] == theirs["greedy"]


@pytest.mark.full_tier
@pytest.mark.slow  # the quick tier compares one process with transformers above
def test_logits_match_transformers_at_tp2_and_ep2(converted):
    """tp=2 splits the heads (each rank normalises its own with the replicated q/k norms) and the experts' widths;
    ep=2 splits the experts. 48 new tokens: generation agrees with transformers well past the windows."""
    theirs = transformers_outputs(converted["hf"], PROMPTS, 48)
    layouts = [{"tp": 2}] + ([{"ep": 2}] if converted["moe_layers"] else [])
    for layout, ranks in zip(layouts, run_distributed_each(nanotron_outputs, 2, [
            {"ckpt": str(converted["ckpt"]), "pp": 1, "tp": 1} | layout for layout in layouts]), strict=True):
        for rank in ranks:
            assert (rank["logits"] - theirs["logits"]).abs().max() < 1e-4, layout
            assert rank["cached"] == rank["uncached"] == theirs["greedy"], layout


def test_conversion_back_is_exact(converted):
    before, after, exported = export_back_exactly(converted["hf"], converted["ckpt"], converted["root"] / "back",
                                                  PROMPTS[0])
    assert any(name.endswith("self_attn.k_norm.weight") for name in exported)
    assert after.architectures == before.architectures
    keys = ["head_dim", "sliding_window", "use_sliding_window", "tie_word_embeddings"]
    keys += ["layer_types"] if converted["name"] == "dense" else [
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef"]
    assert {key: getattr(after, key) for key in keys} == {key: getattr(before, key) for key in keys}
    if converted["moe_layers"]:
        step, dense = after.decoder_sparse_step, after.mlp_only_layers
        assert [i for i in range(4) if i not in dense and (i + 1) % step == 0] == converted["moe_layers"]


def test_checkpoint_records_the_qwen3_type_and_its_head_size(converted):
    model = json.loads((converted["ckpt"] / "checkpoint.json").read_text())["model"]
    assert model["type"] == "qwen3" and model["config"]["head_dim"] == 24
    assert (model["config"]["moe_config"] is None) == (converted["name"] == "dense")


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    prefix, changes, _, _ = VARIANTS["moe-mlp-only"]
    return _save_random(prefix, tmp_path_factory.mktemp("stored"), changes)


@pytest.mark.parametrize("config_changes, drop, fragment", [
    ({"head_dim": 16}, None, "'layers.0.attn.k_norm.weight' is (24,) in the weights but (16,) in the model"),
    ({"moe_intermediate_size": 16}, None, "'layers.1.mlp.experts.down_proj' is (4, 64, 32) in the weights but "
                                          "(4, 64, 16)"),
    ({"mlp_only_layers": [0, 1]}, None, "'model.layers.1.mlp.gate_proj.weight', which the weights lack"),
    ({}, "layers.2.self_attn.q_norm.weight", "'model.layers.2.self_attn.q_norm.weight', which the weights lack"),
], ids=["head-size", "expert-width", "fewer-moe-layers", "no-q-norm"])
def test_declared_sizes_are_checked_against_the_stored_tensors(stored, tmp_path, config_changes, drop, fragment):
    """A config.json whose shapes disagree with the weights (or weights without a q norm) is refused in one line
    before anything is written."""
    outcome = convert_altered(stored, tmp_path, config_changes, drop)
    assert_user_error(outcome, "does not match the weights", fragment)
    assert not (tmp_path / "out").exists()


def test_conversion_refuses_transformers_attention_bias_which_biases_o_proj(stored, tmp_path):
    outcome = convert_altered(stored, tmp_path, {"attention_bias": True})
    assert_user_error(outcome, "attention_bias True is not supported", "biases o_proj too")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes, moe, fragment", [
    ({"attention_bias": True}, {}, "q/k/v biases"),
    ({"no_rope_layer": 2}, None, "layers without RoPE, which Qwen3ForCausalLM"),
    ({}, {"enable_shared_expert": True}, "a shared expert, which Qwen3MoeForCausalLM"),
    ({"sliding_window_size": 4, "sliding_window_layers": [1]}, {}, "sliding windows on some layers only"),
], ids=["bias", "nope", "shared-expert", "some-windows"])
def test_what_the_transformers_architectures_cannot_express_is_refused_on_export(changes, moe, fragment):
    from nanotron.config import Qwen3Config, Qwen3MoEConfig
    from nanotron.errors import CheckpointError
    from nanotron.models.qwen3.hf_adapter import Qwen3HFAdapter

    experts = None if moe is None else Qwen3MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=32, **moe)
    config = Qwen3Config(num_hidden_layers=2, moe_config=experts, **changes)
    with pytest.raises(CheckpointError, match=fragment):
        Qwen3HFAdapter().config_to_hf(config, "float32")


# --- the model: q/k norms, costs, initial weights ---------------------------------------------------------------

def test_costs_count_every_parameter_with_the_q_k_norms_and_the_experts_a_token_uses():
    from nanotron.config import Qwen3Config, Qwen3MoEConfig
    from nanotron.models.registry import spec_for_config

    hidden, head_dim, ffn = 32, 24, 16
    moe = Qwen3MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=ffn, mlp_only_layers=[0])
    for experts in (None, moe):
        config = Qwen3Config(vocab_size=64, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, moe_config=experts)
        spec = spec_for_config(config)
        with torch.device("meta"):
            model = spec.model_class(config, 64)
        costs = spec.costs(config, 64, 16)
        assert costs.parameters == sum(param.numel() for param in model.parameters())
    used = 2 * 3 * hidden * ffn + hidden * 4  # k experts and the router
    assert costs.layer_flops[1] - costs.layer_flops[0] == 6 * (used - 3 * hidden * 48)


def test_the_q_k_norms_start_at_one_and_are_replicated_under_tp():
    from nanotron.config import Qwen3Config
    from nanotron.models.registry import spec_for_config
    from nanotron.parallel.tensor_parallel import HeadNorm

    config = Qwen3Config(num_hidden_layers=2)
    spec = spec_for_config(config)
    weight = torch.empty(8)
    spec.init_rule("layers.1.attn.k_norm.weight", config, 0.02)(weight, torch.Generator())
    assert torch.equal(weight, torch.ones(8))
    plan = spec.tensor_parallel_plan(config)
    assert plan["attn.q_norm"] == plan["attn.k_norm"] == HeadNorm()


# --- training, and layouts against one process ------------------------------------------------------------------

GLOBAL_BATCH = 16
STEPS = parity_steps(short=10)
# 3 layers (a pipeline split [1, 2]); 4 heads of 32 over a hidden size of 64; a window on layer 1
TINY = {"is_qwen3_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 64, "tie_word_embeddings": True, "sliding_window_size": 8,
        "sliding_window_layers": [1]}
# layer 0 dense, layers 1-2 four experts, top-2, with the router's z-loss
TINY_MOE = {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0],
            "router_aux_loss_coef": 0.01, "router_z_loss_coef": 0.001}


def _training_config(tiny_data, run: Path, *, experts: bool = False, tp: int = 1, mode: str = "REDUCE_SCATTER",
                     pp: int = 1, dp: int = 1, cp: int = 1, ep: int = 1, micro_batch: int = 4,
                     scope: str = "sequence", zero: int = 0, engine: str | None = None, virtual: int = 1,
                     layers: int = 3) -> dict:
    """The tiny Qwen3 (with ``experts``, Qwen3-MoE's balance loss over each sequence or, with ``scope:
    global_batch``, over the global batch, under the AFAB schedule at pp > 1) at a layout, over the same global
    batch at every layout; ``layers`` 4 gives interleaved 1F1B a layer per chunk at pp=2, v=2."""
    base = tiny_config_dict(tiny_data, run)
    moe = dict(TINY_MOE, load_balancing_scope=scope) if experts else None
    model = base["model"] | {"model_config": TINY | {"num_hidden_layers": layers, "moe_config": moe}}
    engine = engine or ("afab" if scope == "global_batch" else "1f1b")
    parallelism = {"dp": dp, "tp": tp, "pp": pp, "context_parallel_size": cp, "expert_parallel_size": ep,
                   "tp_mode": mode, "pp_engine": engine, "virtual_pipeline_size": virtual}
    if pp > 1 and virtual == 1:
        parallelism["pp_stage_layers"] = [1, layers - 1]
    return tiny_config_dict(
        tiny_data, run, model=model, parallelism=parallelism, optimizer={"zero_stage": zero},
        tokens={"train_steps": STEPS, "micro_batch_size": micro_batch,
                "batch_accumulation_per_replica": GLOBAL_BATCH // (micro_batch * dp * ep)},
        checkpoints={"checkpoint_interval": 1000, "save_final_state": False})


def _references(tiny_data, root: Path, variants: dict[str, dict], layers: int) -> dict:
    """One process per variant: first-step gradients and the curves every layout must give."""
    calls = [{"config": _training_config(tiny_data, root / name, layers=layers, **changes)}
             for name, changes in variants.items()]
    return {name: ranks[0] for name, ranks in zip(variants, run_distributed_each(first_step_then_train, 1, calls))}


@pytest.fixture(scope="module")
def references(tiny_data, tmp_path_factory) -> dict:
    """Dense and with experts (the balance loss per sequence, and over the global batch)."""
    variants = {"dense": {}, "moe": {"experts": True}, "global": {"experts": True, "scope": "global_batch"}}
    return _references(tiny_data, tmp_path_factory.mktemp("references"), variants, layers=3)


@pytest.fixture(scope="module")
def four_layer_references(tiny_data, tmp_path_factory) -> dict:
    """The references of the 4-layer model, which interleaved 1F1B at pp=2 cuts into its 4 chunks."""
    return _references(tiny_data, tmp_path_factory.mktemp("four_layer_references"),
                       {"dense": {}, "moe": {"experts": True}}, layers=4)


def _assert_layouts_match(reference: dict, tiny_data, tmp_path, world: int, layouts: dict[str, dict],
                          scope: str = "sequence", steps: int = STEPS) -> None:
    """Each layout's first-step gradients as the reference's (unless ZeRO shards them), and its losses and grad-norms
    within 1e-5 of the reference's over its first ``steps`` steps; the reference trains."""
    assert_reference_trains(reference["metrics"], STEPS)
    experts = "moe_z_loss" in reference["metrics"][0]
    calls = [{"config": _training_config(tiny_data, tmp_path / name, experts=experts, scope=scope,
                                         **layout)}
             for name, layout in layouts.items()]
    expected = assemble([reference], "grads")
    assert expected["layers.0.attn.q_norm.weight"].abs().sum() > 0
    for name, ranks in zip(layouts, run_distributed_each(first_step_then_train, world, calls), strict=True):
        assert ranks[0]["sharded"] == (layouts[name].get("zero", 0) > 0), name
        if not ranks[0]["sharded"]:  # ZeRO reduces each gradient onto its shard: no rank holds it whole
            got = assemble(ranks, "grads")  # the replicated q/k norms: every rank's gradient equal, summed over TP
            assert set(got) == set(expected), name
            for tensor, grad in expected.items():
                torch.testing.assert_close(got[tensor], grad, rtol=1e-4, atol=1e-6, msg=f"{name}: {tensor}")
        curve = next(rank["metrics"] for rank in ranks if rank["metrics"])
        for ref, other in zip(reference["metrics"][:steps], curve[:steps], strict=True):
            for key in ("lm_loss", "grad_norm") + (("moe_load_balancing_loss", "moe_z_loss") if experts else ()):
                assert other[key] == pytest.approx(ref[key], rel=1e-5), (name, ref["step"], key)


@pytest.mark.slow
def test_tp2_in_sequence_parallel_mode_matches_one_process(references, tiny_data, tmp_path):
    _assert_layouts_match(references["dense"], tiny_data, tmp_path, 2, {"tp2_rs": {"tp": 2}})


@pytest.mark.full_tier
def test_tp2_all_reduce_pp2_dp2_and_cp2_match_one_process(references, tiny_data, tmp_path):
    _assert_layouts_match(references["dense"], tiny_data, tmp_path, 2, {
        "tp2_ar": {"tp": 2, "mode": "ALL_REDUCE"}, "pp2": {"pp": 2}, "dp2": {"dp": 2}, "cp2": {"cp": 2}})


@pytest.mark.full_tier
def test_expert_parallel_times_tensor_parallel_matches_one_process(references, tiny_data, tmp_path):
    _assert_layouts_match(references["moe"], tiny_data, tmp_path, 4, {"ep2_tp2": {"ep": 2, "tp": 2}})


@pytest.mark.full_tier
def test_expert_parallel_matches_one_process(references, tiny_data, tmp_path):
    _assert_layouts_match(references["moe"], tiny_data, tmp_path, 2, {"ep2": {"ep": 2}})


def test_global_batch_balance_loss_at_dp2_matches_one_process(references, tiny_data, tmp_path):
    """The expert counts pooled over the data-parallel ranks and the micro-batches before the first backward: the
    same gradients, losses and grad-norms as one process over the same global batch."""
    _assert_layouts_match(references["global"], tiny_data, tmp_path, 2, {"dp2": {"dp": 2}}, scope="global_batch")


@pytest.mark.full_tier
def test_global_batch_balance_loss_matches_one_process_at_every_split(references, tiny_data, tmp_path):
    """One micro-batch of 16 sequences against four of 4, expert parallelism, and a pipeline (AFAB) whose stages
    pool their own layers' counts."""
    reference = references["global"]
    _assert_layouts_match(reference, tiny_data, tmp_path, 2, {"ep2": {"ep": 2}, "pp2_afab": {"pp": 2}},
                          scope="global_batch")
    # Micro-batches of another size, and attention split over ranks, round products differently: both curves stay
    # within 1e-5 for 11 steps and part by 1.1e-5 and 1.5e-5 in grad-norm at step 12 of 20 (measured).
    _assert_layouts_match(reference, tiny_data, tmp_path, 1, {"acc1": {"micro_batch": 16}}, scope="global_batch",
                          steps=10)
    _assert_layouts_match(reference, tiny_data, tmp_path, 2, {"cp2": {"cp": 2}}, scope="global_batch", steps=10)


@pytest.mark.parametrize("model, layout", [
    pytest.param("moe", {"dp": 2, "zero": 3}, marks=pytest.mark.slow),  # multi-rank: out of the quick tier
    pytest.param("moe", {"dp": 2, "zero": 1}, marks=pytest.mark.full_tier),
    pytest.param("dense", {"dp": 2, "zero": 3}, marks=pytest.mark.full_tier),
    pytest.param("moe", {"pp": 2, "engine": "zb_h1"}, marks=pytest.mark.full_tier),
    pytest.param("moe", {"pp": 2, "engine": "afab"}, marks=pytest.mark.full_tier),
    pytest.param("moe", {"pp": 2, "engine": "interleaved_1f1b", "virtual": 2, "layers": 4},
                 marks=pytest.mark.full_tier),
    pytest.param("dense", {"pp": 2, "engine": "interleaved_1f1b", "virtual": 2, "layers": 4},
                 marks=pytest.mark.full_tier),
], ids=str)
def test_zero_stages_and_pipeline_schedules_match_one_process(request, tiny_data, tmp_path, model, layout):
    """dp=2 with the optimizer state (ZeRO-1) or everything (ZeRO-3) sharded, and pp=2 under ZB-H1, AFAB and
    interleaved 1F1B (two chunks a stage: the 4-layer model's references)."""
    fixture = "four_layer_references" if layout.get("layers") == 4 else "references"
    reference = request.getfixturevalue(fixture)[model]
    _assert_layouts_match(reference, tiny_data, tmp_path, 2, {"layout": layout})


def _feature_curve(tiny_data, run: Path, recompute: str = "none", compiled: bool = False) -> list[tuple]:
    """Qwen3-MoE with document masking and a window, 3 steps, recomputed and compiled as asked: each step's loss,
    grad-norm and balance loss."""
    from support.runs import train_in_process

    config = _training_config(tiny_data, run, experts=True)
    config["model"]["model_config"]["_use_doc_masking"] = True
    config["model"]["compile"] = compiled
    config["parallelism"]["recompute"] = recompute
    config["tokens"]["train_steps"] = 3
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    return [(r["lm_loss"], r["grad_norm"], r["moe_load_balancing_loss"]) for r in train_in_process(config)]


@pytest.fixture(scope="module")
def eager_curve(tiny_data, tmp_path_factory) -> list[tuple]:
    return _feature_curve(tiny_data, tmp_path_factory.mktemp("eager"))


def test_recomputation_leaves_training_unchanged_under_document_masking(eager_curve, tiny_data, tmp_path):
    """Every recomputation (the q/k norms and the routing rebuilt in the backward) trains exactly as none."""
    curves = {recompute: _feature_curve(tiny_data, tmp_path / recompute, recompute)
              for recompute in ("full", "selective", "pointwise")}
    assert len(eager_curve) == 3
    assert curves["full"] == curves["selective"] == curves["pointwise"] == eager_curve


@pytest.mark.parametrize("recompute", ["none", pytest.param("pointwise", marks=pytest.mark.full_tier)])
@pytest.mark.slow
def test_compilation_leaves_training_unchanged_under_document_masking(eager_curve, tiny_data, tmp_path, recompute):
    """``model.compile``, alone and with pointwise recomputation: the eager run's losses, grad-norms and balance
    losses to 1e-5 (fp32 sums in another order)."""
    curve = _feature_curve(tiny_data, tmp_path / "run", recompute, compiled=True)
    assert len(curve) == len(eager_curve)
    for expected, got in zip(eager_curve, curve, strict=True):
        assert got == pytest.approx(expected, rel=1e-5)


# --- features: FP8 ----------------------------------------------------------------------------------------------

@pytest.mark.slow  # test_fp8.py checks the products themselves
def test_fp8_converts_every_projection_and_expert_but_the_gates_and_trains_as_its_twin(tiny_data, tmp_path):
    """Under fp8.enabled (emulated on the CPU) every linear of the decoder layers takes FP8 products, and so do the
    routed and the shared experts; the router and the shared expert's gate keep the model dtype, as the q/k norms
    do. The run trains within 2% of its twin without FP8."""
    from support.runs import train_fp8_twins

    def config(run: Path) -> dict:
        config = _training_config(tiny_data, run, experts=True)
        config["model"]["model_config"]["moe_config"] |= {"enable_shared_expert": True,
                                                          "shared_expert_intermediate_size": 48}
        return config

    _, fp8 = train_fp8_twins(config, tmp_path)
    expected = {f"layers.{i}.attn.{name}" for i in range(3) for name in ("qkv_proj", "o_proj")}
    assert fp8["linears"] == expected | {"layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj"}
    assert fp8["experts"] == {f"layers.{i}.mlp.{group}" for i in (1, 2) for group in ("experts", "shared_expert")}


# --- a trained checkpoint: generate and eval --------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> dict:
    from support.trained_checkpoint import train_with_evals

    root = tmp_path_factory.mktemp("trained")
    return train_with_evals(_training_config(tiny_data, root / "run", experts=True), tiny_data, root)


@pytest.mark.slow  # the quick tier has the cache's own check
def test_nanotron_generate_on_a_checkpoint_gives_the_same_text_with_and_without_the_cache(trained, tmp_path):
    """Through the cache (the windowed layer's keys included) and through whole recomputation."""
    from support.trained_checkpoint import assert_generation_is_the_same_without_the_cache

    assert_generation_is_the_same_without_the_cache(trained["run"], tmp_path)


@pytest.mark.slow
def test_nanotron_eval_on_a_checkpoint_gives_the_in_loop_scores(trained, tiny_data, tmp_path):
    from support.trained_checkpoint import assert_eval_gives_the_in_loop_scores

    assert_eval_gives_the_in_loop_scores(trained, tiny_data, tmp_path)


# --- the example configs ----------------------------------------------------------------------------------------

EXAMPLES = {"dense": ROOT / "examples" / "config_tiny_qwen3.yaml",
            "moe": ROOT / "examples" / "config_tiny_qwen3_moe.yaml"}


@pytest.mark.parametrize("name", list(EXAMPLES))
@pytest.mark.slow
def test_the_examples_train_on_the_quickstart_data_as_written(name, tiny_data, tmp_path):
    """Each file with the quickstart's paths swapped for the test corpus's, 2 steps, its own parallelism."""
    records = train_example(EXAMPLES[name], tiny_data, tmp_path)
    assert [record["step"] for record in records] == [1, 2]
    assert all(math.isfinite(record["lm_loss"]) for record in records)
    assert all((record.get("moe_z_loss", 0) > 0) == (name == "moe") for record in records)


# --- rules ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_changes, moe_changes, parallelism, fragments", [
    ({"head_dim": 23}, None, {}, ("model.model_config.head_dim (23) must be an even number",)),
    ({"head_dim": None, "num_attention_heads": 3, "num_key_value_heads": 1}, None, {},
     ("hidden_size (64) is not divisible by model.model_config.num_attention_heads (3)", "set model.model_config."
                                                                                          "head_dim")),
    ({}, {}, {"expert_parallel_size": 3}, ("moe_config.num_experts (4) must be divisible",
                                           "expert_parallel_size (3)")),
    ({}, {"decoder_sparse_step": 0}, {}, ("moe_config.decoder_sparse_step must be >= 1",)),
    ({}, {"mlp_only_layers": [0, 3]}, {}, ("moe_config.mlp_only_layers ([0, 3]) must list distinct layer indices",)),
    ({}, {"mlp_only_layers": [0, 1, 2]}, {}, ("leave no layer with experts",
                                                                    "moe_config: null")),
    ({}, {"router_z_loss_coef": -0.1}, {}, ("moe_config.router_z_loss_coef must be >= 0",)),
    ({}, {"load_balancing_scope": "micro_batch"}, {}, ("moe_config.load_balancing_scope",)),
    ({}, {"load_balancing_scope": "global_batch"}, {"pp": 2, "pp_stage_layers": [1, 2], "pp_engine": "1f1b"},
     ("load_balancing_scope: global_batch needs every forward of a step before its first backward",
      "parallelism.pp_engine 1f1b", "set pp_engine: afab")),
    ({}, {"load_balancing_scope": "global_batch"}, {"pp": 2, "pp_stage_layers": [1, 2], "pp_engine": "zb_h1"},
     ("parallelism.pp_engine zb_h1",)),
], ids=["odd-head-dim", "heads", "ep", "sparse-step", "mlp-only-range", "no-moe-layer", "z-loss", "balance-scope",
        "global-balance-1f1b", "global-balance-zero-bubble"])
def test_bad_config_is_one_error_line_naming_the_key(tiny_data, tmp_path, model_changes, moe_changes, parallelism,
                                                     fragments):
    config = _training_config(tiny_data, tmp_path / "run", experts=moe_changes is not None)
    config["model"]["model_config"] |= model_changes
    if moe_changes is not None:
        config["model"]["model_config"]["moe_config"] |= moe_changes
    config["parallelism"] |= parallelism
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, *fragments)
    assert not (tmp_path / "run").exists()



# --- the load-balancing loss over the global batch ---------------------------------------------------------------

def _global_balance(logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Plain torch: each layer's ``E * sum_e f_e * P_e`` over all the tokens of ``logits`` [tokens, E] (f detached),
    averaged over the layers."""
    losses = []
    for layer in logits:
        probs = layer.float().softmax(-1)
        experts = probs.shape[-1]
        share = torch.nn.functional.one_hot(probs.topk(top_k).indices, experts).sum(1).float().mean(0) / top_k
        losses.append(experts * (share * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def _router_logits(model) -> list[list[torch.Tensor]]:
    """Every MoE router's outputs, one list per layer, appended at each forward."""
    from nanotron.models.moe.model import MoEFeedForward

    outputs = []
    for layer in model.layers.values():
        if isinstance(layer.mlp, MoEFeedForward):
            outputs.append([])
            layer.mlp.router.register_forward_hook(lambda module, args, out, into=outputs[-1]: into.append(out))
    return outputs


def test_global_batch_balance_loss_and_gradients_match_plain_torch_on_the_concatenated_batch():
    """Two micro-batches through the router's step term, pooled as the step program pools them, give the balance
    loss of the concatenated batch (logged) and its gradients; pooling each micro-batch's own counts would not."""
    from nanotron.config.qwen3 import Qwen3Config, Qwen3MoEConfig
    from nanotron.models.moe.model import RouterLosses
    from nanotron.models.qwen3.model import Qwen3ForCausalLM
    from nanotron.parallel.statistics import accumulate
    from nanotron.training.objective import StageOutputs

    torch.manual_seed(0)
    moe = Qwen3MoEConfig(**TINY_MOE | {"router_aux_loss_coef": 1.0, "router_z_loss_coef": 0.0,
                                       "load_balancing_scope": "global_batch"})
    config = Qwen3Config(**{k: v for k, v in TINY.items() if k != "is_qwen3_config"}, moe_config=moe)
    model = Qwen3ForCausalLM(config, 384)
    for param in model.parameters():
        torch.nn.init.normal_(param, 0, 0.3)
    batches = [torch.randint(0, 384, (2, 12)) for _ in range(2)]
    logits = _router_logits(model)

    model(input_ids=torch.cat(batches))
    expected = _global_balance([layer.pop() for layer in logits], moe.top_k)
    expected.backward()
    expected_grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad()

    term, losses, sums = RouterLosses(config, sequences_per_step=4), [], {}
    for batch in batches:
        model(input_ids=batch)
        loss, statistics = term.compute(StageOutputs(model, None, True), None)
        losses.append(loss)
        accumulate(sums, statistics)
    term.pool({name: sums[name] for name in term.pooled()})
    torch.stack(losses).sum().backward(retain_graph=True)  # the per-micro-batch pooling below reuses the graph
    assert term.metrics(sums)["moe_load_balancing_loss"] == pytest.approx(expected.item(), rel=1e-6)
    assert expected_grads.keys() == {name for name, param in model.named_parameters() if param.grad is not None}
    for name, param in model.named_parameters():
        if name in expected_grads:
            torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=name)

    per_micro_batch = sum(_global_balance([layer[index] for layer in logits], moe.top_k) for index in range(2)) / 2
    assert per_micro_batch.item() != pytest.approx(expected.item(), rel=1e-3)
    model.zero_grad()
    per_micro_batch.backward()
    router = "layers.1.mlp.router.weight"
    assert not torch.allclose(dict(model.named_parameters())[router].grad, expected_grads[router], rtol=1e-3)
