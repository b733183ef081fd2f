"""Interleaved 1F1B, ZB-H1 and ZBV train the model one process trains: first-step gradients, then loss and grad-norm
of every step, over real trainers in gloo processes (float32, to 1e-5); and a run resumes
exactly at another schedule and pipeline size."""

from __future__ import annotations

import pytest
import torch

from nanotron.pipeline_schedules import SCHEDULES
from support.configs import tiny_config_dict
from support.distributed import run_distributed
from support.parity import assemble, assert_reference_trains, first_step_then_train, first_step_then_train_on
from support.runs import train_in_process
from support.tiers import parity_steps

STEPS = parity_steps(short=10)


LEARNING_RATE = 3e-3  # the tiny config's


def schedule_config(tiny_data, folder, *, engine: str = "1f1b", pp: int = 1, virtual: int = 1, tied: bool = True,
                    learning_rate: float = LEARNING_RATE, zero: int = 0, **parallelism) -> dict:
    """8 layers, 8 micro-batches of one sequence a step: every schedule and chunk count below can split them."""
    base = tiny_config_dict(tiny_data, folder)
    model = base["model"] | {"model_config": base["model"]["model_config"] | {"num_hidden_layers": 8,
                                                                              "tie_word_embeddings": tied}}
    optimizer = base["optimizer"] | {"zero_stage": zero}
    optimizer["learning_rate_scheduler"] = optimizer["learning_rate_scheduler"] | {"learning_rate": learning_rate}
    replicas = parallelism.get("dp", 1) * parallelism.get("expert_parallel_size", 1)
    return tiny_config_dict(
        tiny_data, folder, model=model, optimizer=optimizer,
        parallelism={"pp": pp, "pp_engine": engine, "virtual_pipeline_size": virtual, **parallelism},
        tokens={"micro_batch_size": 1, "batch_accumulation_per_replica": 8 // replicas, "train_steps": STEPS})


@pytest.fixture(scope="module")
def references(tiny_data, tmp_path_factory):
    """One process, by tied embeddings and learning rate: each trained once, when a test first asks for it."""
    trained: dict[tuple[bool, float], dict] = {}

    def reference(tied: bool, learning_rate: float = LEARNING_RATE) -> dict:
        if (tied, learning_rate) not in trained:
            config = schedule_config(tiny_data, tmp_path_factory.mktemp("reference"), tied=tied,
                                     learning_rate=learning_rate)
            (result,) = run_distributed(first_step_then_train, 1, timeout=900, config=config)
            assert_reference_trains(result["metrics"], STEPS)
            trained[tied, learning_rate] = result
        return trained[tied, learning_rate]

    return reference


def check_parity(reference: list[dict], results: list[dict], layout: str) -> None:
    """First-step gradients (unless ZeRO-1 split them over the replicas), then loss and grad-norm of every step:
    ``results`` against ``reference`` (each a run's ranks)."""
    if not results[0]["sharded"]:
        reference_grads = assemble(reference, "grads")
        for name, grad in assemble(results, "grads").items():
            torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=f"{layout} {name}")
    (expected_metrics,), (metrics,) = ([rank["metrics"] for rank in run if rank["metrics"]]
                                       for run in (reference, results))
    for expected, got in zip(expected_metrics, metrics, strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), (layout, got["step"])
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), (layout, got["step"])


