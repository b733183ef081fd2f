"""Gradient buffers in the model dtype where nothing is summed in them (``data_parallel.gradient_dtype``): which
buckets get which dtype, that training is unchanged, and what the memory planner counts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nanotron.config import LRSchedulerArgs, OptimizerArgs, load_config
from nanotron.memory import estimate_memory
from nanotron.optim.optimizer import build_optimizer
from nanotron.parallel import data_parallel
from nanotron.parallel.placement import Placement, Shard, annotate_placements, get_placement, set_placement
from support import ROOT
from support.configs import tiny_config_dict
from support.distributed import run_distributed, run_distributed_each

DENSE_AXES, EXPERT_AXES = ("dp", "cp", "ep"), ("dp", "cp")


@pytest.fixture(autouse=True)
def hold_every_gradient(monkeypatch):
    """The tiny parameters here are held as large ones are (``HELD_GRADIENT_MIN_ELEMENTS``), unless a test says."""
    monkeypatch.setattr(data_parallel, "HELD_GRADIENT_MIN_ELEMENTS", 1)


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group in this process: the reduction group of a run without data parallelism."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def annotated(params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
    holder = nn.Module()
    for name, param in params.items():
        holder.register_parameter(name, param)
    annotate_placements(holder)
    return params


def build(params: dict[str, nn.Parameter], groups: dict, single_micro_batch: bool, accumulate_in_fp32: bool = True):
    args = OptimizerArgs(learning_rate_scheduler=LRSchedulerArgs(learning_rate=1e-2),
                         accumulate_grad_in_fp32=accumulate_in_fp32)
    return build_optimizer(params, args, bucket_mb=1.0, groups=groups, single_micro_batch=single_micro_batch)


HELD = "held"  # no buffer: the bucket keeps the gradients autograd produced


def grad_dtypes(buckets) -> dict[str, torch.dtype | str]:
    return {name: HELD if bucket.grads is None else bucket.grads.dtype
            for bucket in buckets.buckets for name in bucket.names}


def bf16_and_fp32_params() -> dict[str, nn.Parameter]:
    return {"w": nn.Parameter(torch.ones(8, dtype=torch.bfloat16)), "router": nn.Parameter(torch.ones(4))}


@pytest.mark.parametrize("single_micro_batch, accumulate_in_fp32, expected, router", [
    (True, True, HELD, HELD),  # one gradient, no replica, no tied copy: nothing is summed, no buffer
    (False, True, torch.float32, torch.float32),  # micro-batches are summed in the buffer
    (False, False, torch.bfloat16, torch.float32),  # asked for sums in the model dtype; fp32 keeps fp32
])
def test_a_bucket_has_an_fp32_buffer_only_where_gradients_are_summed_in_it_and_none_where_nothing_is(
        group, single_micro_batch, accumulate_in_fp32, expected, router):
    buckets, _ = build(annotated(bf16_and_fp32_params()), {DENSE_AXES: group}, single_micro_batch, accumulate_in_fp32)
    assert grad_dtypes(buckets) == {"w": expected, "router": router}
    assert buckets.held_gradient_bytes() == (8 * 2 + 4 * 4 if expected == HELD else 0)


def test_gradients_smaller_than_the_threshold_keep_a_buffer_in_their_dtype(group, monkeypatch):
    monkeypatch.setattr(data_parallel, "HELD_GRADIENT_MIN_ELEMENTS", 8)
    params = annotated({"w": nn.Parameter(torch.ones(8, 2, dtype=torch.bfloat16)),
                        "small": nn.Parameter(torch.ones(4, dtype=torch.bfloat16))})
    buckets, optimizer = build(params, {DENSE_AXES: group}, single_micro_batch=True)
    assert grad_dtypes(buckets) == {"w": HELD, "small": torch.bfloat16}
    (params["w"].float().square().sum() + params["small"].float().square().sum()).backward()
    buckets.final_micro_batch = True
    buckets.finish_reduction()
    assert torch.equal(buckets.gradient("small"), torch.full((4,), 2.0, dtype=torch.bfloat16))
    optimizer.step(lr=1e-2)  # a held piece and a buffer's, side by side
    assert torch.all(params["w"] < 1) and torch.all(params["small"] < 1)


def test_a_weight_tied_across_pipeline_stages_keeps_an_fp32_buffer(group):
    params = annotated(bf16_and_fp32_params())
    set_placement(params["w"], replace(get_placement(params["w"]), pipeline_copies=(0, 1)))  # summed over stages
    buckets, _ = build(params, {DENSE_AXES: group}, single_micro_batch=True)
    assert grad_dtypes(buckets)["w"] == torch.float32


def test_a_bucket_without_a_buffer_holds_the_backward_gradient_until_the_step_ends_and_refuses_a_second_one(group):
    param = nn.Parameter(torch.linspace(-1, 1, 64, dtype=torch.bfloat16))
    unused = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    buckets, _ = build(annotated({"w": param, "unused": unused}), {DENSE_AXES: group}, single_micro_batch=True)
    (param.float() ** 3).sum().backward()
    buckets.final_micro_batch = True
    buckets.finish_reduction()
    expected = (3 * param.detach().float() ** 2).to(torch.bfloat16)  # the gradient autograd writes, in bf16
    assert buckets.gradient("w").dtype == torch.bfloat16 and torch.equal(buckets.gradient("w"), expected)
    assert param.grad is None and torch.equal(buckets.gradient("unused"), torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="second gradient in a step of one micro-batch"):
        (param.float() * 2).sum().backward()  # a sum in bf16 would round: a broken promise is an error
    buckets.zero()  # the step's gradients are let go
    assert all(not bucket.held for bucket in buckets.buckets)


def _dense_and_expert_buckets() -> dict:
    """Two ranks as two expert-parallel ranks: the dense weight is reduced over both (fp32 buffer), each rank's
    expert is its own (no buffer). Returns the dtypes, the reduced gradients and the global grad norm."""
    from nanotron.layout import Axis, Layout
    from nanotron.optim.clip import GlobalGradNorm
    from nanotron.parallel.context import ParallelContext

    data_parallel.HELD_GRADIENT_MIN_ELEMENTS = 1  # a spawned process: the fixture did not run here
    pc = ParallelContext(Layout(ep=2))
    rank = pc.coord(Axis.EP)
    dense = nn.Parameter(torch.full((4,), 1.0 + rank, dtype=torch.bfloat16))
    expert = nn.Parameter(torch.full((4,), 3.0 + rank, dtype=torch.bfloat16))
    set_placement(dense, Placement("dense", (4,)))
    set_placement(expert, Placement("expert", (8,), (Shard("ep", 0),)))
    buckets, _ = build({"dense": dense, "expert": expert}, pc.reduction_groups, single_micro_batch=True)
    buckets.final_micro_batch = True
    (dense.float() ** 2 / 3).sum().add((expert.float() ** 2 / 3).sum()).backward()
    buckets.finish_reduction()
    return {"dtypes": grad_dtypes(buckets), "norm": GlobalGradNorm(buckets, pc)().item(),
            "dense": buckets.gradient("dense").clone(), "expert": buckets.gradient("expert").clone()}


def test_over_two_ranks_the_reduced_bucket_is_fp32_and_the_unreduced_one_holds_the_bf16_gradient():
    results = run_distributed(_dense_and_expert_buckets, 2)
    # Each rank's backward gradients, 2x/3 computed in fp32 and stored in the parameters' dtype.
    denses, experts = ([(torch.full((4,), 2 * (start + r)) / 3).to(torch.bfloat16) for r in range(2)]
                       for start in (1.0, 3.0))
    dense_sum = denses[0].float() + denses[1].float()
    for rank, result in enumerate(results):
        assert result["dtypes"] == {"dense": torch.float32, "expert": HELD}
        assert result["expert"].dtype == torch.bfloat16
        assert torch.equal(result["dense"], dense_sum)  # summed in fp32
        assert torch.equal(result["expert"], experts[rank])
    exact = (dense_sum.double().square().sum() + sum(e.double().square().sum() for e in experts)).sqrt().item()
    assert results[0]["norm"] == results[1]["norm"] == pytest.approx(exact, rel=1e-6)


# --- training: autograd's bf16 gradients give the run of fp32 buffers ------------------------------------------


def _train_bf16(config: dict, fp32_buffers: bool) -> dict:
    """Train ``config``; with ``fp32_buffers`` every bucket is built as if micro-batches were summed in it."""
    import nanotron.training.build as build_module
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    data_parallel.HELD_GRADIENT_MIN_ELEMENTS = 1  # a spawned process: the fixture did not run here
    build_all = build_module.build_optimizer
    if fp32_buffers:
        build_module.build_optimizer = lambda *a, **k: build_all(*a, **(k | {"single_micro_batch": False}))
    try:
        trainer = Trainer(config_from_dict(config))
    finally:
        build_module.build_optimizer = build_all
    dtypes = set(grad_dtypes(trainer.buckets).values())
    trainer.train()
    lines = trainer.config.resolved_metrics_path().read_text().splitlines()
    return {"dtypes": dtypes, "metrics": [json.loads(line) for line in lines]}


@pytest.mark.slow
def test_bf16_training_with_autograds_gradients_equals_fp32_buffers(tiny_data, tmp_path):
    def config(name):
        return tiny_config_dict(tiny_data, tmp_path / name, model={"dtype": "bfloat16"},
                                tokens={"batch_accumulation_per_replica": 1, "train_steps": 4})

    narrow, wide = run_distributed_each(_train_bf16, 1, [{"config": config("narrow"), "fp32_buffers": False},
                                                         {"config": config("wide"), "fp32_buffers": True}])
    assert narrow[0]["dtypes"] == {HELD} and wide[0]["dtypes"] == {torch.float32}
    for got, expected in zip(narrow[0]["metrics"], wide[0]["metrics"], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-6, abs=0)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6, abs=0)
        assert got["grad_norm"] > 0


def _train_layout(config: dict, persistent_buffers: bool) -> dict:
    """Train ``config`` with every gradient that nothing sums held (none is too small here), or in buffers."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    data_parallel.HELD_GRADIENT_MIN_ELEMENTS = 1  # a spawned process: the fixture did not run here
    config = config | {"optimizer": config["optimizer"] | {"persistent_gradient_buffers": persistent_buffers}}
    trainer = Trainer(config_from_dict(config))
    held = sorted(name for bucket in trainer.buckets.buckets if bucket.grads is None for name in bucket.names)
    trainer.train()
    return {"held": held, "metrics": str(trainer.config.resolved_metrics_path())}


