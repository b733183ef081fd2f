"""Preprocessing, preprocessed folders, the blended sample stream and the data-parallel loader (nanotron.data)."""

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanotron.data import preprocess as preprocess_module
from nanotron.data.dataset import BLEND_PERIOD, DataError, PretrainDataset, TokenShards, unique_domain_names
from nanotron.data.loader import MicroBatchLoader, global_batch_indices, rank_micro_batches
from nanotron.data.permutation import permute
from nanotron.data.preprocess import iter_documents, list_input_files, preprocess
from nanotron.data.tokenizer import load_tokenizer, tokenizer_fingerprint, train_tokenizer
from support.processes import running

PROSE = "the model reads a long stream of tokens and learns to predict the next one from every page".split()
CODE = "def return import class self value list index yield lambda none true false assert".split()
MATH = "sum of two primes equals even number proof lemma theorem integral limit zero one".split()
TOKENS_PER_SHARD = 1000


def _documents(words: list[str], count: int, seed: int) -> list[str]:
    """``count`` documents of one to eight sentences assembled from ``words``."""
    rng = random.Random(seed)
    sentence = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(3, 10))).capitalize() + "."  # noqa: E731
    return [" ".join(sentence() for _ in range(rng.randint(1, 8))) for _ in range(count)]


def _write_jsonl(path: Path, documents: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: document, "id": i}) + "\n" for i, document in enumerate(documents)))
    return path


def _stream(folder: Path) -> np.ndarray:
    metadata = json.loads((folder / "metadata.json").read_text())
    return np.concatenate([np.load(folder / shard["tokens"]) for shard in metadata["shards"]])


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    corpus = _write_jsonl(folder / "corpus.jsonl", _documents(PROSE + CODE + MATH, 300, seed=0))
    return train_tokenizer([corpus], vocab_size=400, output=folder / "tokenizer.json")


@pytest.fixture(scope="module")
def prose_documents() -> list[str]:
    return _documents(PROSE, 150, seed=1)


@pytest.fixture(scope="module")
def domains(tmp_path_factory, tokenizer_file, prose_documents) -> list[Path]:
    """Three preprocessed folders of different sizes and vocabularies: prose (several shards), code, math."""
    inputs = tmp_path_factory.mktemp("inputs")
    output = tmp_path_factory.mktemp("preprocessed")
    folders = []
    for name, documents in (("prose", prose_documents), ("code", _documents(CODE, 60, seed=2)),
                            ("math", _documents(MATH, 40, seed=3))):
        source = _write_jsonl(inputs / f"{name}.jsonl", documents)
        preprocess([source], tokenizer_file, output / name, num_workers=1, tokens_per_shard=TOKENS_PER_SHARD)
        folders.append(output / name)
    return folders


# --------------------------------------------------------------------------------------------- preprocessing


def test_every_document_is_followed_by_eos_and_offsets_are_recorded(domains, tokenizer_file, prose_documents):
    folder = domains[0]
    tokenizer = load_tokenizer(tokenizer_file)
    encoded = [tokenizer.encode(document, add_special_tokens=False).ids + [0] for document in prose_documents]
    metadata = json.loads((folder / "metadata.json").read_text())

    assert metadata["format_version"] == 1
    assert metadata["tokenizer"] == {"name_or_path": str(tokenizer_file), "vocab_size": 400, "eos_token_id": 0,
                                     "fingerprint": tokenizer_fingerprint(tokenizer)}
    assert metadata["dtype"] == "uint16"
    assert metadata["num_documents"] == len(prose_documents)
    assert metadata["num_tokens"] == sum(map(len, encoded))
    assert metadata["inputs"][0].endswith("prose.jsonl")

    shards = metadata["shards"]
    assert len(shards) >= 3
    assert [shard["num_tokens"] for shard in shards[:-1]] == [TOKENS_PER_SHARD] * (len(shards) - 1)
    assert [shard["tokens"] for shard in shards[:2]] == ["tokens-00000.npy", "tokens-00001.npy"]
    stream = _stream(folder)
    assert stream.dtype == np.uint16
    assert stream.tolist() == [token for ids in encoded for token in ids]

    ends = [np.load(folder / shard["documents"]) for shard in shards]
    assert all(end.dtype == np.int64 for end in ends)
    assert [len(end) for end in ends] == [shard["num_documents"] for shard in shards]
    for index, (end, shard) in enumerate(zip(ends, shards)):  # each shard records the documents that end inside it
        shard_start = index * TOKENS_PER_SHARD
        assert np.all((end > shard_start) & (end <= shard_start + shard["num_tokens"]))
    all_ends = np.concatenate(ends)
    assert all_ends.tolist() == np.cumsum([len(ids) for ids in encoded]).tolist()
    assert np.all(stream[all_ends - 1] == 0)


