"""Qwen2's mixture of experts (``is_qwen2_config`` with upstream's ``moe_config``): against transformers'
Qwen2MoeForCausalLM (logits, greedy generation, conversion both ways, the shared expert and its gate included, sizes
checked against the stored tensors), its auxiliary loss and router statistics, expert parallelism against one
process (ep=2, and ep=2 x tp=2), upstream's example file, and every rule of the config named in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from support.configs import tiny_config_dict, write_config
from support.corpus import corpus_documents, datatrove_folder
from support.distributed import run_distributed, run_distributed_each
from support.hf import (
    away_from_initial_values,
    convert_altered,
    export_back_exactly,
    one_process_outputs,
    transformers_outputs,
)
from support.parity import assemble, assert_reference_trains, parity_run
from support.runs import assert_user_error, cli, metrics, train_through_cli
from support.tiers import parity_steps

SHAPE = dict(vocab_size=112, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rope_theta=5000.0, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, initializer_range=0.1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48)
# transformers' config changes, and the layers that should become mixtures of experts and slide once converted
VARIANTS = {
    # a dense first layer, raw top-k weights, q/k/v biases (Qwen1.5-MoE's choices)
    "mlp-only-layers": ({"mlp_only_layers": [0]}, [1, 2, 3], []),
    # every second layer, renormalised weights, no biases, sliding windows shorter than the text on two layers
    "sparse-step": ({"decoder_sparse_step": 2, "norm_topk_prob": True, "qkv_bias": False, "use_sliding_window": True,
                     "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"] * 2}, [1, 3], [0, 2]),
}
PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 21]]
NEW_TOKENS = 12


def _save_random(folder: Path, changes: dict) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**SHAPE | changes))
    away_from_initial_values(model).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=list(VARIANTS))
def converted(request, tmp_path_factory):
    changes, moe_layers, sliding = VARIANTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf = _save_random(root / "hf", changes)
    outcome = cli("convert", "hf-to-nanotron", "--hf-path", hf, "--save-path", root / "nanotron")
    assert outcome.code == 0, outcome.stderr[-3000:]
    return {"hf": hf, "ckpt": root / "nanotron", "moe_layers": moe_layers, "sliding": sliding, "root": root}


def test_logits_and_greedy_generation_match_transformers(converted):
    from nanotron.models.moe.model import MoEFeedForward

    ours = one_process_outputs(converted["ckpt"], PROMPTS, NEW_TOKENS)
    theirs = transformers_outputs(converted["hf"], PROMPTS, NEW_TOKENS)
    blocks = {i: layer.mlp for i, layer in enumerate(ours["layers"]) if isinstance(layer.mlp, MoEFeedForward)}
    assert list(blocks) == converted["moe_layers"] and all(block.shared_expert is not None for block in blocks.values())
    assert [i for i, layer in enumerate(ours["layers"]) if layer.attn.window is not None] == converted["sliding"]
    assert (ours["logits"] - theirs["logits"]).abs().max() < 1e-4
    assert ours["cached"] == ours["uncached"] == theirs["greedy"]


def test_conversion_back_is_exact(converted):
    before, after, exported = export_back_exactly(converted["hf"], converted["ckpt"], converted["root"] / "back",
                                                  PROMPTS[0])
    assert any(name.endswith("mlp.shared_expert_gate.weight") for name in exported)
    assert after.architectures == ["Qwen2MoeForCausalLM"]
    keys = ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "norm_topk_prob", "router_aux_loss_coef", "qkv_bias", "layer_types", "use_sliding_window"]
    assert {key: getattr(after, key) for key in keys} == {key: getattr(before, key) for key in keys}


def test_checkpoint_records_the_qwen2_type_and_upstreams_moe_config(converted):
    model = json.loads((converted["ckpt"] / "checkpoint.json").read_text())["model"]
    assert model["type"] == "qwen2"
    assert model["config"]["moe_config"]["enable_shared_expert"] is True


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    return _save_random(tmp_path_factory.mktemp("stored"), VARIANTS["mlp-only-layers"][0])


@pytest.mark.parametrize("config_changes, drop, fragment", [
    ({"moe_intermediate_size": 16}, None, "'layers.1.mlp.experts.down_proj' is (4, 64, 32) in the weights but "
                                          "(4, 64, 16)"),
    ({"num_experts": 8}, None, "'model.layers.1.mlp.experts.4.gate_proj.weight', which the weights lack"),
    ({"mlp_only_layers": []}, None, "'model.layers.0.mlp.experts.0.gate_proj.weight', which the weights lack"),
    ({"mlp_only_layers": [0, 1]}, None, "'model.layers.1.mlp.gate_proj.weight', which the weights lack"),
    ({}, "layers.2.mlp.shared_expert_gate.weight", "'model.layers.2.mlp.shared_expert_gate.weight', which the "
                                                   "weights lack"),
], ids=["expert-width", "expert-count", "more-moe-layers", "fewer-moe-layers", "no-shared-gate"])
def test_declared_sizes_are_checked_against_the_stored_tensors(stored, tmp_path, config_changes, drop, fragment):
    """A config.json that declares other experts than the weights hold (or weights without the shared expert's
    gate) is refused in one line before anything is written."""
    outcome = convert_altered(stored, tmp_path, config_changes, drop)
    assert_user_error(outcome, "does not match the weights", fragment)
    assert not (tmp_path / "out").exists()


def test_what_qwen2moe_cannot_express_is_refused_on_export():
    from nanotron.config import Qwen2Config
    from nanotron.config.qwen2_moe import Qwen2MoEConfig
    from nanotron.errors import CheckpointError
    from nanotron.models.qwen2.hf_adapter import Qwen2HFAdapter

    for changes, fragment in (({}, "no shared expert"), ({"no_rope_layer": 2}, "layers without RoPE")):
        moe = Qwen2MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=32)
        config = Qwen2Config(num_hidden_layers=2, moe_config=moe, **changes)
        with pytest.raises(CheckpointError, match=fragment):
            Qwen2HFAdapter().config_to_hf(config, "float32")


# --- the auxiliary loss and the block ---------------------------------------------------------------------------

def test_the_auxiliary_loss_is_the_coefficient_times_the_logged_load_balancing_loss():
    """One forward of a model with dense and MoE layers: what the trainer adds to the loss is
    router_aux_loss_coef times the load-balancing statistic it logs, summed over the MoE layers only."""
    from nanotron.config import Qwen2Config
    from nanotron.config.qwen2_moe import Qwen2MoEConfig
    from nanotron.models.moe.model import router_losses, router_metrics, router_statistics_template
    from nanotron.models.qwen2.model import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4,
                         moe_config=Qwen2MoEConfig(num_experts=4, top_k=2, moe_intermediate_size=16,
                                                   shared_expert_intermediate_size=24, layers=[0, 2],
                                                   enable_shared_expert=True, router_aux_loss_coef=0.3))
    model = Qwen2ForCausalLM(config, 64)
    for param in model.parameters():
        torch.nn.init.normal_(param, 0, 0.3)
    model(input_ids=torch.randint(0, 64, (3, 10)))
    loss, statistics = router_losses(model, sequences_per_step=3)
    assert {name: tuple(value.shape) for name, value in statistics.items()} == router_statistics_template(config)
    assert torch.allclose(loss, 0.3 * statistics["moe_load_balancing_loss"])
    assert statistics["moe_load_balancing_loss"] >= 0.99  # 1 at a perfectly uniform router
    assert statistics["moe_tokens_per_expert"].sum(1).tolist() == [3 * 10 * 2] * 2  # k assignments per token
    assert len(router_metrics(statistics, config)["moe_expert_load"]) == 2


def test_a_dense_qwen2_model_has_no_router_statistics():
    from nanotron.config import Qwen2Config
    from nanotron.models.moe.model import router_statistics_template

    assert router_statistics_template(Qwen2Config()) == {}


def test_costs_count_every_parameter_and_a_token_uses_its_k_experts_and_the_shared_one():
    from nanotron.config import Qwen2Config
    from nanotron.config.qwen2_moe import Qwen2MoEConfig
    from nanotron.models.registry import spec_for_config

    hidden, experts, ffn, shared = 32, 4, 16, 24
    moe = Qwen2MoEConfig(num_experts=experts, top_k=2, moe_intermediate_size=ffn, layers=[1],
                         shared_expert_intermediate_size=shared, enable_shared_expert=True)
    config = Qwen2Config(vocab_size=64, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, attention_bias=True, moe_config=moe)
    spec = spec_for_config(config)
    with torch.device("meta"):
        model = spec.model_class(config, 64)
    costs = spec.costs(config, 64, 16)
    assert costs.parameters == sum(param.numel() for param in model.parameters())
    used = 2 * 3 * hidden * ffn + hidden * experts + 3 * hidden * shared + hidden  # k experts, router, shared + gate
    assert costs.layer_flops[1] - costs.layer_flops[0] == 6 * (used - 3 * hidden * 48)


def test_the_memory_planner_models_the_shared_expert(tiny_data, tmp_path):
    from nanotron.config import config_from_dict
    from nanotron.memory import estimate_memory

    def activations(moe_config: dict) -> int:
        config = _training_config(tiny_data, tmp_path / "run", ep=2, tp=2)
        config["model"]["model_config"]["moe_config"] = moe_config
        return estimate_memory(config_from_dict(config), gpu_memory_gb=80).stages[0].activations

    without = activations(TINY_MOE | {"enable_shared_expert": False})
    assert activations(TINY_MOE) > without > activations(TINY_MOE | {"layers": [2]})


# --- training, and expert parallelism against one process -------------------------------------------------------

GLOBAL_BATCH = 16
TINY_MOE = {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
            "enable_shared_expert": True, "layers": [1, 2], "router_aux_loss_coef": 0.01}


def _training_config(tiny_data, run: Path, *, dp: int = 1, ep: int = 1, tp: int = 1) -> dict:
    base = tiny_config_dict(tiny_data, run)
    llama = {k: v for k, v in base["model"]["model_config"].items() if k != "is_llama_config"}
    model_config = llama | {"is_qwen2_config": True, "attention_bias": True, "num_hidden_layers": 3,
                            "moe_config": TINY_MOE}
    return tiny_config_dict(
        tiny_data, run, model=base["model"] | {"model_config": model_config},
        parallelism={"dp": dp, "tp": tp, "pp": 1, "expert_parallel_size": ep, "tp_mode": "REDUCE_SCATTER"},
        tokens={"train_steps": parity_steps(), "micro_batch_size": 4,
                "batch_accumulation_per_replica": GLOBAL_BATCH // (4 * dp * ep)},
        checkpoints={"checkpoint_interval": 1000, "save_final_state": False})


@pytest.mark.full_tier
def test_expert_parallel_layouts_match_one_process(tiny_data, tmp_path):
    """One process, then dp2 x ep2 and ep2 x tp2 in one 4-rank spawn: first-step gradients of every tensor (the
    shared expert and its gate included) and the curves of losses, grad-norms and router statistics."""
    (reference,) = run_distributed(parity_run, 1, config=_training_config(tiny_data, tmp_path / "reference"))
    layouts = {"dp2_ep2": {"dp": 2, "ep": 2}, "ep2_tp2": {"ep": 2, "tp": 2}}
    results = run_distributed_each(parity_run, 4, [{"config": _training_config(tiny_data, tmp_path / name, **layout)}
                                                   for name, layout in layouts.items()])
    assert_reference_trains(reference["metrics"], parity_steps())
    for record in reference["metrics"]:
        assert len(record["moe_expert_load"]) == 2 and record["moe_load_balancing_loss"] >= 0.99
        assert record["moe_z_loss"] > 0 and "moe_dropped_fraction" not in record
    expected = assemble([reference], "grads")
    assert all(expected[f"layers.1.mlp.{name}"].abs().sum() > 0
               for name in ("shared_expert.gate_up_proj", "shared_expert.down_proj", "shared_expert_gate.weight"))
    for layout, ranks in zip(layouts, results, strict=True):
        got = assemble(ranks, "grads")
        assert set(got) == set(expected), layout
        for name, grad in expected.items():
            assert torch.allclose(got[name], grad, atol=1e-6, rtol=1e-4), (layout, name)
        curve = next(rank["metrics"] for rank in ranks if rank["metrics"])
        for ref, other in zip(reference["metrics"], curve, strict=True):
            for key in ("lm_loss", "grad_norm", "moe_load_balancing_loss", "moe_z_loss", "moe_max_expert_load"):
                assert other[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-4), (layout, ref["step"], key)


def test_the_step_line_tells_the_routers_z_loss_from_the_logits(tiny_data, tmp_path):
    config = _training_config(tiny_data, tmp_path / "run")
    config["model"]["model_config"]["z_loss_enabled"] = True
    config["tokens"]["train_steps"] = 1
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    outcome = train_through_cli(config, tmp_path / "config.yaml")
    (line,) = [line for line in (outcome.stdout + outcome.stderr).splitlines() if "step 1/1" in line]
    assert " | z_loss " in line and " | moe_z_loss " in line and " | load_balancing_loss " in line, line
    (record,) = metrics(tmp_path / "run")
    assert record["z_loss"] > 0 and record["moe_z_loss"] > 0


# --- upstream's example file ------------------------------------------------------------------------------------

UPSTREAM_FILE = Path(__file__).parent / "upstream_configs" / "main" / "config_qwen_with_moe.yaml"


@pytest.mark.filterwarnings("ignore::nanotron.config.LegacyKeyWarning", "ignore::nanotron.config.RunLengthWarning")
def test_upstreams_qwen_with_moe_example_trains_its_experts(tiny_data, tmp_path):
    """The file as written (document masking included), with paths and sizes substituted (the experts' widths and
    the shared expert as written)."""
    raw = yaml.safe_load(UPSTREAM_FILE.read_text())
    model = raw["model"]["model_config"]
    assert model["_use_doc_masking"] and raw["data_stages"][0]["data"]["dataset"]["return_positions"]
    model.update(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    data = raw["data_stages"][0]["data"]
    folder = datatrove_folder(tmp_path / "datatrove", corpus_documents(tiny_data["corpus"]), tiny_data["tokenizer"])
    data["dataset"].update(dataset_folder=[str(folder)], vocab_size=384,
                           tokenizer_name=str(tiny_data["tokenizer"]), token_size_in_bytes=2)
    data["num_loading_workers"] = 0
    raw["checkpoints"].update(checkpoints_path=str(tmp_path / "run"))
    raw["tokenizer"]["tokenizer_name_or_path"] = str(tiny_data["tokenizer"])
    raw["parallelism"].update(dp=1)
    raw["tokens"].update(sequence_length=32, micro_batch_size=2, train_steps=2)
    train_through_cli(raw, tmp_path / "config.yaml")
    records = metrics(tmp_path / "run")
    assert [record["step"] for record in records] == [1, 2]
    assert all(len(record["moe_expert_load"]) == 2 and 1.0 <= record["moe_max_expert_load"] <= 8.0
               for record in records)
    saved = json.loads((tmp_path / "run" / "2" / "checkpoint.json").read_text())["model"]["config"]["moe_config"]
    assert saved | {"layers": None} == {"num_experts": 8, "top_k": 1, "moe_intermediate_size": 1408,
                                        "shared_expert_intermediate_size": 5632, "router_aux_loss_coef": 0.01,
                                        "layers": None, "enable_shared_expert": True, "norm_topk_prob": False}


# --- rules ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("moe_changes, parallelism, fragments", [
    ({}, {"expert_parallel_size": 3}, ("moe_config.num_experts (4) must be divisible", "expert_parallel_size (3)")),
    ({"top_k": 5}, {}, ("moe_config.top_k (5)", "[1, 4]")),
    ({"layers": [1, 3]}, {}, ("moe_config.layers ([1, 3])", "[0, 3)")),
    ({"layers": []}, {}, ("moe_config.layers ([])", "moe_config: null")),
    ({"token_dispatcher_type": "allgather"}, {}, ("token_dispatcher_type (allgather)", "set alltoall")),
    ({"token_dispatcher_type": "ring"}, {}, ("token_dispatcher_type (ring): dispatching tokens otherwise",)),
    ({"moe_intermediate_size": 33}, {"tp": 2}, ("moe_config.moe_intermediate_size (33)", "parallelism.tp (2)")),
    ({"shared_expert_intermediate_size": 0}, {}, ("moe_config.shared_expert_intermediate_size must be >= 1",)),
    ({"router_aux_loss_coef": -1.0}, {}, ("moe_config.router_aux_loss_coef must be >= 0",)),
    ({"num_expert": 4}, {}, ("unknown key 'model.model_config.moe_config.num_expert'", "num_experts")),
], ids=["ep", "top-k", "layer-range", "no-layers", "allgather", "dispatcher", "tp-width", "shared-width", "coef",
        "typo"])
def test_bad_moe_config_is_one_error_line_naming_the_key(tiny_data, tmp_path, moe_changes, parallelism, fragments):
    config = _training_config(tiny_data, tmp_path / "run")
    config["model"]["model_config"]["moe_config"] = TINY_MOE | moe_changes
    config["parallelism"] |= parallelism
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "config.yaml", config)), *fragments)
    assert not (tmp_path / "run").exists()


def test_expert_parallelism_needs_a_moe_config(tiny_data, tmp_path):
    config = _training_config(tiny_data, tmp_path / "run", ep=2)
    config["model"]["model_config"]["moe_config"] = None
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, "expert_parallel_size (2)", "is_qwen2_config or is_qwen3_config: true with a moe_config")