@pytest.mark.slow
def test_held_gradients_train_as_buffers_do_under_tensor_and_pipeline_parallelism(tiny_data, tmp_path):
    """Held gradients are normed a parameter at a time: kv heads replicated over TP ranks must still count once, and
    the embedding tied across pipeline stages keeps the buffer it is summed in."""
    layouts = {"tp4": {"tp": 4}, "pp2_tp2": {"pp": 2, "tp": 2}}  # 2 kv heads: replicated over tp=4
    calls = [{"config": tiny_config_dict(tiny_data, tmp_path / f"{name}-{persistent}", parallelism=layout,
                                         tokens={"batch_accumulation_per_replica": 1, "train_steps": 4}),
              "persistent_buffers": persistent}
             for name, layout in layouts.items() for persistent in (False, True)]
    results = run_distributed_each(_train_layout, 4, calls)
    for index, name in enumerate(layouts):
        held, buffered = results[2 * index], results[2 * index + 1]
        assert all(rank["held"] for rank in held) and not any(rank["held"] for rank in buffered), name
        assert not any("embed" in n or "lm_head" in n for rank in held for n in rank["held"]) or name == "tp4"
        runs = [[json.loads(line) for line in Path(run[0]["metrics"]).read_text().splitlines()]
                for run in (held, buffered)]
        assert runs[0][-1]["lm_loss"] < runs[0][0]["lm_loss"] and all(m["grad_norm"] > 0 for m in runs[0]), name
        for got, expected in zip(*runs, strict=True):
            assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5, abs=0), name
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5, abs=0), name


