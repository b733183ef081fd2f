"""Upstream nanotron's 23 example configs (tests/upstream_configs) load as written, or are refused one line per
feature we lack; those that load train 2 steps with only data, tokenizer and checkpoint paths and sizes substituted.
Plus the loader behaviours they need: duplicate keys, honest did-you-mean hints, the MoE hint, one ignored-keys
warning."""

import copy
import json
import warnings
from pathlib import Path

import pytest
import yaml

from nanotron.config import (
    ConfigError,
    DuplicateKeyWarning,
    HFDatasetArgs,
    LegacyKeyWarning,
    RunLengthWarning,
    closest_key,
    config_from_dict,
    load_config,
    save_config,
)
from support.configs import write_config
from support.corpus import corpus_documents, datatrove_folder, pretokenized_domains
from support.runs import assert_user_error, cli, metrics, train_through_cli

UPSTREAM = Path(__file__).parent / "upstream_configs"
FILES = sorted(str(path.relative_to(UPSTREAM)) for path in UPSTREAM.glob("*/*.yaml"))

# Every one loads as written: a file's keys are read with their upstream meaning, ignored by name, or dropped at
# their "off" value; none is refused. Trained in the quick tier: the two below; in the default tier also one file of
# each other mechanism (slow); in the full tier every file.
QUICK_TIER = {"main/config_tiny_llama.yaml", "v0.4/moe__config_llamoe.yaml"}
DEFAULT_TIER = {"v0.4/mamba__config_mamba.yaml", "main/mup__configs__mup_350m_llama_config.yaml",
                "v0.4/doremi__configs__config_280m_llama_proxy.yaml", "main/config_qwen.yaml",
                "main/custom-dataloader__config_custom_dl.yaml"}
REFERENCE_EXAMPLE = "main/doremi__configs__config_280m_llama.yaml"
SEQUENCE_LENGTH = 32


def _problems(path: Path) -> list[str]:
    try:
        load_config(path)
    except ConfigError as error:
        return error.problems
    return []


def test_every_upstream_example_is_here():
    assert len(FILES) == 23


