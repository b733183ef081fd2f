"""DoReMi: the weight update by hand, the proxy's weight trajectory at every split of the
global batch (dp x accumulation, pp, tp) against one process, exact resume, averaging, held-out splits and bad
input; its loss compiled with the model, and its weights resumed by domain name, onto reordered folders, or refused
onto other domains."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from support.configs import DOMAINS, DOREMI_STEPS, doremi_config, write_config
from support.corpus import write_corpus
from support.distributed import run_distributed, run_distributed_each
from support.runs import Outcome, assert_user_error, cli, python_process, train_on_ranks

STEPS = DOREMI_STEPS


def test_weight_update_matches_a_hand_computation_and_survives_an_absent_domain():
    from nanotron.features.doremi_weights import updated_weights

    weights, excess, tokens = [0.5, 0.3, 0.2], [4.0, 0.0, 9.0], [8.0, 0.0, 3.0]  # domain 1 absent from the step
    raw = [math.log(0.5) + 0.5 * 4 / 8, math.log(0.3), math.log(0.2) + 0.5 * 9 / 3]
    softmax = [math.exp(v) / sum(math.exp(u) for u in raw) for v in raw]
    expected = [(1 - 0.1) * p + 0.1 / 3 for p in softmax]
    got = updated_weights(weights, excess, tokens, step_size=0.5, smoothing=0.1)
    assert got == pytest.approx(expected, rel=1e-12) and sum(got) == pytest.approx(1.0)
    assert all(math.isfinite(w) and w > 0 for w in got)


def _proxy(config: dict) -> dict:
    from nanotron.config import config_from_dict
    from nanotron.features import features_for
    from nanotron.trainer import Trainer

    proxy = config_from_dict(config)
    trainer = Trainer(proxy, features=features_for(proxy, doremi_proxy=True))
    trainer.train()
    if trainer.pc.rank != 0:
        return {}
    run = Path(config["checkpoints"]["checkpoints_path"])
    history = [json.loads(line) for line in (run / "domain_weights.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"history": history, "metrics": metrics}


def _train(config: dict) -> None:
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    Trainer(config_from_dict(config)).train()


@pytest.fixture(scope="module")
def proxies(tiny_data, doremi_domains, doremi_reference, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("proxies")

    def config(name, **layout):
        return doremi_config(tiny_data, doremi_domains, root / name, reference=doremi_reference, **layout)

    plain = config("plain")
    plain["model"]["loss_chunk_tokens"] = 0  # the logits in full, not the fused LM head + loss
    one, unfused = run_distributed_each(_proxy, 1, [{"config": config("one")}, {"config": plain}])
    out = {"one": one[0], "plain": unfused[0]}
    calls = {"dp2_acc2": config("dp2_acc2", dp=2, accumulation=2), "pp2": config("pp2", pp=2),
             "tp2": config("tp2", tp=2)}
    for name, ranks in zip(calls, run_distributed_each(_proxy, 2, [{"config": c} for c in calls.values()])):
        out[name] = ranks[0]
    half = doremi_config(tiny_data, doremi_domains, root / "resumed", reference=doremi_reference, steps=3)
    run_distributed(_proxy, 1, config=half)
    rest = doremi_config(tiny_data, doremi_domains, root / "resumed", reference=doremi_reference,
                         resume=root / "resumed")
    out["resumed"] = run_distributed(_proxy, 1, config=rest)[0]
    return out


def _trajectory(result: dict) -> list[list[float]]:
    return [[record["weights"][name] for name in DOMAINS] for record in result["history"]]


@pytest.mark.slow
def test_the_proxy_moves_the_weights_and_logs_them(proxies):
    one = proxies["one"]
    trajectory = _trajectory(one)
    assert [record["step"] for record in one["history"]] == list(range(1, STEPS + 1))
    assert trajectory[0] == pytest.approx([1 / 3] * 3)  # uniform start
    assert max(abs(a - b) for a, b in zip(trajectory[-1], trajectory[0])) > 1e-3  # the weights moved
    assert all(sum(w) == pytest.approx(1.0) for w in trajectory)
    assert [m["domain_weights"] for m in one["metrics"]] == [r["weights"] for r in one["history"]]
    assert all(set(m["domain_losses"]) <= set(DOMAINS) for m in one["metrics"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2_acc2", "pp2", "tp2"])
def test_the_weight_trajectory_is_the_same_at_any_split(proxies, layout):
    expected, got = _trajectory(proxies["one"]), _trajectory(proxies[layout])
    for step, (a, b) in enumerate(zip(expected, got, strict=True), 1):
        assert b == pytest.approx(a, abs=1e-6), (layout, step)
    for a, b in zip(proxies["one"]["metrics"], proxies[layout]["metrics"], strict=True):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], abs=1e-4), layout


def _four_layers(config: dict) -> dict:
    """``config`` with four untied decoder layers: one per model chunk at pp 2 x 2 chunks, ZBV's V included."""
    config["model"]["model_config"] |= {"num_hidden_layers": 4, "tie_word_embeddings": False}
    return config


