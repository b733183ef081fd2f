"""The benchmark as the record: the JSON a run writes (from a run whose timed systems are stand-ins, on the CPU), the
README table written from the records and its ``--check``, the peers' training loops where their libraries import,
and MFU's FLOPs per token in Megatron-LM's convention, computed by hand."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import benchmark
import benchmark_peers
import benchmark_record
import benchmark_table
import pytest
import torch

from support import ROOT
from support.configs import tiny_config_dict
from support.stand_ins import benchmark_on_cpu, integer_histc

SCRIPTS = ROOT / "scripts"

TINY_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 128, "tie_word_embeddings": True, "rope_theta": 10000.0}


# --- the record of a run ----------------------------------------------------------------------------------------------

def _fp8_enabled(overrides: list[str]) -> bool:
    values = [o.split("=", 1)[1] for o in overrides if o.startswith("fp8.enabled=")]
    return bool(values) and values[-1] == "true"


@pytest.fixture
def fake_systems(monkeypatch):
    """``benchmark.main`` on the CPU: a CUDA device named H200, and stand-ins for the timed nanotron runs and peers
    (their arguments recorded); everything else (arguments, names, ratios, the record, its file) is the script's."""
    calls = {"nanotron": [], "peers": [], "order": []}

    def run_nanotron(args, preset, overrides):
        calls["nanotron"].append((preset, list(overrides)))
        calls["order"].append("time nanotron")
        fp8 = _fp8_enabled(overrides)
        speed = 80_000.0 if fp8 else 64_000.0
        result = {"tokens_per_sec": speed, "tokens_per_sec_per_gpu": speed, "mfu": speed * 8.2e9 / 989e12,
                  "peak_memory_gb": 50.0, "state_memory_gb": 19.8, "activation_memory_gb": 30.2,
                  "flops_per_token": 8.2e9 if preset == "llama1b" else 1.0e9, "preset": preset,
                  "overrides": list(overrides), "precision": "fp8" if fp8 else "bf16"}
        return result, [{"input_ids": torch.zeros(1, 8, dtype=torch.long)}]

    speeds = {("hf", None): 66_000.0, ("hf-eager", None): 49_000.0, ("liger", None): 61_600.0,
              ("torchtitan", None): 59_600.0, ("hf", "tensorwise"): 74_000.0}

    def run_peer(args, name, peer, micro_batches, flops_per_token, peak, float8_recipe=None):
        calls["peers"].append((peer, float8_recipe, flops_per_token, peak))
        calls["order"].append(f"time {name}")
        speed = speeds[(peer, float8_recipe)]
        return {"tokens_per_sec": speed, "tokens_per_sec_per_gpu": speed, "mfu": speed * flops_per_token / peak,
                "peak_memory_gb": 36.0, "state_memory_gb": 9.9, "activation_memory_gb": 26.1, "layout": "1 GPU"}

    def examine_nanotron(args, preset, overrides, profile, activations):
        calls["order"].append(f"examine {preset} {profile is not None} {activations is not None}")

    def profile_peer(args, name, peer, micro_batches, float8_recipe=None):
        calls["order"].append(f"profile {name}")

    monkeypatch.setattr(benchmark, "run_nanotron", run_nanotron)
    monkeypatch.setattr(benchmark, "run_peer", run_peer)
    monkeypatch.setattr(benchmark, "examine_nanotron", examine_nanotron)
    monkeypatch.setattr(benchmark, "profile_peer", profile_peer)
    monkeypatch.setattr(benchmark, "peer_problem", lambda peer, name, preset: None)  # libraries not needed here
    monkeypatch.setattr(benchmark, "library_problem", lambda peer: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    for variable in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", *benchmark_record.RECORDED_ENVIRONMENT):
        monkeypatch.delenv(variable, raising=False)
    for variable in list(os.environ):
        if variable.startswith(benchmark_record.RECORDED_ENVIRONMENT_PREFIXES):  # e.g. set by an earlier compile
            monkeypatch.delenv(variable)
    return calls


@pytest.mark.slow
def test_a_run_writes_its_record_with_every_system_and_ratio(tmp_path, fake_systems, capsys):
    results = tmp_path / "results"
    arguments = ["--data", str(tmp_path / "data"), "--results-dir", str(results), "--commit", "abc1234",
                 "--name", "fp8-peers", "--peer", "hf", "hf-eager", "liger", "torchtitan", "--steps", "3",
                 "--override", "fp8.enabled=true", "--versus-override", "fp8.enabled=false", "--torchao", "tensorwise"]
    benchmark.main(arguments)

    today = datetime.date.today().isoformat()
    path = results / f"{today}-h200-fp8-peers.json"
    assert sorted(p.name for p in results.iterdir()) == [path.name]
    record = json.loads(path.read_text())
    assert benchmark_record.record_problems(record) == []
    assert {key: record[key] for key in ("date", "preset", "gpu", "commit", "torch", "sequence_length",
                                         "micro_batch_size", "world_size", "steps", "convention", "reference")} == {
        "date": today, "preset": "llama1b", "gpu": "NVIDIA H200", "commit": "abc1234", "torch": torch.__version__,
        "sequence_length": 4096, "micro_batch_size": 4, "world_size": 1, "steps": 3, "convention": "megatron",
        "reference": "nanotron-fp8"}
    assert record["command"] == "python scripts/benchmark.py " + " ".join(arguments)
    systems = record["systems"]
    assert list(systems) == ["nanotron-fp8", "nanotron-bf16", "hf-compiled", "hf-eager", "liger", "torchtitan",
                             "torchao-float8-tensorwise"]
    for system in systems.values():
        assert {"tokens_per_sec", "mfu", "peak_memory_gb", "state_memory_gb", "activation_memory_gb"} <= set(system)
    assert record["ratios"] == {name: pytest.approx(80_000.0 / systems[name]["tokens_per_sec"])
                                for name in systems if name != "nanotron-fp8"}
    assert record["ratios"]["nanotron-bf16"] == pytest.approx(1.25)
    # The second nanotron run adds --versus-override to --override; every peer shares the first run's FLOPs and the
    # H200's bf16 peak.
    assert fake_systems["nanotron"] == [("llama1b", ["fp8.enabled=true"]),
                                        ("llama1b", ["fp8.enabled=true", "fp8.enabled=false"])]
    assert [call[:2] for call in fake_systems["peers"]] == [("hf", None), ("hf-eager", None), ("liger", None),
                                                            ("torchtitan", None), ("hf", "tensorwise")]
    assert {call[2:] for call in fake_systems["peers"]} == {(8.2e9, 989e12)}
    assert not any(call.startswith(("examine", "profile")) for call in fake_systems["order"])  # none asked for
    printed = capsys.readouterr().out
    assert benchmark_table.HEADER in printed and "| torchtitan | 59,600 |" in printed and str(path) in printed

    benchmark.main(arguments)  # a second run keeps its own file
    assert {p.name for p in results.iterdir()} == {path.name, f"{today}-h200-fp8-peers-2.json"}


@pytest.mark.slow
def test_profiles_and_the_census_come_after_every_timed_run(tmp_path, fake_systems):
    """A run timed after a profiled one in the same process can be slower: every system is timed first."""
    benchmark.main(["--data", str(tmp_path / "data"), "--results-dir", str(tmp_path), "--commit", "abc1234",
                    "--peer", "hf", "liger", "--versus-override", "fp8.enabled=true", "--profile",
                    str(tmp_path / "p.txt"), "--activations", str(tmp_path / "a.txt"), "--profile-peers",
                    str(tmp_path / "peers")])
    assert fake_systems["order"] == ["time nanotron", "time nanotron", "time hf-compiled", "time liger",
                                     "examine llama1b True True", "profile hf-compiled", "profile liger"]


def test_default_peer_is_the_compiled_transformers_loop_and_no_peers_trains_nanotron_alone(tmp_path, fake_systems):
    results = tmp_path / "results"
    benchmark.main(["--data", "d", "--results-dir", str(results), "--commit", "c"])
    benchmark.main(["--data", "d", "--results-dir", str(results), "--commit", "c", "--no-peers", "--name", "alone"])
    alone, default = (json.loads(p.read_text()) for p in sorted(results.iterdir()))  # -alone, -llama1b
    assert list(default["systems"]) == ["nanotron", "hf-compiled"] and list(alone["systems"]) == ["nanotron"]
    assert alone["ratios"] == {} and default["ratios"]["hf-compiled"] == pytest.approx(64_000 / 66_000)


@pytest.mark.parametrize("preset, parameters, used", [("qwen3-1.7b", 1.72e9, 1.72e9), ("qwen3-moe", 3.34e9, 1.22e9),
                                                      ("deepseek-v3", 3.19e9, 0.727e9)])
def test_the_family_presets_build_valid_configs_of_their_size(preset, parameters, used, tmp_path):
    """The bench config with each Qwen3 preset passes validation; its parameters, and those a token uses (the
    LM head's included, the attention's FLOPs left out), are what the presets' comments say."""
    import argparse

    from nanotron.config import validate_config
    from nanotron.models.registry import spec_for_config

    args = argparse.Namespace(data=str(tmp_path), sequence_length=4096, micro_batch_size=1, accumulation=1, steps=2,
                              warmup=1, save_to=None)
    config = benchmark.nanotron_config(args, preset, [])
    validate_config(config)
    model = config.model.model_config
    costs = spec_for_config(model).costs(model, model.vocab_size, 4096)
    assert costs.parameters == pytest.approx(parameters, rel=5e-3)
    assert (costs.flops_per_token - sum(costs.attention_flops)) / 6 == pytest.approx(used, rel=5e-3)


@pytest.mark.parametrize("preset", ["llama1b", "mixtral", "qwen3-1.7b", "qwen3-moe", "deepseek-v3"])
@pytest.mark.slow
def test_the_transformers_peer_has_the_presets_parameters(preset, tmp_path):
    """The compiled-transformers peer is built at the preset's shape: as many parameters as nanotron counts."""
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model = benchmark_peers.hf_model(benchmark.PRESETS[preset], 4096, "meta", "grouped_mm")
    assert sum(p.numel() for p in model.parameters()) == _nanotron_parameters(preset, tmp_path)


def _nanotron_parameters(preset: str, tmp_path: Path) -> int:
    """The parameters nanotron counts in the benchmark's model of ``preset``."""
    import argparse

    from nanotron.models.registry import spec_for_config

    args = argparse.Namespace(data=str(tmp_path), sequence_length=4096, micro_batch_size=1, accumulation=1, steps=2,
                              warmup=1, save_to=None)
    config = benchmark.nanotron_config(args, preset, []).model.model_config
    return spec_for_config(config).costs(config, config.vocab_size, 4096).parameters


@pytest.mark.parametrize("preset", ["llama1b", "mixtral"])
def test_muon_trains_the_preset_with_muon_then_with_adamw_in_one_call(preset, tmp_path):
    args = benchmark.parse_args(["--data", str(tmp_path), "--preset", preset, "--no-peers", "--muon"])
    first = benchmark.nanotron_config(args, preset, args.override)
    second = benchmark.nanotron_config(args, preset, args.override + args.versus_override)
    assert (first.optimizer.name, second.optimizer.name) == ("muon", "adamw")


@pytest.mark.parametrize("arguments, message", [
    (["--preset", "mamba130m", "--peer", "torchtitan"],
     "--peer torchtitan trains llama, mixtral, qwen3, qwen3_moe, deepseek_v3 models; mamba130m is a mamba preset: "
     "use --peer mamba-ssm"),
    (["--preset", "mamba130m"], "--peer hf trains llama, mixtral, qwen3, qwen3_moe, deepseek_v3 models; mamba130m is "
                                "a mamba preset: use --peer mamba-ssm"),
    (["--peer", "mamba-ssm"], "--peer mamba-ssm trains mamba models; llama1b is a llama preset"),
    (["--peer", "liger", "--torchao", "tensorwise"], "--torchao compares torchao's float8 with the compiled"),
    (["--warmup", "0"], "--warmup must be at least 1"),
])
def test_bad_commands_stop_with_one_error_line_before_anything_runs(tmp_path, arguments, message, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as stop:
        benchmark.main(["--data", str(tmp_path), "--results-dir", str(tmp_path / "results"), *arguments])
    assert str(stop.value).startswith(f"error: {message}"), stop.value
    assert "\n" not in str(stop.value) and not (tmp_path / "results").exists()


def test_a_missing_peer_library_is_named_with_how_to_install_it(monkeypatch):
    monkeypatch.setitem(benchmark_peers.REQUIREMENTS, "liger", (("no_such_module_here",), "liger-kernel 0.8.5 (x)"))
    problem = benchmark_peers.peer_problem("liger", "llama1b", benchmark.PRESETS["llama1b"])
    assert problem.startswith("--peer liger needs liger-kernel 0.8.5 (x): importing no_such_module_here failed")


def test_system_names_of_nanotron_runs():
    bf16, fp8 = {"preset": "llama1b", "precision": "bf16"}, {"preset": "llama1b", "precision": "fp8"}
    assert benchmark_record.nanotron_names(bf16, None) == ("nanotron", None)
    assert benchmark_record.nanotron_names(fp8, bf16) == ("nanotron-fp8", "nanotron-bf16")
    assert benchmark_record.nanotron_names({"preset": "mamba130m", "precision": "bf16"},
                                           {"preset": "llama130m", "precision": "bf16"}) == ("nanotron",
                                                                                              "nanotron-llama130m")
    assert benchmark_record.nanotron_names(bf16, dict(bf16)) == ("nanotron", "nanotron-versus")
    assert benchmark_record.nanotron_names(bf16 | {"attention": "fa4"}, bf16) == ("nanotron-fa4-attention",
                                                                                   "nanotron-torch-attention")
    assert benchmark_record.nanotron_names(bf16 | {"optimizer": "muon"}, bf16) == ("nanotron-muon", "nanotron-adamw")


def test_recorded_command_names_the_launcher_and_the_settings_that_matter():
    argv = ["scripts/benchmark.py", "--data", "my data", "--override", "parallelism.dp=2"]
    assert benchmark_record.command_line(argv, {"HOME": "/root"}) == (
        "python scripts/benchmark.py --data 'my data' --override parallelism.dp=2")
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1",
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}
    assert benchmark_record.command_line(argv, torchrun) == (
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 "
        "torchrun --nproc_per_node=2 scripts/benchmark.py --data 'my data' --override parallelism.dp=2")


def test_commit_of_the_checkout(tmp_path):
    commit, dirty = benchmark_record.git_commit(ROOT)
    assert re.fullmatch(r"[0-9a-f]{40}", commit) and isinstance(dirty, bool)
    assert benchmark_record.git_commit(tmp_path) is None  # then the script asks for --commit


def test_file_names():
    assert benchmark_record.gpu_slug("NVIDIA H200") == "h200"
    assert benchmark_record.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


def test_memory_split_from_what_was_allocated():
    """A run that found 1 GB left by an earlier one, started its steps at 6 GB (weights, optimizer state), freed
    2 GB of gradients after each update and peaked at 10 GB: 7 GB of state, 2 GB of activations."""
    fields = benchmark_record.memory_fields(10 * 10**9, 6 * 10**9, 10**9, 2 * 10**9)
    assert fields == {"state_memory_gb": pytest.approx(7.0), "activation_memory_gb": pytest.approx(2.0),
                      "kept_for_backward_gb": None}
    with_backward = benchmark_record.memory_fields(10 * 10**9, 6 * 10**9, 10**9, 2 * 10**9, 9 * 10**9)
    assert with_backward["kept_for_backward_gb"] == pytest.approx(3.0)


def test_the_backward_start_is_read_once_per_step_when_its_first_loss_gets_its_gradient():
    """Two micro-batches per step: the memory is read when the first loss's backward starts (after its forward
    allocated, before its gradient frees anything), not at the second loss, and again in the next step."""
    allocated = {"now": 0}
    start = benchmark_record.BackwardStart(lambda: allocated["now"])
    weight = torch.ones(3, requires_grad=True)
    readings = []
    for step in range(2):
        start.new_step()
        for micro_batch in range(2):
            allocated["now"] = 100 * step + 10 * micro_batch + 5  # what the forward of this micro-batch holds
            loss = (weight * (micro_batch + 1)).sum()
            start.watch(loss)
            allocated["now"] += 1  # allocated after the loss, before its backward: still counted
            loss.backward()
        readings.append(start.bytes)
    assert readings == [6, 106]
    assert torch.equal(weight.grad, torch.full((3,), 6.0))  # the hook leaves the gradients alone
    start.new_step()
    start.watch(torch.ones(1))  # a loss without a graph (no gradient to wait for) is not watched
    assert start._armed


def test_tensor_bytes_counts_a_shared_buffer_once():
    flat = torch.zeros(100)
    assert benchmark_record.tensor_bytes([flat[:50], flat[50:], flat, torch.zeros(10, dtype=torch.bfloat16)]) == 420


def test_a_record_without_the_required_fields_is_refused():
    with pytest.raises(ValueError, match="lack fields"):
        benchmark_record.build_record(
            date="d", recorded_at="t", preset="p", gpu="g", world_size=1, commit="c", dirty=False, torch_version="t",
            versions={},
            command="x", sequence_length=1, micro_batch_size=1, accumulation=1, steps=1, warmup=1,
            systems={"nanotron": {"tokens_per_sec": 1.0}}, reference="nanotron")


# --- the peers' loops, on the CPU where their libraries import --------------------------------------------------------

def _batches(vocab: int, count: int = 2) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (count, 2, 17), generator=generator)
    return [{"input_ids": row[:, :-1], "labels": row[:, 1:]} for row in ids]


