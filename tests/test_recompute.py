"""Full activation recomputation (`parallelism.recompute: full`): the same training with fewer saved activations,
unchanged parameter names, FLOP figures that count the extra forward, and a config key like any other."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml
from torch import nn

from support.configs import RECOMPUTE_STEPS, recompute_config, tiny_config_dict, write_config
from support.distributed import run_distributed_each
from support.runs import train_with_flops


def _saved_for_backward(config: dict) -> dict:
    """What one forward of the built model saves for backward, its parameter names and the gradients it gives."""
    from nanotron.config import config_from_dict
    from nanotron.layout import Layout
    from nanotron.models.build import BuildOptions, build_model
    from nanotron.parallel.context import ParallelContext

    cfg = config_from_dict(config)
    model = build_model(cfg.model.model_config, ParallelContext(Layout()), BuildOptions.from_config(cfg))
    ids = torch.randint(0, cfg.model.model_config.vocab_size, (2, cfg.tokens.sequence_length),
                        generator=torch.Generator().manual_seed(0))
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(input_ids=ids)
    logits.float().logsumexp(-1).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {"count": len(saved), "bytes": sum(saved), "names": [n for n, _ in model.named_parameters()], "grads": grads}


@pytest.fixture(scope="module")
def single_process_runs(tiny_data, tmp_path_factory) -> tuple[dict, dict]:
    """Training without, then with recomputation, on one process."""
    root = tmp_path_factory.mktemp("recompute")
    calls = [{"config": recompute_config(tiny_data, root / f"recompute-{on}", on)} for on in ("none", "full")]
    (plain,), (recomputed,) = run_distributed_each(train_with_flops, 1, calls)
    return plain, recomputed


@pytest.mark.slow
def test_recomputed_training_matches_and_reports_hardware_flops(single_process_runs):
    plain, recomputed = single_process_runs
    reference = plain["metrics"]
    assert [r["step"] for r in reference] == list(range(1, RECOMPUTE_STEPS + 1))
    assert reference[-1]["lm_loss"] < reference[0]["lm_loss"] - 0.3 and all(r["grad_norm"] > 0 for r in reference)
    for expected, got in zip(reference, recomputed["metrics"], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=0, abs=1e-6), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=0, abs=1e-6), got["step"]

    assert plain["hardware_flops"] == plain["model_flops"] == recomputed["model_flops"]
    assert recomputed["hardware_flops"] > recomputed["model_flops"]
    assert all(r["hardware_tflops_per_gpu"] == r["tflops_per_gpu"] for r in reference)
    assert all(r["hardware_tflops_per_gpu"] > r["tflops_per_gpu"] for r in recomputed["metrics"])


@pytest.mark.slow
def test_recompute_with_tensor_and_pipeline_parallelism(single_process_runs, tiny_data, tmp_path):
    """Collectives of the tensor-parallel layers run again in backward, and 1F1B backwards come late."""
    reference = single_process_runs[0]["metrics"]
    config = recompute_config(tiny_data, tmp_path, "full", tp=2, pp=2, tp_mode="REDUCE_SCATTER",
                              tp_linear_async_communication=True)
    (runs,) = run_distributed_each(train_with_flops, 4, [{"config": config}])
    (metrics,) = [run["metrics"] for run in runs if run["metrics"]]
    for expected, got in zip(reference, metrics, strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), got["step"]


def test_recompute_saves_activations_keeps_names_and_gradients(tiny_data, tmp_path):
    calls = [{"config": recompute_config(tiny_data, tmp_path, on)} for on in ("none", "full")]
    (plain,), (recomputed,) = run_distributed_each(_saved_for_backward, 1, calls)
    # Only the embedding, final norm and LM head save their activations; each layer keeps just its input.
    assert recomputed["count"] < plain["count"] / 3 and recomputed["bytes"] < plain["bytes"] / 3
    assert recomputed["names"] == plain["names"]
    assert "layers.1.attn.qkv_proj.weight" in plain["names"]
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(recomputed["grads"][name], grad, rtol=0, atol=1e-7, msg=name)


def test_hardware_flops_add_one_forward_of_the_layers():
    from nanotron.config import LlamaConfig
    from nanotron.models.llama.costs import llama_costs

    config = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    costs = llama_costs(config, padded_vocab_size=104, sequence_length=32)
    layer_params = 16 * (2 + 2 * 1) * 8 + 2 * 8 * 16 + 3 * 16 * 32 + 2 * 16  # q|k|v, o, gate|up|down, two norms
    assert costs.parameters == 4 * layer_params + 104 * 16 + 16
    assert costs.flops_per_token == 6 * costs.parameters + 6 * 4 * 16 * 32  # 6 per weight, causal attention
    assert costs.head_flops == 6 * 104 * 16
    assert costs.hardware_flops_per_token("none") == costs.flops_per_token
    recomputed = costs.hardware_flops_per_token("full")
    assert recomputed == pytest.approx(costs.flops_per_token + 4 * (2 * layer_params + 2 * 16 * 32))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.linear(x).tanh() * scale


def test_recompute_in_backward_checkpoints_only_with_grad(monkeypatch):
    import nanotron.nn.recompute as recompute

    calls = []
    real_checkpoint = recompute.checkpoint

    def counting_checkpoint(*args, **kwargs):
        calls.append(kwargs["use_reentrant"])
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(recompute, "checkpoint", counting_checkpoint)
    module, x = _Scaled(), torch.randn(3, 4)
    expected = module(x, scale=2.0)
    recompute.recompute_in_backward(recompute.recompute_in_backward(module))  # idempotent
    with torch.no_grad():
        assert torch.equal(module(x, scale=2.0), expected)
    assert calls == []
    assert torch.equal(module(x, scale=2.0), expected) and calls == [False]

    # A deep copy (e.g. an EMA or a reference model) recomputes its own forward, not the original's.
    clone = copy.deepcopy(module)
    with torch.no_grad():
        clone.linear.weight.zero_()
    assert clone.forward.__self__ is clone
    assert not torch.equal(clone(x), module(x))


@pytest.mark.parametrize("upstream, recompute", [
    ({"recompute_layer": True}, "full"),
    ({"recompute_layer": True, "recompute_granularity": "SELECTIVE"}, "selective"),
    ({"recompute_layer": True, "recompute_granularity": "pointwise"}, "pointwise"),
    ({"recompute_layer": False, "recompute_granularity": "full"}, "none"),
    ({"recompute_granularity": "full"}, "none"),
], ids=["layer", "selective", "pointwise", "off", "granularity-alone"])
def test_upstreams_recompute_keys_load_as_the_one_recompute_setting(tiny_data, tmp_path, upstream, recompute):
    """Upstream's recompute_layer and recompute_granularity, as written in its files, become parallelism.recompute,
    which a saved config then holds alone."""
    from nanotron.config import load_config, save_config

    config = tiny_config_dict(tiny_data, tmp_path)
    config["parallelism"] |= upstream
    loaded = load_config(write_config(tmp_path / "upstream.yaml", config))
    assert loaded.parallelism.recompute == recompute
    save_config(loaded, tmp_path / "saved.yaml")
    saved = yaml.safe_load((tmp_path / "saved.yaml").read_text())["parallelism"]
    assert saved["recompute"] == recompute and not {"recompute_layer", "recompute_granularity"} & saved.keys()


@pytest.mark.parametrize("overrides, fragment", [
    (["parallelism.recompute=attention"], "parallelism.recompute must be one of none, full, selective, pointwise"),
    (["parallelism.recompute_layer=1"], "parallelism.recompute_layer: expected a boolean (true/false), got 1"),
    (["parallelism.recompute_layer=true", "parallelism.recompute_granularity=attention"],
     "parallelism.recompute_granularity must be one of full, selective, pointwise (got 'attention')"),
    (["parallelism.recompute_granularity=selective"],
     "parallelism.recompute_granularity: selective takes effect only with parallelism.recompute_layer: true"),
    (["parallelism.recompute=full", "parallelism.recompute_layer=true"],
     "parallelism.recompute and upstream's recompute_layer / recompute_granularity are both set"),
], ids=["value", "layer-type", "granularity-value", "granularity-alone", "both"])
def test_a_bad_recompute_setting_is_one_line_naming_the_key(tiny_data, tmp_path, overrides, fragment):
    from nanotron.config import ConfigError, load_config

    plain = write_config(tmp_path / "plain.yaml", tiny_config_dict(tiny_data, tmp_path))
    assert load_config(plain).parallelism.recompute == "none"
    with pytest.raises(ConfigError) as info:
        load_config(plain, overrides)
    (problem,) = info.value.problems
    assert fragment in problem, problem
