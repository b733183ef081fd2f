"""The step-time planner (``nanotron/planning/``): its communication model against the collectives a real gloo
training step issues, its time model, and ``nanotron estimate``."""

from __future__ import annotations

import pytest

from support import ROOT
from support.configs import moe_config, tiny_config_dict, tp_config
from support.distributed import run_distributed_each
from support.runs import assert_user_error, cli

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
    scopes: dict[int, str] = {}
    for group in Group:  # a process group serving several scopes (ZeRO's shards are the replicas) takes the first
        if pc.layout.served_by(group) is not None:
            scopes.setdefault(id(pc.group(group)), group.value)
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
                 ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "isend")}
    wrappers = {
        "all_reduce": lambda tensor, *a, group=None, **k: count("all-reduce", group, nbytes(tensor)),
        "all_gather_into_tensor": lambda out, inp, *a, group=None, **k: count("all-gather", group, nbytes(out)),
        "reduce_scatter_tensor": lambda out, inp, *a, group=None, **k: count("reduce-scatter", group, nbytes(inp)),
        "all_to_all_single": lambda out, inp, *a, group=None, **k: count("all-to-all", group, nbytes(inp)),
        "isend": lambda tensor, dst, group=None, *a, **k: count("send/recv", group, nbytes(tensor)),
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
        "dp2-zero2": with_("dp2-zero2", {"dp": 2}, {"zero_stage": 2}),
        "dp2-zero3": with_("dp2-zero3", {"dp": 2}, {"zero_stage": 3}),
        "cp2": with_("cp2", {"context_parallel_size": 2}),
        "ep2": moe_config(tiny_data, tmp_path / "ep2", ep=2),
        "moe-tp2": moe_config(tiny_data, tmp_path / "moe-tp2", tp=2),
        "tp2-shared-kv-bias": tp_config(tiny_data, tmp_path, "tp2-shared-kv-bias", 2, "ALL_REDUCE"),
    }
    # One kv head over two ranks, with Qwen2's biases: the replicated key/value rows' gradients (weights and biases)
    # are summed over tp.
    qwen2 = layouts["tp2-shared-kv-bias"]["model"]["model_config"]
    del qwen2["is_llama_config"]
    qwen2 |= {"is_qwen2_config": True, "attention_bias": True, "num_key_value_heads": 1}
    for config in layouts.values():
        config["tokens"]["train_steps"] = 1
        config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    return layouts


@pytest.mark.slow
def test_modeled_collectives_equal_those_a_gloo_step_issues(tiny_data, tmp_path):
    """tp2 (both modes, and the overlapped backward; a kv head shared by both ranks, with biases), pp2, dp2 with ZeRO 0
    to 3, cp2, ep2 and a mixture of experts at tp2: per kind and scope, the calls and bytes one training step issues
    on each of two gloo ranks are the model's."""
    layouts = _layouts(tiny_data, tmp_path)
    results = run_distributed_each(_count_step_collectives, 2, [{"config": c} for c in layouts.values()])
    for (name, config), ranks in zip(layouts.items(), results):
        summed = {"ep"} if name.startswith("ep") else set()
        try:
            _assert_model_counts(config, ranks, summed)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


# --- time -------------------------------------------------------------------------------------------------------------


def test_collective_times_follow_the_ring_formulas_and_the_links_a_group_spans():
    """A tp group of 8 stays in its node (NVLink), the dp group of the same ranks' replicas crosses nodes
    (InfiniBand); an all-reduce costs twice the transfer and latency of an all-gather of the same bytes."""
    from nanotron.layout import Layout
    from nanotron.planning.cluster import CLUSTERS
    from nanotron.planning.collectives import Collective

    cluster, layout = CLUSTERS["h100"], Layout(dp=2, tp=8)
    gather = Collective("all-gather", "tp", 10**9, 1, "forward", "test")
    assert not cluster.spans_nodes(layout, "tp") and cluster.spans_nodes(layout, "dp_cp_ep")
    assert cluster.seconds(gather, layout) == pytest.approx(7 / 8 * 1e9 / 360e9 + 7 * 5e-6)
    reduce = Collective("all-reduce", "dp_cp_ep", 10**9, 3, "gradients", "test")
    assert cluster.seconds(reduce, layout) == pytest.approx(3 * 2 * (1 / 2 * 1e9 / 45e9 + 10e-6))


