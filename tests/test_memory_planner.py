"""The memory planner reads each stage's model as training builds it: ``build_stage`` on the meta device for any rank
gives the parameters ``build_model`` gives that rank in a real run; the planner's numbers equal those of the planner
that restated the sharding rules (recorded below); a style or family it has never seen is counted from the model."""

from dataclasses import replace

import pytest
import yaml

from nanotron.config import ConfigError, apply_overrides, config_from_dict, load_config
from nanotron.layout import Layout
from nanotron.memory import estimate_memory
from nanotron.models.build import BuildOptions, build_stage
from nanotron.models.registry import MODEL_SPECS
from nanotron.parallel.context import GridPosition
from nanotron.parallel.placement import get_placement, logical_parameters
from nanotron.parallel.tensor_parallel import Column, ColumnParallelLinear, Style
from support import ROOT
from support.distributed import run_distributed_each

TINY = ROOT / "examples" / "config_tiny_llama.yaml"
TINY_MAMBA = ROOT / "examples" / "config_tiny_mamba.yaml"
BENCH = ROOT / "examples" / "config_llama1b_bench.yaml"


def tiny_moe_raw() -> dict:
    raw = yaml.safe_load(TINY.read_text())
    model_config = {k: v for k, v in raw["model"]["model_config"].items() if k != "is_llama_config"}
    raw["model"]["model_config"] = model_config | {"is_llamoe_config": True, "moe_num_experts": 4,
                                                   "num_experts_per_tok": 2}
    return raw


def tiny_config(family: str, overrides: list[str]):
    if family == "moe":
        return config_from_dict(apply_overrides(tiny_moe_raw(), overrides))
    return load_config(TINY_MAMBA if family == "mamba" else TINY, overrides)


def layout(model) -> dict[str, tuple]:
    """Every parameter of a built model by logical name: its local shape, dtype and placement."""
    return {name: (tuple(param.shape), param.dtype, get_placement(param))
            for name, param in logical_parameters(model).items()}


def _built_by_training(family: str, overrides: list[str]) -> tuple[dict, dict[str, tuple]]:
    from nanotron.models.build import build_model
    from nanotron.parallel.context import ParallelContext

    config = tiny_config(family, overrides)
    pc = ParallelContext(Layout.from_config(config))
    model = build_model(config.model.model_config, pc, BuildOptions.from_config(config))
    return pc.coordinates, layout(model)


