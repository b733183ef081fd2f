"""What the test files share (plain functions and constants; the fixtures are in ``conftest.py``), one module per
concern: ``tiers`` (which tests run), ``corpus`` and ``configs`` (the tiny data and models), ``runs`` (one ``train_*``
per way of running, the CLI's outcome), ``processes`` (training processes steered by signals), ``distributed``
(a function on N gloo ranks), ``parity`` (layouts against the single-process reference), ``grad_norms`` (grad-norms
across layouts, teacher-forced), ``hf`` (Hugging Face interop), ``tasks`` (evaluation task files), ``kernels``
(kernel checks against their references), ``documents`` (document masking through a model), ``stand_ins`` (what
only a GPU has), ``storage`` (tensor storage held, measured) and ``small_llama``. A test file imports from here,
never from another test file."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