@pytest.fixture(scope="module")
def four_layer_proxy(tiny_data, doremi_domains, tmp_path_factory) -> dict:
    """A reference and a proxy of four layers, the proxy trained by one process."""
    root = tmp_path_factory.mktemp("four_layers")
    train_on_ranks(_four_layers(doremi_config(tiny_data, doremi_domains, root / "reference", steps=12)), 1)
    config = _four_layers(doremi_config(tiny_data, doremi_domains, root / "one", reference=root / "reference"))
    return {"reference": root / "reference", "one": run_distributed(_proxy, 1, config=config)[0]}


@pytest.mark.full_tier
@pytest.mark.parametrize("engine", [
    "zbv", pytest.param("interleaved_1f1b", marks=pytest.mark.full_tier),
    pytest.param("zb_h1", marks=pytest.mark.full_tier)])
def test_the_weight_trajectory_is_the_same_under_the_chunked_schedules(four_layer_proxy, tiny_data, doremi_domains,
                                                                        tmp_path, engine):
    """The reference runs through the proxy's chunks (under ZBV its LM head is on stage 0), and the excess losses
    reach the step's statistics from the stage of the head: the same domain weights and losses as one process."""
    config = _four_layers(doremi_config(tiny_data, doremi_domains, tmp_path / "run", pp=2,
                                        reference=four_layer_proxy["reference"]))
    config["parallelism"] |= {"pp_engine": engine, "virtual_pipeline_size": 1 if engine == "zb_h1" else 2}
    got, expected = run_distributed(_proxy, 2, config=config)[0], four_layer_proxy["one"]
    for step, (a, b) in enumerate(zip(_trajectory(expected), _trajectory(got), strict=True), 1):
        assert b == pytest.approx(a, abs=1e-6), (engine, step)
    for a, b in zip(expected["metrics"], got["metrics"], strict=True):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5), (engine, a["step"])
        assert b["domain_losses"] == pytest.approx(a["domain_losses"], rel=1e-5), (engine, a["step"])


def test_a_reference_with_fewer_layers_than_the_proxys_model_chunks_is_refused(tiny_data, doremi_domains,
                                                                              doremi_reference, tmp_path):
    """The reference runs split as the proxy is, one decoder layer at least per model chunk."""
    config = _four_layers(doremi_config(tiny_data, doremi_domains, tmp_path / "run", pp=2, reference=doremi_reference))
    config["parallelism"] |= {"pp_engine": "interleaved_1f1b", "virtual_pipeline_size": 2}
    outcome = cli("doremi", "train", "--config-file", write_config(tmp_path / "proxy.yaml", config))
    assert_user_error(outcome, "has 2 decoder layers", "parallelism.pp x virtual_pipeline_size (2 x 2)",
                      "lower pp or virtual_pipeline_size")


