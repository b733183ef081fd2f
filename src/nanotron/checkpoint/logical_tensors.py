"""Store pieces of logical tensors in safetensors files, and read back any slice of them.

A checkpoint never stores "rank 3's tensor". Each stored entry is a box of a logical (layout-independent) tensor:
its name, the full logical shape, and the offsets of the box. A reader in another layout asks for the slices it
needs and gets them from whichever entries overlap, reading only those bytes (``safe_open(...).get_slice``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from nanotron.errors import CheckpointError
from nanotron.files import atomic_write_safetensors

FORMAT_VERSION = 3  # 3: checkpoint.json carries manifest_sha256; 2: it names the model family; 1 held Llama only
METADATA_KEY = "nanotron"


@dataclass(frozen=True)
class Entry:
    file: Path
    key: str
    name: str
    logical_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


def write_boxes(path: Path, boxes: list[tuple[str, tuple[int, ...], tuple[slice, ...], torch.Tensor]]) -> None:
    """Write boxes ``(logical name, logical shape, logical slices, data)`` to one safetensors file, atomically."""
    tensors, entries = {}, {}
    for index, (name, logical_shape, logical_slices, data) in enumerate(boxes):
        key = f"{index}:{name}"
        tensors[key] = data.detach().to("cpu").contiguous()
        entries[key] = {
            "name": name,
            "logical_shape": list(logical_shape),
            "offsets": [s.start for s in logical_slices],
        }
    metadata = {METADATA_KEY: json.dumps({"format_version": FORMAT_VERSION, "entries": entries})}
    atomic_write_safetensors(path, tensors, metadata)


class LogicalTensorReader:
    """Index of every entry in the safetensors files of one folder; reads arbitrary slices of logical tensors."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.entries: dict[str, list[Entry]] = {}
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors files in {folder}")
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    header = json.loads(handle.metadata()[METADATA_KEY])
                    shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
            except Exception as error:  # safetensors raises several types for truncated or foreign files
                raise CheckpointError(f"cannot read checkpoint file {file}: {error}; the file is corrupt") from error
            for key, info in header["entries"].items():
                entry = Entry(file, key, info["name"], tuple(info["logical_shape"]), tuple(info["offsets"]),
                              shapes[key])
                self.entries.setdefault(entry.name, []).append(entry)

    def names(self) -> set[str]:
        return set(self.entries)

    def logical_shape(self, name: str) -> tuple[int, ...]:
        return self._entries_of(name)[0].logical_shape

    def _entries_of(self, name: str) -> list[Entry]:
        if name not in self.entries:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint folder {self.folder}")
        return self.entries[name]

    def read_into(self, name: str, logical_slices: tuple[slice, ...], out: torch.Tensor) -> None:
        """Fill ``out`` with the logical region ``logical_slices`` of tensor ``name``."""
        covered = 0
        for entry in self._entries_of(name):
            overlap = []
            for want, offset, size in zip(logical_slices, entry.offsets, entry.shape):
                start, stop = max(want.start, offset), min(want.stop, offset + size)
                if start >= stop:
                    break
                overlap.append((start, stop, offset, want.start))
            else:
                source = tuple(slice(lo - off, hi - off) for lo, hi, off, _ in overlap)
                target = tuple(slice(lo - base, hi - base) for lo, hi, _, base in overlap)
                with safe_open(str(entry.file), framework="pt") as handle:
                    piece = handle.get_slice(entry.key)[source]
                out[target].copy_(piece)
                covered += piece.numel()
        if covered != out.numel():
            raise CheckpointError(
                f"the checkpoint in {self.folder} covers {covered} of the {out.numel()} elements of {name!r} "
                "needed here: a shard file is missing"
            )
