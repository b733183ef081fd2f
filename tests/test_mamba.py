"""Mamba: the scan continued across calls equals one call, Hugging Face interop (logits, round trip, greedy
generation with the recurrent cache), a tiny model learning from YAML, fp32 state parameters out of weight decay,
and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support.configs import MAMBA, tiny_config_dict, write_config
from support.distributed import run_distributed, run_distributed_each
from support.hf import PROMPTS
from support.kernels import fresh_python, run_with_triton_interpreter
from support.parity import assemble, assert_reference_trains, initial_weights, parity_run
from support.runs import assert_user_error, cli
from support.tiers import parity_steps


def test_the_scan_continues_across_calls():
    from nanotron.nn.selective_scan import selective_scan_reference as selective_scan

    torch.manual_seed(0)
    x, delta = torch.randn(2, 11, 6), torch.rand(2, 11, 6)
    A, B, C, D = -torch.rand(6, 4), torch.randn(2, 11, 4), torch.randn(2, 11, 4), torch.randn(6)
    whole, last = selective_scan(x, delta, A, B, C, D)
    first, state = selective_scan(x[:, :7], delta[:, :7], A, B[:, :7], C[:, :7], D)
    rest, state = selective_scan(x[:, 7:], delta[:, 7:], A, B[:, 7:], C[:, 7:], D, state)
    assert torch.allclose(torch.cat([first, rest], 1), whole, atol=1e-6) and torch.allclose(state, last)
    # One step by hand: s_0 = Δ_0 B_0 x_0, y_0 = C_0 · s_0 + D x_0.
    s0 = (delta[0, 0] * x[0, 0]).unsqueeze(-1) * B[0, 0]
    assert torch.allclose(whole[0, 0], (s0 * C[0, 0]).sum(-1) + D * x[0, 0], atol=1e-6)


@pytest.mark.slow
def test_the_triton_kernels_equal_the_plain_torch_references():
    """The GPU scan's and conv's Triton kernels, run by Triton's interpreter on the CPU."""
    run_with_triton_interpreter("from support.kernels import check_chunked_scan, check_causal_conv; "
                                "check_chunked_scan(); check_causal_conv()")


def written_kernel_arguments() -> dict[str, list[str]]:
    """Each Triton kernel's arguments (Mamba's, FP8's casts and the loss's statistics) that torch.compile's
    analysis of its IR takes as written, for sm_90 (the analysis only reads the IR, so a CPU build can run it)."""
    import triton
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors
    from triton.backends.compiler import GPUTarget

    from nanotron.nn import causal_conv1d as conv
    from nanotron.nn import selective_scan as scan
    from nanotron.nn.fp8 import cast_kernels
    from nanotron.parallel import linear_cross_entropy as loss

    class Hopper:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    t = torch.zeros(4)
    scan_sizes = {"length": 64, "channels": 16, "d_state": 16, "num_chunks": 8, "BLOCK_T": 8, "BLOCK_D": 8,
                  "BLOCK_N": 16, "NUM_STAGES": 1}
    conv_sizes = {"length": 64, "channels": 16, "x_seq": 64 * 32, "x_row": 32, "KERNEL": 4, "HAS_BIAS": True,
                  "BLOCK_T": 32, "BLOCK_C": 128}
    grouped_sizes = {"rows": 64, "columns": 64, "groups": 2, "FP8_MAX": 448.0, "ROW_AMAX": True, "ROWWISE": True,
                     "GROUPS": 2, "BLOCKS": 4, "BLOCK_ROWS": 16, "BLOCK_C": 128}
    kernels = {"scan forward": (scan._forward_kernel, scan_sizes), "scan backward": (scan._backward_kernel, scan_sizes),
               "conv forward": (conv._conv_forward_kernel, conv_sizes),
               "conv pre-activation gradient": (conv._preactivation_gradient_kernel, conv_sizes),
               "conv input gradient": (conv._input_gradient_kernel, conv_sizes),
               "fp8 cast": (cast_kernels._cast_both_layouts_kernel, {"rows": 64, "columns": 64, "FP8_MAX": 448.0,
                                                                     "RECORD_AMAX": True, "BLOCK_R": 32,
                                                                     "BLOCK_C": 128}),
               "fp8 grouped amax": (cast_kernels._grouped_amax_kernel, grouped_sizes),
               "fp8 grouped cast": (cast_kernels._grouped_cast_kernel, grouped_sizes),
               "loss statistics": (loss._softmax_statistics_kernel, {"tokens": 8, "row_length": 64,
                                                                     "valid_columns": 60, "BLOCK": 32,
                                                                     "labels_ptr": torch.zeros(4).long()})}
    triton.runtime.driver.set_active(Hopper())
    written = {}
    for name, (kernel, sizes) in kernels.items():
        arguments = {arg: sizes.get(arg, t) for arg in kernel.arg_names}
        accesses = identify_accessed_tensors(kernel, arguments, {})
        written[name] = sorted(dep.name for dep in accesses.read_writes.writes)
    return written


