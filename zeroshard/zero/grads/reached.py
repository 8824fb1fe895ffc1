"""Which parameters a backward will give a gradient to, read from its autograd graph
before it runs (the walk DDP's ``find_unused_parameters`` does). No communication.

Stage 3 needs it when a parameter gets a gradient on some ranks only (data-dependent
control flow inside a leaf module): the gradient reducer launches its buckets in one
fixed order, so a rank that waits for a gradient that never comes would hold back that
bucket and every later one until backward ends, while ranks that got the gradient
reduce it at once and then wait for it, inside backward, where the first rank still
needs their parameter gathers: a deadlock. Counting the parameters the graph does not
reach as arrived (zero gradient) when backward starts lets every rank reduce each
bucket as soon as its own gradients are in.
"""

from __future__ import annotations

import torch

# custom autograd Functions whose backward runs a nested backward through a forward it
# recomputes (reentrant activation checkpointing: torch's and DeepSpeed's): the
# parameters used inside are not in the graph, yet get gradients
_NESTED_BACKWARD = frozenset({"CheckpointFunction"})


def reached_leaves(roots: list[torch.Tensor]) -> set[int] | None:
    """``id`` of every leaf tensor (a parameter) the backward of ``roots`` reaches; None
    when the graph holds a node that may reach tensors it does not show (reentrant
    activation checkpointing), so that nothing can be ruled out."""
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    # id -> node: the Python object of a C++ graph node may be made on demand and freed
    # once dropped, and a freed object's id is reused; holding each visited node keeps
    # its id from naming another node (which the walk would then skip, subtree and all)
    seen: dict[int, object] = {}
    reached: set[int] = set()
    leaves: list[torch.Tensor] = []  # held likewise: ids of live objects only
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        leaf = getattr(node, "variable", None)  # AccumulateGrad
        if leaf is not None:
            leaves.append(leaf)
            reached.add(id(leaf))
            continue
        forward = getattr(node, "_forward_cls", None)  # a custom Function's node
        if forward is not None and forward.__name__ in _NESTED_BACKWARD:
            return None
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return reached