def test_a_pipelined_step_idles_its_schedules_bubble():
    """A pp4 step of 8 micro-batches under 1F1B idles 3/8 of its pipelined time, ZB-H1 a third of that
    (``Schedule.idle_share``, checked against the schedules' timelines in test_pipeline_schedules.py)."""
    from nanotron.config import load_config
    from nanotron.layout import Layout
    from nanotron.planning.cluster import CLUSTERS
    from nanotron.planning.step_time import predict
    config = load_config(ROOT / "examples" / "config_tiny_llama.yaml", ["model.model_config.num_hidden_layers=4"])
    base = Layout.from_config(config)
    times = {engine: predict(config, Layout(pp=4, pp_engine=engine, sequence_length=base.sequence_length,
                                            micro_batch_size=1, accumulation=8), CLUSTERS["h100"])
             for engine in ("1f1b", "zb_h1")}
    pipelined = times["1f1b"].bubble / (3 / 8)
    assert times["zb_h1"].bubble == pytest.approx(pipelined / 8)
    assert times["1f1b"].step > times["zb_h1"].step


@pytest.mark.slow
def test_predicted_single_gpu_steps_against_the_records():
    """The check docs/benchmarks.md records, of each compute model. Every GPU with a committed kernel table (the
    H100, the H200): each record of that GPU from its table within 10% (the 1B at 4k and 32k, the 8B, mixtral, the
    1B at 128k on the H200; the Qwen3, Qwen3-MoE and DeepSeek-V3 presets, whose shapes the H100's table holds no
    point of). The efficiency table, which prices what no kernel table does (FP8 linears, other GPUs), on the H200
    records it is made from: those it does not hold within 10%, its own 1B, 8B, mixtral and long-context rows, each
    predicted from the other rows, within 16%."""
    from planner_efficiency import checked_rows
    from planner_kernels import checked_rows as kernel_rows

    from nanotron.planning.efficiency import entries
    from nanotron.planning.kernels import committed_table

    rows = [row for row in checked_rows(entries()) if row["gpu"] == "NVIDIA H200"]
    errors = {row["record"]: round(row["error"], 3) for row in rows}
    assert rows and all(abs(row["error"]) < (0.10 if row["held_out"] else 0.16) for row in rows), errors
    for gpu, least in (("h100", 8), ("h200", 10)):
        rows = kernel_rows(committed_table(gpu))
        errors = {row["record"]: round(row["predicted_s"] / row["measured_s"] - 1, 3) for row in rows}
        assert len(rows) >= least and all(abs(error) < 0.10 for error in errors.values()), (gpu, errors)


# --- compute: the kernel table ----------------------------------------------------------------------------------------

TINY = ROOT / "examples" / "config_tiny_llama.yaml"  # hidden 128, ffn 384, 4 heads of 32 (2 kv), 4 layers, vocab 4096


def _tiny_layout(config, tp: int = 1, ep: int = 1):
    from dataclasses import replace

    from nanotron.layout import Layout

    return replace(Layout.from_config(config), tp=tp, ep=ep, sequence_parallel=tp > 1)


def _uniform_table(kernels, speeds: dict[str, float]):
    """A kernel table with a point at every kernel's dims, of the speed ``speeds`` gives its kind's family."""
    from nanotron.planning.kernels import KernelTable, measured_kind

    points: dict[str, dict] = {}
    for kernel in kernels:
        kind = measured_kind(kernel.kind)
        points.setdefault(kind, {})[tuple(kernel.dims)] = speeds[kind.split(".")[0]]
    return KernelTable("synthetic", "torch", points, "synthetic")