def _train_two_steps(loop, batches) -> dict:
    freed, backward = {}, benchmark_record.BackwardStart(lambda: 7)
    step = loop.step_function(batches, freed, backward)
    before = [p.detach().clone() for p in loop.parameters]
    step(0)
    step(1)
    assert all(p.grad is None for p in loop.parameters)  # freed after every update, as measured
    assert backward.bytes == 7  # read when a loss's backward started
    assert all(not torch.equal(a, p) for a, p in zip(before, loop.parameters) if a.dim() == 2)
    return freed


def test_transformers_loop_trains_and_measures_the_gradients_it_frees():
    pytest.importorskip("transformers")
    loop = benchmark_peers.build_hf(TINY_LLAMA, 16, "cpu", compiled=False)
    freed = _train_two_steps(loop, _batches(TINY_LLAMA["vocab_size"]))
    assert freed["gradient_bytes"] == sum(2 * p.numel() for p in loop.parameters)  # bf16, the tied matrix once


def test_liger_patches_its_model_and_restores_the_transformers_module():
    pytest.importorskip("liger_kernel.transformers")
    from transformers.models.llama import modeling_llama

    original = dict(vars(modeling_llama))
    loop = benchmark_peers.build_liger(TINY_LLAMA, 16, "cpu")
    assert modeling_llama.apply_rotary_pos_emb is not original["apply_rotary_pos_emb"]  # Liger's RoPE, for all
    model = next(cell.cell_contents for cell in loop.loss_of.__closure__
                 if isinstance(cell.cell_contents, torch.nn.Module))  # the model its loss calls
    assert model.forward.__func__.__module__ == "liger_kernel.transformers.model.llama"
    assert model.model.norm._get_name() == "LigerRMSNorm"
    loop.restore()
    assert all(vars(modeling_llama)[name] is value for name, value in original.items())


