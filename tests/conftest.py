"""The fixtures shared by the test files (a tiny learnable corpus with its tokenizer and tokenized shards, a run
trained on it to read or to damage, a converted Hugging Face Llama, DoReMi's domains and reference run) and the
hooks that pick the test tier; the plain functions are in the ``support`` package.

Tiers (``NANOTRON_TEST_TIER``): the default run trains every layout-parity comparison for a few steps
(``parity_steps()``) on top of the exact first-step gradient checks; ``full`` trains them for the full 20 steps and
also runs the tests marked ``full_tier`` (extra layout pairs of mechanisms the default run already covers, e.g. most of
the checkpoint-resharding pairs); ``quick``, the inner loop (a few minutes on two cores), is the default tier less the
tests marked ``slow``: a test runs in every tier unless marked, so a new test is never dropped silently, and a test
is marked ``slow`` only where a quicker test in the quick tier touches the same mechanism. Every mechanism is tested
in every tier, and every layout of the parity tests in the default and full tiers.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from support.configs import DOMAINS, doremi_config, short_config
from support.corpus import write_corpus
from support.hf import save_tiny_hf_model
from support.runs import DISTRIBUTED_VARIABLES, train_on_ranks, train_through_cli
from support.tiers import FULL_TIER_REASON, TIER_VARIABLE, full_tier, quick_tier, tier_name


def pytest_configure(config) -> None:
    # The suite proves correctness on the CPU against CPU references, also on a machine with a GPU; the CUDA tests
    # ask for the GPU themselves (``NANOTRON_DEVICE=cuda`` or tensors placed on it).
    os.environ.setdefault("NANOTRON_DEVICE", "cpu")
    tier_name()  # a misspelt tier fails the run at once instead of silently running the default tier
    config.addinivalue_line("markers", f"full_tier: runs only in the full tier ({FULL_TIER_REASON})")
    config.addinivalue_line("markers", f"slow: left out of the quick tier ({TIER_VARIABLE}=quick); a quicker test "
                                       "there touches the same mechanism")


def pytest_report_header(config) -> str:
    return f"nanotron test tier: {tier_name()} ({TIER_VARIABLE}=quick for the inner loop, =full for the long tier)"


def pytest_collection_modifyitems(config, items) -> None:
    if full_tier():
        return
    if quick_tier():
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    skip = pytest.mark.skip(reason=FULL_TIER_REASON)
    for item in items:
        if "full_tier" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _distributed_environment_restored():
    """A trainer built in the test process sets the torch.distributed variables (``parallel/context.py``); left in
    the environment, every later subprocess would rendezvous on that process's port and fail to bind it. The
    process group it starts is destroyed too, or the next test that starts one in this process fails."""
    import torch.distributed as dist

    saved = {name: os.environ.get(name) for name in DISTRIBUTED_VARIABLES}
    started_here = not dist.is_initialized()  # a module's own group (its fixture set up first) is left alone
    yield
    if started_here and dist.is_initialized():
        dist.destroy_process_group()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> dict[str, Path]:
    """Tokenizer (vocab 384) and tokenized shards built once per test session."""
    from nanotron.data.preprocess import preprocess
    from nanotron.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tiny_data")
    corpus = write_corpus(root / "raw")
    tokenizer = train_tokenizer([corpus], 384, root / "tokenizer.json")
    preprocess([corpus], tokenizer, root / "tokenized", num_workers=1)
    return {"root": root, "corpus": corpus, "tokenizer": tokenizer, "tokenized": root / "tokenized"}


@pytest.fixture(scope="module")
def base(tiny_data, tmp_path_factory) -> dict:
    """A run folder trained 2 steps with the tiny config (hidden 64, 2 layers, 4/2 heads, vocab 384, tied) and its
    config, read by the tests that resume, evaluate or convert it (never changed)."""
    root = tmp_path_factory.mktemp("base")
    config = short_config(tiny_data, root / "run", train_steps=2)
    train_through_cli(config, root / "config.yaml")
    assert (root / "run" / "latest.txt").read_text().strip() == "2"
    return {"run": root / "run", "config": config}


@pytest.fixture
def saved(tiny_data, tmp_path) -> dict:
    """A run folder trained 2 steps, its checkpoint and config, for a test that damages them."""
    run = tmp_path / "run"
    config = short_config(tiny_data, run, 2)
    train_through_cli(config, tmp_path / "config.yaml")
    return {"run": run, "checkpoint": run / "2", "config": config}


@pytest.fixture(scope="module")
def converted_llama(tiny_data, tmp_path_factory) -> Path:
    """A tiny Llama saved by ``transformers`` (128 positions) converted to nanotron with the tiny corpus's
    tokenizer."""
    from nanotron.checkpoint.hf import hf_to_nanotron

    root = tmp_path_factory.mktemp("converted")
    save_tiny_hf_model("llama", root / "hf")
    shutil.copy(tiny_data["tokenizer"], root / "hf" / "tokenizer.json")
    return hf_to_nanotron(root / "hf", root / "ckpt")


@pytest.fixture(scope="module")
def doremi_domains(tiny_data, tmp_path_factory) -> list[Path]:
    """Three domains tokenized with the tiny tokenizer: two corpora of the test grammar and a shuffled-word one."""
    from nanotron.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("domains")
    folders = []
    for seed, name in enumerate(DOMAINS):
        corpus = write_corpus(root / f"raw_{name}", documents=120, seed=seed + 1)
        if name == "rivers":  # word salad: a domain the reference finds harder
            lines = [json.loads(line) for line in corpus.read_text().splitlines()]
            rng = random.Random(0)
            for line in lines:
                words = line["text"].split()
                rng.shuffle(words)
                line["text"] = " ".join(words)
            corpus.write_text("".join(json.dumps(line) + "\n" for line in lines))
        preprocess([corpus], tiny_data["tokenizer"], root / name, num_workers=1)
        folders.append(root / name)
    return folders


@pytest.fixture(scope="module")
def doremi_reference(tiny_data, doremi_domains, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    train_on_ranks(doremi_config(tiny_data, doremi_domains, run, steps=12), 1)
    return run
