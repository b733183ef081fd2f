"""DoReMi under document masking: the reference model's token losses, which the proxy's excess losses subtract, are
computed as the proxy's forward reads the micro-batch (positions restarting per document, attention inside each
document), so that each equals the reference's loss on that document run alone."""

from __future__ import annotations

import pytest
import torch

from support.configs import MAMBA, doremi_config, tiny_config_dict
from support.distributed import run_distributed

QWEN2_DOCUMENTS = {"is_qwen2_config": True, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "max_position_embeddings": 64, "tie_word_embeddings": True, "_use_doc_masking": True}


def _with_documents(config: dict) -> dict:
    # Large initial weights: attention then weighs other tokens strongly, so a token that sees another document's
    # tokens gets a clearly different loss.
    config["model"] = config["model"] | {"model_config": QWEN2_DOCUMENTS, "init_method": {"std": 0.3}}
    return config


def _reference_and_per_document_losses(reference: dict, proxy: dict) -> dict:
    """Trains the reference for one step, then has the proxy's DoReMi feature compute the reference losses of its
    first step's micro-batches, and runs the reference on every document of them alone."""
    from nanotron.config import config_from_dict
    from nanotron.features import features_for
    from nanotron.features.doremi import DoReMiProxy
    from nanotron.generation.generate import forward_logits
    from nanotron.layout import Group
    from nanotron.parallel.cross_entropy import vocab_parallel_token_losses
    from nanotron.trainer import Trainer

    Trainer(config_from_dict(reference)).train()
    config = config_from_dict(proxy)
    trainer = Trainer(config, features=features_for(config, doremi_proxy=True))
    (feature,) = [f for f in trainer.features if isinstance(f, DoReMiProxy)]
    batches = trainer.loader(config.data_stages[0]).next_step()
    feature.before_forward_backward(batches)

    def losses(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = forward_logits(feature.reference, trainer.pc, ids[None], None, None, None, last_only=False,
                                gather=False)
        return vocab_parallel_token_losses(logits, labels[None], trainer.pc.group(Group.TP),
                                           feature.reference.config.vocab_size)[0]

    computed, alone, across, packed = [], [], [], 0
    for mb in batches:
        for row in range(mb.input_ids.shape[0]):
            documents = mb.document_ids[row]
            packed += int(documents.max() > 0)
            kept = mb.label_mask[row]
            computed.append(mb.extras["reference_losses"][row][kept])
            across.append(losses(mb.input_ids[row], mb.labels[row])[kept])
            alone.append(torch.cat([
                losses(mb.input_ids[row][documents == d], mb.labels[row][documents == d])[kept[documents == d]]
                for d in documents.unique()]))
    return {"computed": torch.cat(computed), "alone": torch.cat(alone), "across": torch.cat(across),
            "packed": packed}


@pytest.mark.slow
def test_reference_losses_equal_each_document_run_alone(tiny_data, doremi_domains, tmp_path):
    reference_run = tmp_path / "reference"
    reference = _with_documents(tiny_config_dict(
        tiny_data, reference_run, tokens={"train_steps": 1},
        checkpoints={"checkpoints_path": str(reference_run), "checkpoint_interval": 1000}))
    proxy = _with_documents(doremi_config(tiny_data, doremi_domains, tmp_path / "proxy", reference=reference_run,
                                          steps=1))
    (result,) = run_distributed(_reference_and_per_document_losses, 1, reference=reference, proxy=proxy)
    assert result["packed"] >= 2, "no sample packs two documents: the test would not tell masking from none"
    torch.testing.assert_close(result["computed"], result["alone"], rtol=1e-5, atol=1e-5)
    # The losses across documents (the reference's forward without the documents) differ clearly.
    assert (result["across"] - result["alone"]).abs().max() > 1e-2


def test_a_reference_that_cannot_mask_documents_is_refused_before_training(tiny_data, doremi_domains, tmp_path):
    """A Mamba reads a packed sample on through its documents: its losses cannot be those of each document alone,
    so a proxy that masks documents refuses it with one line naming both keys, before any model is built."""

    from nanotron.config import ConfigError, config_from_dict
    from nanotron.features.doremi import reference_checkpoint
    from nanotron.trainer import Trainer

    reference_run = tmp_path / "reference"
    reference = tiny_config_dict(tiny_data, reference_run, tokens={"train_steps": 1},
                                 checkpoints={"checkpoints_path": str(reference_run), "checkpoint_interval": 1000})
    reference["model"]["model_config"] = MAMBA
    Trainer(config_from_dict(reference)).train()
    proxy = _with_documents(doremi_config(tiny_data, doremi_domains, tmp_path / "proxy", reference=reference_run,
                                          steps=1))
    with pytest.raises(ConfigError, match=r"_use_doc_masking is true, but the reference .* is a mamba model"):
        reference_checkpoint(config_from_dict(proxy))
    proxy["model"]["model_config"] = proxy["model"]["model_config"] | {"_use_doc_masking": False}
    assert reference_checkpoint(config_from_dict(proxy)) is not None