# (world, parallelism, tied embeddings): one representative of each schedule in the default tier. The data-parallel
# cases learn at 1e-3 untied: at 3e-3 the gradient norm jumps 15-fold at steps 5 and 11, after which the replicas'
# order of sums shows above 1e-5 at 20 steps, 1F1B's as much as any other schedule's (pp 2 x dp 2: grad-norm 4.0e-5
# off one process at step 11 under 1F1B, 3.4e-5 under ZBV; at 1e-3 at most 3.5e-6 and 2.7e-6); tied, the norm jumps
# 28-fold at step 16 even at 1e-3, where the split's sums differ by 1e-3.
LAYOUTS = [
    (2, {"pp": 2, "engine": "interleaved_1f1b", "virtual": 2}, True),
    (2, {"pp": 2, "engine": "zb_h1"}, True),
    (2, {"pp": 2, "engine": "zbv", "virtual": 2}, False),
    pytest.param(4, {"pp": 4, "engine": "interleaved_1f1b", "virtual": 2}, True, marks=pytest.mark.full_tier),
    pytest.param(4, {"pp": 4, "engine": "zb_h1"}, True, marks=pytest.mark.full_tier),
    pytest.param(4, {"pp": 2, "engine": "interleaved_1f1b", "virtual": 2, "dp": 2, "zero": 1, "learning_rate": 1e-3},
                 False, marks=pytest.mark.full_tier),
    pytest.param(4, {"pp": 2, "engine": "zb_h1", "tp": 2, "tp_mode": "REDUCE_SCATTER"}, True,
                 marks=pytest.mark.full_tier),
    pytest.param(4, {"pp": 2, "engine": "zbv", "virtual": 2, "dp": 2, "learning_rate": 1e-3}, False,
                 marks=pytest.mark.full_tier),
]


@pytest.mark.parametrize("world, parallelism, tied", LAYOUTS)
@pytest.mark.slow
def test_schedule_trains_as_one_process(references, tiny_data, tmp_path, world, parallelism, tied):
    config = schedule_config(tiny_data, tmp_path, tied=tied, **parallelism)
    results = run_distributed(first_step_then_train, world, timeout=900, config=config)
    check_parity([references(tied, parallelism.get("learning_rate", LEARNING_RATE))], results, str(parallelism))


# --- features on the schedules ---------------------------------------------------------------------------------

