"""Document masking (``_use_doc_masking``): the documents packed in a sample (datatrove's conventions), the one
attention rule and its two kernels (flex attention against the SDPA reference), a packed sample against its
documents run alone (model and trainer: loss, global token count, gradients, fused head, z-loss), every layout,
resume, and the config keys (upstream's ``return_positions``). The GPU kernels' parity tests run only with CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch

from support.configs import tiny_config_dict, write_config
from support.distributed import run_distributed_each
from support.documents import assert_packed_sample_is_its_documents_alone
from support.kernels import relative_error
from support.parity import first_step
from support.runs import assert_user_error, cli, metrics, train_in_process, train_through_cli

EOS = 9
QWEN2_TINY = {"is_qwen2_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": True, "attention_bias": True,
              "sliding_window_size": 6, "no_rope_layer": 3, "_use_doc_masking": True}


def _model(**changes):
    from nanotron.config import Qwen2Config
    from nanotron.models.qwen2.model import Qwen2ForCausalLM

    config = Qwen2Config(**{k: v for k, v in QWEN2_TINY.items() if k != "is_qwen2_config"} | changes)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config, config.vocab_size)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return model


# --- the documents of a sample ---------------------------------------------------------------------------------------

def test_packed_documents_follow_datatrove_conventions():
    from nanotron.data.loader import packed_documents

    window = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 4, 3], [EOS, 1, 2, 3, 4, 5, 6, 7, 8]])
    packed = packed_documents(window[:, :-1] == EOS)
    # the end-of-document token belongs to the document it ends; positions restart after it
    assert packed["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]
    # the target after an end-of-document token (the next document's first token) is left out
    assert packed["label_mask"].tolist() == [[True, True, False, True, False, False, True, True],
                                             [False] + [True] * 7]
    # upstream's collator: label i is kept unless the window's position i + 1 restarts at 0
    full_positions = packed_documents(window == EOS)["position_ids"]
    assert torch.equal(packed["label_mask"], full_positions[:, 1:] != 0)


# --- the rule and its kernels ----------------------------------------------------------------------------------------

def _by_loops(query_index, key_index, window, query_document, key_document) -> torch.Tensor:
    batch = 1 if query_document is None else len(query_document)
    mask = torch.zeros(batch, 1, len(query_index), len(key_index), dtype=torch.bool)
    for b in range(batch):
        for i, q in enumerate(query_index.tolist()):
            for j, k in enumerate(key_index.tolist()):
                same = query_document is None or query_document[b, i] == key_document[b, j]
                mask[b, 0, i, j] = k <= q and (window is None or k > q - window) and bool(same)
    return mask


# Queries as context parallelism holds them: two chunks of a 16-token sequence, against all 16 keys.
CHUNKS = torch.cat([torch.arange(0, 4), torch.arange(12, 16)])


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("queries", ["sequence", "chunks"])
def test_the_rule_is_causal_windowed_and_per_document_over_explicit_vectors(window, documents, queries):
    from nanotron.nn.attention import AttentionMasks

    keys = torch.arange(16)
    query_index = keys if queries == "sequence" else CHUNKS
    key_document = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]) if documents else None
    query_document = key_document[:, query_index] if documents else None
    masks = AttentionMasks(query_index, keys, query_document, key_document)
    expected = _by_loops(query_index, keys, window, query_document, key_document)
    assert torch.equal(masks.dense(window).expand_as(expected), expected)


def test_plain_causal_attention_keeps_sdpas_causal_path_and_masks_are_shared():
    from nanotron.nn.attention import AttentionMasks

    plain = AttentionMasks.of_sequence(8, torch.device("cpu"))
    assert plain.for_window(None) is None  # SDPA's is_causal, as before document masking
    documents = AttentionMasks.of_sequence(8, torch.device("cpu"), documents=torch.zeros(2, 8, dtype=torch.long))
    assert documents.for_window(None) is not None and documents.for_window(3) is documents.for_window(3)


@pytest.mark.parametrize("window", [None, 4])
def test_flex_attention_matches_the_sdpa_reference(window):
    from nanotron.nn.attention import FLEX_AVAILABLE, AttentionMasks, attend

    if not FLEX_AVAILABLE:
        pytest.skip("flex attention needs torch>=2.5")
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, keys, dim = 2, 4, 2, 40, 16
    query_index = torch.cat([torch.arange(0, 10), torch.arange(30, 40)])  # chunks, as context parallelism
    key_document = torch.randint(0, 4, (batch, keys), generator=generator).sort(dim=1).values
    masks = AttentionMasks(query_index, torch.arange(keys), key_document[:, query_index], key_document)
    q = torch.randn(batch, heads, len(query_index), dim, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=generator, dtype=torch.float64) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager flex on CPU says it is not the fused kernel
        flex = attend(q, k, v, masks.block_mask(window))
    torch.testing.assert_close(flex, attend(q, k, v, masks.dense(window)), rtol=1e-10, atol=1e-12)


# --- a packed sample against its documents alone ---------------------------------------------------------------------

def test_a_packed_sample_trains_as_its_documents_alone():
    """float64, so that only the masking can tell the runs apart (fp32's summation order alone moves these gradients
    by up to 1e-5): three documents packed (the last cut by the window's end) against each run as its own sequence,
    through sliding, full and NoPE layers: the same loss and the same gradients."""
    assert_packed_sample_is_its_documents_alone(_model().double(), (7, 11, 9), EOS, 384, loss_rel=1e-12,
                                                grad_rtol=1e-9, grad_atol=1e-12)


def _config(tiny_data, run, chunk_tokens: int = 0, **model_config) -> dict:
    config = tiny_config_dict(tiny_data, run, model={"dtype": "float32", "init_method": {"std": 0.2},
                                                     "model_config": QWEN2_TINY | model_config,
                                                     "loss_chunk_tokens": chunk_tokens},
                              tokens={"sequence_length": 64, "micro_batch_size": 2,
                                      "batch_accumulation_per_replica": 2, "train_steps": 3})
    config["optimizer"]["learning_rate_scheduler"]["lr_warmup_steps"] = 1
    return config


def _documents_alone(model, micro_batches: list, ends: list[torch.Tensor],
                     z_coefficient: float = 0.0) -> tuple[float, float, dict]:
    """CE and z-loss over the step's kept targets, each document of each sample run on its own through a copy of
    the model, divided by the count of kept targets; and the gradients of their sum. ``ends``: per micro-batch, True
    on the last input token of every document."""
    from nanotron.models.qwen2.model import Qwen2ForCausalLM

    alone = Qwen2ForCausalLM(model.config, model.padded_vocab_size)
    alone.load_state_dict(model.state_dict())
    count = sum(int((~micro_batch_ends).sum()) for micro_batch_ends in ends)
    ce = z = 0.0
    for mb, micro_batch_ends in zip(micro_batches, ends):
        for ids, labels, row_ends in zip(mb.input_ids, mb.labels, micro_batch_ends):
            cuts = [0] + [i + 1 for i in row_ends.nonzero().flatten().tolist()] + [len(ids)]
            for start, end in zip(cuts, cuts[1:]):
                if start == end:
                    continue
                logits = alone(input_ids=ids[None, start:end]).float()[0]
                kept = ~row_ends[start:end]  # the last token of a document predicts the next document
                ce = ce + torch.nn.functional.cross_entropy(logits, labels[start:end], reduction="none")[kept].sum()
                z = z + z_coefficient * logits.logsumexp(-1)[kept].square().sum()
    (ce / count + z / count).backward()
    return (ce / count).item(), (z / count).item(), {name: p.grad for name, p in alone.named_parameters()}


@pytest.mark.parametrize("chunk_tokens", [0, 48], ids=["logits", "fused-head"])
@pytest.mark.slow
def test_the_trainer_step_is_the_documents_run_alone(tiny_data, tmp_path, chunk_tokens):
    """From the preprocessed folders (their end-of-document id) through the loader and the trainer: lm_loss is the
    sum over targets inside documents / their global count, the z-loss too, and the gradients follow."""
    from nanotron.config import config_from_dict
    from nanotron.trainer import Trainer

    config = _config(tiny_data, tmp_path / "run", chunk_tokens, z_loss_enabled=True, z_loss_coefficient=0.05)
    trainer = Trainer(config_from_dict(config))
    try:
        eos = trainer.document_ends["main"]
        assert eos == trainer.datasets["main"].eos_token_id
        micro_batches = first_step(trainer)
        assert sum(int((mb.input_ids == eos).sum()) for mb in micro_batches) >= 4  # documents to tell apart
        statistics = trainer.program.run(micro_batches, step=1)
        ce, z, grads = _documents_alone(trainer.model, micro_batches, [mb.input_ids == eos for mb in micro_batches],
                                        0.05)
        assert statistics["lm_loss"].item() == pytest.approx(ce, rel=1e-5)
        assert statistics["z_loss"].item() == pytest.approx(z, rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(trainer.buckets.gradient(name), grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        trainer.close()


# --- layouts, resume, sources ----------------------------------------------------------------------------------------

LAYOUTS = {
    "pp2-afab": ({"pp": 2, "pp_engine": "afab"}, 2),
    "tp2-sequence-parallel": ({"tp": 2, "tp_mode": "REDUCE_SCATTER"}, 2),
    "dp2-zero1": ({"dp": 2}, 2),
}


@pytest.mark.slow
def test_every_layout_trains_as_one_rank(tiny_data, tmp_path):
    """One 2-rank spawn for the three layouts; later pipeline stages read the documents too."""
    reference = train_in_process(_config(tiny_data, tmp_path / "reference"))
    calls = []
    for name, (parallelism, _) in LAYOUTS.items():
        config = _config(tiny_data, tmp_path / name)
        config["parallelism"] |= parallelism
        if "dp" in parallelism:
            config["optimizer"]["zero_stage"] = 1
            config["tokens"]["batch_accumulation_per_replica"] = 1  # the same global batch
        calls.append({"config": config})
    for name, ranks in zip(LAYOUTS, run_distributed_each(train_in_process, 2, calls)):
        for expected, got in zip(reference, ranks[0], strict=True):
            assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), (name, got["step"])
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), (name, got["step"])


@pytest.mark.slow
def test_a_resumed_run_continues_exactly(tiny_data, tmp_path):
    def config(run: str, steps: int) -> dict:
        config = _config(tiny_data, tmp_path / run)
        config["tokens"]["train_steps"] = steps
        config["optimizer"]["learning_rate_scheduler"]["lr_decay_steps"] = 3  # the schedule of the whole run
        config["checkpoints"]["resume_checkpoint_path"] = "auto"
        return config

    train_through_cli(config("straight", 3), tmp_path / "straight.yaml")
    train_through_cli(config("resumed", 2), tmp_path / "first.yaml")
    train_through_cli(config("resumed", 3), tmp_path / "second.yaml")
    expected, got = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [(m["step"], m["lm_loss"], m["grad_norm"]) for m in got] == [
        (m["step"], m["lm_loss"], m["grad_norm"]) for m in expected]


def test_synthetic_tokens_end_documents_at_the_models_eos_id(tiny_data, tmp_path):
    from nanotron.config import config_from_dict
    from nanotron.data.sources import SourceContext, build_source
    from nanotron.training.build import document_ends

    config = _config(tiny_data, tmp_path / "run", eos_token_id=5)
    config["data_stages"][0]["data"]["dataset"] = None
    config["tokenizer"] = {"tokenizer_name_or_path": None}
    synthetic = build_source(None, SourceContext(64, 0, 384, document_masking=True, model_eos_token_id=5))
    assert document_ends(config_from_dict(config), {"main": synthetic}) == {"main": 5}


def test_synthetic_tokens_without_an_eos_id_name_the_key_to_set(tiny_data, tmp_path):
    config = _config(tiny_data, tmp_path / "run", eos_token_id=None)
    config["data_stages"][0]["data"]["dataset"] = None
    config["tokenizer"] = {"tokenizer_name_or_path": None}
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    line = assert_user_error(outcome, "synthetic tokens (dataset: null)", "model.model_config.eos_token_id",
                             "set eos_token_id, or _use_doc_masking: false")
    assert "datatrove" not in line


@pytest.fixture(scope="module")
def datatrove_data(tiny_data, tmp_path_factory):
    from support.corpus import corpus_documents, datatrove_folder

    return datatrove_folder(tmp_path_factory.mktemp("datatrove"), corpus_documents(tiny_data["corpus"])[:60],
                            tiny_data["tokenizer"])


def _recorded_ends(folder, micro_batch: dict) -> torch.Tensor:
    """The last input token of every document, found without the loader: each sample located in the folder's one
    .ds file (windows start every sequence_length + 1 tokens), its documents' ends read from the .ds.index."""
    import numpy as np

    (file,) = folder.glob("*.ds")
    tokens = torch.from_numpy(np.fromfile(file, dtype="<u2").astype(np.int64))
    index = np.fromfile(file.with_name(file.name + ".index"), dtype="<u8").astype(np.int64)
    ends = torch.zeros_like(micro_batch.input_ids, dtype=torch.bool)
    for row, (ids, labels) in enumerate(zip(micro_batch.input_ids, micro_batch.labels)):
        window = torch.cat([ids, labels[-1:]])
        (start,) = [start for start in range(0, len(tokens) - len(window) + 1, len(window))
                    if torch.equal(tokens[start:start + len(window)], window)]
        inside = index[(index > start) & (index <= start + len(ids))]
        ends[row, inside - 1 - start] = True
    return ends


def test_datatrove_folders_without_end_of_document_tokens_are_cut_at_their_index(tiny_data, tmp_path):
    """A folder written without end-of-document tokens: its .ds.index says where the documents end, and the trainer
    step is that of the documents run alone (loss and gradients), without a tokenizer; a data-loading worker's copy
    of the dataset reads the same ends."""
    import pickle

    from nanotron.config import config_from_dict
    from nanotron.data.tokenizer import eos_token_id, load_tokenizer
    from nanotron.trainer import Trainer
    from support.corpus import corpus_documents, datatrove_folder

    eos = eos_token_id(load_tokenizer(tiny_data["tokenizer"]))
    folder = datatrove_folder(tmp_path / "data", corpus_documents(tiny_data["corpus"])[:60], tiny_data["tokenizer"],
                              eos_token=None)
    config = _config(tiny_data, tmp_path / "run")
    config["data_stages"][0]["data"]["dataset"] = {"dataset_folder": [str(folder)]}
    config["tokenizer"] = {"tokenizer_name_or_path": None}
    trainer = Trainer(config_from_dict(config))
    try:
        dataset = trainer.datasets["main"]
        assert dataset.records_document_ends and trainer.document_ends["main"] is None
        micro_batches = first_step(trainer)
        ends = [_recorded_ends(folder, mb) for mb in micro_batches]
        assert not any((mb.input_ids == eos).any() for mb in micro_batches)
        assert sum(int(micro_batch_ends.sum()) for micro_batch_ends in ends) >= 4  # documents to tell apart
        statistics = trainer.program.run(micro_batches, step=1)
        ce, _, grads = _documents_alone(trainer.model, micro_batches, ends)
        assert statistics["lm_loss"].item() == pytest.approx(ce, rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(trainer.buckets.gradient(name), grad, rtol=1e-4, atol=1e-6, msg=name)
        reopened = pickle.loads(pickle.dumps(dataset))
        assert torch.equal(reopened.samples(range(8))["document_ends"], dataset.samples(range(8))["document_ends"])
    finally:
        trainer.close()


def test_datatrove_files_without_an_index_end_documents_at_the_tokenizers_eos_id(tiny_data, datatrove_data,
                                                                                tmp_path):
    """Where the tokenizer added its end-of-document token, the recorded ends are those tokens; files without a
    .ds.index are cut at the tokenizer's id (with a warning), and refused without a tokenizer."""
    import logging
    import shutil

    from nanotron.config import config_from_dict
    from nanotron.data.tokenizer import eos_token_id, load_tokenizer
    from nanotron.trainer import Trainer

    eos = eos_token_id(load_tokenizer(tiny_data["tokenizer"]))
    unindexed = shutil.copytree(datatrove_data, tmp_path / "unindexed")
    for index in unindexed.glob("*.ds.index"):
        index.unlink()
    warned: list[str] = []
    warnings = logging.Handler(logging.WARNING)
    warnings.emit = lambda record: warned.append(record.getMessage())
    for folder, recorded in ((datatrove_data, True), (unindexed, False)):
        config = _config(tiny_data, tmp_path / f"run-{recorded}")
        config["data_stages"][0]["data"]["dataset"] = {"dataset_folder": [str(folder)]}
        warned.clear()
        logging.getLogger("nanotron.data.sources").addHandler(warnings)  # the trainer sets up "nanotron" anew
        try:
            trainer = Trainer(config_from_dict(config))
        finally:
            logging.getLogger("nanotron.data.sources").removeHandler(warnings)
        try:
            assert any("files without a .ds.index" in line and f"end-of-document id {eos}" in line
                       for line in warned) != recorded
            assert trainer.datasets["main"].records_document_ends == recorded
            assert trainer.document_ends["main"] == (None if recorded else eos)
            micro_batch = first_step(trainer)[0]
            assert (micro_batch.input_ids == eos).any()
            assert torch.equal(micro_batch.label_mask, micro_batch.input_ids != eos)
        finally:
            trainer.close()

    config["tokenizer"] = {"tokenizer_name_or_path": None}
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, "_use_doc_masking needs the ends of the documents", f"{unindexed}", "no .ds.index",
                      "set tokenizer.tokenizer_name_or_path")


# --- config ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, fragment", [
    ({"return_positions": False}, "return_positions is false, but model.model_config._use_doc_masking needs"),
    ({"flex_attention_mask": "document", "_use_doc_masking": False},
     "flex_attention_mask: document masks documents, which model.model_config._use_doc_masking switches on"),
], ids=["return-positions-false", "flex-document-without-masking"])
def test_contradicting_keys_are_refused_by_name(tiny_data, tmp_path, change, fragment):
    config = _config(tiny_data, tmp_path / "run")
    model_keys = {key: value for key, value in change.items() if key != "return_positions"}
    config["model"]["model_config"] |= model_keys
    if "return_positions" in change:
        config["data_stages"][0]["data"]["dataset"]["return_positions"] = change["return_positions"]
    outcome = cli("train", "--config-file", write_config(tmp_path / "config.yaml", config))
    assert_user_error(outcome, fragment)
    assert not (tmp_path / "run").exists()