@pytest.mark.slow
def test_the_kernel_recorder_writes_a_table_the_planner_reads(tmp_path):
    """scripts/planner_kernels.py at the tiny Llama's shape, tp 1 and 2 (on the CPU), writes a table holding a point
    at every kernel's dims of both splits; the planner's compute is the sum of their times, plus the update. Checking
    a table that is not there is one error line."""
    from nanotron.config import load_config
    from nanotron.planning.cluster import CLUSTERS
    from nanotron.planning.kernels import TABLES as KERNEL_TABLES
    from nanotron.planning.kernels import KernelTable, measured_kind, micro_batch_kernels
    from nanotron.planning.step_time import predict, update_seconds
    from support.runs import python_process

    path = tmp_path / "cpu.json"
    missing = python_process("scripts/planner_kernels.py", "--check", path)
    assert missing.code == 2 and missing.stderr.strip().endswith(f"--check {path}: no such table (recorded ones: "
                                                                 f"{KERNEL_TABLES}/<gpu>.json)"), missing.stderr
    outcome = python_process("scripts/planner_kernels.py", "--config-file", TINY, "--tp", "1", "2", "--output", path,
                             "--budget-ms", "0.2")
    assert outcome.code == 0, outcome.stderr
    table = KernelTable.read(path)
    config = load_config(TINY)
    for tp in (1, 2):
        layout = _tiny_layout(config, tp)
        kernels = micro_batch_kernels(config, layout, range(4), head=True)
        assert all(tuple(k.dims) in table.points[measured_kind(k.kind)] for k in kernels)
        cluster = CLUSTERS["h200"]
        compute = predict(config, layout, cluster, table).compute - update_seconds(config, layout, cluster, 0)
        assert compute == pytest.approx(table.seconds(kernels)) and compute > 0


def test_compute_is_the_sum_of_its_kernels_times():
    """The tiny Llama's micro-batch at tp 1 from a synthetic table (GEMMs at 1 TFLOP/s, attention at 0.5, elementwise
    at 0.1 TB/s) costs its GEMMs, attention and elementwise bytes counted by hand; the gate|up forward GEMM at half
    the speed adds exactly its own time again (4 layers); full recomputation adds every forward, selective all but
    attention's."""
    from dataclasses import replace

    from nanotron.config import load_config
    from nanotron.planning.kernels import elementwise_bytes, head_elementwise_bytes, micro_batch_kernels

    config = load_config(TINY)
    layout = _tiny_layout(config)
    tokens, hidden, ffn, vocab, layers = 16 * 128, 128, 384, 4096, 4
    linears = hidden * (128 + 2 * 64) + 128 * hidden + hidden * 2 * ffn + ffn * hidden
    gemm_flops = 3 * 2 * tokens * (layers * linears + hidden * vocab)
    attention_flops = layers * 12 * hidden * 128 / 2 * tokens
    forward, backward = elementwise_bytes(hidden, hidden, 128, 64, ffn, 0, 4)
    head = head_elementwise_bytes(tokens, hidden, hidden, vocab, 1, 4)
    moved = layers * tokens * (forward + backward) + sum(head)
    expected = gemm_flops / 1e12 + attention_flops / 0.5e12 + moved / 0.1e12

    kernels = micro_batch_kernels(config, layout, range(layers), head=True)
    table = _uniform_table(kernels, {"gemm": 1e12, "attention": 0.5e12, "elementwise": 0.1e12})
    assert table.micro_batch(config, layout, range(layers), head=True)[0] == pytest.approx(expected, rel=1e-12)
    table.points["gemm.forward"][(tokens, 2 * ffn, hidden)] = 0.5e12
    gate_up = layers * 2 * tokens * 2 * ffn * hidden / 1e12
    assert table.micro_batch(config, layout, range(layers), head=True)[0] == pytest.approx(expected + gate_up)

    def recomputed(mode: str) -> float:
        again = replace(config, parallelism=replace(config.parallelism, recompute=mode))
        return table.micro_batch(again, layout, range(layers), head=True)[0] - expected - gate_up

    forward_gemms = (gemm_flops - 3 * 2 * tokens * hidden * vocab) / 3 / 1e12 + gate_up
    assert recomputed("full") == pytest.approx(forward_gemms + attention_flops / 3 / 0.5e12
                                               + layers * tokens * forward / 0.1e12)
    assert recomputed("selective") == pytest.approx(forward_gemms + layers * tokens * forward / 0.1e12)