@pytest.mark.slow
def test_a_run_with_held_gradients_resumes_with_buffers_and_continues_its_curve(tiny_data, tmp_path):
    """Optimizer checkpoints are per parameter, so a resume does not depend on how buckets were cut: with held
    gradients and with buffers the buckets differ, and a run saved by one continues under the other."""
    def config(run: str, steps: int, persistent: bool, resume: bool = False) -> dict:
        checkpoints = {"checkpoint_interval": 3}
        if resume:
            checkpoints["resume_checkpoint_path"] = str(tmp_path / run)
        return {"config": tiny_config_dict(tiny_data, tmp_path / run, checkpoints=checkpoints,
                                           tokens={"batch_accumulation_per_replica": 1, "train_steps": steps}),
                "persistent_buffers": persistent}

    straight, first, resumed = run_distributed_each(_train_layout, 1, [
        config("straight", 6, False), config("resumed", 3, False), config("resumed", 6, True, resume=True)])
    assert straight[0]["held"] and first[0]["held"] and not resumed[0]["held"]
    runs = [[json.loads(line) for line in Path(run[0]["metrics"]).read_text().splitlines()]
            for run in (straight, resumed)]
    assert [r["step"] for r in runs[1]] == list(range(1, 7))
    for got, expected in zip(runs[1], runs[0], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5, abs=0), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5, abs=0), got["step"]


# --- the memory planner ----------------------------------------------------------------------------------------


def tiny_bf16_stages(*overrides: str):
    config = load_config(ROOT / "examples" / "config_tiny_llama.yaml", ["model.dtype=bfloat16", *overrides])
    return estimate_memory(config, gpu_memory_gb=80).stages


def test_the_planner_counts_buffers_where_gradients_are_summed_and_held_ones_where_not():
    one_buffered, = tiny_bf16_stages("tokens.batch_accumulation_per_replica=1",
                                     "optimizer.persistent_gradient_buffers=true")
    (one,) = tiny_bf16_stages("tokens.batch_accumulation_per_replica=1")
    (two,) = tiny_bf16_stages("tokens.batch_accumulation_per_replica=2")
    (replicated,) = tiny_bf16_stages("tokens.batch_accumulation_per_replica=1", "parallelism.dp=2")
    assert one_buffered.gradients == one.weights  # bf16 weights, a bf16 buffer
    assert two.gradients == replicated.gradients == 2 * one.weights  # fp32
    # Held: at the backward's start the top layer's and the final norm's (the fused loss counts the head's).
    embedding_bytes, norm_bytes = 4096 * 128 * 2, 128 * 2
    layer_bytes = (one.weights - embedding_bytes - norm_bytes) // 4
    assert one.gradients == layer_bytes + norm_bytes
    # Pipeline stages: the embedding and the head tied to it are summed over the two ends, in an fp32 buffer; the
    # rest is held.
    first, last = tiny_bf16_stages("tokens.batch_accumulation_per_replica=1", "parallelism.pp=2")
    assert first.gradients == 2 * embedding_bytes + layer_bytes
    assert last.gradients == 2 * embedding_bytes + layer_bytes + norm_bytes
