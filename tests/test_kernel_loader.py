"""The optional Triton kernels' one loader (``nn/kernels.py``): every kernel module loads through it, a missing
Triton or ``torch.library.triton_op`` is reported once on CUDA and never on the CPU, and without a GPU no compiler
is imported."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys

import pytest
import torch


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


@pytest.mark.slow
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
    from nanotron.nn import causal_conv1d, kernels, selective_scan, swiglu
    from nanotron.nn.fp8 import cast_kernels, casts, grouped

    for module in (swiglu, causal_conv1d, selective_scan):
        assert module.available is kernels.available and module.triton is kernels.triton
    assert cast_kernels.triton is kernels.triton  # FP8's kernels, and the casts that call them
    assert casts.available is grouped.available is kernels.available
