"""``nanotron generate`` refuses missing or empty prompts and sampling options out of range in one line, before
loading any model."""

import pytest

from helpers import assert_user_error, cli


def test_missing_or_blank_prompts_are_one_error_line(tmp_path):
    checkpoint = tmp_path / "no-checkpoint"  # never reached: prompts are checked first
    assert_user_error(cli("generate", "--ckpt-path", checkpoint), "no prompt", "--prompt")
    assert_user_error(cli("generate", "--ckpt-path", checkpoint, "--prompt", "  "), "no prompt")
    assert_user_error(cli("generate", "--ckpt-path", checkpoint, "--prompts-file", tmp_path / "absent.txt"),
                      "absent.txt", "is not a file")
    (tmp_path / "blank.txt").write_text("\n   \n")
    assert_user_error(cli("generate", "--ckpt-path", checkpoint, "--prompts-file", tmp_path / "blank.txt"),
                      "no prompt")


@pytest.mark.parametrize("sampling", [("--sampler", "top-k", "--top-k", "0"), ("--sampler", "top-p", "--top-p", "0"),
                                      ("--sampler", "top-p", "--top-p", "1.5"),
                                      ("--sampler", "top-k", "--temperature", "0")],
                         ids=["top-k-0", "top-p-0", "top-p-1.5", "temperature-0"])
def test_a_sampling_option_out_of_range_is_one_error_line(tmp_path, sampling):
    outcome = cli("generate", "--ckpt-path", tmp_path / "no-checkpoint", "--prompt", "the cat", *sampling)
    assert_user_error(outcome, f"argument {sampling[2]}: must be", f"(got {sampling[3]})")
