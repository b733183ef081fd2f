"""Mixture of experts: routing against a hand computation, grouped GEMMs against the per-expert loop, the
all-to-all, expert parallelism against one process in every composition (ep, ep x tp, ep x pp, dp x ep with
ZeRO-1), resume across expert-parallel sizes, Mixtral interop and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from support.configs import MOE_GLOBAL_BATCH, moe_config, tiny_config_dict, write_config
from support.distributed import run_distributed, run_distributed_each
from support.parity import assemble, assert_reference_trains, first_step_gradients
from support.runs import assert_user_error, cli
from support.tiers import parity_steps

STEPS = parity_steps()
SAVED_AT = STEPS // 2
GLOBAL_BATCH = MOE_GLOBAL_BATCH


def _metrics(trainer) -> list[dict]:
    if trainer.pc.rank != 0:
        return []
    return [json.loads(line) for line in trainer.config.resolved_metrics_path().read_text().splitlines()]


def _run(config: dict, first_step: bool = True) -> dict:
    """First-step gradients (no update; not with ZeRO-1, where each rank only reduces its shard) unless resuming,
    then the run's metrics."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    grads = None
    if first_step and config["optimizer"]["zero_stage"] == 0:
        _, grads = first_step_gradients(trainer)
        trainer.buckets.zero()
    trainer.train()
    return {"grads": grads, "metrics": _metrics(trainer)}


def _exchange_round_trip(seed: int) -> dict:
    """Random routings through the all-to-all with 'experts' that multiply each row by its global expert id + 1: every
    assignment must come back once, from the right expert, and so must its gradient."""
    import torch.distributed as dist

    from nanotron.layout import Axis, Group, Layout
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.expert_parallel import ExpertExchange

    pc = ParallelContext(Layout(ep=2))
    rank, experts = pc.coord(Axis.EP), 6
    generator = torch.Generator().manual_seed(seed + rank)
    failures = []
    for trial in range(20):
        tokens = int(torch.randint(0, 12, (), generator=generator))
        expert_index = torch.randint(0, experts, (tokens,), generator=generator).sort().values
        if trial == 0:
            expert_index = torch.zeros(tokens, dtype=torch.int64)  # every assignment to one expert of rank 0
        x = torch.randn(tokens, 3, generator=generator, requires_grad=True)
        counts = torch.bincount(expert_index, minlength=experts)

        def probe(rows, per_expert):
            first = rank * (experts // 2)
            ids = torch.arange(first, first + experts // 2).repeat_interleave(per_expert)
            return rows * (ids + 1).unsqueeze(-1).to(rows.dtype)

        out = ExpertExchange(pc.group(Group.EP), experts)(probe, x, counts)
        expected = x * (expert_index + 1).unsqueeze(-1)
        out.sum().backward()
        if out.shape != x.shape or not torch.allclose(out, expected) or not torch.allclose(
                x.grad, (expert_index + 1).unsqueeze(-1).expand_as(x).float()):
            failures.append(trial)
    dist.barrier()
    return {"failures": failures}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory) -> dict:
    """One process (the reference), then ep=2, then ep2 x tp2, ep2 x pp2, dp2 x ep2 with ZeRO-1 and the reference's
    checkpoint resumed at ep=4 in one 4-rank spawn, then ep2 x tp2's checkpoint resumed in one process."""
    root = tmp_path_factory.mktemp("moe")
    out = {"reference": run_distributed(_run, 1, config=moe_config(tiny_data, root / "reference"))[0]}
    out["ep2"] = run_distributed(_run, 2, config=moe_config(tiny_data, root / "ep2", ep=2))
    out["exchange"] = run_distributed(_exchange_round_trip, 2, seed=1)
    layouts = {
        "ep2_tp2": {"ep": 2, "tp": 2}, "ep2_pp2": {"ep": 2, "pp": 2}, "dp2_ep2_zero1": {"dp": 2, "ep": 2, "zero": 1},
    }
    calls = [{"config": moe_config(tiny_data, root / name, **layout)} for name, layout in layouts.items()]
    calls.append({"config": moe_config(tiny_data, root / "reference_at_ep4", ep=4,
                                       resume_from=root / "reference" / str(SAVED_AT)),
                  "first_step": False})
    for name, ranks in zip([*layouts, "reference_at_ep4"], run_distributed_each(_run, 4, calls)):
        out[name] = ranks
    resumed = moe_config(tiny_data, root / "ep2_tp2_at_ep1", resume_from=root / "ep2_tp2" / str(SAVED_AT))
    out["ep2_tp2_at_ep1"] = run_distributed(_run, 1, config=resumed, first_step=False)
    out["root"] = root
    return out


def _rank0_metrics(ranks) -> list[dict]:
    ranks = ranks if isinstance(ranks, list) else [ranks]
    return next(r["metrics"] for r in ranks if r["metrics"])


def _assert_same_steps(reference: list[dict], other: list[dict], steps: range, what: str) -> None:
    by_step = {m["step"]: m for m in other}
    for ref in reference:
        if ref["step"] not in steps:
            continue
        got = by_step[ref["step"]]
        for key in ("lm_loss", "grad_norm", "moe_load_balancing_loss", "moe_z_loss", "moe_max_expert_load"):
            assert abs(got[key] - ref[key]) <= 1e-4 * max(1.0, abs(ref[key])), (what, ref["step"], key, got[key],
                                                                                  ref[key])


@pytest.mark.slow
def test_the_reference_learns_and_reports_its_routing(runs):
    metrics = runs["reference"]["metrics"]
    assert_reference_trains(metrics, STEPS)
    for record in metrics:
        assert len(record["moe_expert_load"]) == 2 and record["moe_max_expert_load"] == max(record["moe_expert_load"])
        assert 1.0 <= record["moe_max_expert_load"] <= 4.0
        assert record["moe_load_balancing_loss"] >= 0.99  # 1 at a uniform router, larger when imbalanced
        assert record["moe_z_loss"] > 0
        assert "moe_dropped_fraction" not in record  # dropless


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "ep2_tp2", "ep2_pp2", "dp2_ep2_zero1"])
def test_expert_parallel_layouts_match_one_process(runs, layout):
    reference = runs["reference"]
    ranks = runs[layout] if isinstance(runs[layout], list) else [runs[layout]]
    expected = assemble([reference], "grads")
    got = assemble(ranks, "grads") if ranks[0]["grads"] is not None else expected  # ZeRO-1: the curves only
    assert set(got) == set(expected)
    for name, grad in expected.items():
        assert not torch.isnan(got[name]).any(), f"{layout}: {name} not covered by any rank"
        assert torch.allclose(got[name], grad, atol=1e-6, rtol=1e-4), (layout, name)
    _assert_same_steps(reference["metrics"], _rank0_metrics(ranks), range(1, STEPS + 1), layout)


