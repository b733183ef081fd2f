"""Sharded data parallelism: ZeRO-2 (gradients), ZeRO-3 (weights, gathered a unit at a time) and HSDP, against one
process with the same global batch, and the order in which ZeRO-3 gathers, computes and releases."""

from __future__ import annotations

import pytest
import torch

from support.configs import MAMBA, MOE, tiny_config_dict
from support.distributed import run_distributed, run_distributed_each
from support.parity import assert_matches_reference, assert_reference_trains, logical_pieces
from support.runs import trainer_metrics
from support.tiers import full_tier

STEPS = 20 if full_tier() else 10


def zero_config(tiny_data, folder, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, dp_shard: int | None = None,
                **overrides) -> dict:
    """The same 8-sequence global batch for every layout (micro_batch_size shrinks as dp grows), 4 layers."""
    base = tiny_config_dict(tiny_data, folder)
    model = base["model"] | overrides.pop("model", {})
    model["model_config"] = model["model_config"] | {"num_hidden_layers": 4}
    optimizer = base["optimizer"] | {"zero_stage": zero} | overrides.pop("optimizer", {})
    tokens = {"train_steps": STEPS, "micro_batch_size": 4 // dp, "batch_accumulation_per_replica": 2}
    tokens |= overrides.pop("tokens", {})
    parallelism = {"dp": dp, "tp": tp, "pp": pp, "tp_mode": "REDUCE_SCATTER", "replica_check_interval": 5,
                   "dp_shard": dp_shard} | overrides.pop("parallelism", {})
    return tiny_config_dict(tiny_data, folder, model=model, optimizer=optimizer, tokens=tokens,
                            parallelism=parallelism, **overrides)


def _run(config: dict) -> dict:
    """Train; the metrics (rank 0), this rank's pieces of the final weights (whole ones: ZeRO-3 gathers them) and
    what it holds of parameters and optimizer state between steps."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    trainer.train()
    pc, buckets = trainer.pc, trainer.buckets
    held = sum(p.untyped_storage().nbytes() for p in {b.params.untyped_storage().data_ptr(): b.params
                                                      for b in buckets.buckets}.values())
    weights = {}
    for whole in buckets.whole_parameters():
        weights |= logical_pieces(whole, trainer.params, pc.coordinates, pc.sizes)
    return {"metrics": trainer_metrics(trainer), "weights": weights,
            "state_numel": trainer.optimizer.local_state_numel(), "held_parameter_bytes": held}


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    (result,) = run_distributed(_run, 1, config=zero_config(tiny_data, tmp_path_factory.mktemp("ref") / "run"))
    assert_reference_trains(result["metrics"], STEPS)
    return result


@pytest.mark.slow
def test_zero_2_matches_one_process_and_holds_a_shard_of_each_gradient(reference, tiny_data, tmp_path):
    calls = [{"config": zero_config(tiny_data, tmp_path / f"zero{zero}", dp=2, zero=zero)} for zero in (1, 2)]
    zero1, zero2 = run_distributed_each(_run, 2, calls)
    assert_matches_reference(reference, zero2, "zero 2")
    assert zero2[0]["state_numel"] == zero1[0]["state_numel"]


@pytest.mark.parametrize("dp, tp, pp, dp_shard", [
    (2, 1, 1, None),
    pytest.param(4, 1, 1, 2, id="hsdp-2x2"),
    pytest.param(4, 1, 1, None, marks=pytest.mark.full_tier),
    pytest.param(2, 2, 1, None, marks=pytest.mark.full_tier),
    pytest.param(2, 1, 2, None, marks=pytest.mark.full_tier),
])
@pytest.mark.slow
def test_zero_3_matches_one_process(reference, tiny_data, tmp_path, dp, tp, pp, dp_shard):
    config = zero_config(tiny_data, tmp_path / "zero3", dp=dp, tp=tp, pp=pp, zero=3, dp_shard=dp_shard)
    results = run_distributed(_run, dp * tp * pp, config=config)
    assert_matches_reference(reference, results, (dp, tp, pp, dp_shard))
    assert all(r["held_parameter_bytes"] == 0 for r in results)  # between steps only shards are held


@pytest.mark.full_tier
@pytest.mark.parametrize("zero", [1, 2])
def test_hsdp_at_zero_1_and_2_matches_one_process(reference, tiny_data, tmp_path, zero):
    """dp 4 as 2 shards x 2 replicas: the optimizer state (and at ZeRO-2 the gradients) sharded within each pair."""
    config = zero_config(tiny_data, tmp_path / f"hsdp-zero{zero}", dp=4, zero=zero, dp_shard=2)
    assert_matches_reference(reference, run_distributed(_run, 4, config=config), ("hsdp", zero))


def _is_sharded(config: dict) -> dict:
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    trainer.train()
    return {"units": trainer.sharded_units, "sharded": any(b.sharded for b in trainer.buckets.buckets),
            "metrics": trainer_metrics(trainer)}


def test_zero_3_on_one_rank_is_zero_0_with_no_hook(reference, tiny_data, tmp_path):
    """With one rank per shard group nothing is sharded and nothing is gathered: the run is ZeRO-0's, bit for bit."""
    (result,) = run_distributed(_is_sharded, 1, config=zero_config(tiny_data, tmp_path / "one", zero=3))
    assert result["units"] is None and not result["sharded"]
    for expected, got in zip(reference["metrics"], result["metrics"], strict=True):
        assert (got["lm_loss"], got["grad_norm"]) == (expected["lm_loss"], expected["grad_norm"]), got["step"]


def _gathers_and_computes(config: dict) -> list[tuple[str, str]]:
    """One step's events in order: the units' gathers launched, waited for and released, each layer's forward
    (``forward``, as it starts) and the end of its backward (``backward``: its input's gradient computed)."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer
    from support.parity import first_step

    trainer = Trainer(config_from_dict(config))
    events = trainer.sharded_units.events = []

    def record_forward(name):
        def hook(module, args):
            events.append(("forward", name))
            args[0].register_hook(lambda grad: events.append(("backward", name)))
        return hook

    for index, layer in trainer.model.layers.items():
        layer.register_forward_pre_hook(record_forward(f"layers.{index}"))
    trainer.train_step(first_step(trainer), lr=1e-3)
    return events


def test_zero_3_gathers_the_next_layer_while_one_computes_and_releases_each_after_use(tiny_data, tmp_path):
    """Forward: layer i+1's gather is launched before layer i computes and waited for after; backward: layer i's
    while layer i+1's backward runs (before its input's gradient exists). Each layer is released after its forward
    (the last one only once the backward started) and after its backward; never more than two layers and the outer
    unit are gathered at once; the update releases everything."""
    config = zero_config(tiny_data, tmp_path / "order", dp=2, zero=3, tokens={"batch_accumulation_per_replica": 1,
                                                                                "micro_batch_size": 4})
    events = run_distributed(_gathers_and_computes, 2, config=config)[0]
    layers = [f"layers.{i}" for i in range(4)]
    first, last = {}, {}
    for index, event in enumerate(events):
        first.setdefault(event, index)
        last[event] = index
    for before, after in zip(layers, layers[1:]):
        assert first[("gather", after)] < first[("forward", before)] < first[("wait", after)], events
        assert first[("release", before)] < first[("forward", after)], events
        assert last[("forward", layers[-1])] < last[("gather", before)] < last[("backward", after)], events
    assert first[("release", layers[-1])] > last[("gather", layers[-2])], events  # kept until its backward
    gathered, most = set(), 0
    for what, unit in events:
        if what == "gather":
            gathered.add(unit)
        elif what == "release":
            gathered.discard(unit)
        most = max(most, len(gathered - {"outer"}))
    assert most == 2 and gathered == set(), events


def _reduced_dtypes(config: dict) -> dict:
    """Train; the dtypes ZeRO's reduce-scatters ran in, and the metrics (rank 0)."""
    import torch.distributed as dist

    from nanotron.config import config_from_dict
    from nanotron.parallel import data_parallel
    from nanotron.trainer import Trainer

    dtypes = set()

    def recording(output, input, **kwargs):
        dtypes.add(input.dtype)
        return dist.reduce_scatter_tensor(output, input, **kwargs)

    data_parallel.dist = type("Spy", (), {"__getattr__": lambda self, name: getattr(dist, name),
                                          "reduce_scatter_tensor": staticmethod(recording)})()
    try:
        trainer = Trainer(config_from_dict(config))
        trainer.train()
    finally:
        data_parallel.dist = dist
    return {"dtypes": dtypes, "metrics": trainer_metrics(trainer)}