@pytest.mark.parametrize("preset", ["llama1b", "llama8b", "llama130m", "llama1.4b"])
def test_torchtitan_feed_forward_has_the_presets_width(preset):
    pytest.importorskip("torchtitan.models.llama3")
    from torchtitan.models.llama3.model.model import FeedForward

    shape = benchmark.PRESETS[preset]
    with torch.device("meta"):
        block = FeedForward(shape["hidden_size"], 4 * shape["hidden_size"],
                            **benchmark_peers.torchtitan_feed_forward(shape["hidden_size"], shape["intermediate_size"]))
    assert block.w1.out_features == shape["intermediate_size"]


TINY_QWEN3 = {"is_llama_config": False, "is_qwen3_config": True, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 128, "tie_word_embeddings": True, "rope_theta": 10000.0}
TINY_QWEN3_MOE = TINY_QWEN3 | {"tie_word_embeddings": False,
                               "moe_config": {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 16}}
TINY_DEEPSEEK_V3 = {"is_llama_config": False, "is_deepseek_v3_config": True, "hidden_size": 32,
                    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "vocab_size": 128, "tie_word_embeddings": False, "rope_theta": 10000.0,
                    "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                    "v_head_dim": 8, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 16, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                    "first_k_dense_replace": 1}


@pytest.mark.parametrize("preset", [TINY_QWEN3, TINY_QWEN3_MOE, TINY_DEEPSEEK_V3], ids=benchmark_peers.family)
def test_torchtitan_trains_each_family_at_the_transformers_peers_shape(preset):
    """torchtitan's Qwen3 (dense and MoE) and DeepSeek-V3 at a preset's shape: as many parameters as the
    transformers peer, and both train (torchtitan's experts only on GPUs: its router counts tokens with an integer
    ``histc``, which the CPU lacks)."""
    pytest.importorskip("torchtitan.models.deepseek_v3")
    torchtitan = benchmark_peers.build_torchtitan(preset, 16, "cpu", compiled=False)
    transformers = benchmark_peers.build_hf(preset, 16, "cpu", compiled=False)
    assert sum(p.numel() for p in torchtitan.parameters) == sum(p.numel() for p in transformers.parameters)
    dense = benchmark_peers.family(preset) == "qwen3"
    for loop in (torchtitan, transformers) if dense else (transformers,):
        _train_two_steps(loop, _batches(preset["vocab_size"]))


def test_torchtitans_mixtral_is_its_llama4_with_experts_of_the_presets_width(tmp_path):
    """torchtitan's Llama 4 at the mixtral preset's shape (meta device): nanotron's parameter count, experts of
    width ``intermediate_size`` and RoPE in every layer."""
    pytest.importorskip("torchtitan.models.llama4")
    preset = benchmark.PRESETS["mixtral"]
    model_class, args, _ = benchmark_peers.TORCHTITAN_MODELS["mixtral"](preset)
    with torch.device("meta"):
        model = model_class(args)
    assert sum(p.numel() for p in model.parameters()) == _nanotron_parameters("mixtral", tmp_path)
    shape = (preset["moe_num_experts"], preset["intermediate_size"], preset["hidden_size"])
    blocks = list(model.layers.values())
    assert all(block.moe_enabled and block.moe.experts.w1.shape == shape for block in blocks)
    assert all(block.attention.use_rope for block in blocks)


TINY_MIXTRAL = TINY_LLAMA | {"is_llama_config": False, "is_llamoe_config": True, "moe_num_experts": 4,
                             "num_experts_per_tok": 2}


@pytest.mark.slow
def test_torchtitan_trains_its_mixtral_with_its_expert_bias(monkeypatch):
    """A tiny tied Mixtral in torchtitan: as many parameters as transformers' Mixtral; it trains, its balancing hook
    moving the expert bias. On the CPU its experts run their loop (grouped GEMMs need a GPU) and its routers' integer
    ``histc``, which the CPU lacks, is stood in; the hook reads torchtitan's device mesh, here on a world of one as
    the benchmark's peers run in the one its nanotron run formed."""
    pytest.importorskip("torchtitan.models.llama4")
    import torch.distributed as dist

    integer_histc(monkeypatch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    loop = benchmark_peers.build_torchtitan(TINY_MIXTRAL, 16, "cpu", compiled=False)
    transformers = benchmark_peers.build_hf(TINY_MIXTRAL, 16, "cpu", compiled=False)
    assert sum(p.numel() for p in loop.parameters) == sum(p.numel() for p in transformers.parameters)
    _train_two_steps(loop, _batches(TINY_MIXTRAL["vocab_size"]))
    assert all(block.moe.expert_bias.abs().sum() > 0 for block in loop.model.layers.values())


def test_torchtitan_loop_trains_its_llama_at_the_presets_shape():
    pytest.importorskip("torchtitan.models.llama3")
    loop = benchmark_peers.build_torchtitan(TINY_LLAMA, 16, "cpu", compiled=False)
    assert all(p.dtype == torch.float32 for p in loop.parameters)  # fp32 parameters under bf16 autocast
    tied = 128 * 32
    layer = 32 * (4 + 2 * 2) * 8 + 4 * 8 * 32 + 3 * 32 * 64 + 2 * 32
    assert sum(p.numel() for p in loop.parameters) == 2 * layer + tied + 32
    freed = _train_two_steps(loop, _batches(TINY_LLAMA["vocab_size"]))
    assert freed["gradient_bytes"] == sum(4 * p.numel() for p in loop.parameters)


# --- the README table -------------------------------------------------------------------------------------------------

def _record(date: str, tokens: float, preset: str = "llama1b", convention: str = "megatron") -> dict:
    systems = {"nanotron": {"tokens_per_sec": tokens, "tokens_per_sec_per_gpu": tokens, "mfu": 0.5,
                            "peak_memory_gb": 52.3, "activation_memory_gb": 30.0, "masters": "remainders"},
               "hf-compiled": {"tokens_per_sec": 50_000.0, "mfu": None, "peak_memory_gb": 36.1}}
    return benchmark_record.build_record(
        date=date, recorded_at=f"{date}T12:00:00+00:00", preset=preset, gpu="NVIDIA H200", world_size=1, commit="abc",
        dirty=False, torch_version="2.11",
        versions={}, command="python scripts/benchmark.py --data d", sequence_length=4096, micro_batch_size=4,
        accumulation=1, steps=20, warmup=5, systems=systems, reference="nanotron") | {"convention": convention}


def _page(folder: Path, name: str = "benchmarks.md") -> Path:
    page = folder / name
    page.write_text(f"# Project\n\nBefore.\n\n{benchmark_table.BEGIN}\nstale\n{benchmark_table.END}\n\nAfter.\n")
    return page


def _tables(folder: Path, results: Path) -> tuple[Path, list[str]]:
    """The page of the full table, and the options that write it and the headline into another document."""
    page = _page(folder)
    return page, ["--page", str(page), "--readme", str(_page(folder, "README.md")), "--results", str(results)]


def test_table_shows_the_newest_record_of_each_comparison_and_check_catches_drift(tmp_path, capsys):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    readme, options = _tables(tmp_path, results)
    (results / "2026-12-01-h200-llama1b.json").write_text(json.dumps(_record("2026-12-01", 60_000.0)))
    (results / "2026-12-03-h200-llama1b.json").write_text(json.dumps(_record("2026-12-03", 65_000.0)))
    old = _record("2026-11-30", 54_000.0, preset="mixtral", convention="6N incl. embedding lookup")
    (results / "2026-11-30-h200-mixtral.json").write_text(json.dumps(old))

    assert benchmark_table.main([*options, "--check"]) == 1
    assert "differs from" in capsys.readouterr().err
    assert benchmark_table.main(options) == 0
    text = readme.read_text()
    assert text.startswith("# Project\n\nBefore.\n\n") and text.endswith(f"{benchmark_table.END}\n\nAfter.\n")
    table = text.split(benchmark_table.BEGIN + "\n")[1].split("\n" + benchmark_table.END)[0]
    assert table.splitlines()[:2] == benchmark_table.HEADER.splitlines()
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    assert rows == [
        "| [2026-12-03, H200, llama1b, 4096 × 4](benchmarks/results/2026-12-03-h200-llama1b.json) | nanotron | "
        "65,000 | 65,000 | 50.0% | 52.3 | 30.0 | — |",
        "|  | hf-compiled | 50,000 | — | — | 36.1 | — | 1.30× |",
        "| [2026-11-30, H200, mixtral, 4096 × 4](benchmarks/results/2026-11-30-h200-mixtral.json) | nanotron | "
        "54,000 | 54,000 | 50.0%† | 52.3 | 30.0 | — |",
        "|  | hf-compiled | 50,000 | — | — | 36.1 | — | 1.08× |",
    ]  # the 2026-12-01 record of the same comparison is older: not shown
    assert table.endswith(benchmark_table.OLD_CONVENTION_NOTE)
    assert benchmark_table.main([*options, "--check"]) == 0

    (results / "2026-12-04-h200-llama1b.json").write_text(json.dumps(_record("2026-12-04", 66_000.0)))
    assert benchmark_table.main([*options, "--check"]) == 1


def test_headline_shows_the_newest_comparison_with_a_peer_for_each_shape_and_precision(tmp_path):
    """The README's table: per preset, shape and nanotron precision, the newest record beside a peer library where
    nanotron trains the preset's model unchanged; nanotron-only records and changed models stay on the page."""
    results = tmp_path / "results"
    results.mkdir()
    page, options = _tables(tmp_path, results)
    older, newer = _record("2026-12-01", 60_000.0), _record("2026-12-02", 61_000.0)
    alone = _record("2026-12-03", 62_000.0)
    del alone["systems"]["hf-compiled"]
    alone["ratios"] = {}
    recomputed = _record("2026-12-04", 40_000.0)
    recomputed["systems"]["nanotron"]["overrides"] = ["parallelism.recompute_layer=true"]
    fp8 = _record("2026-12-01", 80_000.0)
    fp8["systems"]["nanotron"].update(precision="fp8", fp8_recipe="delayed")
    for name, record in (("older", older), ("newer", newer), ("alone", alone), ("recomputed", recomputed),
                         ("fp8", fp8)):
        (results / f"{name}.json").write_text(json.dumps(record))
    assert benchmark_table.main(options) == 0
    headline = re.findall(r"\| \[[^]]+\]\(results/(\w+)\.json\)", (tmp_path / "README.md").read_text())
    assert headline == ["fp8", "newer"]
    assert len(re.findall(r"\| \[", page.read_text())) == 4  # each comparison's newest (older is newer's)


def test_table_refuses_a_broken_record_or_a_readme_without_markers(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    readme, options = _tables(tmp_path, results)
    broken = _record("2026-12-01", 1.0)
    del broken["commit"], broken["systems"]["hf-compiled"]["mfu"]
    (results / "2026-12-01-h200-x.json").write_text(json.dumps(broken))
    assert benchmark_table.main(options) == 2
    error = capsys.readouterr().err
    assert "2026-12-01-h200-x.json: no 'commit'; systems.hf-compiled has no 'mfu'" in error
    (results / "2026-12-01-h200-x.json").unlink()
    readme.write_text("# no markers\n")
    assert benchmark_table.main(options) == 2
    assert "benchmarks.md needs the markers" in capsys.readouterr().err


def test_readme_table_matches_the_recorded_results():
    """The README's performance table is what benchmarks/results gives (run the script to update it)."""
    check = subprocess.run([sys.executable, str(SCRIPTS / "benchmark_table.py"), "--check"], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        record = json.loads(path.read_text())
        assert path.name.startswith(f"{record['date']}-{benchmark_record.gpu_slug(record['gpu'])}-")
        assert record["convention"] in ("megatron", "6N incl. embedding lookup")


# --- MFU: FLOPs per token in Megatron-LM's convention -----------------------------------------------------------------

def test_flops_count_the_lm_head_and_not_the_embedding_lookup():
    """Vocabulary 104 (padded), hidden 16, ffn 32, 4 layers, 2 query heads and 1 key-value head of 8, sequence 32.
    A layer: q|k|v 16·32 = 512, o 256, gate|up|down 3·16·32 = 1536, two norms 32: 2336 weights. The FLOPs: 6 per
    weight of the layers (4 · 2336), the final norm (16) and the LM head (104 · 16 = 1664), plus causal attention
    6 · 16 · 32 per layer: 6 · 11,024 + 12,288 = 78,432 per token, tied or not: an untied model's embedding
    matrix adds parameters, not FLOPs (its lookup is a gather)."""
    from nanotron.config import LlamaConfig
    from nanotron.models.llama.costs import llama_costs

    shape = dict(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1)
    tied = llama_costs(LlamaConfig(**shape, tie_word_embeddings=True), padded_vocab_size=104, sequence_length=32)
    untied = llama_costs(LlamaConfig(**shape, tie_word_embeddings=False), padded_vocab_size=104, sequence_length=32)
    assert (tied.parameters, untied.parameters) == (11_024, 12_688)
    assert tied.flops_per_token == untied.flops_per_token == 78_432
    assert tied.head_flops == untied.head_flops == 6 * 1664


def test_mixture_of_experts_flops_count_the_routed_experts_and_the_lm_head():
    """The same shape with 4 experts of ffn 32, top-2, untied: a layer uses attention and norms (800), the router
    (16 · 4 = 64) and 2 of its experts (2 · 1536): 3936 weights; 6 · (4 · 3936 + 16 + 1664) + 12,288 = 116,832."""
    from nanotron.config import LlaMoEConfig
    from nanotron.models.moe.costs import moe_costs

    config = LlaMoEConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False, moe_num_experts=4,
                          num_experts_per_tok=2)
    costs = moe_costs(config, padded_vocab_size=104, sequence_length=32)
    assert costs.flops_per_token == 116_832
    assert costs.parameters == 4 * (800 + 4 * 1536 + 64) + 2 * 1664 + 16


def test_mamba_flops_count_the_lm_head_and_not_the_embedding_lookup():
    """d_model 16, 2 layers, d_state 4, expand 2 (d_inner 32, dt_rank 1), conv 4: a layer holds in_proj 1024, conv
    128 + 32, x_proj 288, dt_proj 32 + 32, A_log 128, D 32, out_proj 512 and its norm 16: 2224 weights, and its scan
    costs 21 · 32 · 4 = 2688. 2 · (6 · 2224 + 2688) + 6 · (16 + 104 · 16) = 42,144 per token, tied or not."""
    from nanotron.config import MambaConfig, MambaSSMArgs
    from nanotron.models.mamba.costs import mamba_costs

    for tie in (True, False):
        config = MambaConfig(d_model=16, num_hidden_layers=2, vocab_size=100, tie_word_embeddings=tie,
                             ssm_cfg=MambaSSMArgs(d_state=4, d_conv=4, expand=2))
        costs = mamba_costs(config, padded_vocab_size=104, sequence_length=32)
        assert costs.flops_per_token == 42_144
        assert costs.parameters == 2 * 2224 + 16 + 1664 * (1 if tie else 2)


@pytest.mark.slow
def test_training_log_reports_tflops_from_the_megatron_count(tiny_data, tmp_path):
    """The tiny untied Llama (vocab 384, hidden 64, ffn 128, 2 layers, 4/2 heads of 16, sequence 32): a layer holds
    8192 + 4096 + 24,576 + 128 = 36,992 weights; 6 · (2 · 36,992 + 64 + 384 · 64) + 6 · 2 · 64 · 32 = 616,320 FLOPs
    per token, which the logged TFLOP/s divide back to."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    config = tiny_config_dict(tiny_data, tmp_path / "run", tokens={"train_steps": 1}, checkpoints={
        "checkpoints_path": str(tmp_path / "run"), "checkpoint_interval": 1000, "save_final_state": False})
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    config["model"]["model_config"]["tie_word_embeddings"] = False
    trainer = Trainer(config_from_dict(config))
    assert trainer.model.padded_vocab_size == 384
    trainer.train()
    record = json.loads(trainer.config.resolved_metrics_path().read_text().splitlines()[-1])
    assert trainer.flops_per_token == 616_320
    assert record["tflops_per_gpu"] * 1e12 / record["tokens_per_sec_per_gpu"] == pytest.approx(616_320, rel=1e-9)


def test_nanotron_run_of_the_benchmark_reads_what_the_trainer_exposes(tiny_data, tmp_path, monkeypatch):
    """``run_nanotron`` end to end on the CPU, with CUDA's timers and memory counters stood in: the record's fields
    come from the real trainer (a renamed trainer attribute fails here, not on the GPU after the timed steps)."""
    import argparse

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(benchmark.PRESETS, "tiny", {**TINY_LLAMA, "vocab_size": 384})
    benchmark_on_cpu(monkeypatch, benchmark)
    args = argparse.Namespace(data=str(tiny_data["tokenized"]), sequence_length=32, micro_batch_size=2, accumulation=1,
                              steps=2, warmup=1, save_to=None)
    result, micro_batch = benchmark.run_nanotron(args, "tiny", ["model.compile=false", "model.dtype=float32"])
    assert result["step_time_s"] == 0.5 and result["tokens_per_sec"] == 2 * 32 / 0.5
    assert result["parameters"] > 0 and result["flops_per_token"] > 0 and result["layout"]["tp"] == 1
    assert result["mfu"] is None  # no peak FLOP/s is known for a CPU
    assert result["kept_for_backward_gb"] == 0.0  # read when the loss's backward started (the counters read 0)
    assert micro_batch[0].input_ids.shape == (2, 32)


def test_the_activation_census_counts_what_is_allocated_between_the_step_start_and_the_loss(tiny_data, tmp_path,
                                                                                          monkeypatch):
    """``--activations``: the allocator's blocks are read once at the step's start and once when the trainer's loss
    is called (the forward done); the new ones are what the forward keeps, grouped by size. The loss is restored."""
    import argparse

    from nanotron.training.objective import LanguageModelLoss

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(benchmark.PRESETS, "tiny", {**TINY_LLAMA, "vocab_size": 384})
    benchmark_on_cpu(monkeypatch, benchmark)
    reads = iter([{1: 100}, {1: 100, 2: 64, 3: 64, 4: 1000}])
    monkeypatch.setattr(benchmark, "live_blocks", lambda: next(reads))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    args = argparse.Namespace(data=str(tiny_data["tokenized"]), sequence_length=32, micro_batch_size=2, accumulation=1,
                              steps=2, warmup=1, save_to=None)
    census = tmp_path / "activations.txt"
    captured = {}
    real_write = benchmark.write_activations

    def write(trainer, step, path):
        captured["loss"] = trainer.program.objective_at(1).language_model.compute
        real_write(trainer, step, path)
        captured["after"] = trainer.program.objective_at(1).language_model.compute

    monkeypatch.setattr(benchmark, "write_activations", write)
    benchmark.examine_nanotron(args, "tiny", ["model.compile=false", "model.dtype=float32"], None, census)
    lines = census.read_text().splitlines()
    assert lines[0] == "kept by the forward at the loss: 0.00 GB in 3 allocations"
    assert [line.split() for line in lines[2:]] == [["0.00", "1", "1000"], ["0.00", "2", "64"]]
    assert captured["after"] == captured["loss"] and captured["after"].__func__ is LanguageModelLoss.compute


def test_a_run_that_changes_the_model_is_a_comparison_of_its_own(tmp_path):
    """A newer record of the same shape whose nanotron run overrides the model or the parallelism (a recomputed or
    Qwen2-shaped run) is shown beside the plain one, labelled with those overrides; compiling is not such a change."""
    results = tmp_path / "results"
    results.mkdir()
    readme, options = _tables(tmp_path, results)
    plain, recomputed = _record("2026-12-03", 65_000.0), _record("2026-12-04", 40_000.0)
    plain["systems"]["nanotron"]["overrides"] = ["model.compile=true"]
    recomputed["systems"]["nanotron"]["overrides"] = ["model.compile=true", "parallelism.recompute_layer=true"]
    (results / "plain.json").write_text(json.dumps(plain))
    (results / "recomputed.json").write_text(json.dumps(recomputed))
    assert benchmark_table.main(options) == 0
    labels = re.findall(r"\| \[([^]]+)\]", readme.read_text())
    assert labels == ["2026-12-03, H200, llama1b, 4096 × 4",
                      "2026-12-04, H200, llama1b (recompute_layer=true), 4096 × 4"]


def test_a_run_with_labelled_options_says_so_and_is_a_comparison_of_its_own(tmp_path):
    """A nanotron run trained in FP8, with bf16 Adam moments or with its masters held as fp32 copies (before they were
    recorded, or after remainders became the default) under the plain name (one setting per call) is labelled with
    them, and a newer such record does not hide the default one of the same shape."""
    results = tmp_path / "results"
    results.mkdir()
    readme, options = _tables(tmp_path, results)
    bf16, fp8, both, held = (_record(date, tokens) for date, tokens in
                             (("2026-12-03", 65_000.0), ("2026-12-04", 80_000.0), ("2026-12-05", 81_000.0),
                              ("2026-12-06", 66_000.0)))
    fp8["systems"]["nanotron"].update(precision="fp8", fp8_recipe="delayed")
    both["systems"]["nanotron"].update(precision="fp8", fp8_recipe="delayed", adam_moments="bf16")
    del bf16["systems"]["nanotron"]["masters"]  # a record from before ``masters`` was recorded: copies
    for name, record in (("bf16", bf16), ("fp8", fp8), ("both", both), ("held", held)):
        (results / f"{name}.json").write_text(json.dumps(record))
    assert benchmark_table.main(options) == 0
    names = re.findall(r"\| (nanotron[^|]*?) \| [\d,]+ \|", readme.read_text())
    assert names == ["nanotron (fp32 master copies)", "nanotron (FP8 delayed)", "nanotron (FP8 delayed, bf16 moments)",
                     "nanotron"]


def test_a_document_masked_run_shows_its_mfu_only_when_counted_inside_documents(tmp_path):
    """A document-masked run recorded before its FLOPs counted the attention inside documents (no
    ``causal_flops_per_token``) overstated its MFU: the table leaves it out; a record with the count shows it."""
    results = tmp_path / "results"
    results.mkdir()
    readme, options = _tables(tmp_path, results)
    masked = ["model.compile=true", "model.model_config._use_doc_masking=true"]
    before, after = _record("2026-12-03", 72_000.0), _record("2026-12-04", 72_000.0)
    before["systems"]["nanotron"]["overrides"] = after["systems"]["nanotron"]["overrides"] = masked
    after["systems"]["nanotron"]["causal_flops_per_token"] = 1.0
    after["micro_batch_size"] = 8  # another comparison, so that both rows are shown
    (results / "before.json").write_text(json.dumps(before))
    (results / "after.json").write_text(json.dumps(after))
    assert benchmark_table.main(options) == 0
    nanotron_mfus = re.findall(r"\| nanotron \| [\d,]+ \| [\d,]+ \| ([^|]+) \|", readme.read_text())
    assert nanotron_mfus == ["—", "50.0%"]


@pytest.mark.slow
def test_the_curve_starts_each_peer_from_nanotrons_weights_on_its_batches(tiny_data, tmp_path, monkeypatch):
    """``scripts/benchmark_curve.py`` on the CPU: the Hugging Face loop, given nanotron's initial weights through the
    export, meets nanotron's first loss and gradient norm (its own random weights miss them by about 1e-2 and 30%),
    and both curves fall together for a few steps (the peer's bf16 weights and moments lag by under 2e-2)."""
    pytest.importorskip("transformers")
    import benchmark_curve

    monkeypatch.chdir(tmp_path)  # the run folder of the benchmark's config
    model = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    args = benchmark_curve.parse_args([
        "--data", str(tiny_data["tokenized"]), "--peer", "hf-eager", "--steps", "5", "--sequence-length", "64",
        "--micro-batch-size", "4", "--accumulation", "2", "--override", "model.compile=false",
        "optimizer.learning_rate_scheduler.learning_rate=0.003", "optimizer.learning_rate_scheduler.min_decay_lr=0.003",
        *(f"model.model_config.{key}={value}" for key, value in model.items())])
    result = benchmark_curve.curves(args, "cpu")
    ours, peer = result["systems"]["nanotron"], result["systems"]["hf-eager"]
    assert ours["losses"][-1] < ours["losses"][0] - 0.5 and min(ours["grad_norms"]) > 0
    assert peer["losses"][0] == pytest.approx(ours["losses"][0], abs=1e-3)
    assert peer["grad_norms"][0] == pytest.approx(ours["grad_norms"][0], rel=2e-2)
    assert result["differences"]["hf-eager"]["max_abs_loss_difference"] < 2e-2
    assert result["optimizer"]["weight_decay"] == 0.0 and len(result["learning_rates"]) == 5
