"""``optimizer.adam_moments_dtype: bfloat16``: Adam moments stored in bf16, updated in fp32 arithmetic, refused with
betas that bf16 cannot follow, saved as fp32 so a run resumes with either setting, counted by the planner and
recorded by the benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nanotron.config import ConfigError, load_config
from nanotron.memory import estimate_memory
from nanotron.optim.adamw import AdamWHyperparameters, adamw_update_
from support import ROOT
from support.configs import tiny_config_dict
from support.distributed import run_distributed_each
from support.stand_ins import benchmark_on_cpu

EXAMPLE = ROOT / "examples" / "config_tiny_llama.yaml"
CPU = torch.device("cpu")


def run_updates(moments: torch.dtype, beta2: float, grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """AdamW updates of a 64-element shard, with its moments stored in ``moments``."""
    master = torch.linspace(-1, 1, 64)
    state = {"master": master, "exp_avg": torch.zeros(64, dtype=moments), "exp_avg_sq": torch.zeros(64, dtype=moments)}
    weights = torch.empty(64, dtype=torch.bfloat16)
    for step, grad in enumerate(grads, start=1):
        hyper = AdamWHyperparameters.at_step(step, 1e-3, 0.9, beta2, 1e-8, 0.1, None, CPU)
        adamw_update_(state["master"], grad, state["exp_avg"], state["exp_avg_sq"], weights, hyper)
    return state


def test_bf16_moments_are_updated_in_fp32_and_rounded_once_on_store():
    grad = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    fp32, bf16 = (run_updates(dtype, 0.95, [grad]) for dtype in (torch.float32, torch.bfloat16))
    assert bf16["exp_avg"].dtype == bf16["exp_avg_sq"].dtype == torch.bfloat16
    assert bf16["master"].dtype == torch.float32 and torch.equal(bf16["master"], fp32["master"])  # fp32 arithmetic
    for kind in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(bf16[kind], fp32[kind].to(torch.bfloat16)), kind


def test_a_bf16_second_moment_never_decays_at_beta2_0999_but_does_at_099():
    """Why bf16 moments are refused above beta 0.99: after one gradient, steps without gradient must shrink the
    second moment by beta2 each; in bf16, 0.999 * v rounds back to v."""
    one = torch.ones(64, dtype=torch.bfloat16)
    grads = [one] + [torch.zeros_like(one)] * 50
    first_step = {beta2: run_updates(torch.bfloat16, beta2, grads[:1])["exp_avg_sq"] for beta2 in (0.999, 0.99)}
    after = {beta2: run_updates(torch.bfloat16, beta2, grads)["exp_avg_sq"] for beta2 in (0.999, 0.99)}
    assert torch.equal(after[0.999], first_step[0.999])  # stuck: 50 decays lost
    assert run_updates(torch.float32, 0.999, grads)["exp_avg_sq"][0] == pytest.approx(0.001 * 0.999**50, rel=1e-4)
    # At 0.99 it follows, with bf16's rounding: 6.4e-3 where fp32 arithmetic gives 6.05e-3 after 50 decays.
    assert after[0.99][0].item() == pytest.approx(0.01 * 0.99**50, rel=0.1)


@pytest.mark.parametrize("beta", ["adam_beta1", "adam_beta2"])
def test_bf16_moments_with_a_beta_above_099_are_refused_naming_the_key_and_the_fix(beta):
    with pytest.raises(ConfigError) as error:
        load_config(EXAMPLE, ["optimizer.adam_moments_dtype=bf16", f"optimizer.{beta}=0.995"])
    message = str(error.value)
    assert "\n" not in message and f"optimizer.{beta} (0.995) must be <= 0.99" in message
    assert "optimizer.adam_moments_dtype: float32" in message
    assert load_config(EXAMPLE, [f"optimizer.{beta}=0.999"]).optimizer.adam_moments_dtype == "float32"
    assert load_config(EXAMPLE, ["optimizer.adam_moments_dtype=bfloat16",
                                 f"optimizer.{beta}=0.99"]).optimizer.adam_moments_dtype == "bfloat16"


@pytest.mark.slow
def test_the_planner_counts_two_bytes_per_bf16_moment():
    def stage(*overrides):
        return estimate_memory(load_config(EXAMPLE, list(overrides)), gpu_memory_gb=80).stages[0]

    fp32, bf16 = stage(), stage("optimizer.adam_moments_dtype=bfloat16")
    assert bf16.adam_moments * 2 == fp32.adam_moments and bf16.master_weights == fp32.master_weights
    assert fp32.peak - bf16.peak == fp32.adam_moments // 2


# --- training and resuming --------------------------------------------------------------------------------------

STEPS, SAVED_AT = 20, 10


def run_config(tiny_data, folder: Path, moments: str, resume_from: Path | None = None) -> dict:
    """The tiny Llama in bf16, one micro-batch per step, a checkpoint at SAVED_AT."""
    config = tiny_config_dict(
        tiny_data, folder, model={"dtype": "bfloat16", "init_method": {"std": 0.02}},
        tokens={"train_steps": STEPS, "batch_accumulation_per_replica": 1},
        checkpoints={"checkpoint_interval": SAVED_AT, "save_final_state": False,
                     "resume_checkpoint_path": None if resume_from is None else str(resume_from)})
    config["optimizer"]["adam_moments_dtype"] = moments
    return config


def _logical_state(optimizer) -> dict[str, torch.Tensor]:
    return {f"{kind}/{name}": tensor.clone() for bucket in optimizer.bucket_states()
            for name, kinds in bucket.items() for kind, tensor in kinds.items()}


def _train(config: dict) -> dict:
    """Train; the optimizer state as loaded (logical fp32 tensors), at the end, and the moments' dtypes."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    optimizer = trainer.optimizer
    loaded = _logical_state(optimizer) if optimizer.step_count else {}
    trainer.train()
    lines = trainer.config.resolved_metrics_path().read_text().splitlines()
    return {"metrics": [json.loads(line) for line in lines], "loaded": loaded, "final": _logical_state(optimizer),
            "dtypes": {t.dtype for t in optimizer.exp_avgs + optimizer.exp_avg_sqs}}


