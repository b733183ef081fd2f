"""Layout parity: what a run at a layout gives (first-step loss, logits and gradients as pieces of the logical
tensors, then the metrics of its steps), the logical tensors rebuilt from every rank's pieces, and the
comparisons against the single-process reference."""

from __future__ import annotations

import pytest
import torch

from support.runs import trainer_metrics


def assert_reference_trains(metrics: list[dict], steps: int, margin: float | None = None) -> None:
    """The single-process reference really learns, so that matching it means something: one record per step, every
    grad-norm positive, and the last step's loss clearly below the first's. The tiny models start near
    ln(384) = 5.95 and lose about 1.0 nat in 6 steps and 2.2 in 16 to 20 at their learning rate of 3e-3 (measured):
    the bar (``margin``) is by default 0.75 in the short runs and 1.0 in the full tier's."""
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["grad_norm"] > 0 for m in metrics), [m["grad_norm"] for m in metrics]
    if margin is None:
        margin = 1.0 if steps >= 16 else 0.75
    first, last = metrics[0]["lm_loss"], metrics[-1]["lm_loss"]
    assert last < first - margin, f"loss {first:.3f} -> {last:.3f} over {steps} steps: no drop > {margin}"


def logical_pieces(tensors: dict[str, torch.Tensor], params: dict, coords: dict, sizes: dict) -> dict:
    """Every local tensor as (logical slices, values) pieces, so the parent can rebuild the logical tensor."""
    from nanotron.parallel.placement import get_placement

    out = {}
    for name, tensor in tensors.items():
        placement = get_placement(params[name])
        out[name] = (placement.logical_shape,
                     [(logical, tensor[local].detach().clone()) for local, logical in placement.boxes(coords, sizes)])
    return out


def final_weights(trainer) -> dict:
    """This rank's pieces (``logical_pieces``) of a trained model's weights as the optimizer holds them whole."""
    pc, weights = trainer.pc, {}
    for whole in trainer.buckets.whole_parameters():
        weights |= logical_pieces(whole, trainer.params, pc.coordinates, pc.sizes)
    return weights


def first_step(trainer) -> list:
    """The micro-batches of the trainer's first step (on this rank), as its training loop reads them."""
    return trainer.loader(trainer.config.data_stages[0]).next_step()


def first_step_gradients(trainer) -> tuple[torch.Tensor, dict]:
    """Loss and gradient pieces of the first step's micro-batches, without updating the weights.

    The gradients stay in the buckets: call ``trainer.buckets.zero()`` before training on.
    """
    loss = trainer.program.run(first_step(trainer), step=1)["lm_loss"]
    grads = {name: trainer.buckets.gradient(name) for name in trainer.params}
    return loss, logical_pieces(grads, trainer.params, trainer.pc.coordinates, trainer.pc.sizes)


