"""The step-time planner (``nanotron/planning/``): its communication model against the collectives a real gloo
training step issues, its time model, and ``nanotron estimate``."""

from __future__ import annotations

import pytest

from support.configs import moe_config, tiny_config_dict, tp_config
from support.distributed import run_distributed_each

# --- the communication model against a counted gloo step ----------------------------------------------------------


def _count_step_collectives(config: dict) -> dict:
    """One training step of ``config`` on this rank with every collective counted: {(kind, scope): [calls, bytes]},
    the rank's pipeline stage and expert-parallel coordinate."""
    import torch.distributed as dist

    from nanotron.config import config_from_dict
    from nanotron.layout import Axis, Group
    from nanotron.planning.collectives import PIPELINE_ENDS, WORLD
    from nanotron.trainer import Trainer
    from support.parity import first_step

    trainer = Trainer(config_from_dict(config))
    pc = trainer.pc
    scopes = {id(pc.group(group)): group.value for group in Group}
    if pc.pipeline_ends is not None:
        scopes[id(pc.pipeline_ends)] = PIPELINE_ENDS
    counted: dict[tuple[str, str], list[int]] = {}

    def count(kind: str, group, size: int) -> None:
        if dist.get_world_size(group) == 1:  # over one rank: nothing moves (the model leaves these out)
            return
        scope = WORLD if group is None else scopes[id(group)]
        calls = counted.setdefault((kind, scope), [0, 0])
        calls[0] += 1
        calls[1] += size

    def nbytes(tensor) -> int:
        return tensor.numel() * tensor.element_size()

    originals = {name: getattr(dist, name) for name in
                 ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                  "batch_isend_irecv")}
    wrappers = {
        "all_reduce": lambda tensor, *a, group=None, **k: count("all-reduce", group, nbytes(tensor)),
        "all_gather_into_tensor": lambda out, inp, *a, group=None, **k: count("all-gather", group, nbytes(out)),
        "reduce_scatter_tensor": lambda out, inp, *a, group=None, **k: count("reduce-scatter", group, nbytes(inp)),
        "all_to_all_single": lambda out, inp, *a, group=None, **k: count("all-to-all", group, nbytes(inp)),
        "batch_isend_irecv": lambda ops: [count("send/recv", op.group, nbytes(op.tensor)) for op in ops
                                          if op.op is dist.isend],
    }

    def counting(name):
        def call(*args, **kwargs):
            wrappers[name](*args, **kwargs)
            return originals[name](*args, **kwargs)
        return call

    micro_batches = first_step(trainer)
    for name in originals:
        setattr(dist, name, counting(name))
    try:
        trainer.finish_step(trainer.train_step(micro_batches, lr=1e-3))
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {"counted": counted, "stage": pc.coord(Axis.PP), "ep": pc.coord(Axis.EP)}


def _modeled(config: dict, stage: int) -> dict[tuple[str, str], list[int]]:
    from nanotron.config import config_from_dict
    from nanotron.planning.collectives import merged, step_collectives

    return {key: list(value) for key, value in merged(step_collectives(config_from_dict(config), stage)).items()}


def _assert_model_counts(config: dict, ranks: list[dict], summed_over_ranks: set[str] = frozenset()) -> None:
    """Every rank's counted collectives equal the model's for its stage, per kind and scope: calls and bytes, bytes
    only for calls of ``SCALAR_BYTES`` or more (the step statistics' size follows the objective's terms, which the
    model leaves out: latency is all they cost); scopes in ``summed_over_ranks`` compared in their sum over the ranks
    (the all-to-alls back from the experts carry what the routing sent)."""
    from nanotron.planning.collectives import SCALAR_BYTES

    def large(totals):
        return {key: value if value[1] >= SCALAR_BYTES * value[0] else [value[0], None]
                for key, value in totals.items()}

    modeled = [large(_modeled(config, rank["stage"])) for rank in ranks]
    counted = [large(rank["counted"]) for rank in ranks]
    for summed in summed_over_ranks:
        for totals in (modeled, counted):
            keys = [key for key in totals[0] if key[1] == summed]
            total = {key: [sum(t[key][i] for t in totals) for i in (0, 1)] for key in keys}
            for t in totals:
                t.update(total)
    for rank, (mine, model) in enumerate(zip(counted, modeled)):
        assert mine == model, f"rank {rank}: counted {mine} != modeled {model}"


def _layouts(tiny_data, tmp_path) -> dict[str, dict]:
    base = tiny_config_dict(tiny_data, tmp_path / "base")
    two_stages = tiny_config_dict(tiny_data, tmp_path / "pp2", parallelism={"dp": 1, "pp": 2, "tp": 1})
    two_stages["model"]["model_config"]["num_hidden_layers"] = 4

    def with_(name: str, parallelism: dict | None = None, optimizer: dict | None = None) -> dict:
        return tiny_config_dict(tiny_data, tmp_path / name, parallelism=base["parallelism"] | (parallelism or {}),
                                optimizer=base["optimizer"] | (optimizer or {}))

    layouts = {
        "tp2": tp_config(tiny_data, tmp_path, "tp2", 2, "ALL_REDUCE"),
        "tp2-sp": tp_config(tiny_data, tmp_path, "tp2-sp", 2, "REDUCE_SCATTER"),
        "tp2-sp-overlap": tp_config(tiny_data, tmp_path, "tp2-sp-overlap", 2, "REDUCE_SCATTER", overlap=True),
        "pp2": two_stages,
        "dp2": with_("dp2", {"dp": 2}),
        "dp2-zero1": with_("dp2-zero1", {"dp": 2}, {"zero_stage": 1, "accumulate_grad_in_fp32": True}),
        "cp2": with_("cp2", {"context_parallel_size": 2}),
        "ep2": moe_config(tiny_data, tmp_path / "ep2", ep=2),
        "moe-tp2": moe_config(tiny_data, tmp_path / "moe-tp2", tp=2),
    }
    for config in layouts.values():
        config["tokens"]["train_steps"] = 1
        config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    return layouts


@pytest.mark.slow
def test_modeled_collectives_equal_those_a_gloo_step_issues(tiny_data, tmp_path):
    """tp2 (both modes, and the overlapped backward), pp2, dp2 with ZeRO 0 and 1, cp2, ep2 and a mixture of experts
    at tp2: per kind and scope,
    the calls and bytes one training step issues on each of two gloo ranks are the model's."""
    layouts = _layouts(tiny_data, tmp_path)
    results = run_distributed_each(_count_step_collectives, 2, [{"config": c} for c in layouts.values()])
    for (name, config), ranks in zip(layouts.items(), results):
        summed = {"ep"} if name.startswith("ep") else set()
        try:
            _assert_model_counts(config, ranks, summed)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
