"""`nanotron plot`: metrics files become one non-blank PNG; bad files give one `error:` line and exit status 2."""

import json
import logging
import math
import sys

import numpy as np
import pytest

from nanotron.cli import main

matplotlib_image = pytest.importorskip("matplotlib.image")


def write_run(folder, steps=30, domains=None, mfu=False, torn=False, moe=False):
    folder.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        loss = 5 * math.exp(-step / 10) + 0.1 * math.sin(step)
        record = {"step": step, "lm_loss": loss, "lr": 1e-3 * min(1, step / 5), "grad_norm": 1 / step,
                  "tokens_per_sec": 1000 + 10 * step, "tokens_per_sec_per_gpu": 500 + 5 * step,
                  "tflops_per_gpu": 1.0, "peak_memory_gb": 0.5}
        if mfu:
            record["mfu"] = 0.3 + 0.01 * math.sin(step)
        if moe:
            record |= {"moe_max_expert_load": 1 + 1 / step, "moe_load_balancing_loss": 1 + 0.5 / step}
        if domains:
            record["domain_losses"] = {name: loss + i for i, name in enumerate(domains)}
        lines.append(json.dumps(record))
    text = "\n".join(lines) + "\n" + ('{"step": 31, "lm_lo' if torn else "")
    (folder / "metrics.jsonl").write_text(text)
    return folder / "metrics.jsonl"


def run_cli(*args):
    try:
        main(["plot", *args])
    except SystemExit as exit:
        return exit.code
    return 0


def check_png(path, width, height):
    pixels = matplotlib_image.imread(path)  # reads only valid PNGs
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0.05
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50


@pytest.mark.slow
def test_two_runs_with_domains_and_smoothing(tmp_path, capsys, caplog):
    a = write_run(tmp_path / "run_a", domains=["code", "prose"], mfu=True, torn=True)
    b = write_run(tmp_path / "run_b", steps=20)
    output = tmp_path / "out" / "curves.png"
    with caplog.at_level(logging.WARNING):
        assert run_cli("--metrics", str(a), str(b), "--output", str(output), "--smooth", "5") == 0
    assert "torn last line" in caplog.text and str(a) in caplog.text
    assert str(output) in capsys.readouterr().out
    check_png(output, 1200, 1050)  # loss, lr, grad-norm, tokens/s, MFU, domains: 3 rows of 2 panels


def test_one_run_named_without_optional_panels(tmp_path):
    output = tmp_path / "curves.png"
    assert run_cli("--metrics", str(write_run(tmp_path / "r")), "--output", str(output), "--names", "baseline") == 0
    check_png(output, 1200, 700)  # loss, lr, grad-norm, tokens/s


def one_error_line(capsys, path):
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and str(path) in err, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("content", [
    "",
    "\n\n",
    '{"step": 1, "lm_loss": 2.0}\nnot json\n{"step": 3, "lm_loss": 1.0}\n',
    '{"step": 1, "lr": 0.1}\n',
    '[1, 2]\n',
    '{"step": 1, "lm_lo',
], ids=["empty", "blank", "bad-json-middle", "no-loss", "not-object", "only-torn"])
def test_bad_metrics_file_is_one_error_line(tmp_path, capsys, content):
    path = tmp_path / "metrics.jsonl"
    path.write_text(content)
    assert run_cli("--metrics", str(path), "--output", str(tmp_path / "c.png")) == 2
    one_error_line(capsys, path)
    assert not (tmp_path / "c.png").exists()


def test_missing_file_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "nope" / "metrics.jsonl"
    assert run_cli("--metrics", str(path), "--output", str(tmp_path / "c.png")) == 2
    one_error_line(capsys, path)


def test_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    path = write_run(tmp_path / "r", steps=3)
    for module in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert run_cli("--metrics", str(path), "--output", str(tmp_path / "c.png")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and 'pip install -e ".[plot]"' in err


@pytest.mark.slow
def test_mixture_of_experts_runs_add_their_routing_panels(tmp_path):
    run = write_run(tmp_path / "moe", moe=True)
    output = tmp_path / "moe.png"
    assert run_cli("--metrics", str(run), "--output", str(output)) == 0
    check_png(output, 1200, 1050)  # loss, lr, grad-norm, tokens/s, expert load, balancing loss


@pytest.mark.slow
def test_evaluations_in_the_loop_get_a_panel_per_metric(tmp_path):
    run = write_run(tmp_path / "evaluated")
    records = [json.loads(line) for line in run.read_text().splitlines()]
    for record in records[9::10]:  # evaluated every 10 steps: records between have no eval fields
        record |= {"eval/arc/acc": 0.25 + record["step"] / 100, "eval/arc/acc_norm": 0.3, "eval_time_s": 1.5}
    run.write_text("".join(json.dumps(record) + "\n" for record in records))
    output = tmp_path / "evals.png"
    assert run_cli("--metrics", str(run), "--output", str(output)) == 0
    check_png(output, 1200, 1050)  # loss, lr, grad-norm, tokens/s, arc's acc and acc_norm


@pytest.mark.slow
def test_domain_weights_get_a_panel_of_their_own(tmp_path):
    run = write_run(tmp_path / "proxy", domains=["code", "prose"])
    lines = [json.loads(line) for line in run.read_text().splitlines()]
    for record in lines:
        record["domain_weights"] = {"code": 0.4 + 0.001 * record["step"], "prose": 0.6 - 0.001 * record["step"]}
    run.write_text("".join(json.dumps(record) + "\n" for record in lines))
    output = tmp_path / "proxy.png"
    assert run_cli("--metrics", str(run), "--output", str(output)) == 0
    check_png(output, 1200, 1050)  # loss, lr, grad-norm, tokens/s, loss per domain, domain weights


@pytest.mark.parametrize("name, magic", [("curves.svg", b"<?xml"), ("curves.pdf", b"%PDF"), ("curves.PNG", b"\x89PNG")])
def test_the_image_format_follows_the_extension(tmp_path, name, magic):
    assert run_cli("--metrics", str(write_run(tmp_path / "r", steps=3)), "--output", str(tmp_path / name)) == 0
    assert (tmp_path / name).read_bytes().startswith(magic)


@pytest.mark.parametrize("output, message", [
    ("curves.txt", "curves.txt does not end in .png, .pdf or .svg, the formats this command writes"),
    ("curves", "curves does not end in .png, .pdf or .svg"),
    ("folder.png", "folder.png is a folder, not a file"),
    ("a-file/curves.png", "a-file is a file, not a folder to write"),
], ids=["txt", "no-extension", "folder", "in-a-file"])
def test_an_output_that_is_not_an_image_file_is_one_error_line(tmp_path, capsys, monkeypatch, output, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "a-file").write_text("kept")
    write_run(tmp_path / "r", steps=3)
    assert run_cli("--metrics", "r", "--output", output) == 2
    assert message in one_error_line(capsys, "--output")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file", "folder.png", "r"]
    assert list((tmp_path / "folder.png").iterdir()) == [] and (tmp_path / "a-file").read_text() == "kept"
