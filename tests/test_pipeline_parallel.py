"""Pipeline parallelism: the partitioner, both engines against one process, tied embeddings, accumulation, timeouts,
an inner stage's auxiliary loss and every stage's statistics, and rotary tables built once per stage."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from nanotron.parallel.pipeline_partition import PartitionError, balanced_partition, stage_layers
from support.configs import tiny_config_dict
from support.distributed import run_distributed, run_distributed_each
from support.parity import assemble, assert_reference_trains, first_step_gradients
from support.tiers import parity_steps

STEPS = parity_steps()  # 6, or 20 under NANOTRON_TEST_TIER=full; the first-step gradients are checked exactly in both


@pytest.mark.parametrize("layers", range(1, 65))
@pytest.mark.slow
def test_every_layer_is_assigned_exactly_once(layers):
    for stages in range(1, min(16, layers) + 1):
        split = stage_layers([10.0] * layers, stages, None, head_cost=25.0)
        assigned = [i for stage in split for i in stage]
        assert assigned == list(range(layers)), (layers, stages)
        assert len(split) == stages and all(len(stage) >= 1 for stage in split)


def test_balanced_partition_accounts_for_the_extras_of_the_first_and_last_stage():
    # 8 equal layers over 2 stages: equal extras keep the halves; an extra on one end moves layers to the other.
    assert balanced_partition([1.0] * 8, 2, first_extra=2.0, last_extra=2.0) == [4, 4]
    assert balanced_partition([1.0] * 8, 2, first_extra=4.0, last_extra=0.0) == [2, 6]
    assert stage_layers([1.0] * 6, 3, [1, 2, 3], 0.0) == [range(0, 1), range(1, 3), range(3, 6)]
    with pytest.raises(PartitionError, match="pp_stage_layers"):
        stage_layers([1.0] * 6, 2, [2, 2], 0.0)
    with pytest.raises(PartitionError, match="need 1 <= pp <= layers"):
        balanced_partition([1.0] * 3, 4, 0.0, 0.0)


LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32}


@pytest.mark.parametrize("shape, pp, expected",
                         [({}, 2, [10, 6]), (LLAMA_8B, 2, [17, 15]), (LLAMA_8B, 4, [8, 9, 9, 6])])
def test_default_split_gives_the_lm_head_stage_fewer_layers(shape, pp, expected):
    """The head's 128k-vocabulary matmul weighs as much as several decoder layers; [10, 6] measured 10% faster than
    [8, 8] for Llama 1B (the bench config's shape) at pp=2 on two H200s (docs/benchmarks.md)."""
    from nanotron.config import load_config
    from nanotron.models.build import BuildOptions, pipeline_stage_layers

    overrides = [f"model.model_config.{key}={value}" for key, value in shape.items()] + [f"parallelism.pp={pp}"]
    config = load_config(Path(__file__).parents[1] / "examples" / "config_llama1b_bench.yaml", overrides)
    split = pipeline_stage_layers(config.model.model_config, BuildOptions.from_config(config), pp)
    assert [len(stage) for stage in split] == expected


def pp_config(tiny_data, tmp_path, name: str, **parallelism) -> dict:
    base = tiny_config_dict(tiny_data, tmp_path / name)
    model = base["model"]
    model["model_config"] = model["model_config"] | {"num_hidden_layers": 4}
    tokens = {"train_steps": STEPS} | parallelism.pop("tokens", {})
    return tiny_config_dict(tiny_data, tmp_path / name, model=model, parallelism=parallelism, tokens=tokens)


def _run(config: dict) -> dict:
    """Gradients of the first step (no update), then STEPS training steps; tied copies compared at the end."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    pc = trainer.pc
    _, pieces = first_step_gradients(trainer)
    trainer.buckets.zero()
    trainer.train()
    model = trainer.model
    return {
        "grads": pieces,
        "metrics": [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]
        if pc.rank == 0 else [],
        "embedding": None if model.embed_tokens is None else model.embed_tokens.weight.detach().clone(),
        "head": None if model.lm_head is None else model.lm_head.weight.detach().clone(),
        "layers": sorted(int(i) for i in model.layers.keys()),
    }


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    (result,) = run_distributed(_run, 1, config=pp_config(tiny_data, tmp_path_factory.mktemp("ref"), "ref"))
    assert_reference_trains(result["metrics"], STEPS)
    return result


def logging_rank(results: list[dict]) -> dict:
    (result,) = [r for r in results if r["metrics"]]
    return result


@pytest.mark.parametrize("world, layouts", [
    (2, [(2, 1, "afab"), (2, 1, "1f1b")]),
    pytest.param(4, [(4, 1, "afab"), (4, 1, "1f1b"), (2, 2, "1f1b")], marks=pytest.mark.full_tier),
])
@pytest.mark.slow
def test_pipeline_matches_single_process(reference, tiny_data, tmp_path, world, layouts):
    # batch_accumulation_per_replica is 2: with pp=4, 1F1B runs fewer micro-batches than stages.
    calls = [{"config": pp_config(tiny_data, tmp_path, f"pp{pp}tp{tp}{engine}", pp=pp, tp=tp, pp_engine=engine,
                                  tp_mode="REDUCE_SCATTER")} for pp, tp, engine in layouts]
    for (pp, tp, engine), results in zip(layouts, run_distributed_each(_run, world, calls)):
        check_pipeline_run(reference, results, tp, (pp, tp, engine))


def check_pipeline_run(reference: dict, results: list[dict], tp: int, layout: tuple) -> None:
    assert sorted(i for r in results[::tp] for i in r["layers"]) == [0, 1, 2, 3], layout
    reference_grads = assemble([reference], "grads")
    for name, grad in assemble(results, "grads").items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=f"{layout} {name}")

    for expected, got in zip(reference["metrics"], logging_rank(results)["metrics"], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), (layout, got["step"])
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), (layout, got["step"])

    # Tied embeddings live on the first and the last stage: both copies stay bit-identical.
    for first, last in zip(results[:tp], results[-tp:]):  # same TP shard on the first and the last stage
        assert first["head"] is None and last["embedding"] is None
        assert torch.equal(first["embedding"], last["head"]), layout


@pytest.mark.slow
def test_accumulation_split_gives_the_same_gradients(tiny_data, tmp_path):
    many = pp_config(tiny_data, tmp_path, "many", pp=2, tokens={"micro_batch_size": 2,
                                                                "batch_accumulation_per_replica": 4, "train_steps": 4})
    one = pp_config(tiny_data, tmp_path, "one", pp=2, tokens={"micro_batch_size": 8,
                                                              "batch_accumulation_per_replica": 1, "train_steps": 4})
    many_results, one_results = run_distributed_each(_run, 2, [{"config": many}, {"config": one}])
    many_grads, one_grads = assemble(many_results, "grads"), assemble(one_results, "grads")
    for name in one_grads:
        torch.testing.assert_close(many_grads[name], one_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def _stuck_neighbour(timeout_s: float) -> str:
    import time

    from nanotron.layout import Axis, Layout
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.pipeline_parallel import P2P, PipelineTimeoutError

    pc = ParallelContext(Layout(pp=2))
    p2p = P2P(pc, (2, 3), torch.float32, timeout_s, step=7)
    if pc.coord(Axis.PP) == 0:
        time.sleep(3 * timeout_s)  # never sends
        return ""
    with pytest.raises(PipelineTimeoutError) as error:
        p2p.recv_from(0)
    return str(error.value)


@pytest.mark.slow
def test_stuck_exchange_fails_naming_stage_and_step():
    _, message = run_distributed(_stuck_neighbour, 2, timeout_s=1.0)
    assert "pipeline stage 1" in message and "step 7" in message and "pp_timeout_s" in message


def _step_lines(config: dict) -> list[str]:
    import logging

    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    lines: list[str] = []
    collect = logging.Handler()
    collect.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("nanotron").addHandler(collect)
    trainer.train()
    return [line for line in lines if line.startswith("step ")]


@pytest.mark.slow
def test_step_lines_appear_at_pp_2_with_quiet_replicas(tiny_data, tmp_path):
    """Every rank knows the step's loss, so rank 0 (a first stage) prints the step lines at logging.log_level even
    when the other ranks, the last stage among them, log only warnings."""
    config = pp_config(tiny_data, tmp_path, "quiet", pp=2, tokens={"train_steps": 5})
    config["logging"] |= {"log_level": "info", "log_level_replica": "warning"}
    by_rank = run_distributed(_step_lines, 2, config=config)
    assert [len(lines) for lines in by_rank] == [5, 0]
    assert by_rank[0][-1].startswith("step 5/5 | loss ")


def _rotary_positions_per_stage(config: dict) -> int:
    """Train, counting the positions whose rotary tables this rank computes."""
    from nanotron.config import config_from_dict
    from nanotron.nn.rotary import RotaryEmbedding
    from nanotron.trainer import Trainer

    computed, forward = [], RotaryEmbedding.forward
    RotaryEmbedding.forward = lambda self, positions: computed.append(positions.numel()) or forward(self, positions)
    try:
        Trainer(config_from_dict(config)).train()
    finally:
        RotaryEmbedding.forward = forward
    return sum(computed)


@pytest.mark.slow
def test_every_pipeline_stage_builds_its_rotary_tables_once_for_the_sequence_length(tiny_data, tmp_path):
    """At pp=2 with sequence parallelism the second stage cannot read the sequence's length from its hidden states:
    it built tables for all max_position_embeddings (here 8x the sequence) at every forward, and the first stage
    rebuilt its own at every forward too. Both now build the sequence's tables once."""
    config = tiny_config_dict(tiny_data, tmp_path / "run", tokens={"train_steps": 2, "sequence_length": 32},
                              parallelism={"pp": 2, "tp": 1})
    config["model"]["model_config"]["max_position_embeddings"] = 256
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    assert run_distributed(_rotary_positions_per_stage, 2, config=config) == [32, 32]


def _two_layer_pipeline(pp: int) -> dict:
    """x + x W0 (a residual block, as stage outputs are) -> W1 -> mean square, with an auxiliary loss on x W0 (as a
    router's), over 4 micro-batches."""
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.pipeline_parallel import P2P, Chunk, PipelineSchedule, StageOutput
    from nanotron.parallel.statistics import sum_over_replicas

    pc = ParallelContext(Layout(pp=pp))
    generator = torch.Generator().manual_seed(0)
    w0, w1 = (torch.randn(8, 8, generator=generator).requires_grad_() for _ in range(2))
    micro_batches = [{"x": torch.randn(2, 4, 8, generator=generator)} for _ in range(4)]

    def forward(micro_batch, hidden):
        statistics, aux = {}, None
        if pc.is_first_stage:
            branch = micro_batch["x"] @ w0
            aux = 0.1 * branch.square().mean()
            hidden = micro_batch["x"] + branch
            statistics["aux_loss"] = aux
        if not pc.is_last_stage:
            return StageOutput(hidden, statistics, () if aux is None else (aux,))
        loss = (hidden @ w1).square().mean()
        return StageOutput(None, statistics | {"loss": loss}, (loss,) if aux is None else (loss, aux))

    schedule = PipelineSchedule(pc, P2P(pc, (2, 4, 8), torch.float32, 60.0), [Chunk(forward)], lambda: None)
    statistics = sum_over_replicas(schedule.run(micro_batches, step=1), {"loss": (), "aux_loss": ()}, pc)
    return {"w0": w0.grad if pc.is_first_stage else None, "w1": w1.grad if pc.is_last_stage else None,
            "statistics": {name: value.item() for name, value in statistics.items()}}


@pytest.mark.slow
def test_an_inner_stage_adds_its_auxiliary_loss_and_every_stage_gets_the_statistics():
    (single,) = run_distributed(_two_layer_pipeline, 1, pp=1)
    first, last = run_distributed(_two_layer_pipeline, 2, pp=2)
    assert single["w0"].abs().sum() > 0 and single["statistics"]["aux_loss"] > 0
    torch.testing.assert_close(first["w0"], single["w0"], rtol=1e-6, atol=1e-7)  # includes the auxiliary loss
    torch.testing.assert_close(last["w1"], single["w1"], rtol=1e-6, atol=1e-7)
    for stage in (first, last):
        assert stage["statistics"] == pytest.approx(single["statistics"], rel=1e-6)


class _Clock:
    """A stand-in for a CUDA event: a time in milliseconds, which ``record`` reads from ``now`` (the wall clock by
    default)."""

    def __init__(self, ms: float = 0.0, now=lambda: time.perf_counter() * 1e3):
        self.ms, self.now = ms, now

    def record(self) -> None:
        self.ms = self.now()

    def elapsed_time(self, end: _Clock) -> float:
        return end.ms - self.ms


def test_the_idle_share_is_the_time_between_actions_and_the_step_log_averages_it_per_stage():
    """On GPUs each stage times its actions with CUDA events: the share of the step between them is its idle share;
    the step's metrics give each stage's, averaged over the ranks that measured it (none yet: no metric)."""
    from nanotron.parallel.pipeline_parallel import IDLE_RANKS, IDLE_SHARE, PipelineSchedule, idle_share

    actions = [(_Clock(0), _Clock(2)), (_Clock(3), _Clock(5)), (_Clock(8), _Clock(10))]  # busy 6 of 10
    assert idle_share(actions) == pytest.approx(0.4)
    assert idle_share([(_Clock(1), _Clock(1))]) == 0.0
    schedule = PipelineSchedule.__new__(PipelineSchedule)
    schedule.idle = object()
    sums = {IDLE_SHARE: torch.tensor([0.8, 0.2, 0.0]), IDLE_RANKS: torch.tensor([2.0, 1.0, 0.0])}
    assert schedule.metrics(sums) == {IDLE_SHARE: pytest.approx([0.4, 0.2, 0.0])}
    assert schedule.metrics({IDLE_SHARE: torch.zeros(3), IDLE_RANKS: torch.zeros(3)}) == {}


def test_idle_times_give_a_stage_its_share_of_the_step_two_steps_back_and_keep_no_older_step():
    """Events are read two steps after they were recorded (a GPU has run them by then), in the stage's slot; the
    step's start mark (a pair of no length) makes the wait before the first action idle time."""
    from nanotron.parallel.pipeline_parallel import IDLE_RANKS, IDLE_SHARE, IdleTimes

    clock = [0.0]
    idle = IdleTimes(event=lambda: _Clock(now=lambda: clock[0]))
    for step, actions in ((1, [(2, 4), (5, 7), (8, 10)]), (2, [(0, 5), (5, 10)]), (3, [(1, 2)])):
        clock[0] = 0.0
        idle.mark_start(step)
        for start, end in actions:
            first, last = idle.around(step)
            clock[0] = start
            first.record()
            clock[0] = end
            last.record()

    def read(step: int) -> tuple[list[float], list[float]]:
        statistics = idle.statistics(step, stage=1, stages=3, device=torch.device("cpu"))
        return statistics[IDLE_SHARE].tolist(), statistics[IDLE_RANKS].tolist()

    assert read(2) == ([0.0] * 3, [0.0] * 3)  # nothing two steps back yet
    assert read(3) == (pytest.approx([0.0, 0.4, 0.0]), [0.0, 1.0, 0.0])  # busy 6 of 10: 2 before the first action
    assert sorted(idle.steps) == [2, 3]
    assert read(4) == ([0.0] * 3, [0.0, 1.0, 0.0])  # step 2 never idled
    assert read(6) == ([0.0] * 3, [0.0] * 3) and idle.steps == {}  # step 4 was not measured; step 3 is dropped


def _idle_behind_a_slow_stage() -> list[float]:
    """1F1B at pp 2 over 4 micro-batches where the last stage's forward sleeps 50 ms: the first stage waits for every
    gradient. Each stage's idle share of step 3 (read at step 5: the first steps start as each process comes up), its
    actions timed on the wall clock."""
    from nanotron.layout import Axis, Layout
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.pipeline_parallel import IDLE_SHARE, P2P, Chunk, IdleTimes, PipelineSchedule, StageOutput

    pc = ParallelContext(Layout(pp=2))
    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    micro_batches = [{"x": torch.randn(2, 4, 8)} for _ in range(4)]

    def forward(micro_batch, hidden):
        if hidden is None:
            return StageOutput(micro_batch["x"] + micro_batch["x"] @ weight)
        time.sleep(0.05)
        loss = (hidden @ weight).square().mean()
        return StageOutput(None, {}, (loss,))

    schedule = PipelineSchedule(pc, P2P(pc, (2, 4, 8), torch.float32, 60.0), [Chunk(forward)], lambda: None)
    schedule.idle = IdleTimes(event=_Clock)
    statistics = [schedule.run(micro_batches, step) for step in range(1, 6)]
    return statistics[-1][IDLE_SHARE][pc.coord(Axis.PP)].item()


def test_a_stage_waiting_for_its_neighbour_measures_the_wait_as_idle():
    """The wait for a message is idle time, not part of the action that needs it: the first stage, which computes
    almost nothing and waits 50 ms for each gradient, idles most of its step; the slow stage hardly at all."""
    first, last = run_distributed(_idle_behind_a_slow_stage, 2)
    assert first > 0.5 and last < first, (first, last)