# --- GPU: flex attention against the SDPA reference (skipped without CUDA) --------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
@pytest.mark.parametrize("window", [None, 512])
def test_cuda_uses_compiled_flex_matching_sdpa_at_4k(window):
    """At 4096 tokens: the masks on CUDA are block masks (no dense mask), and the compiled flex kernel's outputs and
    gradients match SDPA with the dense mask of the same rule."""
    from nanotron.nn.attention import AttentionMasks, BlockMask, attend

    device, length = torch.device("cuda"), 4096
    generator = torch.Generator(device).manual_seed(0)
    ends = torch.rand(2, length, device=device, generator=generator) < 1 / 700
    masks = AttentionMasks.of_sequence(length, device, documents=ends.long().cumsum(dim=1))
    block_mask = masks.for_window(window)
    assert isinstance(block_mask, BlockMask) and masks.for_window(window) is block_mask
    q = torch.randn(2, 8, length, 64, device=device, generator=generator, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, length, 64, device=device, generator=generator, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)
    outputs = {}
    for name, mask in (("flex", block_mask), ("sdpa", masks.dense(window))):
        out = attend(q, k, v, mask)
        out.backward(grad)
        outputs[name] = [out.float()] + [t.grad.float() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
    for what, flex, sdpa in zip(("out", "dq", "dk", "dv"), outputs["flex"], outputs["sdpa"]):
        assert relative_error(flex, sdpa) < 1e-2, what  # two bf16 kernels


@cuda_only
def test_cuda_model_with_documents_matches_the_cpu_reference():
    """The tiny Qwen2 model (sliding, full and NoPE layers) on a packed sample: CUDA's flex path in fp32 against the
    CPU's dense SDPA path."""
    from nanotron.data.loader import packed_documents

    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(10, 384, (2, 200), generator=generator)
    ids[ids % 17 == 0] = EOS
    packed = packed_documents(ids == EOS)
    model = _model()
    with torch.no_grad():
        reference = model(input_ids=ids, position_ids=packed["position_ids"], document_ids=packed["document_ids"])
        model.cuda()
        got = model(input_ids=ids.cuda(), position_ids=packed["position_ids"].cuda(),
                    document_ids=packed["document_ids"].cuda())
    assert relative_error(got.cpu(), reference) < 1e-5
