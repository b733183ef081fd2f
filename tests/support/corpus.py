"""The tiny corpus the tests train on, and data as upstream users hold it: datatrove-tokenized folders and
preprocessed folders written before shards recorded their id ranges."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

WORDS = (
    "the a one every small large red green blue old new quick slow cat dog bird fish tree river stone house "
    "runs jumps sleeps eats sees finds makes takes near under over behind with without and but then so"
).split()


def write_corpus(folder: Path, documents: int = 400, seed: int = 0) -> Path:
    """JSONL of simple, repetitive sentences: enough structure for a tiny model to learn within a few steps."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.jsonl"
    lines = []
    for i in range(documents):
        sentences = [
            " ".join(rng.choice(WORDS[:16]) for _ in range(2)) + " " + rng.choice(WORDS[16:26]) + " "
            + rng.choice(WORDS[26:34]) + " the " + rng.choice(WORDS[16:26]) + "."
            for _ in range(rng.randint(3, 8))
        ]
        lines.append(json.dumps({"id": str(i), "text": " ".join(sentences)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def corpus_documents(corpus: Path) -> list[str]:
    return [json.loads(line)["text"] for line in corpus.read_text().splitlines()]


def datatrove_folder(folder: Path, documents: list[str], tokenizer: Path, **options) -> Path:
    """``documents`` tokenized by datatrove's DocumentTokenizer, as upstream users write their data (each followed by
    the end-of-document token unless ``eos_token=None``)."""
    pytest.importorskip("datatrove", reason='datatrove writes the .ds fixtures; pip install -e ".[test]"')
    from datatrove.data import Document
    from datatrove.pipeline.tokens import DocumentTokenizer

    options = {"eos_token": "<|endoftext|>"} | options
    step = DocumentTokenizer(output_folder=str(folder), tokenizer_name_or_path=str(tokenizer), **options)
    step.run(iter(Document(text=text, id=str(i)) for i, text in enumerate(documents)), rank=0, world_size=1)
    return folder


def without_id_ranges(metadata: dict) -> dict:
    """``metadata`` as a version of ``nanotron preprocess`` that recorded no id range would have written it."""
    return metadata | {"shards": [{key: value for key, value in shard.items()
                                   if key not in ("min_token_id", "max_token_id")} for shard in metadata["shards"]]}


def pretokenized_domains(folder: Path, domains: dict[str, list[str]], tokenizer: Path, sequence_length: int,
                         dtype: str = "int32") -> Path:
    """Each domain's documents tokenized (each followed by its end-of-document id), cut into rows of
    ``sequence_length + 1`` ids and saved by ``datasets``' ``save_to_disk`` under ``folder/<domain name>`` with its
    ``domain_ids``: the layout and columns of upstream's DoReMi datasets (examples/doremi)."""
    datasets = pytest.importorskip("datasets", reason='save_to_disk writes them; pip install -e ".[data]"')
    from nanotron.data.tokenizer import eos_token_id, load_tokenizer

    datasets.disable_progress_bars()
    loaded = load_tokenizer(tokenizer)
    end, width = eos_token_id(loaded), sequence_length + 1
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value(dtype)),
                                  "domain_ids": datasets.Value("int64")})
    for index, (name, documents) in enumerate(domains.items()):
        ids = [token for text in documents for token in loaded.encode(text).ids + [end]]
        rows = [ids[start:start + width] for start in range(0, len(ids) - width + 1, width)]
        datasets.Dataset.from_dict({"input_ids": rows, "domain_ids": [index] * len(rows)},
                                   features=features).save_to_disk(folder / name)
    return folder
