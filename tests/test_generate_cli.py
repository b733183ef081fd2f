"""``nanotron generate`` refuses missing or empty prompts in one line, before loading any model."""

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
