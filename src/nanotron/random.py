"""Save and restore every random generator a rank uses, so that a resumed run draws the same numbers.

The states are stored as plain tensors and JSON in a safetensors file, never pickled: loading a checkpoint must
never run code from it. Python's Mersenne Twister state is 625 integers, numpy's 624 plus a position, torch's a
byte tensor per device.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from nanotron.files import atomic_write_safetensors


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device, coords: dict[str, int]) -> tuple[dict[str, torch.Tensor], dict]:
    """This process's generators as tensors and JSON-able values, with the rank's grid coordinates."""
    version, python_state, gauss = random.getstate()
    kind, numpy_key, numpy_pos, has_gauss, cached_gauss = np.random.get_state()
    tensors = {"python": torch.tensor(python_state, dtype=torch.int64),
               "numpy": torch.from_numpy(numpy_key.astype(np.int64)), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["cuda"] = torch.cuda.get_rng_state(device)
    info = {"coords": coords, "python_version": version, "python_gauss": gauss, "numpy_kind": kind,
            "numpy_pos": int(numpy_pos), "numpy_has_gauss": int(has_gauss), "numpy_cached_gauss": float(cached_gauss)}
    return tensors, info


def write_rng_state(path: Path, tensors: dict[str, torch.Tensor], info: dict) -> None:
    """Write what ``rng_state`` took to ``path``, atomically."""
    atomic_write_safetensors(path, tensors, {"rng": json.dumps(info)})


def load_rng_state(path: Path, device: torch.device, coords: dict[str, int]) -> bool:
    """Restore the generators saved at ``path`` if they belong to a rank at ``coords``; report whether they did. An
    axis the saved coordinates do not name was added since: the saving rank sat at 0 on it."""
    with safe_open(str(path), framework="pt") as handle:
        info = json.loads(handle.metadata()["rng"])
        if any(info["coords"].get(axis, 0) != coordinate for axis, coordinate in coords.items()):
            return False
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    random.setstate((info["python_version"], tuple(tensors["python"].tolist()), info["python_gauss"]))
    np.random.set_state((info["numpy_kind"], tensors["numpy"].numpy().astype(np.uint32), info["numpy_pos"],
                         info["numpy_has_gauss"], info["numpy_cached_gauss"]))
    torch.set_rng_state(tensors["torch"])
    if device.type == "cuda" and "cuda" in tensors:
        torch.cuda.set_rng_state(tensors["cuda"], device)
    return True
