"""``nanotron generate`` refuses missing or empty prompts and sampling options that would be ignored or out of
range in one line, before loading any model; each sampler runs with its options or their defaults; generating past
the model's context is one error line suggesting the length that fits."""

from __future__ import annotations

import pytest

from support.configs import short_config
from support.runs import assert_user_error, cli, nanotron_process, train_through_cli


def test_missing_or_blank_prompts_are_one_error_line(tmp_path):
    checkpoint = tmp_path / "no-checkpoint"  # never reached: prompts are checked first
    assert_user_error(cli("generate", "--ckpt-path", checkpoint), "no prompt", "--prompt")
    assert_user_error(cli("generate", "--ckpt-path", checkpoint, "--prompt", "  "), "no prompt")
    assert_user_error(cli("generate", "--ckpt-path", checkpoint, "--prompts-file", tmp_path / "absent.txt"),
                      "absent.txt", "is not a file")
    (tmp_path / "blank.txt").write_text("\n   \n")
    assert_user_error(cli("generate", "--ckpt-path", checkpoint, "--prompts-file", tmp_path / "blank.txt"),
                      "no prompt")


@pytest.mark.parametrize("sampling, option, samplers", [
    (("--top-k", "5"), "--top-k", "top-k"),
    (("--sampler", "top-p", "--top-k", "5"), "--top-k", "top-k"),
    (("--sampler", "top-k", "--top-p", "0.5"), "--top-p", "top-p"),
    (("--temperature", "0.7"), "--temperature", "top-k or top-p"),
], ids=["top-k-greedy", "top-k-top-p", "top-p-top-k", "temperature-greedy"])
def test_a_sampling_option_the_sampler_does_not_use_is_one_error_line(tmp_path, sampling, option, samplers):
    outcome = cli("generate", "--ckpt-path", tmp_path / "no-checkpoint", "--prompt", "the cat", *sampling)
    assert_user_error(outcome, f"{option} does nothing with --sampler", f"pass --sampler {samplers} with it")


@pytest.mark.parametrize("sampling", [("--sampler", "top-k", "--top-k", "0"), ("--sampler", "top-p", "--top-p", "0"),
                                      ("--sampler", "top-p", "--top-p", "1.5"),
                                      ("--sampler", "top-k", "--temperature", "0")],
                         ids=["top-k-0", "top-p-0", "top-p-1.5", "temperature-0"])
def test_a_sampling_option_out_of_range_is_one_error_line(tmp_path, sampling):
    outcome = cli("generate", "--ckpt-path", tmp_path / "no-checkpoint", "--prompt", "the cat", *sampling)
    assert_user_error(outcome, f"argument {sampling[2]}: must be", f"(got {sampling[3]})")


def test_each_sampler_runs_with_its_options_or_their_defaults(tiny_data, tmp_path):
    run = tmp_path / "run"
    train_through_cli(short_config(tiny_data, run, train_steps=1), tmp_path / "config.yaml")

    def completion(*sampling: str) -> str:
        outcome = cli("generate", "--ckpt-path", run, "--prompt", "the cat", "--max-new-tokens", 6, "--seed", 3,
                      *sampling)
        assert outcome.code == 0 and outcome.stdout.startswith("=== the cat\n"), outcome.stderr[-3000:]
        return outcome.stdout

    assert completion("--sampler", "top-k") == completion("--sampler", "top-k", "--top-k", "50", "--temperature", "1")
    assert completion("--sampler", "top-p") == completion("--sampler", "top-p", "--top-p", "0.9", "--temperature", "1")
    completion("--sampler", "top-p", "--top-p", "1", "--temperature", "0.5")  # 1 keeps every token
    completion("--sampler", "top-k", "--top-k", "1000")  # more than the vocabulary: every token


@pytest.mark.slow
def test_generation_past_the_context_is_an_error(converted_llama):
    outcome = nanotron_process("generate", "--ckpt-path", converted_llama, "--prompt", "the cat",
                               "--max-new-tokens", 200)
    line = assert_user_error(outcome, "--max-new-tokens (200)", "more than the 128 the model was trained for "
                                                                "(max_position_embeddings)")
    assert "===" not in outcome.stdout  # nothing was generated
    # the largest length it suggests fits exactly; none at all is an error too
    most = int(line.split("pass --max-new-tokens ")[1].split()[0])
    fitting = cli("generate", "--ckpt-path", converted_llama, "--prompt", "the cat", "--max-new-tokens", most)
    assert fitting.code == 0 and "=== the cat" in fitting.stdout, fitting.stderr[-3000:]
    one_more = cli("generate", "--ckpt-path", converted_llama, "--prompt", "the cat", "--max-new-tokens", most + 1)
    assert_user_error(one_more, f"--max-new-tokens ({most + 1})")
    assert_user_error(cli("generate", "--ckpt-path", converted_llama, "--prompt", "the cat", "--max-new-tokens", 0),
                      "argument --max-new-tokens: must be at least 1 (got 0)")