# Layer 0 dense, then mixtures of 4 experts (top-2) with both router losses: inner chunks add losses of their own.
MOE = {"is_llamoe_config": True, "moe_num_experts": 4, "num_experts_per_tok": 2, "moe_first_dense_layers": 1,
       "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001}
MAMBA = {"is_mamba_config": True, "d_model": 64, "num_hidden_layers": 8, "vocab_size": 384,
         "ssm_cfg": {"d_state": 8, "d_conv": 4, "expand": 2}}
QWEN2_DOCUMENTS = {"is_qwen2_config": True, "attention_bias": True, "_use_doc_masking": True}


def feature_config(tiny_data, folder, feature: str, **layout) -> dict:
    """The model of ``feature``; the mixture of experts and the document-masked Qwen2 learn at 1e-3: at 3e-3 their
    gradient norms jump 25- to 50-fold (the MoE's at step 5, the Qwen2's at step 10), after which any split's order of
    sums shows above 1e-5 (1F1B's too)."""
    slower = feature in ("moe", "documents")
    config = schedule_config(tiny_data, folder, learning_rate=1e-3 if slower else LEARNING_RATE, **layout)
    model_config = config["model"]["model_config"]
    if feature in ("moe", "documents"):
        del model_config["is_llama_config"]
        model_config |= MOE if feature == "moe" else QWEN2_DOCUMENTS
    if feature == "fp8":
        config["fp8"] = {"enabled": True}
    if feature == "mamba":
        config["model"]["model_config"] = MAMBA
    elif feature == "documents":
        config["data_stages"][0]["data"]["dataset"]["return_positions"] = True
    return config


@pytest.mark.full_tier
@pytest.mark.parametrize("feature, world, parallelism", [
    ("moe", 2, {"pp": 2, "engine": "interleaved_1f1b", "virtual": 2}),
    pytest.param("moe", 4, {"pp": 2, "engine": "zb_h1", "expert_parallel_size": 2}, marks=pytest.mark.full_tier),
    pytest.param("mamba", 2, {"pp": 2, "engine": "zb_h1"}, marks=pytest.mark.full_tier),
    pytest.param("mamba", 2, {"pp": 2, "engine": "interleaved_1f1b", "virtual": 2}, marks=pytest.mark.full_tier),
    pytest.param("documents", 2, {"pp": 2, "engine": "zb_h1"}, marks=pytest.mark.full_tier),
    pytest.param("llama", 4, {"pp": 2, "engine": "interleaved_1f1b", "virtual": 2, "context_parallel_size": 2},
                 marks=pytest.mark.full_tier),
    pytest.param("llama", 2, {"pp": 2, "engine": "interleaved_1f1b", "virtual": 2, "recompute": "full"},
                 marks=pytest.mark.full_tier),
], ids=str)
def test_features_train_as_one_process_under_the_schedules(tiny_data, tmp_path, feature, world, parallelism):
    """Mixtures of experts (router losses on inner chunks; expert parallelism), Mamba (whose convolution's weight
    cannot wait for W), document masking, context parallelism and recomputed layers, each against one process of
    the same model."""
    (reference,) = run_distributed(first_step_then_train, 1, timeout=900,
                                   config=feature_config(tiny_data, tmp_path / "one", feature))
    assert_reference_trains(reference["metrics"], STEPS)
    results = run_distributed(first_step_then_train, world, timeout=900,
                              config=feature_config(tiny_data, tmp_path / "split", feature, **parallelism))
    check_parity([reference], results, f"{feature} {parallelism}")


def _fp8_gradients_in_order(config: dict) -> dict:
    """``first_step_then_train``, logging in order each action's op and each FP8 linear's weight as its gradient
    arrives (by name)."""
    from nanotron.config import config_from_dict
    from nanotron.nn.fp8 import FP8Matmul
    from nanotron.parallel import pipeline_parallel
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    log: list[str] = []
    for name, module in trainer.model.named_modules():
        if isinstance(getattr(module, "matmul", None), FP8Matmul):
            module.weight.register_post_accumulate_grad_hook(lambda _, name=name: log.append(name))
    act = pipeline_parallel._StepRun.act
    pipeline_parallel._StepRun.act = lambda run, action, *args: (log.append(action.op.value), act(run, action, *args))
    try:
        result = first_step_then_train_on(trainer)
    finally:
        pipeline_parallel._StepRun.act = act
    return result | {"log": log, "last_stage": trainer.pc.is_last_stage}


def _ops_that_computed_each_gradient(log: list[str]) -> list[str]:
    """For each weight's gradient in ``log``, the op of the action it arrived in."""
    op, ops = None, []
    for entry in log:
        if entry in ("F", "B", "I", "W"):
            op = entry
        else:
            ops.append(op)
    return ops


# In every tier: the gradient norm sums each stage's squares, which other chunks group otherwise; FP8's casts round
# such 1e-7 differences apart, to 1e-5 (interleaved) and 9e-5 (ZBV) by step 14 of 20 (measured, first 13 within 1e-5).
FP8_STEPS = 6


@pytest.mark.full_tier
@pytest.mark.parametrize("parallelism", [
    {"pp": 2, "engine": "zb_h1"},
    pytest.param({"pp": 2, "engine": "zbv", "virtual": 2, "tied": False}, marks=pytest.mark.full_tier),
    pytest.param({"pp": 2, "engine": "interleaved_1f1b", "virtual": 2}, marks=pytest.mark.full_tier),
], ids=str)
def test_fp8_trains_as_under_1f1b_and_a_split_backward_defers_its_weight_gradients(tiny_data, tmp_path,
                                                                                   parallelism):
    """FP8's linear (emulated on the CPU) computes only the gradients asked for, so a split backward defers its
    weight's to W: on the last stage (whose chunks all have an input to differentiate) every FP8 weight gets each
    micro-batch's gradient in a W action. Each micro-batch is cast and its gradients summed as under 1F1B at the same
    pp: first-step gradients, loss and grad-norm within 1e-5. (Against one process the tied embeddings' gradients are
    summed in another order, which FP8's casts round apart: 5e-5 in the grad-norm by step 9.)"""
    def config(folder: str, **layout) -> dict:
        config = feature_config(tiny_data, tmp_path / folder, "fp8", **layout)
        config["tokens"]["train_steps"] = FP8_STEPS
        return config

    reference = run_distributed(first_step_then_train, 2, timeout=900,
                                config=config("1f1b", pp=2, tied=parallelism.get("tied", True)))
    assert_reference_trains(reference[0]["metrics"], FP8_STEPS)
    results = run_distributed(_fp8_gradients_in_order, 2, timeout=900, config=config("split", **parallelism))
    check_parity(reference, results, f"fp8 {parallelism}")
    (last,) = [result for result in results if result["last_stage"]]
    ops = _ops_that_computed_each_gradient(last["log"])
    fp8_weights = len(set(last["log"]) - set("FBIW"))
    assert fp8_weights > 0 and len(ops) == fp8_weights * 8 * (FP8_STEPS + 1)  # 8 micro-batches a step, the first
    assert set(ops) == ({"W"} if SCHEDULES[parallelism["engine"]].splits_backward else {"B"})


# --- resume across schedules and pipeline sizes -----------------------------------------------------------------

SAVED_AT, RESUMED_STEPS = 3, 6
ONE_PROCESS = {"pp": 1}
INTERLEAVED = {"pp": 2, "engine": "interleaved_1f1b", "virtual": 2}


def resume_config(tiny_data, folder, layout: dict, resume_from: str | None = None) -> dict:
    config = schedule_config(tiny_data, folder, **layout)
    config["tokens"]["train_steps"] = RESUMED_STEPS
    config["checkpoints"] |= {"checkpoint_interval": SAVED_AT, "resume_checkpoint_path": resume_from,
                              "save_final_state": False}
    return config


def world(layout: dict) -> int:
    return layout["pp"] * layout.get("dp", 1) * layout.get("tp", 1)


@pytest.fixture(scope="module")
def saved_runs(tiny_data, tmp_path_factory):
    """Uninterrupted runs, each saving at SAVED_AT, by layout."""
    runs = {}

    def run(layout: dict) -> tuple:
        key = str(layout)
        if key not in runs:
            folder = tmp_path_factory.mktemp("saved")
            runs[key] = (folder, run_distributed(train_in_process, world(layout), timeout=900,
                                                 config=resume_config(tiny_data, folder, layout))[0])
            assert_reference_trains(runs[key][1], RESUMED_STEPS)
        return runs[key]

    return run


@pytest.mark.parametrize("source, target", [
    (INTERLEAVED, ONE_PROCESS),
    pytest.param(INTERLEAVED, {"pp": 4, "engine": "zb_h1"}, marks=pytest.mark.full_tier),
    pytest.param(ONE_PROCESS, INTERLEAVED, marks=pytest.mark.full_tier),
    pytest.param({"pp": 4, "engine": "interleaved_1f1b", "virtual": 2}, INTERLEAVED, marks=pytest.mark.full_tier),
    pytest.param({"pp": 2, "engine": "zbv", "virtual": 2, "tied": False}, {"pp": 2, "engine": "zb_h1", "tied": False},
                 marks=pytest.mark.full_tier),
], ids=str)
@pytest.mark.slow
def test_a_run_resumes_exactly_under_another_schedule_and_pipeline_size(saved_runs, tiny_data, tmp_path, source,
                                                                         target):
    """Checkpoints hold logical tensors: the steps after the resume are the uninterrupted run's, whatever the
    chunks and stages on either side."""
    folder, straight = saved_runs(source)
    config = resume_config(tiny_data, tmp_path / "resumed", target, resume_from=str(folder / str(SAVED_AT)))
    resumed = run_distributed(train_in_process, world(target), timeout=900, config=config)[0]
    assert [m["step"] for m in resumed] == list(range(SAVED_AT + 1, RESUMED_STEPS + 1))
    for expected, got in zip(straight[SAVED_AT:], resumed, strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), got["step"]
        assert (got["lr"], got["consumed_tokens"]) == (expected["lr"], expected["consumed_tokens"])
