"""Tokenizer loading, training and identity (nanotron.data.tokenizer): data or initial weights of another tokenizer
refused unless ``checkpoints.allow_tokenizer_change``."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from nanotron.data.dataset import DataError
from nanotron.data.tokenizer import (
    EOS_TOKEN,
    TokenizerError,
    eos_token_id,
    load_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
)
from support.configs import folder_stage, short_config, write_config
from support.corpus import write_corpus
from support.runs import (
    assert_user_error,
    cli,
    python_process,
    train_through_cli,
)

WORDS = ("the model reads a long stream of tokens and learns to predict the next one from every shard of data "
         "while each rank trains on its own window of the global batch with a small learning rate").split()


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A folder with a .jsonl file and a nested .txt file of English-like text."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    with (folder / "documents.jsonl").open("w") as file:
        for _ in range(200):
            file.write(json.dumps({"text": " ".join(_sentence(rng) for _ in range(5))}) + "\n")
    (folder / "notes").mkdir()
    (folder / "notes" / "story.txt").write_text("\n\n".join(_sentence(rng) for _ in range(50)))
    return folder


@pytest.fixture(scope="module")
def tokenizer_file(corpus, tmp_path_factory) -> Path:
    return train_tokenizer([corpus], vocab_size=400, output=tmp_path_factory.mktemp("tokenizer"))


def test_train_writes_tokenizer_json_into_an_output_directory(tokenizer_file):
    assert tokenizer_file.name == "tokenizer.json"
    assert [path.name for path in tokenizer_file.parent.iterdir()] == ["tokenizer.json"]  # no temporary left
    tokenizer = load_tokenizer(tokenizer_file)
    assert tokenizer.get_vocab_size() == 400
    assert "Ġmodel" in tokenizer.get_vocab()  # a frequent word became one byte-level token


def test_training_is_deterministic(corpus, tokenizer_file, tmp_path):
    again = train_tokenizer([corpus], vocab_size=400, output=tmp_path / "again.json")
    assert again == tmp_path / "again.json"
    assert hashlib.sha256(again.read_bytes()).hexdigest() == hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()


def test_encode_decode_round_trip(tokenizer_file):
    tokenizer = load_tokenizer(tokenizer_file)
    text = "The model reads  tokens.\n\nÜnïcode — 日本語 🙂\tand unseen wörds like zyzzyva!"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text
    common = "the model reads a long stream of tokens"
    assert len(tokenizer.encode(common).ids) < len(common.encode()) / 2


def test_eos_token_is_the_first_special_token(tokenizer_file):
    tokenizer = load_tokenizer(tokenizer_file)
    assert eos_token_id(tokenizer) == 0
    assert tokenizer.id_to_token(0) == EOS_TOKEN


def test_eos_token_id_follows_the_candidate_order():
    llama_like = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "<eos>": 3}, unk_token="<unk>"))
    assert eos_token_id(llama_like) == 2
    without_eos = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    with pytest.raises(TokenizerError, match="end-of-document"):
        eos_token_id(without_eos)


def _llama_like() -> Tokenizer:
    """A word-level tokenizer whose post-processor puts ``<s>`` before every text, as Llama's does."""
    from tokenizers import AddedToken, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "<|im_end|>": 4},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in ("<unk>", "<s>", "</s>", "<|im_end|>")])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer


@pytest.mark.parametrize("written, expected, ordinary", [
    ({}, {"bos_token_id": None, "eos_token_id": 0}, []),  # the defaults, 1 and 2, are "!" and '"'
    ({"bos_token_id": 0, "eos_token_id": None}, {"bos_token_id": 0, "eos_token_id": None}, []),
    ({"eos_token_id": 5}, {"bos_token_id": None, "eos_token_id": 0}, ["eos_token_id"]),
])
def test_a_model_takes_the_tokenizers_ids_in_place_of_defaults_and_ordinary_tokens(tokenizer_file, written, expected,
                                                                                   ordinary):
    from nanotron.config import LlamaConfig
    from nanotron.data.tokenizer import model_token_ids

    assert model_token_ids(load_tokenizer(tokenizer_file), LlamaConfig(**written)) == (expected, ordinary)


def test_the_bos_id_is_the_token_the_tokenizer_puts_before_every_text():
    from nanotron.config import LlamaConfig
    from nanotron.data.tokenizer import model_token_ids

    llama_like = _llama_like()
    assert model_token_ids(llama_like, LlamaConfig(bos_token_id=3, eos_token_id=3)) == (
        {"bos_token_id": 1, "eos_token_id": 2}, ["bos_token_id", "eos_token_id"])
    assert model_token_ids(llama_like, LlamaConfig(eos_token_id=4)) == ({"bos_token_id": 1, "eos_token_id": 4}, [])