def saved_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The optimizer tensors of a one-rank checkpoint, by logical name (one box each, keyed ``<index>:<name>``)."""
    return {key.split(":", 1)[1]: tensor for file in sorted((checkpoint / "optimizer").glob("*.safetensors"))
            for key, tensor in load_file(file).items()}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """Straight runs with bf16 and fp32 moments, and resumptions of each checkpoint with both settings."""
    folder = tmp_path_factory.mktemp("moments")
    straight = {moments: folder / f"straight-{moments}" for moments in ("bfloat16", "float32")}
    calls = [{"config": run_config(tiny_data, path, moments)} for moments, path in straight.items()]
    calls += [{"config": run_config(tiny_data, folder / f"{saved}-to-{moments}", moments, path / str(SAVED_AT))}
              for saved, path in straight.items() for moments in ("bfloat16", "float32")]
    results = [ranks[0] for ranks in run_distributed_each(_train, 1, calls)]
    keys = [("bfloat16",), ("float32",), ("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "bfloat16"),
            ("float32", "float32")]
    return dict(zip(keys, results)) | {"checkpoints": {m: saved_state(p / str(SAVED_AT)) for m, p in straight.items()}}


@pytest.mark.full_tier
def test_a_bf16_model_with_bf16_moments_trains_close_to_fp32_moments(runs):
    bf16, fp32 = runs["bfloat16",], runs["float32",]
    assert bf16["dtypes"] == {torch.bfloat16} and fp32["dtypes"] == {torch.float32}
    losses = [m["lm_loss"] for m in bf16["metrics"]]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 1.0
    assert all(m["grad_norm"] > 0 for m in bf16["metrics"])
    for got, expected in zip(bf16["metrics"], fp32["metrics"], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=2e-2), got["step"]


@pytest.mark.slow
def test_checkpoints_hold_fp32_moments_whatever_the_training_dtype(runs):
    for moments, saved in runs["checkpoints"].items():
        kinds = {key.split("/")[0] for key in saved}
        assert kinds >= {"exp_avg", "exp_avg_sq", "master"}, moments
        assert {tensor.dtype for tensor in saved.values()} == {torch.float32}, moments
    bf16_saved = runs["checkpoints"]["bfloat16"]
    for key, tensor in bf16_saved.items():
        if not key.startswith("master"):
            assert torch.equal(tensor, tensor.to(torch.bfloat16).float()), key  # upcast bf16 values, exactly


def test_resuming_bf16_moments_with_bf16_moments_continues_the_run_exactly(runs):
    straight, resumed = runs["bfloat16",], runs["bfloat16", "bfloat16"]
    assert [m["step"] for m in resumed["metrics"]] == list(range(SAVED_AT + 1, STEPS + 1))
    for expected, got in zip(straight["metrics"][SAVED_AT:], resumed["metrics"], strict=True):
        assert (got["lm_loss"], got["grad_norm"]) == (expected["lm_loss"], expected["grad_norm"]), got["step"]
    assert resumed["final"].keys() == straight["final"].keys()
    for key, tensor in resumed["final"].items():
        assert torch.equal(tensor, straight["final"][key]), key


@pytest.mark.parametrize("saved, loaded", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_a_checkpoint_resumes_with_the_other_moments_dtype(runs, saved, loaded):
    resumed, checkpoint = runs[saved, loaded], runs["checkpoints"][saved]
    assert resumed["dtypes"] == {getattr(torch, loaded)}
    for key, tensor in resumed["loaded"].items():
        expected = checkpoint[key]
        if loaded == "bfloat16" and not key.startswith("master"):
            expected = expected.to(torch.bfloat16).float()  # cast on load
        assert torch.equal(tensor, expected), key
    reference = runs[saved, saved]["metrics"]  # the same checkpoint resumed with its own setting
    for expected, got in zip(reference, resumed["metrics"], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=2e-2), got["step"]


# --- the benchmark's record ---------------------------------------------------------------------------------------


def test_the_benchmark_records_the_moments_dtype_and_names_runs_by_it(tiny_data, tmp_path, monkeypatch):
    import argparse

    import benchmark
    import benchmark_record

    monkeypatch.chdir(tmp_path)
    tiny = tiny_config_dict(tiny_data, tmp_path)["model"]["model_config"]
    monkeypatch.setitem(benchmark.PRESETS, "tiny", tiny)
    benchmark_on_cpu(monkeypatch, benchmark)
    args = argparse.Namespace(data=str(tiny_data["tokenized"]), sequence_length=32, micro_batch_size=2, accumulation=1,
                              steps=1, warmup=1, save_to=None)
    result, _ = benchmark.run_nanotron(args, "tiny", ["model.compile=false", "model.dtype=float32",
                                                      "optimizer.adam_moments_dtype=bfloat16"])
    assert (result["precision"], result["adam_moments"]) == ("fp32", "bf16")
    fp32_moments = {"preset": "tiny", "precision": "fp32", "adam_moments": "fp32"}
    assert benchmark_record.nanotron_names(result, fp32_moments) == ("nanotron-bf16-moments",
                                                                     "nanotron-fp32-moments")
    assert benchmark_record.nanotron_names({"preset": "tiny", "precision": "fp32"}, fp32_moments) == (
        "nanotron", "nanotron-versus")  # a record from before the field had fp32 moments
