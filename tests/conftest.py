"""Shared fixtures: a tiny learnable text corpus, its tokenizer and tokenized shards, config factories, training runs
in subprocesses with their process trees (to signal or kill), and the test tiers.

Tiers: the default run trains every layout-parity comparison for a few steps (``parity_steps()``) on top of the exact
first-step gradient checks; ``NANOTRON_TEST_TIER=full`` trains them for the full 20 steps and also runs the tests
marked ``full_tier`` (extra layout pairs of mechanisms the default run already covers, e.g. most of the
checkpoint-resharding pairs). Every mechanism, and every layout of the parity tests, is tested in both tiers.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TIER_VARIABLE = "NANOTRON_TEST_TIER"
TIERS = ("default", "full")
FULL_TIER_REASON = f"full tier only; run it with {TIER_VARIABLE}=full bash scripts/run_tests.sh"


def tier_name() -> str:
    """``default`` or ``full``, from the environment (unset or empty means ``default``)."""
    tier = os.environ.get(TIER_VARIABLE, "").strip().lower() or "default"
    if tier not in TIERS:
        raise pytest.UsageError(f"{TIER_VARIABLE}={os.environ[TIER_VARIABLE]!r}: expected one of {', '.join(TIERS)}")
    return tier


def full_tier() -> bool:
    return tier_name() == "full"


def parity_steps(short: int = 6, full: int = 20) -> int:
    """Training steps of a layout-parity run: ``full`` under NANOTRON_TEST_TIER=full, ``short`` otherwise."""
    return full if full_tier() else short


def assert_reference_trains(metrics: list[dict], steps: int) -> None:
    """The single-process reference really learns, so that matching it means something: one record per step, every
    grad-norm positive, and the last step's loss clearly below the first's. The tiny models start near
    ln(384) = 5.95 and lose about 1.0 nat in 6 steps and 2.2 in 16 to 20 (measured): the bar is 0.75 in the short
    runs and 1.0 in the full tier's."""
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["grad_norm"] > 0 for m in metrics), [m["grad_norm"] for m in metrics]
    margin = 1.0 if steps >= 16 else 0.75
    first, last = metrics[0]["lm_loss"], metrics[-1]["lm_loss"]
    assert last < first - margin, f"loss {first:.3f} -> {last:.3f} over {steps} steps: no drop > {margin}"


def pytest_configure(config) -> None:
    tier_name()  # a misspelt tier fails the run at once instead of silently running the default tier
    config.addinivalue_line("markers", f"full_tier: runs only in the full tier ({FULL_TIER_REASON})")


def pytest_report_header(config) -> str:
    return f"nanotron test tier: {tier_name()} ({TIER_VARIABLE}=full for the long tier)"


def pytest_collection_modifyitems(config, items) -> None:
    if full_tier():
        return
    skip = pytest.mark.skip(reason=FULL_TIER_REASON)
    for item in items:
        if "full_tier" in item.keywords:
            item.add_marker(skip)


WORDS = (
    "the a one every small large red green blue old new quick slow cat dog bird fish tree river stone house "
    "runs jumps sleeps eats sees finds makes takes near under over behind with without and but then so"
).split()


def run_with_triton_interpreter(code: str) -> None:
    """Run ``code`` in a fresh Python with Triton's interpreter on (it is chosen when Triton is imported), the tests
    folder importable: how the CPU checks the GPU's Triton kernels against their plain-torch references."""
    pytest.importorskip("triton")
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); {code}"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


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


def tiny_config_dict(tiny_data: dict[str, Path], checkpoint_dir: Path, **overrides) -> dict:
    """A complete config for a ~0.2M-parameter Llama on the tiny corpus; ``overrides`` patch sections."""
    config = {
        "general": {"project": "tests", "run": "tiny", "seed": 7},
        "checkpoints": {"checkpoints_path": str(checkpoint_dir), "checkpoint_interval": 1000},
        "parallelism": {"dp": 1, "pp": 1, "tp": 1},
        "model": {
            "dtype": "float32",
            "init_method": {"std": 0.02},
            "model_config": {
                "is_llama_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "tie_word_embeddings": True,
            },
        },
        "tokenizer": {"tokenizer_name_or_path": str(tiny_data["tokenizer"])},
        "tokens": {"sequence_length": 32, "micro_batch_size": 4, "batch_accumulation_per_replica": 2, "train_steps": 20},
        "optimizer": {
            "weight_decay": 0.01, "clip_grad": 1.0,
            "learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 4, "min_decay_lr": 3e-4},
        },
        "data_stages": [{"name": "main", "start_training_step": 1,
                         "data": {"seed": 3, "num_loading_workers": 0,
                                  "dataset": {"dataset_folder": [str(tiny_data["tokenized"])]}}}],
        "logging": {"iteration_step_info_interval": 1},
    }
    for section, values in overrides.items():
        if isinstance(values, dict) and isinstance(config.get(section), dict):
            config[section] = {**config[section], **values}
        else:
            config[section] = values
    return config


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoint_json(run: Path) -> dict:
    return json.loads((run / (run / "latest.txt").read_text().strip() / "checkpoint.json").read_text())


def start_training(config_path: Path, launcher: list[str], log: Path | None = None) -> subprocess.Popen:
    """Start a training run; its output goes to ``log`` (a file: a pipe nobody reads while the test waits would
    stall the run once full)."""
    env = {**os.environ, "NANOTRON_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    with open(log or os.devnull, "w") as output:
        return subprocess.Popen(launcher + [str(ROOT / "run_train.py"), "--config-file", str(config_path)],
                                stdout=output, stderr=subprocess.STDOUT, text=True, env=env)


def children(pid: int) -> list[int]:
    listing = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(child) for child in listing.split()]


def descendants(pid: int) -> list[int]:
    """Every process started by ``pid``, depth first (a child, then what it started)."""
    return [d for child in children(pid) for d in (child, *descendants(child))]


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def kill_with_descendants(processes: list[subprocess.Popen]) -> None:
    """Those still running, with everything they started: torchrun's workers run in sessions of their own and
    would outlive their agent (or the script that started it) if only that were killed."""
    for process in processes:
        if process.poll() is None:
            signal_all([*descendants(process.pid), process.pid], signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def killed_on_failure(processes: list[subprocess.Popen]):
    try:
        yield
    except BaseException:
        kill_with_descendants(processes)
        raise