def test_training_refuses_an_eos_id_that_names_an_ordinary_token_in_one_line(tiny_data, tmp_path):
    from support.configs import tiny_config_dict, write_config
    from support.runs import assert_user_error, cli

    config = tiny_config_dict(tiny_data, tmp_path / "run", tokens={"train_steps": 1})
    config["model"]["model_config"]["eos_token_id"] = 5
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, "model.model_config.eos_token_id (5 ('%')) is an ordinary token of the tokenizer "
                               f"({tiny_data['tokenizer']}), not a special one; set it to the tokenizer's own, "
                               "0 ('<|endoftext|>'), or leave it out to take that")
    assert not any((tmp_path / "run").glob("*/checkpoint.json"))


def test_fingerprint_identifies_the_tokenizer(corpus, tokenizer_file, tmp_path):
    tokenizer = load_tokenizer(tokenizer_file)
    assert tokenizer_fingerprint(tokenizer) == hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    assert tokenizer_fingerprint(load_tokenizer(tokenizer_file.parent)) == tokenizer_fingerprint(tokenizer)
    smaller = load_tokenizer(train_tokenizer([corpus], vocab_size=300, output=tmp_path))
    assert tokenizer_fingerprint(smaller) != tokenizer_fingerprint(tokenizer)


def test_load_errors_name_the_value(tmp_path, monkeypatch):
    with pytest.raises(TokenizerError, match=f"{tmp_path} has no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="missing.json does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="broken.json is not a valid"):
        load_tokenizer(tmp_path / "broken.json")
    # Fail at once instead of retrying the network. huggingface_hub (which Tokenizer.from_pretrained calls) reads
    # HF_HUB_OFFLINE once, at import, and another test may have imported it already: patch the value it reads.
    huggingface_hub_constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(huggingface_hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TokenizerError, match="'no-such-org/no-such-tokenizer' does not exist locally"):
        load_tokenizer("no-such-org/no-such-tokenizer")


def test_train_rejects_a_vocabulary_smaller_than_the_byte_alphabet(corpus, tmp_path):
    with pytest.raises(TokenizerError, match="--vocab-size must be at least 257"):
        train_tokenizer([corpus], vocab_size=100, output=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_train_stops_at_a_bad_input_line_and_writes_nothing(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "wrong key"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl, line 2: no 'text' key"):
        train_tokenizer([tmp_path / "bad.jsonl"], vocab_size=300, output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_initial_weights_trained_with_another_tokenizer_of_the_same_size_are_refused(tiny_data, tmp_path):
    from nanotron.data.preprocess import preprocess
    from nanotron.data.tokenizer import load_tokenizer, train_tokenizer

    trained = tmp_path / "trained"
    first = short_config(tiny_data, trained, 1)
    assert cli("train", "--config-file", write_config(tmp_path / "a.yaml", first)).code == 0
    corpus = write_corpus(tmp_path / "raw", documents=200, seed=5)
    other = train_tokenizer([corpus], 384, tmp_path / "other.json")
    assert load_tokenizer(other).get_vocab_size() == load_tokenizer(tiny_data["tokenizer"]).get_vocab_size()
    preprocess([corpus], other, tmp_path / "other_data", num_workers=1)
    config = short_config(tiny_data, tmp_path / "run", 2, tokenizer={"tokenizer_name_or_path": str(other)},
                          data_stages=[folder_stage(tmp_path / "other_data")])
    config["model"]["init_method"] = {"path": str(trained)}
    outcome = python_process("run_train.py", "--config-file", write_config(tmp_path / "init.yaml", config))
    assert_user_error(outcome, str(tmp_path / "other_data"), "another tokenizer", "checkpoints.allow_tokenizer_change")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    config["checkpoints"]["allow_tokenizer_change"] = True
    assert cli("train", "--config-file", write_config(tmp_path / "allowed.yaml", config)).code == 0


def test_resuming_on_data_from_another_tokenizer_is_refused_unless_asked(saved, tiny_data, tmp_path):
    from nanotron.data.preprocess import preprocess
    from nanotron.data.tokenizer import train_tokenizer

    corpus = write_corpus(tmp_path / "raw", documents=100, seed=5)
    other = train_tokenizer([corpus], 300, tmp_path / "other.json")
    preprocess([corpus], other, tmp_path / "other_data", num_workers=1)
    stage = {"name": "main", "start_training_step": 1,
             "data": {"seed": 3, "num_loading_workers": 0,
                      "dataset": {"dataset_folder": [str(tmp_path / "other_data")]}}}
    checkpoints = {"checkpoint_interval": 1000, "resume_checkpoint_path": str(saved["run"])}
    resume = short_config(tiny_data, tmp_path / "resumed", 3, data_stages=[stage], checkpoints=checkpoints,
                          tokenizer={"tokenizer_name_or_path": None})
    assert_user_error(cli("train", "--config-file", write_config(tmp_path / "resume.yaml", resume)),
                      str(tmp_path / "other_data"), "another tokenizer", "checkpoints.allow_tokenizer_change")
    resume["checkpoints"]["allow_tokenizer_change"] = True
    assert "resumed from" in train_through_cli(resume, tmp_path / "allowed.yaml").stderr
