"""Convert checkpoints between Hugging Face ``transformers`` folders and nanotron, for every registered family.

The family is detected from ``config.json``'s ``model_type`` (Hugging Face → nanotron) or from checkpoint.json's
``model.type`` (nanotron → Hugging Face); its ``HFAdapter`` maps configs and tensor names, this module does the
reading and writing (a Hugging Face folder is read through ``hf_folder``, which checks its config.json and weights
against each other first). nanotron may pad the vocabulary (``make_vocab_size_divisible_by`` × tp); exports keep
the first ``vocab_size`` rows, and the bos and eos ids of the tokenizer the checkpoint carries. Only
``safetensors``, ``tokenizers`` and JSON are needed; ``transformers`` itself is used by the tests, never here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanotron.checkpoint.hf_folder import FLOAT_DTYPES, check_weights_fit, read_hf_config, read_weights, stored_shapes
from nanotron.checkpoint.integrity import file_entry, read_metadata, verify_checkpoint
from nanotron.checkpoint.logical_tensors import LogicalTensorReader, write_boxes
from nanotron.checkpoint.manager import checkpoint_metadata, checkpoint_model, model_metadata, write_metadata
from nanotron.checkpoint.run_folder import resolve_checkpoint
from nanotron.data.tokenizer import TOKENIZER_FILE_NAME, describe_token, load_tokenizer, model_token_ids
from nanotron.errors import CheckpointError
from nanotron.files import fsync_path
from nanotron.layout import Layout
from nanotron.models.registry import check_model_config

logger = logging.getLogger("nanotron.convert")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def _copy_tokenizer(source: Path, target: Path) -> bool:
    found = [source / name for name in TOKENIZER_FILES if (source / name).exists()]
    if found:
        target.mkdir(parents=True, exist_ok=True)
        for file in found:
            shutil.copy(file, target / file.name)
    return bool(found)


def hf_to_nanotron(hf_path: Path, save_path: Path) -> Path:
    """Write a nanotron checkpoint (weights only, step 0) from a Hugging Face model folder; returns its folder.
    Nothing is written before config.json, the stored tensors' names, shapes and dtypes, and their values (finite)
    have been checked."""
    hf_path, save_path = Path(hf_path), Path(save_path)
    if save_path.exists():
        raise CheckpointError(f"{save_path} already exists; choose another --save-path or delete it")
    spec, config = read_hf_config(hf_path)
    stored = stored_shapes(hf_path)
    config = spec.hf_adapter.config_for_weights(config, stored)
    check_weights_fit(spec, config, stored, hf_path)
    tensors = spec.hf_adapter.weights_from_hf(read_weights(hf_path), config)

    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    tmp = save_path.with_name(save_path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "model").mkdir(parents=True)
    boxes = [(name, tuple(t.shape), tuple(slice(0, n) for n in t.shape), t) for name, t in sorted(tensors.items())]
    write_boxes(tmp / "model" / "hf.safetensors", boxes)
    files = ["model/hf.safetensors"]
    if _copy_tokenizer(hf_path, tmp / "tokenizer"):
        files += [f"tokenizer/{p.name}" for p in sorted((tmp / "tokenizer").iterdir())]
    write_metadata(tmp, checkpoint_metadata(
        step=0, optimizer_step=0, lr_schedule_start_step=0, consumed_samples={}, consumed_tokens=0,
        layout=Layout().to_dict(),
        model=model_metadata(config, config.vocab_size, dtype), tokenizer_fingerprint=None,
        files={f: file_entry(tmp / f) for f in files}, converted_from=str(hf_path),
    ))
    tmp.rename(save_path)
    return save_path


def nanotron_to_hf(ckpt_path: Path, save_path: Path) -> Path:
    """Write a Hugging Face folder (config.json, model.safetensors, tokenizer) from a nanotron checkpoint: built
    beside ``save_path`` and renamed to it when complete, so that a failed export leaves an earlier one whole."""
    save_path = Path(save_path)
    _check_replaceable_export(save_path)
    checkpoint = resolve_checkpoint(Path(ckpt_path))
    metadata = read_metadata(checkpoint)
    verify_checkpoint(checkpoint, metadata)
    spec, config = checkpoint_model(checkpoint, metadata)
    check_model_config(config, 1, checkpoint / "checkpoint.json", key="model.config")
    reader = LogicalTensorReader(checkpoint / "model")
    padded, vocab = metadata["model"]["padded_vocab_size"], config.vocab_size

    def read(name: str) -> torch.Tensor:
        shape = reader.logical_shape(name)
        out = torch.empty(shape, dtype=_stored_dtype(reader, name))
        reader.read_into(name, tuple(slice(0, n) for n in shape), out)
        return out[:vocab] if shape[0] == padded and padded != vocab else out

    hf = spec.hf_adapter.weights_to_hf(read, config)
    save_path.parent.mkdir(parents=True, exist_ok=True)
    staging = save_path.with_name(f".{save_path.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)  # left over by a killed export that had the same process id
    staging.mkdir()
    try:
        save_file({k: v.contiguous() for k, v in hf.items()}, str(staging / "model.safetensors"),
                  metadata={"format": "pt"})
        hf_config = spec.hf_adapter.config_to_hf(config, metadata["model"]["dtype"])
        hf_config |= _tokenizer_token_ids(checkpoint / "tokenizer", config)
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
        _copy_tokenizer(checkpoint / "tokenizer", staging)
        _replace_folder(staging, save_path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return save_path


def _tokenizer_token_ids(folder: Path, config) -> dict[str, int | None]:
    """The ``bos_token_id`` and ``eos_token_id`` of the tokenizer in ``folder`` where the checkpoint's config has
    other ones than its special tokens (``model_token_ids``: the schema's defaults of a run trained before they were
    taken from the tokenizer, or ids written as ordinary tokens, which are named); none without a tokenizer.json."""
    if not (folder / TOKENIZER_FILE_NAME).is_file():
        return {}
    tokenizer = load_tokenizer(folder)
    ids, ordinary = model_token_ids(tokenizer, config)
    for name in ordinary:
        logger.warning(f"the checkpoint's {name} ({describe_token(tokenizer, getattr(config, name))}) is an ordinary "
                       f"token of its tokenizer; exported the tokenizer's own, {describe_token(tokenizer, ids[name])}")
    return ids


EXPORT_FILES = ("model.safetensors", "config.json", *TOKENIZER_FILES)


def _check_replaceable_export(save_path: Path) -> None:
    """An export replaces its whole target folder: refuse one that holds anything else than an earlier export."""
    if not save_path.exists():
        return
    if not save_path.is_dir():
        raise CheckpointError(f"--save-path {save_path} is a file; choose a new or empty folder")
    others = sorted(p.name for p in save_path.iterdir() if p.name not in EXPORT_FILES)
    if others:
        raise CheckpointError(f"--save-path {save_path} holds other files than a Hugging Face export "
                              f"({', '.join(others[:5])}); choose a new or empty folder")


def _replace_folder(staging: Path, target: Path) -> None:
    """Rename the complete ``staging`` folder to ``target``: an earlier export there stays whole until the rename
    (moved aside just before it, deleted after it), and a failed export leaves it untouched."""
    for path in staging.iterdir():
        fsync_path(path)
    if target.exists() and any(target.iterdir()):
        earlier = target.with_name(f".{target.name}.{os.getpid()}.old")
        shutil.rmtree(earlier, ignore_errors=True)
        os.replace(target, earlier)
        os.replace(staging, target)
        shutil.rmtree(earlier)
    else:
        os.replace(staging, target)  # replaces an empty folder too
    fsync_path(target.parent)


def _stored_dtype(reader: LogicalTensorReader, name: str) -> torch.dtype:
    entry = reader.entries[name][0]
    with safe_open(str(entry.file), framework="pt") as handle:
        return FLOAT_DTYPES[handle.get_slice(entry.key).get_dtype()]