@pytest.mark.parametrize("name", FILES)
def test_upstream_example_loads_as_written(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _problems(UPSTREAM / name) == []
    assert sum(issubclass(w.category, LegacyKeyWarning) for w in caught) <= 1  # every ignored key in one warning


def _substituted(name: str, tiny_data, data: dict[str, Path], run: Path) -> dict:
    """The upstream file with only paths and sizes replaced: our tiny data, tokenizer and checkpoint folder, a tiny
    model, 2 steps on one process."""
    raw = yaml.safe_load((UPSTREAM / name).read_text())
    checkpoints = raw["checkpoints"]
    checkpoints.update(checkpoints_path=str(run), resume_checkpoint_path=None)
    raw["tokenizer"]["tokenizer_name_or_path"] = str(tiny_data["tokenizer"])
    stages = raw.get("data_stages") or [{"data": raw.get("data")}]
    for stage in stages:  # their kind of data: datatrove folders, a Hugging Face dataset, or synthetic tokens
        dataset = stage["data"].get("dataset")
        if dataset is not None and "hf_dataset_or_datasets" in dataset:  # DoReMi's: pre-tokenized, one per domain
            dataset.update(hf_dataset_or_datasets=str(data["doremi" if raw.get("doremi") else "jsonl"]),
                           hf_dataset_config_name=None,
                           dataset_processing_num_proc_per_process=1)  # sized for this machine (theirs: up to 12)
        elif dataset is not None:
            folders = dataset["dataset_folder"]
            weights = list(folders.values()) if isinstance(folders, dict) else None
            count = len(weights or ([folders] if isinstance(folders, str) else folders))
            dataset.update(dataset_folder=_domains_of(data["datatrove"], run, count),
                           dataset_weights=weights or dataset.get("dataset_weights"),
                           tokenizer_name=str(tiny_data["tokenizer"].parent),  # the folder of the file datatrove names
                           vocab_size=384, token_size_in_bytes=2)
        stage["data"]["num_loading_workers"] = 0
    if raw.get("doremi", {}).get("ref_model_resume_checkpoint_path"):
        raw["doremi"]["ref_model_resume_checkpoint_path"] = str(data["doremi_reference"])
    if raw.get("profiler"):
        raw["profiler"]["profiler_export_path"] = str(run / "profile")
    raw["parallelism"].update(dp=1, tp=1, pp=1, expert_parallel_size=1)
    raw["tokens"].update(sequence_length=SEQUENCE_LENGTH, micro_batch_size=2, batch_accumulation_per_replica=1,
                         train_steps=2)
    model = raw["model"]["model_config"]
    if model.get("is_mamba_config"):
        model.update(vocab_size=384, d_model=64, num_hidden_layers=2)
        return raw
    model.update(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    if "moe_num_experts" in model:
        model.update(moe_num_experts=2, num_experts_per_tok=1)
    return raw


def _domains_of(folder: Path, run: Path, count: int) -> list[str]:
    """``count`` folders of ``folder``'s files under names of their own (one folder listed twice is refused)."""
    if count == 1:
        return [str(folder)]
    domains = []
    for index in range(count):
        domain = run.parent / f"{folder.name}-{index}"
        if not domain.exists():
            domain.symlink_to(folder.resolve(), target_is_directory=True)
        domains.append(str(domain))
    return domains


@pytest.fixture(scope="module")
def their_data(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """The tiny corpus as upstream users hold it: tokenized by datatrove, as a folder of jsonl files (the text under
    both column names the examples read), and as DoReMi's pre-tokenized datasets of the Pile's 22 domains (rows of
    sequence_length + 1 ids saved by save_to_disk, one folder per domain name)."""
    root = tmp_path_factory.mktemp("their_data")
    documents = corpus_documents(tiny_data["corpus"])
    (root / "jsonl").mkdir()
    (root / "jsonl" / "train.jsonl").write_text(
        "".join(json.dumps({"text": text, "completion": text}) + "\n" for text in documents))
    names = _upstream("main/doremi__configs__config_280m_llama_proxy.yaml")["doremi"]["domain_names"].split(",")
    domains = {name.strip(): documents[index::len(names)] for index, name in enumerate(names)}
    return {"datatrove": datatrove_folder(root / "datatrove", documents, tiny_data["tokenizer"]),
            "jsonl": root / "jsonl",
            "doremi": pretokenized_domains(root / "the_pile", domains, tiny_data["tokenizer"], SEQUENCE_LENGTH),
            "doremi_names": list(domains)}


@pytest.fixture(scope="module")
def doremi_reference(tiny_data, their_data, tmp_path_factory) -> Path:
    """The checkpoint of upstream's DoReMi reference example trained 2 steps, which the proxy examples read."""
    root = tmp_path_factory.mktemp("doremi_reference")
    config = _substituted(REFERENCE_EXAMPLE, tiny_data, their_data, root / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunLengthWarning)
        warnings.simplefilter("ignore", LegacyKeyWarning)
        train_through_cli(config, root / "config.yaml")
    return root / "run" / "2"


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in QUICK_TIER else pytest.mark.slow
                                                if name in DEFAULT_TIER else pytest.mark.full_tier)
                                  for name in FILES])
