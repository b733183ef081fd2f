"""Regressions: the optional Triton kernels reported once on CUDA when they cannot load, the vocabulary-parallel
cross-entropy without a host sync, DoReMi's loss compiled with the model, rotary tables built once per length on
every pipeline stage, and an export to Hugging Face that never leaves a half-written folder."""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.configs import doremi_config, tiny_config_dict
from support.distributed import run_distributed
from support.runs import assert_user_error, cli, train_through_cli


@pytest.mark.parametrize("missing", ["triton", "torch older than 2.6"])
def test_triton_kernels_that_cannot_load_are_reported_once_on_cuda_and_never_on_cpu(monkeypatch, caplog, missing):
    """The loader imported on a CUDA machine without Triton, or with a torch whose ``torch.library`` lacks
    ``triton_op``: no kernel runs, a CPU asks silently, and the first CUDA ask logs one warning with the import error
    and the fix."""
    from nanotron.nn import kernels as loaded

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if missing == "triton":
        monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    else:
        monkeypatch.delattr(torch.library, "triton_op", raising=False)
    spec = importlib.util.spec_from_file_location("kernels_without_triton", loaded.__file__)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    assert kernels.triton is None and kernels.UNAVAILABLE
    with caplog.at_level(logging.WARNING):
        assert not kernels.available(torch.device("cpu"))
        assert not caplog.records
        assert not any(kernels.available(torch.device("cuda")) for _ in range(3))
    assert len(caplog.records) == 1, [record.getMessage() for record in caplog.records]
    message = caplog.records[0].getMessage()
    assert kernels.UNAVAILABLE in message and "torch>=2.6" in message
    assert ("triton" in kernels.UNAVAILABLE) if missing == "triton" else ("triton_op" in kernels.UNAVAILABLE)


def test_importing_the_trainer_without_a_gpu_loads_no_compiler():
    """Registering the Triton ops imports inductor and dynamo (over a second per process, every rank of every run):
    without a CUDA device or Triton's interpreter no kernel can run, and none is registered."""
    code = ("import sys, nanotron.trainer, nanotron.cli; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env={**environment, "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "[]", done.stdout


def test_every_triton_kernel_module_loads_through_the_one_loader():
    from nanotron.nn import causal_conv1d, fp8, kernels, selective_scan, swiglu

    for module in (fp8, swiglu, causal_conv1d, selective_scan):
        assert module.available is kernels.available and module.triton is kernels.triton


def _host_syncs_of_vocab_parallel_cross_entropy() -> int:
    """Forward and backward of the cross-entropy over a vocabulary of 10 padded to 12 (rank 1 holds the padding),
    counting the reads of tensor values to the host (``bool`` and ``item``) that it makes."""
    import torch.distributed as dist

    from nanotron.parallel.cross_entropy import vocab_parallel_token_losses

    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    logits = torch.randn(2, 5, 6, requires_grad=True)
    labels = torch.randint(0, 10, (2, 5))
    reads = []
    to_bool, item = torch.Tensor.__bool__, torch.Tensor.item
    torch.Tensor.__bool__ = lambda self: reads.append("bool") or to_bool(self)
    torch.Tensor.item = lambda self: reads.append("item") or item(self)
    try:
        losses = vocab_parallel_token_losses(logits, labels, dist.group.WORLD, vocab_size=10)
        losses.sum().backward()
    finally:
        torch.Tensor.__bool__, torch.Tensor.item = to_bool, item
    assert torch.isfinite(losses).all() and torch.isfinite(logits.grad).all()
    return len(reads)


def test_vocab_parallel_cross_entropy_reads_nothing_back_to_the_host():
    """Which columns are padding is known from the ranks' vocabulary slices: testing the mask's values made every
    rank wait for the GPU at every micro-batch."""
    assert run_distributed(_host_syncs_of_vocab_parallel_cross_entropy, 2) == [0, 0]


def _doremi_loss_is_compiled(config: dict) -> dict:
    """Build the proxy trainer with model.compile, recording what ``torch.compile`` is given; call its language-model
    loss on a micro-batch weighted as DoReMi weighs it, compiled and eagerly, and by hand."""
    from nanotron.config import config_from_dict
    from nanotron.data.batch import MicroBatch
    from nanotron.features import features_for
    from nanotron.layout import Group
    from nanotron.trainer import Trainer
    from nanotron.training.objective import micro_batch_loss

    compiled, real_compile = {}, torch.compile

    def recording_compile(function, *args, **kwargs):
        result = real_compile(function, *args, **kwargs)
        compiled[id(result)] = function
        return result

    torch.compile = recording_compile
    try:
        proxy = config_from_dict(config)
        trainer = Trainer(proxy, features=features_for(proxy, doremi_proxy=True))
    finally:
        torch.compile = real_compile
    labels = torch.randint(0, 384, (2, 8))
    batch = MicroBatch(labels, labels, torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 2]),
                       token_count=torch.tensor(16.0), sample_weights=torch.tensor([0.1, 0.3]))
    logits = torch.randn(2, 8, trainer.model.padded_vocab_size)
    loss_function = trainer.program.objective_at(1).language_model.loss
    arguments = (logits, batch, trainer.pc.group(Group.TP), 384, 3)
    loss = loss_function(*arguments)[0]
    source = compiled.get(id(loss_function))
    eager = (source or loss_function)(*arguments)[0]
    by_hand = (torch.nn.functional.cross_entropy(logits[..., :384].transpose(1, 2), labels, reduction="none").sum(-1)
               * batch.sample_weights).sum()
    trainer.pc.destroy()
    return {"compiled": source is micro_batch_loss, "equal": torch.allclose(loss, eager, rtol=1e-5),
            "weighted": torch.allclose(eager, by_hand, rtol=1e-5)}


