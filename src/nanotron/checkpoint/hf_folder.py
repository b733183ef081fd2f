"""A Hugging Face model folder, read for conversion: its config.json as a checked nanotron model config, and its
weights checked against that config before any tensor is read.

config.json is read the way a YAML config is: the family's table of transformers' fields (``models/hf_fields.py``)
refuses the values nanotron does not build, the family's adapter maps it to nanotron's model-config fields, the
config loader checks their types, the family's rules their values (sizes, divisibility, RoPE scaling), and the
adapter the config.json keys nanotron derives instead of reading. Then one check, the same for every family,
compares the model that config describes with the stored tensors (``check_weights_fit``): a config.json that
declares another vocabulary, width, layer or expert count, tying or bias than the weights have is refused with one
line instead of converting into a checkpoint of wrong weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from nanotron.config import ConfigError, model_config_from_dict
from nanotron.errors import CheckpointError
from nanotron.models.hf_fields import check_fields
from nanotron.models.registry import check_model_config, spec_for_hf_model_type
from nanotron.models.spec import ModelSpec

# torch cannot size a tensor of 2**63 bytes or more, even on the meta device (4 bytes per float32 value)
_MAX_PARAMETERS = 2**61
# The floating-point dtypes of safetensors files that conversion reads, by their names in the file headers.
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_hf_config(hf_path: Path) -> tuple[ModelSpec, object]:
    """The family and nanotron model config that ``hf_path/config.json`` describes, or one error (ConfigError,
    CheckpointError for what nanotron does not build) naming the problem."""
    config_file = hf_path / "config.json"
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{config_file} does not exist: --hf-path must be a Hugging Face model folder") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}",
                          source=config_file) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot be read ({error}); it must be a UTF-8 JSON file", source=config_file) from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"must hold a JSON object of model settings, not a {type(hf_config).__name__}",
                          source=config_file)
    model_type = hf_config.get("model_type")
    spec = spec_for_hf_model_type(model_type, config_file)
    check_fields(hf_config, spec.hf_adapter.hf_fields[model_type], str(config_file))
    try:
        fields = spec.hf_adapter.config_fields_from_hf(hf_config)
    except KeyError as missing:
        raise ConfigError(f"the key {missing.args[0]!r} is missing; every {model_type} config.json has it",
                          source=config_file) from None
    except CheckpointError as unsupported:  # a feature nanotron does not build (a sliding window, RoPE yarn, ...)
        raise CheckpointError(f"{config_file}: {unsupported}") from None
    # Type and value messages name nanotron's fields, which the source says (most have config.json's names too).
    as_nanotron = f"{config_file} (as nanotron's {spec.config_class.__name__})"
    config = model_config_from_dict(spec.config_class, fields, source=as_nanotron)
    check_model_config(config, 1, as_nanotron, key=None)
    problems = spec.hf_adapter.derived_key_problems(hf_config, config)
    if problems:
        raise ConfigError(*problems, source=config_file)
    return spec, config


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {folder} (save the model with safe_serialization)")
    return files


def stored_shapes(folder: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor as an empty tensor of its shape and dtype on the meta device, from the safetensors headers
    alone; a tensor of another dtype than ``FLOAT_DTYPES`` (integers, float8: a quantized checkpoint) is refused."""
    stored, where = {}, {}
    for file in _weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as handle:
                headers = {key: handle.get_slice(key) for key in handle.keys()}
                headers = {key: (info.get_shape(), info.get_dtype()) for key, info in headers.items()}
        except Exception as error:  # safetensors raises several types for truncated or foreign files
            raise CheckpointError(f"cannot read {file}: {error}; the file is corrupt") from error
        for key, (shape, dtype) in headers.items():
            if key in where:
                raise CheckpointError(f"{key!r} is stored in both {where[key]} and {file}; keep one of them")
            if dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{key!r} in {file} is stored as {dtype}, not one of the floating-point dtypes "
                                      f"nanotron converts ({', '.join(FLOAT_DTYPES)}); a quantized model must be "
                                      "dequantized and saved in one of them first")
            where[key], stored[key] = file, torch.empty(shape, dtype=FLOAT_DTYPES[dtype], device="meta")
    return stored


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor; one holding a NaN or an infinite value is refused by name."""
    tensors = {}
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                tensor = tensors[key] = handle.get_tensor(key)
                finite = int(torch.isfinite(tensor).sum())
                if finite != tensor.numel():
                    raise CheckpointError(f"{key!r} in {file} holds {tensor.numel() - finite:,} NaN or infinite "
                                          "values; nanotron converts finite weights only")
    return tensors


class _TakenTensors(Mapping):
    """Stored tensors by name that remember which ones were taken (a membership test takes nothing), so that the
    ones an adapter left are known."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = tensors
        self.taken: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensors[name]
        self.taken.add(name)
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_weights_fit(spec: ModelSpec, config, stored: dict[str, torch.Tensor], hf_path: Path) -> None:
    """Refuse weights that are not the model ``config`` describes, from their shapes alone (``stored_shapes``).

    The family's adapter maps the stored shapes to nanotron's logical tensors exactly as it maps the weights (a
    tensor it needs and lacks is refused, and so is a stored one it leaves), and the model is built from ``config``
    on the meta device: every parameter must come out with its shape. Sizes too large for any tensor stop before
    the build, by the family's parameter count.
    """
    mismatch = f"{hf_path / 'config.json'} does not match the weights in {hf_path}"
    taken = _TakenTensors(stored)
    try:
        mapped = spec.hf_adapter.weights_from_hf(taken, config)
    except KeyError as missing:
        raise CheckpointError(f"{mismatch}: the model it describes has a tensor {missing.args[0]!r}, which the "
                              "weights lack") from None
    except RuntimeError as error:  # tensors the adapter concatenates disagree with each other
        raise CheckpointError(f"{mismatch}: the stored tensors do not fit together ({error})") from None
    unused = sorted(stored.keys() - taken.taken)
    if unused:
        raise CheckpointError(f"{mismatch}: the weights hold tensors that the model it describes does not have "
                              f"({_some(unused)})")
    declared = spec.costs(config, config.vocab_size, 1).parameters
    if declared >= _MAX_PARAMETERS:
        raise CheckpointError(f"{mismatch}: the model it describes would have {declared:.3g} parameters, while "
                              f"the weights hold {sum(t.numel() for t in stored.values()):,} values")
    with torch.device("meta"):
        model = spec.model_class(config, config.vocab_size)
    # its parameters and persistent buffers (DeepSeek-V3's balancing bias), which the checkpoint stores alike
    state = model.state_dict(keep_vars=True)
    expected = {name: tuple(tensor.shape) for name, tensor in [*model.named_parameters(), *model.named_buffers()]
                if name in state}
    found = {name: tuple(tensor.shape) for name, tensor in mapped.items()}
    wrong = [name for name in sorted(expected.keys() | found.keys()) if expected.get(name) != found.get(name)]
    if wrong:
        name, more = wrong[0], f" ({len(wrong)} tensors differ)" if len(wrong) > 1 else ""
        raise CheckpointError(f"{mismatch}: nanotron's {name!r} is {found.get(name, 'absent')} in the weights but "
                              f"{expected.get(name, 'absent')} in the model it describes{more}")
