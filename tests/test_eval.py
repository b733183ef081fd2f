"""``nanotron eval``: the loss of a checkpoint on held-out data, the same at any pipeline split, per folder also for
folders of one name, and one ``error:`` line for data shorter than one evaluation window."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nanotron.cli import main
from support.distributed import run_distributed
from support.runs import assert_user_error, cli, nanotron_process


@pytest.fixture(scope="module")
def short_data(tiny_data, tmp_path_factory) -> Path:
    """A tokenized folder of one short sentence: fewer tokens than one window of 32 + 1."""
    from nanotron.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("short")
    (root / "short.jsonl").write_text(json.dumps({"text": "the cat runs."}) + "\n")
    preprocess([root / "short.jsonl"], tiny_data["tokenizer"], root / "short", num_workers=1)
    return root / "short"


@pytest.mark.slow
def test_eval_on_data_shorter_than_one_window_is_an_error(converted_llama, short_data, tmp_path):
    from nanotron.data.dataset import TokenShards

    tokens = TokenShards(short_data).num_tokens
    outcome = nanotron_process("eval", "--ckpt-path", converted_llama, "--data", short_data, "--sequence-length", 32,
                               "--output", tmp_path / "eval.json")
    assert_user_error(outcome, str(short_data), f"holds {tokens} tokens, fewer than one evaluation window",
                      f"pass --sequence-length {tokens - 1} or less")
    assert "perplexity" not in outcome.stdout and not (tmp_path / "eval.json").exists()
    # the suggested length evaluates; no window at all is an error too
    fitting = cli("eval", "--ckpt-path", converted_llama, "--data", short_data, "--sequence-length", tokens - 1)
    assert fitting.code == 0 and f"| {tokens - 1} tokens" in fitting.stdout, fitting.stderr[-3000:]
    nothing = cli("eval", "--ckpt-path", converted_llama, "--data", short_data, "--sequence-length", 2,
                  "--max-windows", 0)
    assert_user_error(nothing, "argument --max-windows: must be at least 1 (got 0)")


def _cli_on_rank(argv: list[str]) -> None:
    main(argv)


EVAL_ARGS = ("--sequence-length", "16", "--max-windows", "10", "--batch-size", "4")  # batches of 4, 4 and 2


@pytest.mark.slow
def test_eval_at_pp2_gives_the_loss_of_pp1(base, tiny_data, tmp_path):
    data = str(tiny_data["tokenized"])
    single = cli("eval", "--ckpt-path", base["run"], "--data", data, *EVAL_ARGS, "--output", tmp_path / "pp1.json")
    assert single.code == 0, single.stderr[-3000:]
    run_distributed(_cli_on_rank, 2, argv=["eval", "--ckpt-path", str(base["run"]), "--data", data, *EVAL_ARGS,
                                           "--pp", "2", "--output", str(tmp_path / "pp2.json")])
    pp1 = json.loads((tmp_path / "pp1.json").read_text())["tokenized"]
    pp2 = json.loads((tmp_path / "pp2.json").read_text())["tokenized"]
    assert pp1["tokens"] == pp2["tokens"] == 10 * 16
    assert 3.0 < pp1["loss"] < 7.0  # about ln(384) = 5.95 after 2 steps: a real loss, not 0 or NaN
    assert pp2["loss"] == pytest.approx(pp1["loss"], rel=1e-6, abs=1e-6)
    assert pp2["perplexity"] == pytest.approx(pp1["perplexity"], rel=1e-6)


@pytest.mark.slow
def test_eval_of_folders_of_one_name_reports_each(base, tiny_data, tmp_path):
    """The second overwrote the first: both were "tokenized"."""
    folders = [tmp_path / "a" / "tokenized", tmp_path / "b" / "tokenized"]
    for folder in folders:
        shutil.copytree(tiny_data["tokenized"], folder)
    outcome = cli("eval", "--ckpt-path", base["run"], "--data", *folders, *EVAL_ARGS, "--output", tmp_path / "e.json")
    assert outcome.code == 0, outcome.stderr[-3000:]
    results = json.loads((tmp_path / "e.json").read_text())
    assert list(results) == ["a/tokenized", "b/tokenized"] and results["a/tokenized"] == results["b/tokenized"]