@pytest.mark.slow
def test_resume_across_expert_parallel_sizes_continues_the_curve(runs):
    after = range(SAVED_AT + 1, STEPS + 1)
    at_ep4 = _rank0_metrics(runs["reference_at_ep4"])
    assert [m["step"] for m in at_ep4] == list(after)
    _assert_same_steps(runs["reference"]["metrics"], at_ep4, after, "ep1 -> ep4")
    at_ep1 = _rank0_metrics(runs["ep2_tp2_at_ep1"])
    assert [m["step"] for m in at_ep1] == list(after)
    _assert_same_steps(_rank0_metrics(runs["ep2_tp2"]), at_ep1, after, "ep2 x tp2 -> ep1")


@pytest.mark.slow
def test_eval_reads_an_expert_parallel_checkpoint(runs, tiny_data):
    outcome = cli("eval", "--ckpt-path", runs["root"] / "ep2_tp2", "--data", tiny_data["tokenized"],
                  "--sequence-length", "32", "--max-windows", "8")
    assert outcome.code == 0, outcome.stderr[-2000:]
    loss = float(outcome.stdout.split("loss ")[1].split()[0])
    assert 3.0 < loss < _rank0_metrics(runs["ep2_tp2"])[0]["lm_loss"]  # trained: below the first step's loss


@pytest.mark.slow
def test_all_to_all_loses_and_duplicates_no_token(runs):
    assert [rank["failures"] for rank in runs["exchange"]] == [[], []]


# --- routing by hand -------------------------------------------------------------------------------------------