@pytest.mark.slow
def test_output_is_byte_identical_for_any_worker_count(domains, tokenizer_file, tmp_path, monkeypatch):
    reference = domains[0]
    source = json.loads((reference / "metadata.json").read_text())["inputs"]
    monkeypatch.setattr(preprocess_module, "_BATCH_DOCUMENTS", 7)  # many batches, so the workers interleave
    preprocess(source, tokenizer_file, tmp_path / "parallel", num_workers=2, tokens_per_shard=TOKENS_PER_SHARD)
    names = sorted(path.name for path in reference.iterdir())
    assert sorted(path.name for path in (tmp_path / "parallel").iterdir()) == names
    for name in names:
        assert (tmp_path / "parallel" / name).read_bytes() == (reference / name).read_bytes(), name


def test_refuses_a_non_empty_output_folder_but_fills_an_empty_one(tokenizer_file, tmp_path):
    source = _write_jsonl(tmp_path / "source.jsonl", ["one document", "another"])
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("precious")
    with pytest.raises(DataError, match=f"output folder {taken} already exists and is not empty; choose another "
                                        f"--output-folder or delete it"):
        preprocess([source], tokenizer_file, taken, num_workers=1)
    assert [path.name for path in taken.iterdir()] == ["keep.txt"]

    empty = tmp_path / "empty"
    empty.mkdir()
    metadata = preprocess([source], tokenizer_file, empty, num_workers=1)
    assert metadata["num_documents"] == 2
    assert json.loads((empty / "metadata.json").read_text()) == metadata


def test_jsonl_line_without_the_text_key_names_file_and_line_and_leaves_nothing(tokenizer_file, tmp_path):
    source = tmp_path / "broken.jsonl"
    source.write_text('{"text": "fine"}\n\n{"content": "wrong key"}\n')
    output = tmp_path / "out" / "folder"
    with pytest.raises(DataError, match=f"{source}, line 3: no 'text' key; pass the key that holds the text "
                                        f"with --text-key"):
        preprocess([source], tokenizer_file, output, num_workers=1)
    assert list((tmp_path / "out").iterdir()) == []  # neither the folder nor its hidden staging sibling

    with pytest.raises(DataError, match="line 1: no 'content' key"):
        list(iter_documents(source, text_key="content"))


def test_text_key_selects_the_field(tokenizer_file, tmp_path):
    source = _write_jsonl(tmp_path / "content.jsonl", ["alpha beta", "gamma"], key="content")
    assert list(iter_documents(source, text_key="content")) == ["alpha beta", "gamma"]
    metadata = preprocess([source], tokenizer_file, tmp_path / "out", text_key="content", num_workers=1)
    assert metadata["num_documents"] == 2