@pytest.mark.slow
def test_compiled_graphs_copy_no_input_of_the_kernels():
    """torch.compile copies every input it believes a user kernel writes before each call; the Triton kernels must
    be seen to write only their outputs (an address computed by a helper that also took input pointers once made it
    copy x, Δ, A, B and C for every backward)."""
    pytest.importorskip("triton")
    triton_kernel_wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    if not hasattr(triton_kernel_wrap, "identify_accessed_tensors"):
        pytest.skip("this torch names its Triton IR analysis differently")
    done = fresh_python("import json; from test_mamba import written_kernel_arguments; "
                        "print(json.dumps(written_kernel_arguments()))")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "scan forward": ["last_ptr", "starts_ptr", "y_ptr"],
        "scan backward": ["dA_ptr", "dB_ptr", "dC_ptr", "ddelta_ptr", "dx_ptr"],
        "conv forward": ["out_ptr"],
        "conv pre-activation gradient": ["dpre_ptr"],
        "conv input gradient": ["dx_ptr"],
        "fp8 cast": ["amax_ptr", "out_ptr", "out_t_ptr"],
        "fp8 grouped amax": ["group_amax_ptr", "row_amax_ptr"],
        "fp8 grouped cast": ["out_ptr", "out_t_ptr"],
        "loss statistics": ["out_ptr"]}


def test_the_backward_prefetches_only_where_its_grid_overflows_one_wave(monkeypatch):
    """On an H200's 132 multiprocessors the 130M shape's backward (8 sequences x 192 channel blocks) fits in one wave
    without prefetching, which would make it two; the 1.4B shape's (4 x 512) takes two waves anyway. A set
    ``BACKWARD_STAGES`` (the benchmark's sweeps) wins."""
    from nanotron.nn import selective_scan as scan

    assert scan.backward_stages(8 * 192, 132) == 1
    assert scan.backward_stages(4 * 512, 132) == 2
    monkeypatch.setattr(scan, "BACKWARD_STAGES", 1)
    assert scan.backward_stages(4 * 512, 132) == 1


