"""The training sample stream: token streams cut into windows, shuffled and blended.

Sample ``g`` of a data stage is a pure function of ``(g, seed, weights, folders, sequence_length)`` computed in
O(1): no index files, no state to checkpoint beyond the step counter, and resuming at any step (or changing the
data-parallel layout) replays exactly the same samples.

* A folder (a "domain") is one token stream, made of one or more segments. Its samples are windows of
  ``sequence_length + 1`` tokens that never cross a segment's end. A preprocessed folder is a single segment cut
  with stride ``sequence_length``, so consecutive windows share one token and every token is a training target
  once; datatrove folders (``datatrove_folder``) choose their own segments and stride. Windows ignore document
  boundaries; the end-of-document ids written by tokenization separate them.
* Each domain visits its windows in a fresh pseudo-random order every epoch (``permutation.permute``).
* Domains are blended by a fixed pattern of ``BLEND_PERIOD`` slots in which domain ``i`` owns ``count_i``
  slots, ``count_i / BLEND_PERIOD`` being its weight rounded to the period. The slots are spread evenly, so
  even a short run, or a single global batch, sees the requested proportions.
"""

import json
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from nanotron.data.permutation import permute
from nanotron.data.preprocess import FORMAT_VERSION, METADATA_FILE_NAME, DataError

__all__ = ["BLEND_PERIOD", "BlendedDataset", "DataError", "PretrainDataset", "SampleSource", "TokenShards",
           "TokenStream", "check_token_ids", "domain_name", "folder_list", "unique_domain_names"]

BLEND_PERIOD = 4096
# Permutation streams of different domains must not collide for any realistic number of epochs.
_STREAMS_PER_DOMAIN = 2**20
_REBUILD = "re-run `nanotron preprocess` to rebuild the folder"
_CORRUPT = f"the folder is corrupt; {_REBUILD}"
_IDS_CHECKED_AT_ONCE = 1 << 24  # tokens: bounds the memory of checking a shard's ids, whatever its size


def domain_name(folder: str | Path) -> str:
    """The name of a folder's domain (in metrics, and DoReMi's weights): its own name, also when given as ``.``."""
    return Path(os.path.abspath(folder)).name


def unique_domain_names(sources: Sequence[str | Path], names: Sequence[str] | None = None) -> list[str]:
    """The names of the domains read from ``sources`` (folders, or Hugging Face datasets' names), as metrics, the
    step line, DoReMi's weights and ``nanotron eval`` key them: ``names`` (default: each folder's own name,
    ``domain_name``) where they are unique; domains that share one are each named by the shortest end of its source's
    path that none of the others ends with (``a/web`` and ``b/web``). A source listed twice is refused."""
    paths = [Path(os.path.abspath(source)).parts for source in sources]
    unique = [domain_name(source) for source in sources] if names is None else list(names)
    sharing = defaultdict(list)
    for index, name in enumerate(unique):
        sharing[name].append(index)
    for indices in (indices for indices in sharing.values() if len(indices) > 1):
        for index in indices:
            path, others = paths[index], [paths[other] for other in indices if other != index]
            if path in others:
                raise DataError(f"the data stage lists {Path(*path)} twice; list it once (its weight sets its share)")
            depth = next(k for k in range(min(2, len(path)), len(path) + 1)
                         if all(other[-k:] != path[-k:] for other in others))
            unique[index] = str(Path(*path[-depth:]))
    return unique


def folder_list(folders: str | Path | Sequence[str | Path]) -> list[Path]:
    """One folder or several as a list of paths (iterating one path given as a str would yield its characters)."""
    if isinstance(folders, (str, Path)):
        folders = [folders]
    if not folders:
        raise DataError("dataset_folder is empty; list at least one folder")
    return [Path(folder) for folder in folders]