def test_parquet_input_gives_the_same_tokens_as_jsonl(tokenizer_file, tmp_path):
    documents = _documents(MATH, 30, seed=4)
    pq.write_table(pa.table({"text": documents, "id": list(range(30))}), tmp_path / "part.parquet")
    _write_jsonl(tmp_path / "part.jsonl", documents)
    assert list(iter_documents(tmp_path / "part.parquet")) == documents
    preprocess([tmp_path / "part.parquet"], tokenizer_file, tmp_path / "from_parquet", num_workers=1)
    preprocess([tmp_path / "part.jsonl"], tokenizer_file, tmp_path / "from_jsonl", num_workers=1)
    assert np.array_equal(_stream(tmp_path / "from_parquet"), _stream(tmp_path / "from_jsonl"))
    with pytest.raises(DataError, match=r"part.parquet has no column 'body' \(columns: text, id\)"):
        list(iter_documents(tmp_path / "part.parquet", text_key="body"))


def test_a_txt_file_is_one_document_even_with_blank_lines(tokenizer_file, tmp_path):
    text = "First paragraph.\n\nSecond paragraph.\n\n\nThird."
    (tmp_path / "book.txt").write_text(text)
    assert list(iter_documents(tmp_path / "book.txt")) == [text]
    metadata = preprocess([tmp_path / "book.txt"], tokenizer_file, tmp_path / "out", num_workers=1)
    assert metadata["num_documents"] == 1
    expected = load_tokenizer(tokenizer_file).encode(text, add_special_tokens=False).ids + [0]
    assert _stream(tmp_path / "out").tolist() == expected


def test_list_input_files_expands_directories_in_sorted_order(tmp_path):
    (tmp_path / "b.jsonl").write_text("")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.txt").write_text("")
    (tmp_path / "a" / "notes.csv").write_text("")
    (tmp_path / "c.parquet").write_text("")
    assert list_input_files([tmp_path]) == [tmp_path / "a" / "z.txt", tmp_path / "b.jsonl", tmp_path / "c.parquet"]
    assert list_input_files([tmp_path / "b.jsonl", tmp_path / "a"]) == [tmp_path / "b.jsonl", tmp_path / "a" / "z.txt"]
    with pytest.raises(DataError, match=f"input {tmp_path / 'missing'} does not exist"):
        list_input_files([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=f"input directory {tmp_path / 'empty'} contains no"):
        list_input_files([tmp_path / "empty"])
    with pytest.raises(DataError, match="notes.csv has an unsupported format"):
        list_input_files([tmp_path / "a" / "notes.csv"])


# --------------------------------------------------------------------------------------------- token shards


def test_token_shards_read_across_shard_boundaries(domains, tokenizer_file):
    shards = TokenShards(domains[0])
    stream = _stream(domains[0]).astype(np.int64)
    assert (shards.num_tokens, shards.vocab_size, shards.eos_token_id, shards.name) == (len(stream), 400, 0, "prose")
    assert shards.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(tokenizer_file))
    for start, length in ((0, 10), (995, 10), (990, 2100), (TOKENS_PER_SHARD, 0), (len(stream) - 5, 5)):
        span = shards.read(start, length)
        assert span.dtype == np.int64
        assert np.array_equal(span, stream[start:start + length]), (start, length)
    with pytest.raises(IndexError):
        shards.read(len(stream) - 5, 6)


def test_corrupt_or_missing_shards_are_named(domains, tmp_path):
    broken = tmp_path / "prose"
    shutil.copytree(domains[0], broken)
    with (broken / "tokens-00001.npy").open("r+b") as file:
        file.truncate(200)
    with pytest.raises(DataError, match=r"tokens-00001.npy is corrupt .*re-run `nanotron preprocess`"):
        TokenShards(broken)
    (broken / "tokens-00001.npy").unlink()
    with pytest.raises(DataError, match=r"tokens-00001.npy is missing; re-run `nanotron preprocess`"):
        TokenShards(broken)
    with pytest.raises(DataError, match=f"{tmp_path} is not a preprocessed folder"):
        TokenShards(tmp_path)


# --------------------------------------------------------------------------------------------- sample stream