def test_tensor_and_expert_parallelism_split_the_kernels_they_ask_for(tiny_data, tmp_path):
    """At tp 2 the column-parallel linears' outputs (q|k|v, gate|up, the vocabulary) and the row-parallel ones'
    inputs (o, down) are halved, and the attention's FLOPs; at ep 2 a rank runs half the experts on twice the tokens
    each."""
    from nanotron.config import config_from_dict, load_config
    from nanotron.planning.kernels import ATTENTION_FORWARD, EXPERTS_FORWARD, GEMM_FORWARD, micro_batch_kernels

    config = load_config(TINY)

    def asked(tp: int) -> tuple[set, float]:
        kernels = micro_batch_kernels(config, _tiny_layout(config, tp), range(4), head=True)
        return ({k.dims for k in kernels if k.kind == GEMM_FORWARD},
                sum(k.work for k in kernels if k.kind == ATTENTION_FORWARD))

    (whole, attention), (split, attention_split) = asked(1), asked(2)
    tokens = 16 * 128
    assert whole == {(tokens, 256, 128), (tokens, 128, 128), (tokens, 768, 128), (tokens, 128, 384),
                     (tokens, 4096, 128)}
    assert split == {(tokens, 128, 128), (tokens, 128, 64), (tokens, 384, 128), (tokens, 128, 192),
                     (tokens, 2048, 128)}
    assert attention_split == attention / 2

    moe = config_from_dict(moe_config(tiny_data, tmp_path / "moe"))  # 4 experts, top 2, 2 of 3 layers
    experts = [[k.dims for k in micro_batch_kernels(moe, _tiny_layout(moe, ep=ep), range(3), head=False)
                if k.kind == EXPERTS_FORWARD] for ep in (1, 2)]
    c = moe.model.model_config
    tokens, hidden, ffn = moe.tokens.micro_batch_size * moe.tokens.sequence_length, c.hidden_size, c.moe.ffn
    assert experts == [[(4, tokens * 2 / 4, hidden, ffn)] * 2, [(2, tokens * 2 * 2 / 4, hidden, ffn)] * 2]


def test_kernel_speeds_interpolate_log_linearly_between_powers_of_two():
    """Between the powers of two around each dim the logarithm of the speed is linear in those of the dims (a speed
    that is a power law of the dims comes back exactly); a dims' own point is its speed; a missing corner gives the
    nearest point's."""
    from itertools import product

    from nanotron.planning.kernels import GEMM_FORWARD, KernelTable

    def law(m, n, k):
        return 1e12 * m ** 0.5 * n ** 0.25 / k ** 0.1

    grid = {dims: law(*dims) for dims in product([1024, 2048, 4096], [256, 512], [128, 256])}
    table = KernelTable("synthetic", "torch", {GEMM_FORWARD: grid}, "synthetic")
    for dims in ((1500, 300, 200), (3000, 512, 130), (2048, 256, 128)):
        assert table.speed(GEMM_FORWARD, dims) == pytest.approx(law(*dims), rel=1e-12)
    assert table.speed(GEMM_FORWARD, (8000, 300, 200)) == law(4096, 256, 256)  # no 8192: the nearest point
    table.points[GEMM_FORWARD][(3000, 300, 200)] = 7.0
    assert table.speed(GEMM_FORWARD, (3000, 300, 200)) == 7.0


