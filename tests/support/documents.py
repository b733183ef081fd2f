"""Document masking checked through a model: a window of documents packed, against each document run alone."""

from __future__ import annotations

import pytest
import torch


def assert_packed_sample_is_its_documents_alone(model, lengths: tuple[int, ...], eos: int, vocab_size: int,
                                                loss_rel: float, grad_rtol: float, grad_atol: float) -> None:
    """Random documents of ``lengths`` tokens (each but the last ending with ``eos``; the last is cut by the window's
    end) packed in one window through ``model`` with their document ids and restarting positions, against each run
    as its own sequence: the same summed cross-entropy over the targets inside documents (to ``loss_rel``) and the
    same gradients; without the masking the packed window's loss differs (what the check tells apart)."""
    from nanotron.data.loader import packed_documents

    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(10, vocab_size, (n,), generator=generator) for n in lengths]
    for document in documents[:-1]:
        document[-1] = eos
    window = torch.cat(documents)[None]
    inputs, labels = window[:, :-1], window[:, 1:]
    packed = packed_documents(inputs == eos)

    def losses(ids, targets, **kwargs):
        logits = model(input_ids=ids, **kwargs)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")

    packed_loss = losses(inputs, labels, position_ids=packed["position_ids"],
                         document_ids=packed["document_ids"])[packed["label_mask"].flatten()].sum()
    packed_loss.backward()
    packed_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    alone = sum(losses(document[None, :-1], document[None, 1:]).sum() for document in documents)
    alone.backward()
    assert int(packed["label_mask"].sum()) == sum(lengths) - len(lengths)  # every target inside a document
    assert packed_loss.item() == pytest.approx(alone.item(), rel=loss_rel)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=grad_rtol, atol=grad_atol, msg=name)
    with torch.no_grad():
        unmasked = losses(inputs, labels)[packed["label_mask"].flatten()].sum()
    assert abs(unmasked.item() - alone.item()) > 1e-3