def _windows(folder: Path, sequence_length: int) -> dict[bytes, int]:
    """Window contents -> window index, for recognising which window a sample is."""
    stream = _stream(folder).astype(np.int64)
    count = (len(stream) - 1) // sequence_length
    windows = {stream[w * sequence_length:w * sequence_length + sequence_length + 1].tobytes(): w
               for w in range(count)}
    assert len(windows) == count  # all windows distinct, so the lookup is unambiguous
    return windows


def test_each_epoch_visits_every_window_once_in_a_fresh_order(domains):
    dataset = PretrainDataset(domains[:1], None, sequence_length=16, seed=0)
    windows = _windows(domains[0], 16)
    num_windows = len(windows)
    assert dataset.num_windows == [num_windows]
    order = []
    for g in range(3 * num_windows):
        tokens, domain = dataset.sample(g)
        assert domain == 0 and tokens.dtype == np.int64 and tokens.shape == (17,)
        order.append(windows[tokens.tobytes()])
    epochs = [order[e * num_windows:(e + 1) * num_windows] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(num_windows))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != sorted(epochs[0])


def test_sample_order_depends_on_the_seed_only(domains):
    first = PretrainDataset(domains, [1, 1, 1], sequence_length=16, seed=7).samples(range(64))
    again = PretrainDataset(domains, [1, 1, 1], sequence_length=16, seed=7).samples(range(64))
    other = PretrainDataset(domains, [1, 1, 1], sequence_length=16, seed=8).samples(range(64))
    assert torch.equal(first["tokens"], again["tokens"]) and torch.equal(first["domain_ids"], again["domain_ids"])
    assert not torch.equal(first["tokens"], other["tokens"])
    assert torch.equal(first["domain_ids"], other["domain_ids"])  # the blend pattern does not depend on the seed


def test_any_sample_is_computed_directly(domains):
    iterated = PretrainDataset(domains, [0.5, 0.3, 0.2], sequence_length=16, seed=1).samples(range(400))
    fresh = PretrainDataset(domains, [0.5, 0.3, 0.2], sequence_length=16, seed=1)
    for g in (399, 0, 123, 200):
        tokens, domain = fresh.sample(g)
        assert np.array_equal(tokens, iterated["tokens"][g].numpy()) and domain == iterated["domain_ids"][g]

    start = time.perf_counter()
    tokens, domain = fresh.sample(10**12)
    assert time.perf_counter() - start < 0.05
    assert tokens.tobytes() in _windows(domains[domain], 16)


def test_blend_follows_the_quantised_weights_and_labels_every_domain(domains):
    dataset = PretrainDataset(domains, [0.5, 0.3, 0.2], sequence_length=8, seed=3)
    counts = np.array([2048, 1229, 819])  # 0.3 * 4096 = 1228.8 takes the one slot left after flooring
    assert dataset.weights == (counts / BLEND_PERIOD).tolist()
    assert dataset.domain_names == ["prose", "code", "math"]

    periods = 3
    batch = dataset.samples(range(periods * BLEND_PERIOD))
    domain_ids = batch["domain_ids"].numpy()
    assert np.bincount(domain_ids).tolist() == (periods * counts).tolist()
    taken = np.cumsum(np.eye(3, dtype=np.int64)[domain_ids], axis=0)
    expected = np.outer(np.arange(1, len(domain_ids) + 1), counts / BLEND_PERIOD)
    assert np.abs(taken - expected).max() < 1  # smooth: every prefix is within one sample of its share

    windows = [_windows(folder, 8) for folder in domains]
    for tokens, domain in zip(batch["tokens"].numpy(), domain_ids):
        assert tokens.tobytes() in windows[domain]