@pytest.mark.slow
def test_bf16_gradient_reduction_is_an_option_and_summed_in_fp32(tiny_data, tmp_path):
    """bf16 weights: ZeRO-2 reduce-scatters in fp32 by default; ``grad_reduce_in_bf16`` in bf16, which stays close."""
    def config(name, bf16_reduce):
        return zero_config(tiny_data, tmp_path / name, dp=2, zero=2, model={"dtype": "bfloat16"},
                           tokens={"train_steps": 4}, optimizer={"grad_reduce_in_bf16": bf16_reduce})

    fp32, bf16 = run_distributed_each(_reduced_dtypes, 2, [{"config": config("fp32", False)},
                                                            {"config": config("bf16", True)}])
    assert fp32[0]["dtypes"] == {torch.float32} and bf16[0]["dtypes"] == {torch.bfloat16}
    for expected, got in zip(fp32[0]["metrics"], bf16[0]["metrics"], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-2)


def _llama_without_marker(config: dict) -> dict:
    return {key: value for key, value in config["model"]["model_config"].items() if key != "is_llama_config"}


# What ZeRO-3 composes with, each as the changes it makes to ``zero_config``'s dp=2 run; the tied embeddings of the
# tiny model are in every case above.
COMPOSED = {
    "moe, ep 2": lambda c: {"model": c["model"] | {"model_config": _llama_without_marker(c) | MOE},
                            "parallelism": c["parallelism"] | {"expert_parallel_size": 2}},
    "cp 2, qwen2, document masking": lambda c: {
        "parallelism": c["parallelism"] | {"context_parallel_size": 2},
        "model": c["model"] | {"model_config": _llama_without_marker(c) | {
            "is_qwen2_config": True, "attention_bias": True, "_use_doc_masking": True}}},
    "fp8 (emulated)": lambda c: {"fp8": {"enabled": True, "recipe": "rowwise"}},
    "mamba": lambda c: {"model": c["model"] | {"model_config": MAMBA | {"num_hidden_layers": 4}}},
    "selective recompute": lambda c: {"parallelism": c["parallelism"] | {"recompute": "selective"}},
    "pointwise recompute": lambda c: {"parallelism": c["parallelism"] | {"recompute": "pointwise"}},
    "compiled layers": lambda c: {"model": c["model"] | {"compile": True}},
    "tp 2, ALL_REDUCE": lambda c: {"parallelism": c["parallelism"] | {"tp": 2, "tp_mode": "ALL_REDUCE"}},
    "pp 2, afab": lambda c: {"parallelism": c["parallelism"] | {"pp": 2, "pp_engine": "afab"}},
}
COMPOSED_RANKS = {"moe, ep 2": 4, "cp 2, qwen2, document masking": 4, "tp 2, ALL_REDUCE": 4, "pp 2, afab": 4}
REPRESENTATIVE = "selective recompute"