def test_top_k_weights_and_auxiliary_losses_match_a_hand_computation():
    from nanotron.models.moe.model import route

    rows = [[2.0, 1.0, 0.0], [0.0, 0.5, 3.0]]
    routing, record = route(torch.tensor([rows]), top_k=2, normalize=True, capacity_factor=None)
    softmax = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in rows]
    assert routing.token_index is None  # dropless: token t owns assignments 2t and 2t + 1
    assert routing.expert_index.tolist() == [0, 1, 2, 1]
    first = softmax[0][0] + softmax[0][1]
    second = softmax[1][2] + softmax[1][1]
    expected_weights = [softmax[0][0] / first, softmax[0][1] / first, softmax[1][2] / second, softmax[1][1] / second]
    assert torch.allclose(routing.weight, torch.tensor(expected_weights))
    share = [1 / 4, 2 / 4, 1 / 4]  # expert 1 chosen by both tokens, experts 0 and 2 once, out of 4 assignments
    mean_probs = [(softmax[0][e] + softmax[1][e]) / 2 for e in range(3)]
    assert math.isclose(record.balance.item(), 3 * sum(f * p for f, p in zip(share, mean_probs)), rel_tol=1e-6)
    lse = [math.log(sum(math.exp(v) for v in row)) for row in rows]
    assert math.isclose(record.z.item(), (lse[0] ** 2 + lse[1] ** 2) / 2, rel_tol=1e-6)
    assert record.tokens_per_expert.tolist() == [1, 2, 1]

    raw, _ = route(torch.tensor([rows]), top_k=2, normalize=False, capacity_factor=None)
    assert torch.allclose(raw.weight, torch.tensor([softmax[0][0], softmax[0][1], softmax[1][2], softmax[1][1]]))


def test_capacity_drops_later_tokens_and_later_choices_first():
    from nanotron.models.moe.model import route

    logits = torch.tensor([[[3.0, 1.0]] * 4])  # four tokens, all prefer expert 0, then expert 1
    top1, record = route(logits, top_k=1, normalize=True, capacity_factor=0.5)  # capacity ceil(0.5 * 4 / 2) = 1
    assert top1.token_index.tolist() == [0] and top1.expert_index.tolist() == [0] and record.dropped.item() == 3
    top2, record = route(logits, top_k=2, normalize=True, capacity_factor=0.5)  # capacity 2 per expert
    assert sorted(zip(top2.token_index.tolist(), top2.expert_index.tolist())) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert record.dropped.item() == 4


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_grouped_gemms_match_the_per_expert_loop():
    from nanotron.models.moe.model import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(4, 16, 8)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    counts = torch.tensor([3, 0, 5, 2])  # an expert without tokens too
    x = torch.randn(10, 16)
    upstream = torch.randn(10, 16)
    results = []
    for grouped in (False, True):
        experts.grouped_mm = grouped
        inputs = x.clone().requires_grad_()
        out = experts(inputs, counts)
        (out * upstream).sum().backward()
        results.append((out.detach(), inputs.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
        experts.zero_grad()
    for loop, grouped in zip(*results):
        assert torch.allclose(loop, grouped, atol=1e-5), (loop - grouped).abs().max()


# --- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, fragments", [
    ({"parallelism": {"expert_parallel_size": 3}}, ("moe_num_experts (4)", "expert_parallel_size (3)")),
    ({"model_config": {"num_experts_per_tok": 5}}, ("num_experts_per_tok (5)", "[1, 4]")),
    ({"model_config": {"moe_router_jitter": 0.1}}, ("moe_router_jitter",)),
])
def test_bad_moe_config_is_one_error_line_naming_the_key(tiny_data, tmp_path, change, fragments):
    config = moe_config(tiny_data, tmp_path / "run")
    config["model"]["model_config"] |= change.get("model_config", {})
    config["parallelism"] |= change.get("parallelism", {})
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, *fragments)


def test_expert_parallelism_needs_a_mixture_of_experts(tiny_data, tmp_path):
    config = tiny_config_dict(tiny_data, tmp_path / "run", parallelism={"expert_parallel_size": 2})
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, "expert_parallel_size (2)", "is_llamoe_config")


def test_a_capacity_that_drops_nothing_gives_the_dropless_block():
    from nanotron.config import LlaMoEConfig
    from nanotron.models.moe.model import MoEFeedForward

    torch.manual_seed(0)
    config = LlaMoEConfig(hidden_size=16, intermediate_size=8, moe_num_experts=4, num_experts_per_tok=2)
    dropless = MoEFeedForward(config)
    for param in dropless.parameters():
        torch.nn.init.normal_(param, 0, 0.3)
    capped = MoEFeedForward(LlaMoEConfig(**{**config.__dict__, "moe_capacity_factor": 100.0}))
    capped.load_state_dict(dropless.state_dict())
    x = torch.randn(2, 5, 16)
    outputs = []
    for block in (dropless, capped):
        inputs = x.clone().requires_grad_()
        out = block(inputs)
        out.square().sum().backward()
        outputs.append((out, inputs.grad, block.experts.gate_up_proj.grad, block.router.weight.grad))
    assert capped.record.dropped.item() == 0
    for a, b in zip(*outputs):
        assert torch.allclose(a, b, atol=1e-6)