def test_upstream_example_trains_with_paths_and_sizes_substituted(name, tiny_data, their_data, tmp_path,
                                                                  monkeypatch, request):
    """A DoReMi proxy example trains its proxy (``nanotron doremi train``, as upstream's train_doremi.py) against
    the reference example's checkpoint."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    run = tmp_path / "run"
    proxy = "proxy" in name
    data = their_data | ({"doremi_reference": request.getfixturevalue("doremi_reference")} if proxy else {})
    config = write_config(tmp_path / "config.yaml", _substituted(name, tiny_data, data, run))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunLengthWarning)  # their warmups and later stages outlast 2 steps
        warnings.simplefilter("ignore", LegacyKeyWarning)
        outcome = cli(*(("doremi", "train") if proxy else ("train",)), "--config-file", config)
    assert outcome.code == 0, outcome.stderr[-3000:]
    records = metrics(run)
    assert [record["step"] for record in records] == [1, 2]
    if "doremi" in name:  # the 22 domains of the Pile, each read from its own pre-tokenized dataset
        assert set(records[0]["domain_losses"]) <= set(their_data["doremi_names"]), records[0]
    if proxy:
        assert list(records[-1]["domain_weights"]) == their_data["doremi_names"]


# --- what upstream keys mean here ---------------------------------------------------------------------------------


def _upstream(name: str) -> dict:
    return yaml.safe_load((UPSTREAM / name).read_text())


def _loaded(raw: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_from_dict(raw)


def test_optimizer_factory_selects_adamw_with_its_settings():
    raw = _upstream("main/config_tiny_llama.yaml")
    raw["optimizer"]["optimizer_factory"].update(adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6,
                                                 torch_adam_is_fused=False)
    optimizer = _loaded(raw).optimizer
    assert (optimizer.adam_beta1, optimizer.adam_beta2, optimizer.adam_eps, optimizer.torch_adam_is_fused) == (
        0.8, 0.99, 1e-6, False)


def test_optimizer_factory_and_flat_fields_that_disagree_are_one_line_naming_the_override():
    raw = _upstream("main/config_tiny_llama.yaml")
    raw["optimizer"]["adam_beta1"] = 0.5
    with pytest.raises(ConfigError) as info:
        _loaded(raw)
    assert info.value.problems == ["optimizer.adam_beta1 (0.5) and optimizer.optimizer_factory.adam_beta1 (0.9) "
                                   "disagree; keep one of them, or set both with --override optimizer.adam_beta1="
                                   "<value>"]


def test_optimizer_factory_and_flat_fields_agree_as_numbers_not_as_written(tmp_path):
    """YAML 1.1 reads ``1e-8`` as a string and ``1.0e-08`` as a number: the same value."""
    raw = _upstream("main/config_tiny_llama.yaml")
    text = yaml.safe_dump(raw, sort_keys=False).replace("  zero_stage: 0\n", "  zero_stage: 0\n  adam_eps: 1e-8\n")
    assert "adam_eps: 1e-8" in text and "adam_eps: 1.0e-08" in text
    path = tmp_path / "both.yaml"
    path.write_text(text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_config(path).optimizer.adam_eps == 1e-8


def test_zero_stage_3_in_an_upstream_file_loads_as_written(tmp_path):
    """Upstream nanotron accepts ``zero_stage: 3`` (its open request for ZeRO-3); here it shards parameters."""
    path = tmp_path / "zero3.yaml"
    upstream = (UPSTREAM / "main" / "config_tiny_llama.yaml").read_text()
    path.write_text(upstream.replace("zero_stage: 0", "zero_stage: 3"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_config(path).optimizer.zero_stage == 3


@pytest.mark.parametrize("key", ["optimizer.adam_beta1", "optimizer.optimizer_factory.adam_beta1"])
def test_an_override_of_either_spelling_of_an_adamw_setting_wins(tmp_path, key):
    raw = _upstream("main/config_tiny_llama.yaml")
    raw["optimizer"]["adam_beta1"] = 0.9  # the file gives both spellings, as some upstream files do
    path = write_config(tmp_path / "config.yaml", raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_config(path, [f"{key}=0.8"]).optimizer.adam_beta1 == 0.8


def test_a_null_optimizer_factory_is_no_factory():
    raw = _upstream("main/config_tiny_llama.yaml")
    raw["optimizer"].update(optimizer_factory=None, adam_eps=1e-6)
    assert _loaded(raw).optimizer.adam_eps == 1e-6


@pytest.mark.parametrize("key, fix", [
    ("zero_stage", "zero_stage is a setting of the optimizer section; write it as optimizer.zero_stage"),
    ("momentum", "momentum is not a setting of AdamW or Muon; remove it"),
])
def test_a_key_inside_optimizer_factory_that_is_not_adamws_is_refused_naming_its_place(key, fix):
    raw = _upstream("main/config_tiny_llama.yaml")
    raw["optimizer"]["optimizer_factory"][key] = 1
    with pytest.raises(ConfigError) as info:
        _loaded(raw)
    (problem,) = info.value.problems
    assert problem.startswith(f"optimizer.optimizer_factory.{key} is misplaced") and problem.endswith(fix), problem


def test_another_optimizer_is_refused_by_name():
    raw = _upstream("main/config_tiny_llama.yaml")
    raw["optimizer"]["optimizer_factory"] = {"name": "sgd"}
    with pytest.raises(ConfigError, match=r"optimizer_factory.name \(sgd\): the optimizers are adamW and muon"):
        _loaded(raw)


def test_optimizer_factory_selects_muon_with_its_settings_and_adamws_for_the_rest():
    raw = _upstream("main/config_tiny_llama.yaml")
    raw["optimizer"]["optimizer_factory"].update(name="muon", muon_momentum=0.9, muon_ns_steps=4, adam_beta1=0.8)
    optimizer = _loaded(raw).optimizer
    assert (optimizer.name, optimizer.muon_momentum, optimizer.muon_ns_steps, optimizer.adam_beta1) == (
        "muon", 0.9, 4, 0.8)


def test_flat_and_factory_optimizer_names_that_disagree_are_one_line():
    raw = _upstream("main/config_tiny_llama.yaml")
    raw["optimizer"]["optimizer_factory"]["name"] = "muon"
    raw["optimizer"]["name"] = "adamw"
    with pytest.raises(ConfigError) as info:
        _loaded(raw)
    assert info.value.problems == ["optimizer.name (adamw) and optimizer.optimizer_factory.name (muon) disagree; "
                                   "keep one of them, or set both with --override optimizer.name=<value>"]


def test_dataset_folder_mapping_is_folders_and_weights():
    cfg = _loaded(_upstream("main/config_nanoset.yaml"))
    blended = cfg.data_stages[2].data.dataset
    assert [str(f) for f in blended.dataset_folder] == ["datasets/SlimPajama-6B/tokenized", "datasets/c4-es/tokenized"]
    assert blended.dataset_weights == [0.8, 0.2]


def test_hf_dataset_keys_and_null_dataset_load_into_typed_fields():
    cfg = _loaded(_upstream("main/custom-dataloader__config_custom_dl.yaml"))
    synthetic, hf = (stage.data.dataset for stage in cfg.data_stages)
    assert synthetic is None
    assert hf == HFDatasetArgs(hf_dataset_or_datasets="stas/openwebtext-10k",
                               hf_dataset_splits=["train"], hf_dataset_config_name=None,
                               dataset_processing_num_proc_per_process=1, dataset_overwrite_cache=False,
                               text_column_name="text")


def test_v04_data_section_and_comma_separated_domain_names():
    cfg = _loaded(_upstream("v0.4/doremi__configs__config_280m_llama.yaml") | {"tokens": {
        "sequence_length": 256, "train_steps": 10, "micro_batch_size": 1, "batch_accumulation_per_replica": 1}})
    (stage,) = cfg.data_stages
    assert stage.start_training_step == 1 and isinstance(stage.data.dataset, HFDatasetArgs)
    assert cfg.doremi.domain_names[:3] == ["Pile-CC", "Github", "OpenWebText2"] and len(cfg.doremi.domain_names) == 22


def test_qwen2_marker_is_the_qwen2_family():
    raw = _upstream("main/config_resume_training.yaml")
    raw["model"]["model_config"]["attention_bias"] = True
    model = _loaded(raw).model.model_config
    assert type(model).__name__ == "Qwen2Config" and model.attention_bias and model.rope_theta == 100000


@pytest.mark.parametrize("key", ["rope_interleaved", "interleaved_rotary"])
def test_interleaved_rotary_true_is_refused_by_name(key):
    raw = _upstream("main/config_resume_training.yaml")
    raw["model"]["model_config"][key] = True
    with pytest.raises(ConfigError) as info:
        _loaded(raw)
    assert info.value.problems == [
        f"model.model_config.{key} (true): the interleaved rotary layout is not available yet; remove {key} or set it "
        "to false: the Hugging Face layout (rotating the two halves of each head) is the one implemented"]


@pytest.mark.parametrize("key, value, feature", [
    ("parallelism.moe_layer_recompute", True, "recomputing the MoE layers alone"),
    ("metrics_logging", {"log_level": 1}, "detailed metrics logging"),
    ("model.init_method.scaling_method", "LAYER_INDEX", "only NUM_LAYERS is available"),
])
def test_features_we_lack_are_refused_in_one_line_naming_them(key, value, feature):
    raw = _upstream("main/config_resume_training.yaml")
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node[part]
    node[leaf] = value
    with pytest.raises(ConfigError) as info:
        _loaded(raw)
    (problem,) = info.value.problems
    assert problem.startswith(key) and feature in problem


def test_a_stage_sequence_length_equal_to_the_global_one_loads_and_another_is_refused():
    raw = _upstream("main/config_nanoset.yaml")
    raw["data_stages"][0]["sequence_length"] = raw["tokens"]["sequence_length"]
    assert _loaded(copy.deepcopy(raw)).tokens.sequence_length == raw["tokens"]["sequence_length"]
    raw["data_stages"][0]["sequence_length"] = 2 * raw["tokens"]["sequence_length"]
    with pytest.raises(ConfigError) as info:
        _loaded(raw)
    (problem,) = info.value.problems
    assert problem.startswith("data_stages[0].sequence_length") and "or to tokens.sequence_length" in problem


def test_an_override_of_data_stages_on_a_v04_file_names_the_data_key(tmp_path):
    outcome = cli("train", "--config-file", UPSTREAM / "v0.4/config_tiny_llama.yaml",
                  "--override", "data_stages.0.data.seed=5")
    assert_user_error(outcome, "'data_stages.0.data.seed=5'", "v0.4's data section", "override data.seed=5 instead")


def test_off_values_of_feature_keys_load_silently():
    raw = _upstream("main/config_resume_training.yaml")
    raw["parallelism"].update(context_parallel_size=1, moe_layer_recompute=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config_from_dict(raw)
    (ignored,) = [w for w in caught if issubclass(w.category, LegacyKeyWarning)]
    for key in ("context_parallel_size", "moe_layer_recompute"):
        assert key not in str(ignored.message)


def test_ignored_keys_are_named_in_one_warning():
    raw = _upstream("main/config_qwen.yaml")
    raw["model"]["model_config"]["_use_doc_masking"] = False
    raw["data_stages"][0]["data"]["dataset"]["return_positions"] = False
    with pytest.warns(LegacyKeyWarning) as record:
        config_from_dict(raw)
    (warning,) = [w for w in record if issubclass(w.category, LegacyKeyWarning)]
    for key in ("'s3_upload'", "'lighteval'", "'general.ignore_sanity_checks'", "'parallelism.tp_recompute_allgather'"):
        assert key in str(warning.message)


def test_a_repeated_key_warns_naming_it_and_the_last_one_wins(tmp_path):
    with pytest.warns(DuplicateKeyWarning, match=r"the key 'moe_config' is written more than once"):
        config = load_config(UPSTREAM / "main/config_qwen_with_moe.yaml")
    assert config.model.model_config.moe_config.num_experts == 8  # the last one, not null
    raw = _upstream("main/config_tiny_llama.yaml")
    written = f"  train_steps: {raw['tokens']['train_steps']}\n"
    path = write_config(tmp_path / "c.yaml", raw)
    path.write_text(path.read_text().replace(written, written + "  train_steps: 16\n"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyKeyWarning)
        with pytest.warns(DuplicateKeyWarning, match="'train_steps'"):
            assert load_config(path).tokens.train_steps == 16


def test_warmup_longer_than_the_run_and_late_stages_warn():
    raw = _upstream("main/contributor-guide__debug_config_tiny_llama.yaml")
    raw["tokens"]["train_steps"] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyKeyWarning)
        with pytest.warns(RunLengthWarning) as record:
            config_from_dict(raw)
    messages = [str(w.message) for w in record if issubclass(w.category, RunLengthWarning)]
    assert any("lr_warmup_steps (2) is longer than tokens.train_steps (1)" in m for m in messages)
    assert any("start_training_step (10) is after tokens.train_steps (1)" in m for m in messages)


def test_sequences_longer_than_the_positions_raise_them_for_fresh_weights_only():
    """Upstream's DoReMi and LlaMoE examples train sequences longer than their max_position_embeddings."""
    raw = _upstream("v0.4/moe__config_llamoe.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LegacyKeyWarning)
        with pytest.warns(RunLengthWarning, match=r"max_position_embeddings \(128\) is below tokens.sequence_length "
                                                  r"\(256\).*records max_position_embeddings: 256"):
            config = config_from_dict(copy.deepcopy(raw))
        assert config.model.model_config.max_position_embeddings == 256
        raw["model"]["model_config"]["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}  # now it means something
        with pytest.raises(ConfigError, match=r"tokens.sequence_length \(256\) exceeds"):
            config_from_dict(raw)


# --- hints ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, valid", [
    ("optimizer_factory", ["loss_spike_factor", "zero_stage"]),
    ("hf_dataset_splits", ["dataset_folder", "dataset_weights"]),
    ("context_parallel_size", ["expert_parallel_size", "dp"]),
    ("tp_recompute_allgather", ["recompute_layer"]),
    ("dataset_read_path", ["dataset_weights"]),
    ("metrics_logging", ["logging"]),
])
def test_no_hint_without_a_real_similarity(name, valid):
    assert closest_key(name, valid) is None