@pytest.mark.slow
def test_the_doremi_loss_is_compiled_when_the_model_is(tiny_data, doremi_domains, doremi_reference, tmp_path):
    config = doremi_config(tiny_data, doremi_domains, tmp_path / "proxy", reference=doremi_reference, steps=1)
    config["model"]["compile"] = True
    assert run_distributed(_doremi_loss_is_compiled, 1, config=config) == [
        {"compiled": True, "equal": True, "weighted": True}]


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


def test_every_pipeline_stage_builds_its_rotary_tables_once_for_the_sequence_length(tiny_data, tmp_path):
    """At pp=2 with sequence parallelism the second stage cannot read the sequence's length from its hidden states:
    it built tables for all max_position_embeddings (here 8x the sequence) at every forward, and the first stage
    rebuilt its own at every forward too. Both now build the sequence's tables once."""
    config = tiny_config_dict(tiny_data, tmp_path / "run", tokens={"train_steps": 2, "sequence_length": 32},
                              parallelism={"pp": 2, "tp": 1})
    config["model"]["model_config"]["max_position_embeddings"] = 256
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    assert run_distributed(_rotary_positions_per_stage, 2, config=config) == [32, 32]


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """A run folder trained one step with the tiny config."""

    root = tmp_path_factory.mktemp("trained")
    config = tiny_config_dict(tiny_data, root / "run", tokens={"train_steps": 1})
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    train_through_cli(config, root / "config.yaml")
    return root / "run"


def test_a_failed_export_to_hugging_face_leaves_the_earlier_export_whole(trained, tmp_path, monkeypatch):
    """The tokenizer copy fails half-way (a file-size limit reached: EFBIG) while an earlier export is in the
    target: the earlier export keeps every byte, and nothing half-written is left beside it. The next export
    replaces it."""
    from nanotron.checkpoint.hf import nanotron_to_hf

    target = nanotron_to_hf(trained, tmp_path / "hf")
    earlier = {path.name: path.read_bytes() for path in target.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(earlier)
    config = json.loads(earlier["config.json"])
    config["note"] = "the earlier export"
    (target / "config.json").write_text(json.dumps(config))
    earlier["config.json"] = (target / "config.json").read_bytes()

    def copy_until_full(source, destination):
        data = Path(source).read_bytes()
        Path(destination).write_bytes(data[: len(data) // 2])
        raise OSError(errno.EFBIG, "File too large", str(destination))

    with monkeypatch.context() as patched:
        patched.setattr(shutil, "copy", copy_until_full)
        with pytest.raises(OSError, match="File too large"):
            nanotron_to_hf(trained, target)
    assert {path.name: path.read_bytes() for path in target.iterdir()} == earlier
    assert [path.name for path in tmp_path.iterdir()] == ["hf"]

    nanotron_to_hf(trained, target)
    assert "note" not in json.loads((target / "config.json").read_text())
    assert (target / "tokenizer.json").read_bytes() == (trained / "1" / "tokenizer" / "tokenizer.json").read_bytes()


def test_an_export_refuses_a_folder_holding_other_files(trained, tmp_path):
    """The export replaces its target folder whole: a folder with anything else in it is refused, untouched."""
    target = tmp_path / "models"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    outcome = cli("convert", "nanotron-to-hf", "--ckpt-path", trained, "--save-path", target)
    assert_user_error(outcome, str(target), "notes.txt", "choose a new or empty folder")
    assert [path.name for path in target.iterdir()] == ["notes.txt"]