def test_folders_of_one_name_are_domains_named_by_the_end_of_their_paths(domains, tmp_path):
    for parent in ("a", "b", "c/a"):
        (tmp_path / parent).mkdir(parents=True)
        shutil.copytree(domains[1], tmp_path / parent / "web")
    folders = [tmp_path / "a" / "web", domains[0], tmp_path / "b" / "web", tmp_path / "c" / "a" / "web"]
    assert PretrainDataset(folders, None, 8, seed=3).domain_names == [f"{tmp_path.name}/a/web", "prose", "b/web",
                                                                      "c/a/web"]  # a/web ends c/a/web too
    assert unique_domain_names(["a/web", "b/web", "code"]) == ["a/web", "b/web", "code"]
    with pytest.raises(DataError, match=f"the data stage lists {tmp_path / 'a' / 'web'} twice; list it once"):
        PretrainDataset([folders[0], tmp_path / "b" / ".." / "a" / "web"], None, 8, seed=3)


def test_default_weights_follow_token_counts_and_small_weights_keep_a_slot(domains):
    tokens = np.array([TokenShards(folder).num_tokens for folder in domains])
    dataset = PretrainDataset(domains, None, sequence_length=8, seed=0)
    assert np.allclose(dataset.weights, tokens / tokens.sum(), atol=1 / BLEND_PERIOD)
    tiny = PretrainDataset(domains[:2], [1.0, 1e-9], sequence_length=8, seed=0)
    assert tiny.weights == [4095 / BLEND_PERIOD, 1 / BLEND_PERIOD]


def test_dataset_configuration_errors(domains, tokenizer_file, tmp_path):
    with pytest.raises(DataError, match="dataset_weights has 2 values but dataset_folder has 3 folders"):
        PretrainDataset(domains, [0.5, 0.5], sequence_length=8, seed=0)
    with pytest.raises(DataError, match="dataset_weights must all be positive"):
        PretrainDataset(domains, [0.5, 0.0, 0.5], sequence_length=8, seed=0)

    _write_jsonl(tmp_path / "short.jsonl", ["Tiny."])
    metadata = preprocess([tmp_path / "short.jsonl"], tokenizer_file, tmp_path / "short", num_workers=1)
    with pytest.raises(DataError, match=f"{tmp_path / 'short'} holds {metadata['num_tokens']} tokens, fewer than "
                                        f"one sample of sequence_length \\+ 1 = 17"):
        PretrainDataset([domains[0], tmp_path / "short"], None, sequence_length=16, seed=0)

    other_tokenizer = train_tokenizer([tmp_path / "short.jsonl"], vocab_size=300, output=tmp_path / "other.json")
    preprocess([tmp_path / "short.jsonl"], other_tokenizer, tmp_path / "other", num_workers=1)
    with pytest.raises(DataError, match="tokenized with different tokenizers"):
        PretrainDataset([tmp_path / "short", tmp_path / "other"], None, sequence_length=1, seed=0)


def test_permutation_is_a_seeded_bijection():
    for n in (1, 2, 7, 1000, 65537):
        order = permute(np.arange(n), n, seed=0, stream=0)
        assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(n))
    base = permute(np.arange(1000), 1000, seed=0, stream=0)
    assert not np.array_equal(base, permute(np.arange(1000), 1000, seed=1, stream=0))
    assert not np.array_equal(base, permute(np.arange(1000), 1000, seed=0, stream=1))
    assert np.any(np.diff(base) < 0) and np.any(np.diff(base) > 0)  # neither sorted nor reversed
    assert abs(np.corrcoef(np.arange(1000), base)[0, 1]) < 0.1
    assert permute(5, 1000, seed=0, stream=0) == base[5]
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 1000\)"):
        permute(1000, 1000, seed=0, stream=0)


# --------------------------------------------------------------------------------------------- loader


def _loader(dataset, **overrides) -> MicroBatchLoader:
    options = dict(first_sample=5, start_step=0, micro_batch_size=2, accumulation=2, dp_rank=0, dp_size=2)
    return MicroBatchLoader(dataset, **{**options, **overrides})