@pytest.mark.parametrize("name, hint", [
    ("learning_rate_schedular", "learning_rate_scheduler"), ("optimiser", "optimizer"), ("tp_mod", "tp_mode"),
    ("trian_steps", "train_steps"), ("datset_folder", "dataset_folder"), ("LearningRate", "learning_rate"),
])
def test_typos_get_hints(name, hint):
    valid = ["learning_rate_scheduler", "optimizer", "tp_mode", "train_steps", "dataset_folder", "learning_rate"]
    assert closest_key(name, valid) == hint


def test_unknown_upstream_like_key_gets_the_valid_keys_not_a_wrong_hint():
    raw = _upstream("main/config_tiny_llama.yaml")
    raw["parallelism"]["context_parallel_degree"] = 2
    with pytest.raises(ConfigError) as info:
        _loaded(raw)
    (problem,) = info.value.problems
    assert problem.startswith("unknown key 'parallelism.context_parallel_degree'; valid keys are: dp, pp, tp")


def test_moe_fields_under_a_llama_config_point_at_is_llamoe_config():
    raw = _upstream("main/config_tiny_llama.yaml")
    raw["model"]["model_config"].update(moe_num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ConfigError) as info:
        _loaded(raw)
    assert len(info.value.problems) == 2
    assert all("mixture-of-experts fields need 'is_llamoe_config: true'" in p for p in info.value.problems)