def check_token_ids(path: Path, tokens: np.ndarray, vocab_size: int, remedy: str, kind: str = "shard",
                    first: int = 0, vocabulary: str | None = None,
                    recorded_range: tuple[int, int] | None = None) -> None:
    """Refuse ``tokens`` (the ids of the ``kind`` file ``path`` from its token ``first`` on) if one lies outside
    ``[0, vocab_size)``, or outside the ``recorded_range`` (smallest, largest id; inside the vocabulary) that its
    metadata records: it would index past the embedding (an IndexError, or a device-side assert on a GPU) far from its
    cause. Reads the ids in chunks of bounded memory, a few GB/s from the page cache. ``vocabulary`` says whose
    ``vocab_size`` ids these are (default: the shard's tokenizer's); ``remedy`` ends the error: what is wrong and
    what to do."""
    lowest, highest = (0, vocab_size - 1) if recorded_range is None else recorded_range
    for start in range(0, len(tokens), _IDS_CHECKED_AT_ONCE):
        chunk = tokens[start:start + _IDS_CHECKED_AT_ONCE]
        if chunk.max() <= highest and ((lowest <= 0 and tokens.dtype.kind == "u") or chunk.min() >= lowest):
            continue
        position = int(np.flatnonzero((chunk < lowest) | (chunk > highest))[0])
        if recorded_range is None:
            outside = vocabulary or f"the vocabulary of its tokenizer ({vocab_size} ids)"
        else:
            outside = f"the range {lowest} to {highest} that {METADATA_FILE_NAME} records for it"
        raise DataError(f"{kind} {path} holds token id {chunk[position]} at token {first + start + position}, "
                        f"outside {outside}: {remedy}")


class TokenStream(Protocol):
    """What the blending code reads of one domain: its token stream, cut into segments that windows do not cross.
    A stream that records where its documents end (``DatatroveTokens``) also has ``document_ends(start, length)``, a
    boolean array marking the last token of each document, which a ``BlendedDataset`` that ``records_document_ends``
    reads."""

    folder: Path
    name: str
    num_tokens: int
    segment_lengths: tuple[int, ...]

    def read(self, start: int, length: int) -> np.ndarray: ...


class ConcatenatedArrays:
    """Token arrays (memory maps) read as one stream, the arrays following each other without a gap.

    Every piece read is checked against the ids its file may hold (``check_token_ids``: the vocabulary, or the range
    that the file's metadata records), a pass over tokens already in memory: a file changed after it was checked or
    its range recorded stops the run with one line naming it and the offset, not with an IndexError in the embedding.
    """

    folder: Path
    vocab_size: int

    def _concatenate(self, arrays: list[np.ndarray], files: list[Path], kind: str, id_remedy: str,
                     recorded_ranges: list[tuple[int, int] | None] | None = None) -> None:
        """``arrays`` are the tokens of ``files``; ``kind`` and ``id_remedy`` word the error of an id outside those
        of its file (``check_token_ids``), ``recorded_ranges`` the smallest and largest id of each file, if known."""
        self._tokens = arrays
        self._files, self._kind, self._id_remedy = files, kind, id_remedy
        self._recorded_ranges = recorded_ranges or [None] * len(arrays)
        self._shard_starts = np.cumsum([0] + [len(tokens) for tokens in arrays[:-1]])
        self.num_tokens = sum(len(tokens) for tokens in arrays)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the stream (crossing array boundaries), as int64."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) are outside {self.folder}, which holds "
                             f"{self.num_tokens} tokens")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            local_start = start + filled - int(self._shard_starts[shard])
            piece = self._tokens[shard][local_start:local_start + length - filled]
            check_token_ids(self._files[shard], piece, self.vocab_size, self._id_remedy, self._kind, local_start,
                            recorded_range=self._recorded_ranges[shard])
            out[filled:filled + len(piece)] = piece
            filled += len(piece)
            shard += 1
        return out