def test_the_causal_conv_equals_a_depthwise_conv1d_and_silu():
    """The module, continued from carried inputs (as in generation), against ``F.conv1d`` and SiLU in fp64."""
    from nanotron.nn.causal_conv1d import CausalConv1d

    torch.manual_seed(0)
    conv = CausalConv1d(6, 4, bias=True)
    torch.nn.init.normal_(conv.weight)
    torch.nn.init.normal_(conv.bias)
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = torch.randn(2, 3 + 9, 6).to(dtype).requires_grad_()  # three earlier inputs, nine new ones
        upstream = torch.randn(2, 9, 6).to(dtype)
        conv.to(dtype)
        out = conv(x[:, 3:], x[:, :3])
        grads = torch.autograd.grad(out, (x, conv.weight, conv.bias), upstream)
        xr, weight, bias = (t.detach().double().requires_grad_() for t in (x, conv.weight, conv.bias))
        reference = torch.nn.functional.silu(
            torch.nn.functional.conv1d(xr.transpose(1, 2), weight, bias, groups=6).transpose(1, 2))
        expected = torch.autograd.grad(reference, (xr, weight, bias), upstream.double())
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), reference, rtol=tolerance, atol=tolerance)
        for grad, want in zip(grads, expected):
            torch.testing.assert_close(grad.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from nanotron.checkpoint.hf import hf_to_nanotron

    torch.manual_seed(0)
    config = transformers.MambaConfig(vocab_size=112, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                      conv_kernel=4, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0)
    model = transformers.MambaForCausalLM(config).eval()
    with torch.no_grad():  # away from the init, so that a lost or misplaced tensor shows and greedy text varies
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif not name.endswith(("A_log", "D")):
                param.normal_(0.0, 0.3)
    root = tmp_path_factory.mktemp("mamba")
    model.save_pretrained(root / "hf", safe_serialization=True)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        logits = model(ids).logits[0]
        greedy = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    return {"hf": root / "hf", "ckpt": hf_to_nanotron(root / "hf", root / "nanotron"), "logits": logits,
            "greedy": greedy, "root": root}


def _nanotron(ckpt: str, tp: int = 1, pp: int = 1) -> dict:
    from nanotron.generation.generate import SamplingArgs, forward_logits, generate, load_model
    from nanotron.layout import Layout
    from nanotron.parallel.context import ParallelContext

    pc = ParallelContext(Layout(tp=tp, pp=pp))
    model, _ = load_model(Path(ckpt), pc)
    logits = forward_logits(model, pc, torch.tensor([PROMPTS[0]]), None, None, None, last_only=False)
    greedy = SamplingArgs("greedy")
    return {"logits": None if logits is None else logits[0, :, :112],
            "cached": generate(model, pc, PROMPTS, 16, greedy, None, 112),
            "uncached": generate(model, pc, PROMPTS, 16, greedy, None, 112, use_cache=False),
            "dtypes": {n: p.dtype for n, p in model.named_parameters()}}


@pytest.mark.slow
def test_logits_and_greedy_generation_match_transformers(converted):
    (ours,) = run_distributed(_nanotron, 1, ckpt=str(converted["ckpt"]))
    assert (ours["logits"] - converted["logits"]).abs().max() < 1e-4
    assert ours["cached"] == ours["uncached"]  # the recurrent cache changes nothing, left-padded prompts included
    assert ours["cached"] == converted["greedy"]
    assert len({tuple(row) for row in ours["cached"]}) == 3 and len(set(ours["cached"][0])) > 2  # not degenerate
    for layout in ({"tp": 2}, {"pp": 2}):  # channels split over 2 ranks; one block per pipeline stage
        ranks = run_distributed(_nanotron, 2, ckpt=str(converted["ckpt"]), **layout)
        last = ranks[-1]
        assert (last["logits"] - converted["logits"]).abs().max() < 1e-4, layout
        assert all(rank["cached"] == converted["greedy"] for rank in ranks), layout


def test_round_trip_is_bit_identical(converted):
    transformers = pytest.importorskip("transformers")
    from nanotron.checkpoint.hf import nanotron_to_hf

    exported = nanotron_to_hf(converted["ckpt"], converted["root"] / "back")
    original, back = load_file(converted["hf"] / "model.safetensors"), load_file(exported / "model.safetensors")
    assert set(back) == set(original)
    assert all(torch.equal(back[name], original[name]) for name in original)
    _, loading = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]


def mamba_config(tiny_data, run: Path, **changes) -> dict:
    config = tiny_config_dict(tiny_data, run, tokens={"train_steps": 20})
    config["model"]["model_config"] = json.loads(json.dumps(MAMBA)) | changes
    return config


def _train(config: dict) -> dict:
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    mixer = next(iter(trainer.model.layers.values())).mixer  # this stage's first block
    facts = {"fp32": (mixer.A_log.dtype, mixer.D.dtype, mixer.in_proj.weight.dtype),
             "no_decay": sorted(n for n in trainer.params if trainer.buckets.bucket_of[n].weight_decay is False),
             "flops_per_token": trainer.flops_per_token}
    trainer.train()
    if trainer.pc.rank != 0:
        return facts
    lines = trainer.config.resolved_metrics_path().read_text().splitlines()
    return facts | {"metrics": [json.loads(line) for line in lines]}