def test_translation_leaves_the_callers_data_alone():
    raw = _upstream("main/config_nanoset.yaml")
    before = copy.deepcopy(raw)
    _loaded(raw)
    assert raw == before


def test_fields_nothing_reads_are_named_in_the_ignored_keys_warning():
    """Set to another value than what runs anyway; the values our own saved configs hold say nothing."""
    raw = _upstream("v0.4/mamba__config_mamba.yaml")
    raw["model"]["init_method"] = {"std": 0.02}
    raw["tokenizer"]["tokenizer_max_length"] = 2048
    model = raw["model"]["model_config"]
    model.update(fused_add_norm=False, pad_vocab_size_multiple=16)
    model["ssm_cfg"]["use_fast_path"] = False
    with pytest.warns(LegacyKeyWarning) as record:
        config_from_dict(raw)
    (warning,) = [w for w in record if issubclass(w.category, LegacyKeyWarning)]
    for key in ("tokenizer.tokenizer_max_length", "model_config.fused_add_norm", "model_config.pad_vocab_size_multiple",
                "ssm_cfg.use_fast_path"):
        assert key in str(warning.message), warning.message


@pytest.mark.parametrize("name", ["main/config_qwen.yaml", "main/config_qwen_with_moe.yaml",
                                  "v0.4/mamba__config_mamba.yaml"])
