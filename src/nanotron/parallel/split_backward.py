"""A model chunk's backward in two parts: its input's gradient now (``I``), its weights' gradients later (``W``), as
the zero-bubble schedules run it (``pipeline_schedules.py``).

The split is made on the autograd graph, for any model (torchtitan's method, ``torch.distributed.pipelining``'s
``_backward.py``). A weight's gradient leaves the path to the input at the node that takes both, the weight's
*intermediate* (a linear's matmul takes its input and its weight). ``I`` runs the backward to the chunk's input
only, with the graph kept, and catches the gradient arriving at each intermediate; autograd computes no product that
only a weight needs (it runs only the outputs of a node that lead to the requested tensors). ``W`` runs the backward
from each intermediate, with the gradient caught there, to its weights: the products ``I`` left out, accumulated into
``.grad`` by autograd as a whole backward would (post-accumulate-grad hooks included, so data-parallel buckets fill
as usual). Both parts together compute exactly the products of the whole backward.

A weight is deferred only where that is exact and cheap: its path reaches the input's path at one intermediate, and
that node is one of autograd's own or a function that computes only the gradients the current backward asks for
(``splits_weight_gradients``: FP8's linear). Every other weight gets its gradient in ``I``, with the input's: a
compiled layer (one node for the whole layer), Mamba's scan kernels, a custom function that computes all its
gradients at once. A chunk without an input to differentiate (the first) runs its whole backward in ``I``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class DeferredWeightGradients:
    """The ``W`` half of a backward: per group of weights sharing an intermediate, the gradients caught there."""

    groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]]  # (edges, gradients, weights)

    def run(self) -> None:
        for edges, gradients, weights in self.groups:
            torch.autograd.backward(edges, gradients, inputs=weights, retain_graph=True)
        self.groups = []


def backward_input(roots: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor | None],
                   chunk_input: torch.Tensor | None, weights: Iterable[torch.Tensor]) -> DeferredWeightGradients:
    """The backward of ``roots`` (with ``gradients``, None for scalar losses) to ``chunk_input`` and the weights
    that cannot wait; the deferred weights' part is returned, to run later."""
    if chunk_input is None or not chunk_input.requires_grad:
        torch.autograd.backward(list(roots), list(gradients))
        return DeferredWeightGradients([])
    parents = _parents([root.grad_fn for root in roots if root.grad_fn is not None])
    input_node = get_gradient_edge(chunk_input).node
    leads_to_input = _ancestors(input_node, parents) if input_node in parents else set()
    now: list[torch.Tensor] = [chunk_input]
    by_intermediate: dict[Node, list[torch.Tensor]] = {}
    for weight in weights:
        if not weight.requires_grad:
            continue
        node = get_gradient_edge(weight).node
        if node not in parents:
            continue  # not used by this micro-batch
        intermediate = _single_intermediate(node, parents, leads_to_input)
        if intermediate is None:
            now.append(weight)
        else:
            by_intermediate.setdefault(intermediate, []).append(weight)

    caught: dict[Node, list[torch.Tensor | None]] = {}
    handles = [node.register_prehook(_catch(caught, node)) for node in by_intermediate]
    try:
        torch.autograd.backward(list(roots), list(gradients), inputs=now, retain_graph=bool(by_intermediate))
    finally:
        for handle in handles:
            handle.remove()
    groups = []
    for node, deferred in by_intermediate.items():
        pairs = [(GradientEdge(node, i), grad) for i, grad in enumerate(caught.get(node, ())) if grad is not None]
        if pairs:
            groups.append(([edge for edge, _ in pairs], [grad for _, grad in pairs], deferred))
    return DeferredWeightGradients(groups)


def _catch(caught: dict, node: Node):
    def hook(grad_outputs):
        caught[node] = list(grad_outputs)
    return hook


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node of the graph below ``roots``, with the nodes that send it a gradient."""
    parents: dict[Node, list[Node]] = {root: [] for root in roots}
    stack = list(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _ancestors(node: Node, parents: dict[Node, list[Node]]) -> set[Node]:
    """``node`` and every node whose gradient flows into it."""
    seen, stack = {node}, [node]
    while stack:
        for parent in parents[stack.pop()]:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _single_intermediate(weight_node: Node, parents: dict[Node, list[Node]], leads_to_input: set[Node]) -> Node | None:
    """The one node where the weight's path meets the input's, if it is one and can compute the weight's products
    alone; None: the weight's gradient is computed with the input's."""
    found, seen, stack = set(), {weight_node}, [weight_node]
    while stack:
        node = stack.pop()
        if not parents[node]:
            return None  # a root reached without meeting the input's path: a loss of the weights alone
        for parent in parents[node]:
            if parent in leads_to_input:
                found.add(parent)
            elif parent not in seen:
                seen.add(parent)
                stack.append(parent)
    if len(found) != 1:
        return None
    (intermediate,) = found
    return intermediate if _splits(intermediate) else None


def _splits(node: Node) -> bool:
    """Whether ``node`` computes only the gradients the running backward asks for: autograd's own nodes do; a
    custom function only if it says so."""
    forward_class = getattr(type(node), "_forward_cls", None)
    return forward_class is None or getattr(forward_class, "splits_weight_gradients", False)