@pytest.mark.slow
def test_the_fused_loss_weighs_the_domains_as_the_unfused_one(proxies):
    """The default fused LM head + loss takes DoReMi's per-domain token weights: the same trajectory, losses and
    gradient norms as the loss on full logits."""
    for step, (a, b) in enumerate(zip(_trajectory(proxies["plain"]), _trajectory(proxies["one"]), strict=True), 1):
        assert b == pytest.approx(a, abs=1e-6), step
    for a, b in zip(proxies["plain"]["metrics"], proxies["one"]["metrics"], strict=True):
        for key in ("lm_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a["step"])


@pytest.mark.slow
def test_resume_continues_the_same_trajectory(proxies):
    assert proxies["resumed"]["history"] == proxies["one"]["history"]  # lines of steps 1-3 kept, 4-6 appended
    straight = {m["step"]: m["lm_loss"] for m in proxies["one"]["metrics"]}
    assert {m["step"]: m["lm_loss"] for m in proxies["resumed"]["metrics"]} == straight


@pytest.mark.slow
def test_a_domain_absent_from_every_batch_keeps_a_finite_weight(tiny_data, doremi_domains, doremi_reference, tmp_path):
    config = doremi_config(tiny_data, doremi_domains, tmp_path / "run", reference=doremi_reference, steps=3)
    config["data_stages"][0]["data"]["dataset"]["dataset_weights"] = [0.998, 0.001, 0.001]  # 8 of 8 from domain 0
    (result,) = [r for r in run_distributed(_proxy, 1, config=config) if r]
    assert all(set(m["domain_losses"]) == {DOMAINS[0]} for m in result["metrics"])
    for weights in _trajectory(result):
        assert all(math.isfinite(w) and w > 0 for w in weights)


def test_average_prints_a_line_to_paste(tmp_path, capsys):
    history = tmp_path / "domain_weights.jsonl"
    history.write_text('{"step": 1, "weights": {"a": 0.5, "b": 0.5}}\n{"step": 2, "weights": {"a": 0.7, "b": 0.3}}\n')
    outcome = cli("doremi", "average", "--history", history, "--output", tmp_path / "w.json")
    assert outcome.code == 0, outcome.stderr
    assert outcome.stdout.strip() == "domain_weights: [0.600000, 0.400000]  # a, b"
    assert json.loads((tmp_path / "w.json").read_text()) == pytest.approx({"a": 0.6, "b": 0.4})
    assert_user_error(cli("doremi", "average", "--history", tmp_path / "missing.jsonl"), "missing.jsonl")


def test_held_out_split_shares_no_document_with_training(tiny_data, tmp_path):
    from nanotron.data.preprocess import preprocess

    corpus = write_corpus(tmp_path / "raw", documents=50)
    train = preprocess([corpus], tiny_data["tokenizer"], tmp_path / "train", num_workers=1, split="train",
                       held_out_every=10)
    held = preprocess([corpus], tiny_data["tokenizer"], tmp_path / "held", num_workers=1, split="held-out",
                      held_out_every=10)
    everything = preprocess([corpus], tiny_data["tokenizer"], tmp_path / "all", num_workers=1)
    assert (train["num_documents"], held["num_documents"]) == (45, 5)
    assert train["num_tokens"] + held["num_tokens"] == everything["num_tokens"]


@pytest.mark.parametrize("doremi, fragments", [
    ({"domain_weights": [0.5, 0.3, 0.3]}, ("doremi.domain_weights must sum to 1",)),
    ({"domain_weights": [0.5, 0.5]}, ("doremi.domain_weights has 2 entries", "3 dataset folders")),
    ({"ref_model_resume_checkpoint_path": "/nonexistent/ref"}, ("/nonexistent/ref", "does not exist")),
])
def test_bad_doremi_input_is_one_error_line(tiny_data, doremi_domains, tmp_path, doremi, fragments):
    config = doremi_config(tiny_data, doremi_domains, tmp_path / "run", **doremi)
    outcome = cli("doremi", "train", "--config-file", write_config(tmp_path / "proxy.yaml", config))
    assert_user_error(outcome, *fragments)


def test_a_reference_with_another_vocabulary_is_refused(tiny_data, doremi_domains, doremi_reference, tmp_path):
    config = doremi_config(tiny_data, doremi_domains, tmp_path / "run", reference=doremi_reference)
    config["model"]["model_config"]["vocab_size"] = 512
    outcome = cli("doremi", "train", "--config-file", write_config(tmp_path / "proxy.yaml", config))
    assert_user_error(outcome, "vocabulary of 384", "vocab_size is 512")


def test_a_proxy_over_folders_of_one_name_keys_its_weights_by_the_end_of_their_paths(tiny_data, doremi_domains,
                                                                                     doremi_reference, tmp_path):
    """They were refused as domains of one name."""
    folders = [tmp_path / "a" / "animals", tmp_path / "b" / "animals", doremi_domains[1]]
    for source, folder in zip(doremi_domains[:2], folders):
        shutil.copytree(source, folder)
    run = tmp_path / "run"
    config = doremi_config(tiny_data, folders, run, reference=doremi_reference, steps=2)
    assert cli("doremi", "train", "--config-file", write_config(tmp_path / "proxy.yaml", config)).code == 0
    names = {"a/animals", "b/animals", "colours"}
    history = [json.loads(line) for line in (run / "domain_weights.jsonl").read_text().splitlines()]
    assert [set(record["weights"]) for record in history] == [names, names]
    assert set(json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["domain_losses"]) == names


def _doremi_loss_is_compiled(config: dict) -> dict:
    """Build the proxy trainer with model.compile, recording what ``torch.compile`` is given; call its language-model
    loss on a micro-batch weighted as DoReMi weighs it, compiled and eagerly, and by hand."""
    from nanotron.config import config_from_dict
    from nanotron.data.batch import MicroBatch
    from nanotron.features import features_for
    from nanotron.layout import Group
    from nanotron.trainer import Trainer
    from nanotron.training.objective import micro_batch_loss

    compiled, real_compile = {}, torch.compile

    def recording_compile(function, *args, **kwargs):
        result = real_compile(function, *args, **kwargs)
        compiled[id(result)] = function
        return result

    torch.compile = recording_compile
    try:
        proxy = config_from_dict(config)
        trainer = Trainer(proxy, features=features_for(proxy, doremi_proxy=True))
    finally:
        torch.compile = real_compile
    labels = torch.randint(0, 384, (2, 8))
    batch = MicroBatch(labels, labels, torch.ones(2, 8, dtype=torch.bool), torch.tensor([0, 2]),
                       token_count=torch.tensor(16.0), sample_weights=torch.tensor([0.1, 0.3]))
    logits = torch.randn(2, 8, trainer.model.padded_vocab_size)
    loss_function = trainer.program.objective_at(1).language_model.loss
    arguments = (logits, batch, trainer.pc.group(Group.TP), 384, 3)
    loss = loss_function(*arguments)[0]
    source = compiled.get(id(loss_function))
    eager = (source or loss_function)(*arguments)[0]
    by_hand = (torch.nn.functional.cross_entropy(logits[..., :384].transpose(1, 2), labels, reduction="none").sum(-1)
               * batch.sample_weights).sum()
    trainer.pc.destroy()
    return {"compiled": source is micro_batch_loss, "equal": torch.allclose(loss, eager, rtol=1e-5),
            "weighted": torch.allclose(eager, by_hand, rtol=1e-5)}


@pytest.mark.full_tier
def test_the_doremi_loss_is_compiled_when_the_model_is(tiny_data, doremi_domains, doremi_reference, tmp_path):
    config = doremi_config(tiny_data, doremi_domains, tmp_path / "proxy", reference=doremi_reference, steps=1)
    config["model"]["compile"] = True
    assert run_distributed(_doremi_loss_is_compiled, 1, config=config) == [
        {"compiled": True, "equal": True, "weighted": True}]


# --- DoReMi weights resumed onto other domains ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def proxy_run(tiny_data, doremi_domains, doremi_reference, tmp_path_factory) -> Path:
    """A DoReMi proxy over the domains animals, colours, rivers, stopped with a checkpoint at step 3."""
    run = tmp_path_factory.mktemp("proxy") / "run"
    config = doremi_config(tiny_data, doremi_domains, run, reference=doremi_reference, steps=3)
    assert cli("doremi", "train", "--config-file", write_config(run.parent / "proxy.yaml", config)).code == 0
    return run


def _resume_proxy(tiny_data, folders, reference, checkpoint: Path, run: Path, **doremi) -> Outcome:
    """One more step (4) of the proxy from ``checkpoint``, written to ``run``, by ``nanotron doremi train``."""
    config = doremi_config(tiny_data, folders, run, reference=reference, resume=checkpoint, steps=4, **doremi)
    return cli("doremi", "train", "--config-file", write_config(run.parent / f"{run.name}.yaml", config))


def _first_weights(run: Path) -> dict[str, float]:
    """The weights the first resumed step trained with, by domain: those the checkpoint saved."""
    (record,) = [json.loads(line) for line in (run / "domain_weights.jsonl").read_text().splitlines()]
    assert record["step"] == 4
    return record["weights"]


def _as_written_before(checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of ``checkpoint`` holding its weights as checkpoints did before they were keyed by name: a list in the
    order of the domains of its config."""
    copy = tmp_path / "old"
    shutil.copytree(checkpoint, copy)
    metadata = json.loads((copy / "checkpoint.json").read_text())
    weights = metadata["domain_weights"]
    if isinstance(weights, dict):  # (a checkpoint of the code before the change already holds a list)
        metadata["domain_weights"] = [weights[name] for name in DOMAINS]
    # Those checkpoints were of format 2, which carried no manifest checksum.
    metadata.pop("manifest_sha256", None)
    metadata["format_version"] = 2
    (copy / "checkpoint.json").write_text(json.dumps(metadata))
    return copy


@pytest.mark.parametrize("written", ["by-name", "as-a-list-before"])
@pytest.mark.slow
def test_resumed_domain_weights_follow_their_domain_when_the_folders_are_reordered(
        tiny_data, doremi_domains, doremi_reference, proxy_run, tmp_path, written):
    checkpoint = proxy_run / "3"
    if written == "as-a-list-before":
        checkpoint = _as_written_before(checkpoint, tmp_path)
    assert _resume_proxy(tiny_data, doremi_domains, doremi_reference, checkpoint, tmp_path / "same").code == 0
    assert _resume_proxy(tiny_data, doremi_domains[::-1], doremi_reference, checkpoint, tmp_path / "reversed").code == 0
    expected = _first_weights(tmp_path / "same")
    assert len(set(expected.values())) == len(DOMAINS)  # the weights moved apart: a swap would show
    assert _first_weights(tmp_path / "reversed") == expected


@pytest.mark.parametrize("written, change, fragments", [
    ("by-name", {"domain_names": ["animals", "colours", "lakes"]}, ("new: lakes", "gone: rivers")),
    pytest.param("by-name", {"folders": 2}, ("gone: rivers",), marks=pytest.mark.full_tier),
    pytest.param("as-a-list-before", {"domain_names": ["animals", "colours", "lakes"]}, ("new: lakes", "gone: rivers"),
                 marks=pytest.mark.full_tier),
], ids=["renamed", "removed", "renamed-as-a-list-before"])
@pytest.mark.slow
def test_resuming_domain_weights_onto_other_domains_is_refused(
        tiny_data, doremi_domains, doremi_reference, proxy_run, tmp_path, written, change, fragments):
    checkpoint = proxy_run / "3"
    if written == "as-a-list-before":
        checkpoint = _as_written_before(checkpoint, tmp_path)
    config = doremi_config(tiny_data, doremi_domains[:change.get("folders", 3)], tmp_path / "run",
                           reference=doremi_reference, resume=checkpoint, steps=4,
                           domain_names=change.get("domain_names"))
    outcome = python_process("-m", "nanotron", "doremi", "train", "--config-file",
                             write_config(tmp_path / "resume.yaml", config))
    assert_user_error(outcome, str(checkpoint), "data_stages[0].data.dataset.dataset_folder", *fragments)
    assert not (tmp_path / "run" / "domain_weights.jsonl").exists()


def test_domains_of_the_same_name_are_refused(tiny_data, doremi_domains, doremi_reference, tmp_path):
    config = doremi_config(tiny_data, doremi_domains, tmp_path / "run", reference=doremi_reference,
                           domain_names=["animals", "colours", "animals"])
    assert_user_error(cli("doremi", "train", "--config-file", write_config(tmp_path / "proxy.yaml", config)),
                      "'animals' names several domains", "give each its own name in doremi.domain_names")