@pytest.mark.parametrize("feature", [feature if feature == REPRESENTATIVE else
                                     pytest.param(feature, marks=pytest.mark.full_tier) for feature in COMPOSED])
@pytest.mark.slow
def test_zero_3_composes_with(tiny_data, tmp_path, feature):
    """The same run at ZeRO-0 and at ZeRO-3 (whose ZeRO-0 each feature's own tests hold against one process): loss
    and grad-norm within 1e-5 at every step (FP8 within 1e-3: a rounding flip of the casts moves more)."""
    calls = []
    for zero in (0, 3):
        config = zero_config(tiny_data, tmp_path / f"zero{zero}", dp=2, zero=zero, tokens={"train_steps": 6})
        calls.append({"config": config | COMPOSED[feature](config)})
    plain, sharded = run_distributed_each(_run, COMPOSED_RANKS.get(feature, 2), calls)
    tolerance = 1e-3 if feature.startswith("fp8") else 1e-5
    (expected,), (got,) = [r["metrics"] for r in plain if r["metrics"]], [r["metrics"] for r in sharded if r["metrics"]]
    assert len(got) == 6
    for before, after in zip(expected, got, strict=True):
        assert after["lm_loss"] == pytest.approx(before["lm_loss"], rel=tolerance), (feature, after["step"])
        assert after["grad_norm"] == pytest.approx(before["grad_norm"], rel=tolerance), (feature, after["step"])
    assert all(r["held_parameter_bytes"] == 0 for r in sharded)


@pytest.mark.full_tier
def test_zero_3_composes_with_doremi(tiny_data, doremi_domains, doremi_reference, tmp_path):
    """DoReMi's proxy run at dp 2 (its reference model whole on each rank, the proxy sharded): ZeRO-3 as ZeRO-0,
    domain weights included."""
    from support.configs import doremi_config

    calls = []
    for zero in (0, 3):
        config = doremi_config(tiny_data, doremi_domains, tmp_path / f"zero{zero}", dp=2, reference=doremi_reference)
        config["optimizer"]["zero_stage"] = zero
        calls.append({"config": config})
    plain, sharded = run_distributed_each(_run, 2, calls)
    (expected,), (got,) = [r["metrics"] for r in plain if r["metrics"]], [r["metrics"] for r in sharded if r["metrics"]]
    assert_reference_trains(expected, len(expected))
    timings = ("step_time_s", "tokens_per_sec", "tokens_per_sec_per_gpu", "tflops_per_gpu", "hardware_tflops_per_gpu",
               "peak_memory_gb")
    for before, after in zip(expected, got, strict=True):
        assert before.keys() == after.keys()
        for key in before.keys() - set(timings):
            assert after[key] == pytest.approx(before[key], rel=1e-5, abs=1e-7), (key, after["step"])