def parity_run(config: dict) -> dict:
    """What the layout-parity tests compare of a run: its initial weights, the first step's logits, loss and
    gradients (no update), then the metrics of the config's training steps."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config))
    pc, params = trainer.pc, trainer.params
    weights = logical_pieces(dict(params), params, pc.coordinates, pc.sizes)
    batch = first_step(trainer)[0]
    with torch.no_grad():
        logits = trainer.model(input_ids=batch.input_ids)
    loss, grads = first_step_gradients(trainer)
    norm_grads = {n: trainer.buckets.gradient(n).clone() for n in params if "norm" in n}
    trainer.buckets.zero()

    trainer.train()
    local_shapes = {n: tuple(p.shape) for n, p in params.items()}
    return {"weights": weights, "grads": grads, "logits": logits, "loss": loss.item(),
            "norm_grads": norm_grads, "metrics": trainer_metrics(trainer), "local_shapes": local_shapes}


def first_step_then_train(config: dict) -> dict:
    """Loss and gradient pieces of the first step (no update), then the config's training steps, without the
    logits and weights of ``parity_run``, and the persistent buffers this rank holds at the end (state that training
    moves besides the weights: DeepSeek-V3's balancing bias). The process group stays for the next call of the same
    spawn."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    return first_step_then_train_on(Trainer(config_from_dict(config)))


def first_step_then_train_on(trainer) -> dict:
    """``first_step_then_train`` with a trainer already built (a test may watch its model first)."""
    from nanotron.parallel.placement import logical_buffers

    loss, grads = first_step_gradients(trainer)
    trainer.buckets.zero()
    trainer.train()
    return {"loss": loss.item(), "grads": grads, "metrics": trainer_metrics(trainer),
            "sharded": trainer.buckets.buckets[0].sharded,
            "buffers": {name: buffer.clone() for name, buffer in logical_buffers(trainer.model).items()}}


def assemble(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Logical tensors rebuilt from every rank's pieces; each element must be written consistently."""
    full: dict[str, torch.Tensor] = {}
    for result in results:
        for name, (shape, pieces) in result[key].items():
            target = full.setdefault(name, torch.full(shape, float("nan")))
            for logical, values in pieces:
                region = target[logical]
                assert torch.isnan(region).all() or torch.equal(region, values), f"{name}: ranks disagree"
                region.copy_(values)
    for name, tensor in full.items():
        assert not torch.isnan(tensor).any(), f"{name} is not fully covered"
    return full


def assert_matches_reference(reference: dict, results: list[dict], what) -> None:
    """Loss and grad-norm within 1e-5 of one process at every step, and the final weights within 1e-5 (absolute):
    ``reference`` and each of ``results`` hold a run's ``metrics`` (rank 0's, the others' empty) and ``weights``
    (``logical_pieces``)."""
    (metrics,) = [r["metrics"] for r in results if r["metrics"]]
    for expected, got in zip(reference["metrics"], metrics, strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), (what, got["step"])
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), (what, got["step"])
    expected_weights = assemble([reference], "weights")
    for name, weight in assemble(results, "weights").items():
        # Adam divides by the root of tiny second moments: gradients equal to 1e-7 move weights by up to ~2e-6 over
        # 10 steps at a learning rate of 3e-3 (a step at most), as ZeRO-1 against ZeRO-0 does.
        torch.testing.assert_close(weight, expected_weights[name], rtol=0, atol=1e-5, msg=f"{what}: {name}")


def check_against_reference(reference: dict, results: list[dict], tp: int, variant: tuple) -> None:
    # Each rank holds 1/tp of every matrix.
    assert results[1]["local_shapes"]["layers.0.attn.qkv_proj.weight"][0] == 128 // tp, variant
    assert results[1]["local_shapes"]["embed_tokens.weight"][0] == 384 // tp

    reference_weights = assemble([reference], "weights")
    for name, tensor in assemble(results, "weights").items():
        assert torch.equal(tensor, reference_weights[name]), f"initial {name} differs"

    logits = torch.cat([r["logits"] for r in results], dim=-1)
    torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-6)
    assert results[0]["loss"] == pytest.approx(reference["loss"], rel=1e-5)

    reference_grads = assemble([reference], "grads")
    for name, grad in assemble(results, "grads").items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    for name in results[0]["norm_grads"]:  # replicated norm weights: same gradient on every TP rank
        for other in results[1:]:
            assert torch.equal(other["norm_grads"][name], results[0]["norm_grads"][name]), name

    for expected, got in zip(reference["metrics"], results[0]["metrics"], strict=True):
        assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), got["step"]


def initial_weights(config: dict, **parallelism: int) -> dict[str, torch.Tensor]:
    """The logical initial tensors of ``config``'s model at the layout ``parallelism`` (tp, pp, dp, ...), assembled
    from every rank's part, each rank built and initialised in this process without process groups
    (``GridPosition``), as training builds it."""
    from nanotron.config import config_from_dict
    from nanotron.layout import Layout
    from nanotron.models.build import BuildOptions, build_stage, parameter_initializer
    from nanotron.parallel.context import GridPosition
    from nanotron.parallel.placement import logical_parameters

    cfg = config_from_dict(config | {"parallelism": config["parallelism"] | parallelism})
    layout, options = Layout.from_config(cfg), BuildOptions.from_config(cfg)
    results = []
    for rank in range(layout.world_size):
        grid = GridPosition(layout, layout.coordinates(rank))
        model = build_stage(cfg.model.model_config, grid, options, device=torch.device("cpu"))
        params = logical_parameters(model)
        parameter_initializer(cfg.model.model_config, grid, options)(params)
        tensors = {name: param.detach().float() for name, param in params.items()}
        results.append({"weights": logical_pieces(tensors, params, grid.coordinates, grid.sizes)})
    return assemble(results, "weights")
