"""``optimizer.store_param_remainders``: fp32 masters held as the bf16 weights plus 16 bits. The masters are the same
numbers as fp32 copies, bit for bit, through updates, ZeRO-1 shards and checkpoints in either setting; the weights
are their nearest bf16; the planner counts 2 bytes instead of 4."""

from __future__ import annotations

import json

import pytest
import torch

from nanotron.config import load_config
from nanotron.memory import estimate_memory
from nanotron.optim.adamw import AdamWHyperparameters, adamw_update_function, adamw_update_remainders_fused
from nanotron.optim.param_remainders import joined, split_
from support import ROOT
from support.configs import tiny_config_dict
from support.distributed import run_distributed_each
from support.kernels import run_with_triton_interpreter

CPU = torch.device("cpu")


def split(masters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.empty_like(masters, dtype=torch.bfloat16)
    remainders = torch.empty_like(masters, dtype=torch.int16)
    split_(masters, weights, remainders)
    return weights, remainders


def test_every_finite_fp32_comes_back_bit_for_bit_and_its_weight_is_the_nearest_bf16():
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31, (200_000,), generator=generator, dtype=torch.int64).to(torch.int32)
    masters = bits.view(torch.float32)
    masters = torch.cat([masters[masters.isfinite()], torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38])])
    weights, remainders = split(masters)
    assert torch.equal(joined(weights, remainders).view(torch.int32), masters.view(torch.int32))
    exact = masters.double()
    distance, nearest = (weights.double() - exact).abs(), (masters.to(torch.bfloat16).double() - exact).abs()
    assert torch.all(distance <= nearest)  # as close as round-to-nearest-even: only ties may differ
    differs = weights.view(torch.int16) != masters.to(torch.bfloat16).view(torch.int16)
    assert torch.all(masters.view(torch.int32)[differs] & 0xFFFF == 0x8000)


def test_a_tie_rounds_away_from_zero_where_to_bfloat16_rounds_to_even():
    tie = torch.tensor([1 + 2**-8, -(1 + 2**-8)])  # halfway between 1 and the next bf16, 1 + 2**-7
    weights, remainders = split(tie)
    assert weights.tolist() == [1 + 2**-7, -(1 + 2**-7)] and tie.to(torch.bfloat16).tolist() == [1.0, -1.0]
    assert remainders.tolist() == [-2**15, -2**15] and torch.equal(joined(weights, remainders), tie)