LAYOUTS = {  # two ranks each
    "llama tp=2 sequence parallel": ("llama", ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"]),
    "llama pp=2, tied embeddings": ("llama", ["parallelism.pp=2"]),
    "moe ep=2": ("moe", ["parallelism.expert_parallel_size=2"]),
    "moe tp=2": ("moe", ["parallelism.tp=2"]),
    "mamba tp=2": ("mamba", ["parallelism.tp=2"]),
    "llama cp=2": ("llama", ["parallelism.context_parallel_size=2"]),
}


@pytest.mark.slow
def test_build_stage_on_the_meta_device_gives_every_rank_the_parameters_training_builds_for_it():
    """``build_model`` in two real gloo processes against ``build_stage`` here, for each rank's grid position, with
    ``GroupShape`` stand-ins for the process groups: the same names, local shapes, dtypes and placements."""
    calls = [{"family": family, "overrides": overrides} for family, overrides in LAYOUTS.values()]
    for name, per_rank in zip(LAYOUTS, run_distributed_each(_built_by_training, 2, calls)):
        family, overrides = LAYOUTS[name]
        config = tiny_config(family, overrides)
        for coordinates, trained in per_rank:
            planned = build_stage(config.model.model_config, GridPosition(Layout.from_config(config), coordinates),
                                  BuildOptions.from_config(config))
            assert all(param.is_meta for param in planned.parameters()), name
            assert layout(planned) == trained, (name, coordinates)


# --- the planner's numbers against those of the planner that restated the sharding rules ---------------------------

SEQUENCE_PARALLEL = ["parallelism.tp_mode=REDUCE_SCATTER", "parallelism.tp_linear_async_communication=true"]
LLAMA_8B = ["model.model_config.hidden_size=4096", "model.model_config.intermediate_size=14336",
            "model.model_config.num_hidden_layers=32", "model.model_config.tie_word_embeddings=false",
            "tokens.micro_batch_size=1"]
MIXTRAL_SHAPE = [  # docs/benchmarks.md's $MIX
    "model.model_config.is_llama_config=false", "model.model_config.is_llamoe_config=true",
    "model.model_config.intermediate_size=4096", "model.model_config.vocab_size=32000",
    "model.model_config.tie_word_embeddings=false", "model.model_config.rope_theta=1000000.0",
    "model.model_config.moe_num_experts=8", "model.model_config.num_experts_per_tok=2", "tokens.micro_batch_size=2"]
MAMBA_130M = {"is_mamba_config": True, "vocab_size": 50280, "tie_word_embeddings": True, "d_model": 768,
              "num_hidden_layers": 24, "ssm_cfg": {"d_state": 16, "d_conv": 4, "expand": 2}}

CASES = {
    "1B": (BENCH, []),
    "1B full logits": (BENCH, ["model.loss_chunk_tokens=0"]),
    "1B tp=2": (BENCH, ["parallelism.tp=2", "tokens.batch_accumulation_per_replica=4"]),
    "1B tp=2 sequence parallel": (BENCH, ["parallelism.tp=2", *SEQUENCE_PARALLEL,
                                          "tokens.batch_accumulation_per_replica=4"]),
    "1B tp=2 sequence parallel, full logits": (BENCH, ["parallelism.tp=2", *SEQUENCE_PARALLEL,
                                                       "tokens.batch_accumulation_per_replica=4",
                                                       "model.loss_chunk_tokens=0"]),
    "1B tp=4 sequence parallel": (BENCH, ["parallelism.tp=4", *SEQUENCE_PARALLEL]),
    "1B pp=2": (BENCH, ["parallelism.pp=2", "tokens.batch_accumulation_per_replica=4"]),
    "1B pp=2 afab eager": (BENCH, ["parallelism.pp=2", "parallelism.pp_engine=afab", "model.compile=false",
                                   "tokens.batch_accumulation_per_replica=4"]),
    "1B dp=2": (BENCH, ["parallelism.dp=2"]),
    "1B dp=2 zero-1": (BENCH, ["parallelism.dp=2", "optimizer.zero_stage=1"]),
    "1B recomputed, bf16 gradients": (BENCH, ["parallelism.recompute=full",
                                              "optimizer.accumulate_grad_in_fp32=false"]),
    "8B recomputed, fp8": (BENCH, [*LLAMA_8B, "parallelism.recompute=full", "fp8.enabled=true"]),
    "8B tp=2 pp=2 dp=2 zero-1": (BENCH, [*LLAMA_8B, "parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=2",
                                         "optimizer.zero_stage=1", "tokens.batch_accumulation_per_replica=8"]),
    "tiny tp=4 (kv heads replicated)": (TINY, ["parallelism.tp=4"]),
    "tiny pp=2 tied": (TINY, ["parallelism.pp=2", "tokens.batch_accumulation_per_replica=4"]),
    "Mixtral shape": (BENCH, MIXTRAL_SHAPE),
    "Mixtral shape ep=2 dp=2 zero-1": (BENCH, [*MIXTRAL_SHAPE, "parallelism.expert_parallel_size=2",
                                               "parallelism.dp=2", "optimizer.zero_stage=1"]),
    "Mixtral shape tp=2 ep=2 sequence parallel": (BENCH, [*MIXTRAL_SHAPE, "parallelism.tp=2", *SEQUENCE_PARALLEL,
                                                          "parallelism.expert_parallel_size=2"]),
    "Mamba 130M": (None, ["model.compile=true", "tokens.micro_batch_size=8"]),
    "Mamba 130M tp=2 sequence parallel, recomputed": (None, ["model.compile=true", "parallelism.tp=2",
                                                             *SEQUENCE_PARALLEL, "parallelism.recompute=full"]),
    "Mamba 130M pp=2 zero-1": (None, ["model.compile=true", "parallelism.pp=2", "parallelism.dp=2",
                                      "optimizer.zero_stage=1", "tokens.batch_accumulation_per_replica=4"]),
}

# Per stage: (first layer, end of layers, micro-batches in flight, weights, gradients, master weights, Adam moments,
# activations, logits) in bytes, from the planner of commit 8ae8ee3, which restated every family's sharding rules;
# with one micro-batch per step, gradients of parameters neither reduced nor tied across stages in their own dtype.
# Since v is copied out of the fused q|k|v output, a layer with Llama's attention keeps d·(q + kv) bytes a token less
# (the deltas checked by hand: 1,342,177,280 for the 1B's 16 layers of 16,384 tokens, d = 2, q + kv = 2,560); with
# recomputed layers only the rebuilt layer's, which the loss's share of the logits column takes up at the peak.
# Softmax routing measured (``routing_bytes``): a compiled Mixtral layer keeps 16 bytes a token more than the 3·4·E
# counted before (2,097,152 for 16 layers of 8,192 tokens).
RECORDED = {
    "1B": [(0, 16, 1, 2471628800, 2471628800, 4943257600, 9886515200, 20854079488, 5040504832)],
    "1B full logits": [(0, 16, 1, 2471628800, 2471628800, 4943257600, 9886515200, 20854079488, 7600078848)],
    "1B tp=2": [(0, 16, 1, 1235881984, 2471763968, 2471763968, 4943527936, 12650020864, 2553806848)],
    "1B tp=2 sequence parallel": [(0, 16, 1, 1235881984, 2471763968, 2471763968, 4943527936, 10435428352,
                                   2553806848)],
    "1B tp=2 sequence parallel, full logits": [(0, 16, 1, 1235881984, 2471763968, 2471763968, 4943527936,
                                                10435428352, 5901385728)],
    "1B tp=4 sequence parallel": [(0, 16, 1, 618008576, 618008576, 1236017152, 2472034304, 5226102784,
                                   1310457856)],
    "1B pp=2": [(0, 10, 2, 1741766656, 3483533312, 3483533312, 6967066624, 25698500608, 0),
                (10, 16, 1, 1255198720, 2510397440, 2510397440, 5020794880, 8407482368, 5040504832)],
    "1B pp=2 afab eager": [(0, 10, 4, 1741766656, 3483533312, 3483533312, 6967066624, 61329113088, 0),
                           (10, 16, 4, 1255198720, 2510397440, 2510397440, 5020794880, 38193332224, 18375245824)],
    "1B dp=2": [(0, 16, 1, 2471628800, 4943257600, 4943257600, 9886515200, 20854079488, 5040504832)],
    "1B dp=2 zero-1": [(0, 16, 1, 2471628800, 4943257600, 2471628800, 4943257600, 20854079488, 5040504832)],
    "1B recomputed, bf16 gradients": [(0, 16, 1, 2471628800, 2471628800, 4943257600, 9886515200, 7552892928,
                                       3795845120)],
    "8B recomputed, fp8": [(0, 32, 1, 16060522496, 16060522496, 32121044992, 64242089984, 12803637248,
                            2260205568)],
    "8B tp=2 pp=2 dp=2 zero-1": [(0, 17, 2, 4233379840, 8466759680, 4233379840, 8466759680, 12235309056, 0),
                                 (17, 32, 1, 3797147648, 7594295296, 3797147648, 7594295296, 5563482112,
                                  1433403392)],
    "tiny tp=4 (kv heads replicated)": [(0, 4, 1, 1380864, 1380864, 1380864, 2761728, 44466176, 34865152)],
    "tiny pp=2 tied": [(0, 3, 2, 4459520, 4459520, 4459520, 8919040, 123076608, 0),
                       (3, 4, 1, 2885120, 2885120, 2885120, 5770240, 31522816, 136314880)],
    "Mixtral shape": [(0, 16, 1, 7040798720, 7040798720, 14081597440, 28163194880, 12597592064, 810549248)],
    "Mixtral shape ep=2 dp=2 zero-1": [(0, 16, 1, 3819573248, 7639146496, 3520399360, 7040798720, 12597592064,
                                        810549248)],
    "Mixtral shape tp=2 ep=2 sequence parallel": [(0, 16, 1, 1910116352, 2209619968, 3820232704, 7640465408,
                                                   7388266496, 422051840)],
    "Mamba 130M": [(0, 24, 1, 259524096, 259524096, 516541440, 1033082880, 16448225280, 1904431104)],
    "Mamba 130M tp=2 sequence parallel, recomputed": [(0, 24, 1, 129781248, 129781248, 258309120, 516618240,
                                                       486326272, 703232000)],
    "Mamba 130M pp=2 zero-1": [(0, 17, 2, 206353920, 410932224, 205466112, 410932224, 11616845824, 0),
                               (17, 24, 1, 130400256, 260069376, 130034688, 260069376, 2416869376, 1737388032)],
}


def case_config(name: str):
    path, overrides = CASES[name]
    # RECORDED counts masters as fp32 copies and every gradient in a buffer.
    overrides = [*overrides, "optimizer.store_param_remainders=false", "optimizer.persistent_gradient_buffers=true"]
    if path is not None:
        return load_config(path, overrides)
    raw = yaml.safe_load(BENCH.read_text())
    raw["model"]["model_config"] = MAMBA_130M
    raw["tokens"]["sequence_length"] = 2048
    return config_from_dict(apply_overrides(raw, overrides))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
def test_the_planner_reading_the_model_gives_the_numbers_of_the_one_that_restated_the_rules(case):
    stages = estimate_memory(case_config(case), gpu_memory_gb=150.1).stages
    assert len(stages) == len(RECORDED[case])
    for stage, recorded in zip(stages, RECORDED[case]):
        start, stop, in_flight, weights, gradients, masters, moments, activations, logits = recorded
        assert (stage.layers, stage.in_flight) == (list(range(start, stop)), in_flight)
        assert (stage.weights, stage.gradients, stage.activations, stage.logits) == (
            weights, gradients, activations, logits)
        # The ZeRO-1 shards are fractions summed in another order: equal to the byte.
        assert stage.master_weights == pytest.approx(masters, abs=4)
        assert stage.adam_moments == pytest.approx(moments, abs=8)


# --- what the planner knows of a family: its model, plans and activation model, nothing else -----------------------


class _ColumnUnderAnotherName(Style):
    """A family's own style, unknown to the planner, that splits a linear's rows as ``Column`` does."""

    keeps_bias = True

    def parallelize(self, module, group, mode, overlap):
        return ColumnParallelLinear(module.in_features, module.out_features, group, mode, overlap=overlap)


def test_a_style_the_planner_has_never_seen_is_counted_from_the_module_it_builds(monkeypatch):
    """The LM head split by a family's own style weighs what it weighs split by ``Column``: a quarter at tp=4."""
    llama = MODEL_SPECS["llama"]

    def weights(lm_head: Style | None) -> int:
        def plan(config):
            entries = {key: style for key, style in llama.tensor_parallel_plan(config).items() if key != "lm_head"}
            return entries | ({"lm_head": lm_head} if lm_head is not None else {})

        monkeypatch.setitem(MODEL_SPECS, "llama", replace(llama, tensor_parallel_plan=plan))
        config = load_config(TINY, ["parallelism.tp=4", "model.model_config.tie_word_embeddings=false"])
        return estimate_memory(config, gpu_memory_gb=80).stages[0].weights

    head_bytes = 4096 * 128 * 4  # vocabulary x hidden, fp32
    assert weights(_ColumnUnderAnotherName()) == weights(Column()) == weights(None) - head_bytes * 3 // 4


def test_a_family_without_an_activation_model_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(MODEL_SPECS, "llama", replace(MODEL_SPECS["llama"], layer_activations=None))
    with pytest.raises(ConfigError, match="no model of what the llama family's layers keep for the backward"):
        estimate_memory(load_config(TINY), gpu_memory_gb=80)


def test_the_planner_names_no_family():
    """Everything it knows of a family comes through the registry's ``ModelSpec`` and the model it builds."""
    code = (ROOT / "src" / "nanotron" / "memory.py").read_text().split('"""', 2)[2]
    for name in ("llama", "moe", "mamba", "experts", "isinstance(config"):
        assert name not in code.lower(), name