def test_upstream_fields_nothing_reads_load_silently_and_are_never_saved(name, tmp_path):
    """Kernel choices, guard fields at their "off" value and unread fields at upstream's defaults: accepted without
    a word by the translation, and absent from the config nanotron saves (and from checkpoint.json)."""
    raw = _upstream(name)
    raw["model"]["init_method"] = {"std": 0.02}
    unread = {"_attn_implementation", "_fused_rms_norm", "_fused_rotary_emb", "_use_qkv_packed", "flex_attention_mask",
              "pretraining_tp", "rope_interleaved", "use_cache", "log_attn_probs", "ring_attn_heads_k_stride",
              "rope_seq_len_interpolation_factor", "rms_norm", "fused_add_norm", "pad_vocab_size_multiple"}
    assert unread & raw["model"]["model_config"].keys()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = config_from_dict(raw)
    assert not [w for w in caught if issubclass(w.category, LegacyKeyWarning) and "model_config" in str(w.message)]
    save_config(config, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert not unread & saved["model"]["model_config"].keys()
    assert "tokenizer_max_length" not in saved["tokenizer"]
    assert "token_dispatcher_type" not in (saved["model"]["model_config"].get("moe_config") or {})
    assert "use_fast_path" not in saved["model"]["model_config"].get("ssm_cfg", {})