def test_rank_micro_batches_split_the_global_batch_contiguously():
    indices = global_batch_indices(step=3, first_sample=10, global_batch_size=8)
    assert indices == range(34, 42)
    assert rank_micro_batches(indices, dp_rank=1, dp_size=2, micro_batch_size=2, accumulation=2) == [range(38, 40),
                                                                                                      range(40, 42)]
    with pytest.raises(DataError, match="cannot be split into dp_size 2 x micro_batch_size 2 x accumulation 3"):
        rank_micro_batches(indices, dp_rank=0, dp_size=2, micro_batch_size=2, accumulation=3)


@pytest.fixture(scope="module")
def blend(domains) -> PretrainDataset:
    return PretrainDataset(domains, [0.6, 0.4, 0.2], sequence_length=16, seed=5)


@pytest.mark.parametrize("dp_size, micro_batch_size, accumulation", [(1, 4, 2), (2, 2, 2), (4, 1, 2), (4, 2, 1)])
def test_ranks_together_train_on_the_global_batch_whatever_the_layout(blend, dp_size, micro_batch_size, accumulation):
    loaders = [_loader(blend, micro_batch_size=micro_batch_size, accumulation=accumulation, dp_rank=rank,
                       dp_size=dp_size) for rank in range(dp_size)]
    for step in range(3):
        micro_batches = [batch for loader in loaders for batch in loader.next_step()]
        assert len(micro_batches) == dp_size * accumulation
        expected = blend.samples(global_batch_indices(step, first_sample=5, global_batch_size=8))
        input_ids = torch.cat([batch.input_ids for batch in micro_batches])
        labels = torch.cat([batch.labels for batch in micro_batches])
        assert micro_batches[0].input_ids.shape == (micro_batch_size, 16)
        assert input_ids.dtype == labels.dtype == torch.int64
        assert torch.equal(input_ids, expected["tokens"][:, :-1])
        assert torch.equal(labels, expected["tokens"][:, 1:])
        assert torch.equal(torch.cat([batch.domain_ids for batch in micro_batches]), expected["domain_ids"])
        assert all(batch.label_mask.dtype == torch.bool and batch.label_mask.all() for batch in micro_batches)
    assert loaders[0].step == 3


def test_loader_resumes_at_any_step_and_workers_change_nothing(blend):
    from_start = _loader(blend, dp_rank=1)
    steps = [from_start.next_step() for _ in range(4)]
    resumed = _loader(blend, dp_rank=1, start_step=2)
    with_workers = _loader(blend, dp_rank=1, start_step=2, num_workers=2)
    for step in (2, 3):
        for expected, plain, loaded in zip(steps[step], resumed.next_step(), with_workers.next_step()):
            for key in ("input_ids", "labels", "label_mask", "domain_ids"):
                assert torch.equal(getattr(plain, key), getattr(expected, key)), key
                assert torch.equal(getattr(loaded, key), getattr(expected, key)), key


# Started as a fresh process: a loader with a worker, left open by an exception, prints the worker's process id.
_LOADER_LEFT_OPEN = """
import multiprocessing
from nanotron.data.loader import MicroBatchLoader
from nanotron.data.synthetic import SyntheticDataset

loader = MicroBatchLoader(SyntheticDataset(64, 8, seed=0), first_sample=0, start_step=0, micro_batch_size=2,
                          accumulation=1, dp_rank=0, dp_size=1, num_workers=1)
loader.next_step()
print(*(child.pid for child in multiprocessing.active_children()), flush=True)
raise RuntimeError("an error with the loader open")
"""


@pytest.mark.slow
def test_a_loader_left_open_by_an_error_lets_the_process_exit(tmp_path):
    """Its worker ignores SIGTERM, with which the interpreter's exit ends daemon processes before waiting for them:
    the process used to wait for it forever."""
    try:
        done = subprocess.run([sys.executable, "-c", _LOADER_LEFT_OPEN], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit within 60 s")
    assert done.returncode == 1 and "RuntimeError: an error with the loader open" in done.stderr, done.stderr
    (worker,) = map(int, done.stdout.split())
    assert not running(worker)