def test_the_gpus_committed_kernel_table_prices_what_it_covers(tmp_path, monkeypatch):
    """Without a table for the cluster's GPU, for what a table does not price (FP8 linears) and with a table missing
    one of the config's kernel kinds, the compute is efficiency.json's; with a whole one, the table's."""
    import json

    from nanotron.config import load_config
    from nanotron.planning import kernels
    from nanotron.planning.cluster import CLUSTERS
    from nanotron.planning.efficiency import Efficiency
    from nanotron.planning.step_time import compute_model

    config, fp8 = load_config(TINY), load_config(TINY, ["fp8.enabled=true"])
    kinds = [kernels.GEMM_FORWARD, kernels.GEMM_INPUT_GRADIENT, kernels.GEMM_WEIGHT_GRADIENT,
             kernels.ATTENTION_FORWARD, kernels.ATTENTION_BACKWARD, kernels.ELEMENTWISE_FORWARD]
    monkeypatch.setattr(kernels, "TABLES", tmp_path)

    def model(cluster: str, recorded: list[str]):
        if recorded:
            (tmp_path / "h200.json").write_text(json.dumps({"gpu": "NVIDIA H200", "attention": "torch", "entries": [
                {"kind": kind, "dims": [1], "seconds": 1.0, "work": 1.0} for kind in recorded]}))
        kernels.committed_table.cache_clear()
        return compute_model(config, CLUSTERS[cluster])

    try:
        assert isinstance(model("h200", []), Efficiency)
        assert isinstance(model("h200", kinds[:-1]), Efficiency)
        assert model("h200", kinds).source == "h200.json"
        assert isinstance(compute_model(fp8, CLUSTERS["h200"]), Efficiency)
        assert isinstance(model("h100", kinds), Efficiency)
    finally:
        kernels.committed_table.cache_clear()


# --- nanotron estimate ------------------------------------------------------------------------------------------------


def test_estimate_ranks_the_layouts_that_fit_fastest_first():
    outcome = cli("estimate", "--config-file", ROOT / "examples" / "config_tiny_llama.yaml", "--gpus", "4",
                  "--top", "3", "--global-batch-size", "8")
    assert outcome.code == 0, outcome.stderr
    rows = [line.split("|") for line in outcome.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3
    steps = [float(row[9]) for row in rows]
    assert steps == sorted(steps)
    assert all(int(row[1]) * int(row[2]) * int(row[3]) * int(row[4]) * int(row[5]) == 4 for row in rows)


def test_estimate_predicts_one_layout():
    outcome = cli("estimate", "--config-file", ROOT / "examples" / "config_tiny_llama.yaml", "--layout",
                  "dp=2,tp=2,zero=3", "--cluster", "h200", "--global-batch-size", "8")
    assert outcome.code == 0, outcome.stderr
    (row,) = [line for line in outcome.stdout.splitlines() if line.strip().startswith("1 |")]
    assert "planned" not in row and "fits in 150.1 GB" in outcome.stdout


@pytest.mark.parametrize("arguments, fragment", [
    (("--layout", "dp=2,xp=2"), "is not KEY=VALUE with KEY one of"),
    (("--layout", "dp=3"), "cannot run 8 sequences per step"),
    (("--layout", "tp=3"), "tp=3 does not divide"),
    (("--layout", "dp=2", "--gpus", "4"), "uses 2 GPUs, not --gpus 4"),
    (("--layout", "schedule=gpipe"), "is not a schedule the planner knows"),
    ((), "give --gpus N"),
    (("--gpus", "0"), "must be at least 1"),
])
def test_estimate_refuses_bad_input_in_one_line(arguments, fragment):
    outcome = cli("estimate", "--config-file", ROOT / "examples" / "config_tiny_llama.yaml",
                  "--global-batch-size", "8", *arguments)
    assert_user_error(outcome, fragment)