class TokenShards(ConcatenatedArrays):
    """One preprocessed folder, memory-mapped read-only, seen as a single token stream.

    Every token id is checked against the folder's vocabulary once, when the folder is opened, so that a corrupt or
    foreign shard is named before training starts, in the training process rather than in a data-loading worker. The
    check compares the id range that ``nanotron preprocess`` recorded for each shard with the vocabulary; only a shard
    without one is read (a few GB/s from the page cache). Each window read is then checked against that range
    (``ConcatenatedArrays``). ``ids_checked`` skips the check at opening for a folder already checked by this run
    (the copy a worker opens).
    """

    def __init__(self, folder: Path, ids_checked: bool = False):
        self.folder = Path(folder)
        self.name = domain_name(self.folder)
        metadata_file = self.folder / METADATA_FILE_NAME
        metadata = _read_metadata(metadata_file)
        try:
            tokenizer = metadata["tokenizer"]
            self.vocab_size = int(tokenizer["vocab_size"])
            self.eos_token_id = int(tokenizer["eos_token_id"])
            self.tokenizer_fingerprint = str(tokenizer["fingerprint"])
            self.tokenizer_name = tokenizer.get("name_or_path")
            recorded_tokens = int(metadata["num_tokens"])
            dtype = np.dtype(metadata["dtype"])
            if dtype.kind not in "iu":
                raise ValueError(f"dtype {dtype} is not an integer type")
            shards = [(shard["tokens"], int(shard["num_tokens"]), shard["documents"], int(shard["num_documents"]),
                       _recorded_id_range(shard)) for shard in metadata["shards"]]
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(f"{metadata_file} is malformed ({type(error).__name__}: {error}); {_REBUILD}") from None

        arrays = []
        for tokens_file, num_tokens, documents_file, num_documents, id_range in shards:
            arrays.append(self._open_array(tokens_file, dtype, num_tokens))
            if not ids_checked:
                self._check_ids(self.folder / tokens_file, arrays[-1], id_range)
            self._open_array(documents_file, np.dtype(np.int64), num_documents)
        self._concatenate(arrays, [self.folder / shard[0] for shard in shards], "shard", _CORRUPT,
                          [shard[4] for shard in shards])
        if self.num_tokens != recorded_tokens:
            raise DataError(f"{metadata_file} records {recorded_tokens} tokens but its shards hold "
                            f"{self.num_tokens}; {_REBUILD}")
        self.segment_lengths = (self.num_tokens,)  # shards continue each other: windows may cross them

    def _open_array(self, file_name: str, dtype: np.dtype, length: int) -> np.ndarray:
        path = self.folder / file_name
        if not path.is_file():
            raise DataError(f"shard {path} is missing; {_REBUILD}")
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as error:
            raise DataError(f"shard {path} is corrupt ({error}); {_REBUILD}") from None
        if array.dtype != dtype or array.shape != (length,):
            raise DataError(f"shard {path} holds {array.dtype}{list(array.shape)} but {METADATA_FILE_NAME} records "
                            f"{dtype}[{length}]; {_REBUILD}")
        return array

    def _check_ids(self, path: Path, tokens: np.ndarray, recorded_range: tuple[int, int] | None) -> None:
        """Refuse a shard holding an id outside ``[0, vocab_size)``: it would index past the embedding (an
        IndexError, or a device-side assert on a GPU) far from its cause.

        The ids are bounded by the shard's dtype, which cannot lie, and by the range its metadata records: when
        these bounds fit the vocabulary the shard is not read, which would cost every rank of every run a pass over
        the whole dataset (minutes from a network file system). Only a shard without a recorded range whose dtype
        does not fit the vocabulary is read.
        """
        lowest, highest = np.iinfo(tokens.dtype).min, np.iinfo(tokens.dtype).max
        if recorded_range is not None:
            lowest, highest = max(lowest, recorded_range[0]), min(highest, recorded_range[1])
        if lowest >= 0 and highest < self.vocab_size:
            return
        if recorded_range is not None:
            raise DataError(f"shard {path} holds token ids {recorded_range[0]} to {recorded_range[1]} as recorded "
                            f"in {METADATA_FILE_NAME}, outside the vocabulary of its tokenizer ({self.vocab_size} "
                            f"ids): {_CORRUPT}")
        self._check_ids_by_reading(path, tokens)

    def _check_ids_by_reading(self, path: Path, tokens: np.ndarray) -> None:
        """The check of a shard whose metadata records no id range."""
        check_token_ids(path, tokens, self.vocab_size, _CORRUPT)

    def __reduce__(self):
        # Reopen the memory maps in the receiving process (data-loading workers) instead of pickling the tokens;
        # their ids were checked when this copy opened them.
        return TokenShards, (self.folder, True)


