"""Weight-decay groups for `ZeroOptimizer`: torch-style parameter groups over one flat shard.

ZeroOptimizer steps one flat shard with one inner optimizer group, so groups may differ in
`weight_decay` only (what a trainer needs: matrices decayed, biases and LayerNorms not);
ZeroOptimizer applies each group's decay itself on its range of the shard, in the form the
optimizer class uses (`decay_kind`), and runs the inner step with weight_decay 0.
"""
from __future__ import annotations

import torch

__all__ = ["parse_groups", "decay_kind"]


def parse_groups(params, optimizer_kwargs: dict):
    """(parameters, {id(p): weight_decay}, optimizer_kwargs) from tensors or torch-style groups.

    Groups may differ in `weight_decay` only: any other key must have one value in
    every group (and agree with the keyword arguments); it joins the keyword arguments.
    """
    params = list(params)
    if not any(isinstance(g, dict) for g in params):
        return params, {}, optimizer_kwargs
    if not all(isinstance(g, dict) and "params" in g for g in params):
        raise TypeError("pass either parameters or parameter groups (dicts with 'params'), not a mix")
    kwargs, flat, decay_of = dict(optimizer_kwargs), [], {}
    keys = {k for g in params for k in g} - {"params", "weight_decay"}
    for key in sorted(keys):
        missing = object()
        values = [g.get(key, kwargs.get(key, missing)) for g in params]
        if any(v is missing or v != values[0] for v in values):
            raise ValueError(f"ZeroOptimizer's parameter groups may differ only in weight_decay "
                             f"(one flat shard, one inner group); {key!r} is "
                             f"{['(unset)' if v is missing else v for v in values]} across the groups")
        kwargs[key] = values[0]
    for g in params:
        group = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        for p in group:
            if "weight_decay" in g:
                wd = float(g["weight_decay"])
                if decay_of.setdefault(id(p), wd) != wd:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} is in two groups, with "
                                     f"weight_decay {decay_of[id(p)]} and {wd}")
        flat.extend(group)
    return flat, decay_of, kwargs


def decay_kind(optimizer_class, defaults: dict) -> str:
    """'decoupled' (AdamW's p *= 1 - lr wd) or 'coupled' (L2: grad += wd p), as `optimizer_class` decays."""
    # torch's Adam(decoupled_weight_decay=True) is AdamW; an optimizer of the course's says so itself
    if (issubclass(optimizer_class, torch.optim.AdamW) or getattr(optimizer_class, "decoupled_weight_decay", False)
            or defaults.get("decoupled_weight_decay")):
        return "decoupled"
    if issubclass(optimizer_class, (torch.optim.SGD, torch.optim.Adam, torch.optim.Adagrad,
                                    torch.optim.RMSprop, torch.optim.Adamax)):
        return "coupled"
    raise ValueError(f"ZeroOptimizer applies per-group weight decay itself and knows AdamW's "
                     f"decoupled form and the L2 form of SGD, Adam, Adagrad, RMSprop and Adamax; "
                     f"{optimizer_class.__name__} is neither: give every group one weight_decay")