@pytest.mark.slow
def test_a_tiny_mamba_learns_from_yaml(tiny_data, tmp_path):
    (result,) = run_distributed(_train, 1, config=mamba_config(tiny_data, tmp_path / "run"))
    assert_reference_trains(result["metrics"], 20)
    assert result["flops_per_token"] > 6 * 2 * 64 * 128  # the projections, the scan: not 0
    assert all(record["tflops_per_gpu"] > 0 for record in result["metrics"])

    bf16 = mamba_config(tiny_data, tmp_path / "bf16") | {"tokens": {"sequence_length": 32, "train_steps": 4,
                                                                    "micro_batch_size": 4,
                                                                    "batch_accumulation_per_replica": 1}}
    bf16["model"]["dtype"] = "bfloat16"
    (facts,) = run_distributed(_train, 1, config=bf16)
    assert facts["fp32"] == (torch.float32, torch.float32, torch.bfloat16)
    assert {"layers.0.mixer.A_log", "layers.0.mixer.D"} <= set(facts["no_decay"])


UPSTREAM_INIT = {"initializer_range": 0.02, "rescale_prenorm_residual": True, "n_residuals_per_layer": 1}


def _upstream_bounds(config: dict) -> dict[str, float]:
    """Upstream's Mamba initialisation (examples/mamba/mamba.py, ``init_model_randomly`` at its main branch),
    transcribed: the bound of every uniform parameter, by its name in a layer."""
    model, ssm = config["model"]["model_config"], config["model"]["model_config"].get("ssm_cfg", {})
    d_model, layers, d_inner = model["d_model"], model["num_hidden_layers"], 2 * model["d_model"]
    dt_rank, d_conv, d_state = -(-d_model // 16), ssm.get("d_conv", 4), ssm.get("d_state", 16)
    kaiming = lambda fan_in: math.sqrt(6 / ((1 + 5) * fan_in))  # noqa: E731 kaiming_uniform_(a=sqrt(5))
    return {"in_proj.weight": kaiming(d_model), "x_proj.weight": kaiming(d_inner),
            "out_proj.weight": kaiming(d_inner) / math.sqrt(UPSTREAM_INIT["n_residuals_per_layer"] * layers),
            "conv1d.weight": kaiming(d_conv), "conv1d.bias": 1 / math.sqrt(d_conv),
            "dt_proj.weight": dt_rank ** -0.5, "dt_proj.bias": 1 / math.sqrt(dt_rank), "d_state": d_state}


@pytest.mark.slow
def test_upstreams_mamba_init_is_its_formulas_at_every_layout(tiny_data, tmp_path):
    """Selected by upstream's keys; every uniform parameter fills its bound (max within 2%, std bound/sqrt(3)), A, D
    and the norms are exact, the embedding normal(0, initializer_range); tp 2 and pp 2 start from the same values."""
    config = mamba_config(tiny_data, tmp_path / "run")
    config["model"]["init_method"] = dict(UPSTREAM_INIT)
    weights, bounds = initial_weights(config), _upstream_bounds(config)
    for part in ("in_proj.weight", "x_proj.weight", "out_proj.weight", "conv1d.weight", "conv1d.bias",
                 "dt_proj.weight", "dt_proj.bias"):
        values = weights[f"layers.1.mixer.{part}"]
        assert values.abs().max().item() == pytest.approx(bounds[part], rel=0.02), part
        assert values.std().item() == pytest.approx(bounds[part] / math.sqrt(3), rel=0.1), part
    log_a = torch.log(torch.arange(1, bounds["d_state"] + 1, dtype=torch.float32))
    assert torch.equal(weights["layers.0.mixer.A_log"], log_a.expand_as(weights["layers.0.mixer.A_log"]))
    assert torch.equal(weights["layers.0.mixer.D"], torch.ones_like(weights["layers.0.mixer.D"]))
    assert torch.equal(weights["norm.weight"], torch.ones_like(weights["norm.weight"]))
    assert weights["embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    for layout in ({"tp": 2}, {"pp": 2}):
        other = initial_weights(config, **layout)
        assert all(torch.equal(other[name], weights[name]) for name in weights), layout
    config["model"]["init_method"] = {"std": 0.02}  # the reference initialisation keeps its own name
    assert initial_weights(config)["layers.1.mixer.in_proj.weight"].std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("change, fragments", [
    ({"ssm_cfg": {"d_state": 8, "d_kernel": 4}}, ("ssm_cfg.d_kernel",)),
    ({"parallelism": {"tp": 3}}, ("= 128 channels", "parallelism.tp (3)")),
])
def test_bad_mamba_config_is_one_error_line(tiny_data, tmp_path, change, fragments):
    config = mamba_config(tiny_data, tmp_path / "run")
    if "ssm_cfg" in change:
        config["model"]["model_config"]["ssm_cfg"] = change["ssm_cfg"]
    config["parallelism"] |= change.get("parallelism", {})
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, *fragments)


@pytest.mark.slow
def test_data_and_pipeline_parallelism_follow_one_process(tiny_data, tmp_path):
    """dp=2 with ZeRO-1, and pp=2 (one block per stage, the fp32 residual stream exchanged between them)."""
    def config(name, dp=1, pp=1, zero=0):
        base = mamba_config(tiny_data, tmp_path / name)
        return base | {"parallelism": {"dp": dp, "pp": pp}, "optimizer": base["optimizer"] | {"zero_stage": zero},
                       "tokens": base["tokens"] | {"train_steps": 6, "micro_batch_size": 4 // dp}}

    (reference,) = run_distributed(_train, 1, config=config("one"))
    calls = [{"config": config("dp2", dp=2, zero=1)}, {"config": config("pp2", pp=2)}]
    for layout, ranks in zip(("dp2 zero1", "pp2"), run_distributed_each(_train, 2, calls)):
        for a, b in zip(reference["metrics"], ranks[0]["metrics"], strict=True):
            assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5), layout
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), layout


@pytest.mark.slow
def test_tensor_parallel_in_both_modes_matches_one_process_and_resumes_at_tp_1(tiny_data, tmp_path):
    """Every channel-sharded tensor (in_proj's x and z, conv1d, dt_proj, A_log, D) is assembled from distinct
    per-rank pieces that must equal the single process's, gradients included; a tp=2 checkpoint continues at tp=1."""
    steps = parity_steps()

    def config(name, tp, mode="ALL_REDUCE", resume=None):
        base = mamba_config(tiny_data, tmp_path / name)
        return base | {"parallelism": {"tp": tp, "tp_mode": mode},
                       "tokens": base["tokens"] | {"train_steps": steps},
                       "checkpoints": base["checkpoints"] | {"checkpoint_interval": steps // 2,
                                                             "resume_checkpoint_path": resume}}

    (reference,) = run_distributed(parity_run, 1, config=config("one", 1))
    first, last = reference["metrics"][0], reference["metrics"][-1]  # it learns (more slowly than the tiny Llama)
    assert last["lm_loss"] < first["lm_loss"] - 0.3 and all(m["grad_norm"] > 0 for m in reference["metrics"])
    expected_weights, expected_grads = assemble([reference], "weights"), assemble([reference], "grads")
    for mode, ranks in zip(("ALL_REDUCE", "REDUCE_SCATTER"), run_distributed_each(
            parity_run, 2, [{"config": config(f"tp2_{mode}", 2, mode)} for mode in ("ALL_REDUCE", "REDUCE_SCATTER")])):
        assert ranks[0]["local_shapes"]["layers.0.mixer.A_log"] == (64, 8)  # 128 channels over 2 ranks
        for name, tensor in assemble(ranks, "weights").items():
            assert torch.equal(tensor, expected_weights[name]), (mode, name)
        for name, grad in assemble(ranks, "grads").items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-7, msg=f"{mode} {name}")
        for a, b in zip(reference["metrics"], ranks[0]["metrics"], strict=True):
            assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5), (mode, a["step"])
    resumed = config("tp2_at_tp1", 1, resume=str(tmp_path / "tp2_ALL_REDUCE" / str(steps // 2)))
    (at_tp1,) = run_distributed(parity_run, 1, config=resumed)
    later = {m["step"]: m["lm_loss"] for m in reference["metrics"] if m["step"] > steps // 2}
    assert {m["step"]: pytest.approx(m["lm_loss"], rel=1e-5) for m in at_tp1["metrics"]} == later