def _updates(remainders: bool, steps: int = 6) -> dict[str, torch.Tensor]:
    """Updates of a 4096-element shard whose gradients follow its weights (as a model's would)."""
    generator = torch.Generator().manual_seed(1)
    masters = torch.randn(4096, generator=generator)
    weights, remainder_bits = split(masters)
    exp_avg, exp_avg_sq = torch.zeros(4096), torch.zeros(4096, dtype=torch.bfloat16)
    update = adamw_update_function(CPU, fused=True, remainders=remainders)
    for step in range(1, steps + 1):
        grad = (weights.float() * 0.1 + torch.randn(4096, generator=generator)).to(torch.bfloat16)
        hyper = AdamWHyperparameters.at_step(step, 1e-3, 0.9, 0.95, 1e-8, 0.1, torch.tensor(0.5), CPU)
        update(remainder_bits if remainders else masters, grad, exp_avg, exp_avg_sq, weights, hyper)
    masters = joined(weights, remainder_bits) if remainders else masters
    return {"masters": masters, "weights": weights, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def test_the_update_of_remainders_computes_the_update_of_fp32_masters():
    held, copies = _updates(remainders=True), _updates(remainders=False)
    for key in ("masters", "exp_avg", "exp_avg_sq"):
        assert torch.equal(held[key], copies[key]), key
    assert torch.equal(held["weights"], split(held["masters"])[0])
    assert (held["masters"] - torch.randn(4096, generator=torch.Generator().manual_seed(1))).abs().mean() > 1e-4


def check_update_kernel(device: str = "cpu") -> None:
    """The Triton update of remainders against the update of fp32 copies (plain torch on the CPU, where Triton's
    interpreter runs the kernel; the compiled kernel on CUDA): the same masters and moments up to how each contracts
    multiplications and additions, weights and remainders that hold the kernel's masters exactly, masters that
    moved."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(2)
    n = 3 * 1024 + 5  # not a whole number of blocks
    for moments_dtype in (torch.float32, torch.bfloat16):
        start = torch.randn(n, device=device, generator=generator)
        masters = start.clone()
        weights, remainders = split(masters)
        copy_weights = weights.clone()
        moments = [torch.zeros(n, device=device, dtype=moments_dtype) for _ in range(4)]
        copies = adamw_update_function(device, fused=True, remainders=False)
        for step in range(1, 4):
            grad = torch.randn(n, device=device, generator=generator).to(torch.bfloat16)
            hyper = AdamWHyperparameters.at_step(step, 1e-3, 0.9, 0.95, 1e-8, 0.1, torch.tensor(0.5, device=device),
                                                 device)
            adamw_update_remainders_fused(remainders, grad, moments[0], moments[1], weights, hyper)
            copies(masters, grad, moments[2], moments[3], copy_weights, hyper)
        held = joined(weights, remainders)
        resplit = split(held)
        assert torch.equal(resplit[0], weights) and torch.equal(resplit[1], remainders)
        if moments_dtype == torch.float32:
            # the plain-torch reference's last bits varied between processes on a 2-core CPU (once in a few runs:
            # up to 3e-7 on 43 of the 3,077 masters); a step moves a master by about 1e-3, which a wrong kernel misses
            torch.testing.assert_close(held, masters, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(moments[0], moments[2], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(moments[1], moments[3], rtol=1e-6, atol=1e-9)
        else:  # a moment may round to the neighbouring bf16 value, which the next steps read
            torch.testing.assert_close(moments[0], moments[2], rtol=2**-6, atol=2**-9)
            torch.testing.assert_close(moments[1], moments[3], rtol=2**-6, atol=2**-9)
            torch.testing.assert_close(held, masters, rtol=0, atol=1e-4)
        assert (held - start).abs().mean() > 1e-4


@pytest.mark.slow
def test_the_update_kernel_of_remainders_follows_the_update_of_fp32_masters_under_the_interpreter():
    run_with_triton_interpreter("from test_param_remainders import check_update_kernel; check_update_kernel()")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_the_update_kernel_of_remainders_follows_the_compiled_update_of_fp32_masters_on_cuda():
    assert adamw_update_function(torch.device("cuda"), fused=True, remainders=True) is adamw_update_remainders_fused
    check_update_kernel("cuda")


def test_the_planner_counts_two_bytes_per_master_of_a_bf16_weight():
    def stage(*overrides):
        config = load_config(ROOT / "examples" / "config_tiny_llama.yaml", ["model.dtype=bfloat16", *overrides])
        return estimate_memory(config, gpu_memory_gb=80).stages[0]

    held, copies = stage(), stage("optimizer.store_param_remainders=false")
    assert held.master_weights * 2 == copies.master_weights and held.master_weights > 0
    assert copies.peak - held.peak == held.master_weights
    example = load_config(ROOT / "examples" / "config_tiny_llama.yaml",
                          ["model.dtype=float32", "optimizer.store_param_remainders=true"])
    fp32_model = estimate_memory(example, gpu_memory_gb=80).stages[0]
    assert fp32_model.master_weights == copies.master_weights  # fp32 weights keep fp32 copies whatever the key


# --- training, ZeRO-1 and checkpoints ------------------------------------------------------------------------------

STEPS, SAVED_AT = 12, 6


def _config(tiny_data, folder, remainders: bool, dp: int = 1, resume_from=None) -> dict:
    config = tiny_config_dict(
        tiny_data, folder, model={"dtype": "bfloat16", "init_method": {"std": 0.02}},
        parallelism={"dp": dp, "pp": 1, "tp": 1},
        tokens={"train_steps": STEPS, "micro_batch_size": 4 // dp, "batch_accumulation_per_replica": 1},
        checkpoints={"checkpoint_interval": SAVED_AT, "save_final_state": False,
                     "resume_checkpoint_path": None if resume_from is None else str(resume_from)})
    config["optimizer"] |= {"zero_stage": 1, "store_param_remainders": remainders}
    return config


def _train(config: dict) -> dict:
    """Train; the logical fp32 masters as loaded and at the end, the losses, and how the masters were held."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    optimizer = trainer.optimizer

    def masters() -> dict[str, torch.Tensor]:
        return {name: kinds["master"].clone() for bucket in optimizer.bucket_states() for name, kinds in bucket.items()}

    loaded = masters()
    trainer.train()
    lines = trainer.config.resolved_metrics_path().read_text().splitlines()
    return {"losses": [json.loads(line)["lm_loss"] for line in lines], "loaded": loaded, "final": masters(),
            "held": {t.dtype for t in optimizer.master_state}}


@pytest.fixture(scope="module")
def zero1_runs(tiny_data, tmp_path_factory):
    """On 2 ranks with ZeRO-1: a straight run holding remainders and one holding fp32 copies, each checkpoint
    resumed with the other setting."""
    folder = tmp_path_factory.mktemp("remainders")
    calls = [{"config": _config(tiny_data, folder / "held", True, dp=2)},
             {"config": _config(tiny_data, folder / "copies", False, dp=2)},
             {"config": _config(tiny_data, folder / "held-to-copies", False, 2, folder / "held" / str(SAVED_AT))},
             {"config": _config(tiny_data, folder / "copies-to-held", True, 2, folder / "copies" / str(SAVED_AT))}]
    results = [ranks[0] for ranks in run_distributed_each(_train, 2, calls)]
    return dict(zip(("held", "copies", "held-to-copies", "copies-to-held"), results)) | {"folder": folder}


@pytest.mark.slow
def test_zero1_runs_with_remainders_train_like_fp32_copies(zero1_runs):
    held, copies = zero1_runs["held"], zero1_runs["copies"]
    assert held["held"] == {torch.int16} and copies["held"] == {torch.float32}
    assert held["losses"][-1] < held["losses"][0] - 0.5
    # The same masters until a tie rounds a weight differently; after that the runs differ by rounding.
    assert held["losses"][0] == copies["losses"][0]
    assert held["losses"] == pytest.approx(copies["losses"], rel=1e-3)
    for name, master in held["final"].items():
        torch.testing.assert_close(master, copies["final"][name], rtol=0, atol=2e-3)


def saved_masters(checkpoint) -> dict[str, torch.Tensor]:
    """The fp32 masters of a checkpoint, as whole logical tensors."""
    from nanotron.checkpoint.logical_tensors import LogicalTensorReader

    reader = LogicalTensorReader(checkpoint / "optimizer")
    masters = {}
    for key in sorted(name for name in reader.names() if name.startswith("master/")):
        shape = reader.logical_shape(key)
        masters[key.removeprefix("master/")] = out = torch.empty(shape)
        reader.read_into(key, tuple(slice(0, size) for size in shape), out)
    return masters


def test_a_checkpoint_resumes_its_masters_exactly_with_the_other_setting(zero1_runs):
    for saved, resumed in (("copies", "copies-to-held"), ("held", "held-to-copies")):
        run = zero1_runs[resumed]
        assert run["held"] == ({torch.int16} if resumed.endswith("held") else {torch.float32})
        assert len(run["losses"]) == STEPS - SAVED_AT
        checkpoint = saved_masters(zero1_runs["folder"] / saved / str(SAVED_AT))
        assert checkpoint.keys() == run["loaded"].keys()
        for name, master in run["loaded"].items():
            assert torch.equal(master, checkpoint[name]), (resumed, name)
        # and the weights the resumed run trained from are those masters rounded: it continues the saved run
        assert run["losses"] == pytest.approx(zero1_runs[saved]["losses"][SAVED_AT:], rel=1e-3), resumed


def test_the_benchmark_names_two_runs_by_how_they_hold_the_masters():
    import benchmark_record

    run = {"preset": "mixtral", "precision": "bf16", "adam_moments": "fp32"}
    names = benchmark_record.nanotron_names(run | {"masters": "remainders"}, run | {"masters": "fp32"})
    assert names == ("nanotron-remainders-masters", "nanotron-fp32-masters")
    assert benchmark_record.nanotron_names(run | {"masters": "fp32"}, run) == ("nanotron", "nanotron-versus")
