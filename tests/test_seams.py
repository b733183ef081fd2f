"""The seams a model family plugs into: registry and model type in checkpoints, module converters and the linear
matmul, persistent buffers in checkpoints, auxiliary losses and statistics through the pipeline, per-domain loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed import run_distributed, run_distributed_each
from helpers import _train, tiny_config_dict, write_corpus

# --- registry -------------------------------------------------------------------------------------------------------


def test_registry_finds_llama_by_name_config_and_hf_model_type():
    from nanotron.config import LlamaConfig
    from nanotron.errors import CheckpointError
    from nanotron.models.registry import LLAMA, spec_for_config, spec_for_hf_model_type, spec_named
    from nanotron.models.spec import CausalLM

    assert spec_named("llama", "here") is spec_for_config(LlamaConfig()) is LLAMA
    assert spec_for_hf_model_type("llama", "x") is LLAMA
    with torch.device("meta"):
        assert isinstance(LLAMA.model_class(LlamaConfig(num_hidden_layers=1), 32000), CausalLM)
    for name, hf_type in (("llamoe", "mixtral"), ("mamba", "mamba")):
        assert spec_named(name, "here") is spec_for_hf_model_type(hf_type, "x")
    with pytest.raises(CheckpointError, match="holds a 'rwkv' model, which this version cannot build"):
        spec_named("rwkv", "ckpt/5")
    with pytest.raises(CheckpointError, match="describes a 'gpt2' model; supported model_type values: llama, mamba, "
                                              "mixtral, qwen2"):
        spec_for_hf_model_type("gpt2", "hf/config.json")


def test_checkpoint_records_the_model_type_and_one_without_it_is_refused(tmp_path):
    from nanotron.checkpoint.manager import checkpoint_model, model_metadata
    from nanotron.config import LlamaConfig
    from nanotron.errors import CheckpointError

    config = LlamaConfig(num_hidden_layers=3)
    metadata = {"model": model_metadata(config, 32000, "bfloat16")}
    assert metadata["model"]["type"] == "llama" and metadata["model"]["padded_vocab_size"] == 32000
    assert checkpoint_model(tmp_path, metadata) == (checkpoint_model(tmp_path, metadata)[0], config)
    del metadata["model"]["type"]
    for version in (1, 3):  # format 1, which named none, is refused before (tests/test_checkpoint_integrity.py)
        with pytest.raises(CheckpointError, match="names no model family"):
            checkpoint_model(tmp_path, metadata | {"format_version": version})


# --- converters, the linear matmul and buffers ----------------------------------------------------------------------


def counting_matmul(counts: dict):
    import torch.nn.functional as F

    def matmul(x, weight, bias=None):
        counts["calls"] = counts.get("calls", 0) + 1
        return F.linear(x, weight, bias)

    return matmul


def swap_matmuls(model) -> None:
    """A converter in the way FP8 would plug in: every linear but the LM head gets another matmul; the final norm
    gets a persistent buffer (scaling state)."""
    from nanotron.nn.linear import Linear
    from nanotron.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    model.counts = {}
    for name, module in model.named_modules():
        if isinstance(module, (Linear, ColumnParallelLinear, RowParallelLinear)) and not name.endswith("lm_head"):
            module.matmul = counting_matmul(model.counts)
    if model.norm is not None:
        model.norm.register_buffer("scale_history", torch.zeros(4))


def _train_with_converter(config: dict, converted: bool, resume_buffer: bool = False) -> dict:
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    trainer = Trainer(config_from_dict(config), converters=(swap_matmuls,) if converted else ())
    losses = []
    loader = trainer.loader(trainer.config.data_stages[0])
    for step in range(1, 4):
        losses.append(trainer.finish_step(trainer.train_step(loader.next_step(), 1e-3)).loss)
        trainer.progress.step = step
    result = {"losses": losses, "calls": getattr(trainer.model, "counts", {}).get("calls", 0)}
    if converted and trainer.model.norm is not None:
        result["loaded_buffer"] = trainer.model.norm.scale_history.tolist()
        trainer.model.norm.scale_history.copy_(torch.arange(4.0))
    trainer.save()
    return result


@pytest.mark.slow
def test_converted_linears_train_like_the_plain_model_and_buffers_are_checkpointed(tiny_data, tmp_path):
    """At tp=2 in sequence-parallel mode with overlap, a converter's matmul runs in every converted layer (the
    overlapped path steps aside) and gives the same losses; the buffer it adds is saved and restored on resume."""
    parallelism = {"tp": 2, "tp_mode": "REDUCE_SCATTER", "tp_linear_async_communication": True}
    plain, converted = (tiny_config_dict(tiny_data, tmp_path / name, parallelism=parallelism)
                        for name in ("plain", "converted"))
    resumed = tiny_config_dict(tiny_data, tmp_path / "converted", parallelism=parallelism,
                               checkpoints={"checkpoint_interval": 1000,
                                            "resume_checkpoint_path": str(tmp_path / "converted")})
    runs = run_distributed_each(_train_with_converter, 2, [
        {"config": plain, "converted": False}, {"config": converted, "converted": True},
        {"config": resumed | {"tokens": resumed["tokens"] | {"train_steps": 40}}, "converted": True},
    ])
    (plain_run, _), (converted_run, _), (resumed_run, _) = runs
    assert converted_run["calls"] == 3 * 2 * 2 * 4  # steps x micro-batches x layers x linears (the head is left)
    assert plain_run["calls"] == 0
    torch.testing.assert_close(converted_run["losses"], plain_run["losses"], rtol=1e-6, atol=0)
    assert converted_run["loaded_buffer"] == [0.0] * 4  # a fresh run starts from zeros
    assert resumed_run["loaded_buffer"] == [0.0, 1.0, 2.0, 3.0]  # the resumed one from the checkpoint


# --- auxiliary losses and statistics through the pipeline -----------------------------------------------------------


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


def test_an_inner_stage_adds_its_auxiliary_loss_and_every_stage_gets_the_statistics():
    (single,) = run_distributed(_two_layer_pipeline, 1, pp=1)
    first, last = run_distributed(_two_layer_pipeline, 2, pp=2)
    assert single["w0"].abs().sum() > 0 and single["statistics"]["aux_loss"] > 0
    torch.testing.assert_close(first["w0"], single["w0"], rtol=1e-6, atol=1e-7)  # includes the auxiliary loss
    torch.testing.assert_close(last["w1"], single["w1"], rtol=1e-6, atol=1e-7)
    for stage in (first, last):
        assert stage["statistics"] == pytest.approx(single["statistics"], rel=1e-6)


# --- per-domain loss ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_domains(tiny_data, tmp_path_factory) -> list[Path]:
    """The tiny corpus and a second domain tokenized with the same tokenizer: 'tokenized' and 'other'."""
    from nanotron.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("domains")
    corpus = write_corpus(root / "raw", documents=200, seed=1)
    preprocess([corpus], tiny_data["tokenizer"], root / "other", num_workers=1)
    return [tiny_data["tokenized"], root / "other"]


@pytest.mark.slow
def test_multi_folder_runs_log_the_loss_of_every_domain_at_any_layout(tiny_data, two_domains, tmp_path):
    stage = {"name": "main", "start_training_step": 1,
             "data": {"seed": 3, "num_loading_workers": 0,
                      "dataset": {"dataset_folder": [str(f) for f in two_domains], "dataset_weights": [0.5, 0.5]}}}
    single = tiny_config_dict(tiny_data, tmp_path / "single", data_stages=[stage], tokens={"train_steps": 4})
    split = tiny_config_dict(tiny_data, tmp_path / "split", data_stages=[stage], parallelism={"dp": 2, "pp": 2},
                             tokens={"train_steps": 4, "micro_batch_size": 2})
    (reference,) = run_distributed(_train, 1, config=single)
    layout = run_distributed(_train, 4, config=split)[0]
    for record in reference:
        losses = record["domain_losses"]
        assert set(losses) == {"tokenized", "other"}
        assert min(losses.values()) <= record["lm_loss"] <= max(losses.values())
    assert reference[-1]["lm_loss"] < reference[0]["lm_loss"]
    for ours, theirs in zip(layout, reference):
        assert ours["domain_losses"] == pytest.approx(theirs["domain_losses"], rel=1e-5)