def _recorded_id_range(shard: dict) -> tuple[int, int] | None:
    """The smallest and largest id of a shard, as ``nanotron preprocess`` records them; None for a folder written
    before it recorded them (its ids are checked by reading the shard)."""
    if "min_token_id" not in shard and "max_token_id" not in shard:
        return None
    return int(shard["min_token_id"]), int(shard["max_token_id"])


def _read_metadata(metadata_file: Path) -> dict:
    if not metadata_file.is_file():
        raise DataError(f"{metadata_file.parent} is not a preprocessed folder ({METADATA_FILE_NAME} is missing); "
                        f"create it with `nanotron preprocess`")
    try:
        metadata = json.loads(metadata_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{metadata_file} is not valid JSON ({error}); {_REBUILD}") from None
    version = metadata.get("format_version") if isinstance(metadata, dict) else None
    if version != FORMAT_VERSION:
        raise DataError(f"{metadata_file} has format_version {version} but this nanotron reads version "
                        f"{FORMAT_VERSION}; {_REBUILD}")
    return metadata


class SampleSource(Protocol):
    """What the loader and the trainer use of a data stage's samples (``BlendedDataset``, ``SyntheticDataset``), as
    ``data/sources.py`` builds them."""

    sequence_length: int
    vocab_size: int
    domain_names: list[str]
    domain_sources: list[str]  # what each domain is read from, for messages: a folder or a dataset as written
    weights: list[float]
    # Per domain, its samples in an epoch, and the tokens between the starts of neighbouring windows; None for an
    # endless stream (synthetic tokens)
    num_windows: list[int] | None
    window_stride: int | None
    eos_token_id: int | None  # the id that ends the documents of its tokens, where it is known
    # Per domain, the tokenizer its data records: by name and by fingerprint (None where the source does not say).
    tokenizer_names: list[str | None]
    tokenizer_fingerprints: list[str | None]
    # Whether ``samples`` also gives ``document_ends`` (bool, shaped like ``tokens``: True on the last token of every
    # document), the ends the source recorded, which document masking then reads instead of an end-of-document id.
    # A source of conversations (``sft.py``) also gives ``trained`` (bool, like ``tokens``): the tokens the loss counts.
    records_document_ends: bool

    def samples(self, indices: Sequence[int]) -> dict[str, torch.Tensor]: ...


class BlendedDataset:
    """The deterministic, infinite sample stream of one data stage, blended over token streams (its domains).

    A stream's windows start every ``window_stride`` tokens inside each of its segments: ``sequence_length`` (the
    default) makes neighbours share one token, ``sequence_length + 1`` makes them disjoint. ``weights`` defaults to
    the streams' token counts. Domain ids are positions in ``streams``; domains are named after the ``sources``
    they are read from (default: the streams' folders; ``unique_domain_names``), which ``domain_sources`` lists.
    """

    records_document_ends = False  # a subclass whose streams have ``document_ends`` may set it

    def __init__(self, streams: Sequence[TokenStream], weights: Sequence[float] | None, sequence_length: int,
                 seed: int, window_stride: int | None = None, sources: Sequence[str | Path] | None = None):
        check_sequence_length(sequence_length)
        window_stride = sequence_length if window_stride is None else window_stride
        if not 1 <= window_stride <= sequence_length + 1:
            raise ValueError(f"window_stride must lie in [1, sequence_length + 1], got {window_stride}")
        self.sequence_length = sequence_length
        self.window_stride = window_stride
        self.seed = seed
        self._streams = list(streams)
        sources = [stream.folder for stream in self._streams] if sources is None else sources
        self.domain_sources = [str(source) for source in sources]
        self.domain_names = unique_domain_names(sources, [stream.name for stream in self._streams])
        # Per domain: the first token of each segment and the index of its first window.
        self._segment_starts, self._segment_first_windows, self.num_windows = [], [], []
        for stream in self._streams:
            lengths = np.asarray(stream.segment_lengths, dtype=np.int64)
            windows = np.where(lengths > sequence_length, (lengths - sequence_length - 1) // window_stride + 1, 0)
            self._segment_starts.append(np.cumsum(lengths) - lengths)
            self._segment_first_windows.append(np.cumsum(windows) - windows)
            self.num_windows.append(int(windows.sum()))
            if windows.sum() == 0:
                in_files = f" in files of at most {lengths.max(initial=0)} tokens" if len(lengths) > 1 else ""
                raise DataError(f"{stream.folder} holds {stream.num_tokens} tokens{in_files}, fewer than one sample of "
                                f"sequence_length + 1 = {sequence_length + 1} tokens; add data to it or lower "
                                f"sequence_length")

        self._samples_per_period = _quantise(_validated_weights(weights, self._streams), BLEND_PERIOD)
        self.weights = (self._samples_per_period / BLEND_PERIOD).tolist()
        self._domain_of_slot, self._rank_of_slot = _interleave(self._samples_per_period)

    def sample(self, g: int) -> tuple[np.ndarray, int]:
        """Global sample ``g``: its ``sequence_length + 1`` tokens (int64) and its domain id."""
        domains, windows = self._locate([g])
        return self._read_window(int(domains[0]), int(windows[0])), int(domains[0])

    def samples(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The samples ``indices`` stacked: ``tokens`` [n, sequence_length + 1] and ``domain_ids`` [n], int64; with
        ``records_document_ends``, ``document_ends`` too (bool, like ``tokens``)."""
        domains, windows = self._locate(indices)
        tokens = np.empty((len(domains), self.sequence_length + 1), dtype=np.int64)
        for row, (domain, window) in enumerate(zip(domains.tolist(), windows.tolist())):
            tokens[row] = self._read_window(domain, window)
        batch = {"tokens": torch.from_numpy(tokens), "domain_ids": torch.from_numpy(domains)}
        if self.records_document_ends:
            batch["document_ends"] = torch.from_numpy(np.stack([
                self._streams[domain].document_ends(self._window_start(domain, window), self.sequence_length + 1)
                for domain, window in zip(domains.tolist(), windows.tolist())]))
        return batch

    def _locate(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Domain id and window index of each global sample index, vectorised over the indices."""
        g = np.asarray(indices, dtype=np.int64).reshape(-1)
        if g.size and g.min() < 0:
            raise IndexError(f"sample indices start at 0, got {g.min()}")
        period, slot = np.divmod(g, BLEND_PERIOD)
        domains = self._domain_of_slot[slot]
        index_in_domain = period * self._samples_per_period[domains] + self._rank_of_slot[slot]
        epochs, positions = np.divmod(index_in_domain, np.asarray(self.num_windows, dtype=np.int64)[domains])
        windows = np.empty_like(positions)
        for domain, epoch in np.unique(np.stack([domains, epochs], axis=1), axis=0).tolist():
            selected = (domains == domain) & (epochs == epoch)
            windows[selected] = permute(positions[selected], self.num_windows[domain], self.seed,
                                        stream=domain * _STREAMS_PER_DOMAIN + epoch)
        return domains, windows

    def _read_window(self, domain: int, window: int) -> np.ndarray:
        return self._streams[domain].read(self._window_start(domain, window), self.sequence_length + 1)

    def _window_start(self, domain: int, window: int) -> int:
        """The first token of a domain's window in its stream."""
        first_windows = self._segment_first_windows[domain]
        segment = int(np.searchsorted(first_windows, window, side="right")) - 1
        # Empty segments share their first window with the next one; searchsorted lands on the last of them.
        return int(self._segment_starts[domain][segment]) + (window - int(first_windows[segment])) * self.window_stride


def check_sequence_length(sequence_length: int) -> None:
    if sequence_length < 1:
        raise DataError(f"sequence_length must be at least 1, got {sequence_length}")


class PretrainDataset(BlendedDataset):
    """The sample stream of preprocessed folders (``nanotron preprocess``): windows of ``sequence_length + 1``
    tokens with stride ``sequence_length``, neighbours sharing one token.

    ``weights`` defaults to the folders' token counts. Domain ids are positions in ``folders``; ``sources`` are what
    they were made from, if not themselves (``BlendedDataset``). A folder may be given opened, as a stream of the
    same attributes as ``TokenShards`` (a pre-tokenized dataset's ``ArrowTokens``, which records no tokenizer).
    """

    def __init__(self, folders: Sequence[Path | ConcatenatedArrays], weights: Sequence[float] | None,
                 sequence_length: int, seed: int, sources: Sequence[str | Path] | None = None):
        check_sequence_length(sequence_length)
        listed = [folders] if isinstance(folders, (str, Path)) else list(folders)
        shards = [folder if isinstance(folder, ConcatenatedArrays) else TokenShards(Path(folder))
                  for folder in listed or folder_list(listed)]
        self.vocab_size = max(folder.vocab_size for folder in shards)
        # one tokenizer (checked below), so one end-of-document id
        self.eos_token_id = next((folder.eos_token_id for folder in shards if folder.eos_token_id is not None), None)
        self.tokenizer_fingerprints = [folder.tokenizer_fingerprint for folder in shards]
        self.tokenizer_names = [folder.tokenizer_name for folder in shards]
        if len(set(self.tokenizer_fingerprints) - {None}) > 1:
            raise DataError("the folders of dataset_folder were tokenized with different tokenizers ("
                            + ", ".join(f"{folder.folder}: {folder.tokenizer_fingerprint[:12]}" for folder in shards)
                            + "); preprocess them all with the same tokenizer")
        super().__init__(shards, weights, sequence_length, seed, sources=sources)


def _validated_weights(weights: Sequence[float] | None, shards: Sequence[TokenStream]) -> np.ndarray:
    if weights is None:
        return np.array([folder.num_tokens for folder in shards], dtype=np.float64)
    if len(weights) != len(shards):
        raise DataError(f"dataset_weights has {len(weights)} values but dataset_folder has {len(shards)} folders; "
                        f"give one weight per folder")
    values = np.array(weights, dtype=np.float64)
    if not np.all(np.isfinite(values) & (values > 0)):
        raise DataError(f"dataset_weights must all be positive numbers, got {list(weights)}")
    return values


def _quantise(weights: np.ndarray, period: int) -> np.ndarray:
    """Integer slot counts summing to ``period``, proportional to ``weights`` (largest-remainder method).

    Every domain keeps at least one slot, so a small but positive weight is never rounded away.
    """
    if len(weights) > period:
        raise DataError(f"dataset_folder lists {len(weights)} folders; at most {period} can be blended")
    exact = weights / weights.sum() * period
    counts = np.maximum(np.floor(exact).astype(np.int64), 1)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - np.floor(exact[i])), i))
    surplus = period - int(counts.sum())
    for domain in by_remainder[:max(surplus, 0)]:
        counts[domain] += 1
    while surplus < 0:  # the one-slot minimum overshot: take back from the smallest remainders
        for domain in reversed(by_remainder):
            if surplus < 0 and counts[domain] > 1:
                counts[domain] -= 1
                surplus += 1
    return counts


def _interleave(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Spread ``counts[i]`` slots of each domain ``i`` evenly over one period (smooth weighted round robin).

    Each slot goes to the domain furthest behind its share, ``counts[i] * (slot + 1) / period - taken[i]``
    (ties to the lowest id); each domain ends the period with exactly ``counts[i]`` slots. Returns, per slot,
    the domain and the number of earlier slots of the same domain.
    """
    period = int(counts.sum())
    credit = [0] * len(counts)  # period * (share so far - slots taken), in integers to keep ties exact
    taken = [0] * len(counts)
    domain_of_slot = np.empty(period, dtype=np.int64)
    rank_of_slot = np.empty(period, dtype=np.int64)
    for slot in range(period):
        credit = [value + int(count) for value, count in zip(credit, counts)]
        domain = credit.index(max(credit))
        credit[domain] -= period
        domain_of_slot[slot], rank_of_slot[slot] = domain, taken[domain]
        taken[domain] += 1
    return domain_of_slot, rank_of_slot
