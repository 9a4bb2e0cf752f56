"""Homework 06's composed exercise in a rank: the mesh's groups, the call of the student's
`finish_step` on this rank's raw gradients, and the course's own answer.

The cases, the one-process answer and the judge are in `parallel_step`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["call_finish_step", "course_finish_step", "torch_finish_step"]


def _groups(dp: int, tp: int, pp: int, tie: bool) -> dict:
    """This rank's groups of a dp x tp x pp mesh (rank = (pp_rank dp + dp_rank) tp + tp_rank);
    every rank creates every group in the same order."""
    rank, mine = dist.get_rank(), {"embedding": None}
    index = {(s, d, t): (s * dp + d) * tp + t for s in range(pp) for d in range(dp) for t in range(tp)}
    for s in range(pp):
        for d in range(dp):
            ranks = [index[s, d, t] for t in range(tp)]
            group = dist.new_group(ranks)
            mine["tp"] = group if rank in ranks else mine.get("tp")
    for s in range(pp):
        for t in range(tp):
            ranks = [index[s, d, t] for d in range(dp)]
            group = dist.new_group(ranks)
            mine["dp"] = group if rank in ranks else mine.get("dp")
    for d in range(dp):
        for t in range(tp):
            ranks = [index[s, d, t] for s in range(pp)]
            group = dist.new_group(ranks)
            mine["pp"] = group if rank in ranks else mine.get("pp")
            if tie and pp > 1:
                ends = [ranks[0], ranks[-1]]
                group = dist.new_group(ends)
                if rank in ends:
                    mine["embedding"] = group
    return mine


def _number(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def call_finish_step(fn, case: dict) -> dict:
    groups = _groups(*case["dims"], case["tie"])
    grads = {n: g.clone() for n, g in case["grads"].items()}
    before = {n: g.data_ptr() for n, g in grads.items()}
    loss = case["loss"].clone() if case["loss"] is not None else None
    out = fn(grads, {n: dict(v) for n, v in case["layout"].items()}, loss, dict(groups),
             case["dp_reduce"], case["max_norm"])
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        return {"error": f"returned {type(out).__name__}, not (loss, norm)"}
    kept = all(isinstance(grads.get(n), torch.Tensor) and grads[n].data_ptr() == p
               for n, p in before.items())
    return {"error": "", "loss": _number(out[0]), "norm": _number(out[1]),
            "norm_is_none": out[1] is None, "in_place": kept,
            "grads": {n: g.detach().clone() if isinstance(g, torch.Tensor) else None
                      for n, g in grads.items()}}


def course_finish_step(grads, layout, loss, groups, dp_reduce=True, max_norm=None):
    """The course's answer: tp sums, tied sums, dp mean, the loss from the last stage, the
    norm with each number once, the clip."""
    tp_group, dp_group, pp_group = groups["tp"], groups["dp"], groups["pp"]
    for name, g in grads.items():
        if layout[name]["tp"] == "partial":
            dist.all_reduce(g, group=tp_group)
        if layout[name]["tied"]:
            dist.all_reduce(g, group=groups["embedding"])
    if dp_reduce:
        dp = dist.get_world_size(dp_group)
        for g in grads.values():
            dist.all_reduce(g, group=dp_group)
            g /= dp
    value = torch.zeros((), dtype=torch.float64) if loss is None else loss.detach().double()
    value = value.reshape(1).clone()
    dist.all_reduce(value, group=pp_group)  # only the last stage holds a loss
    dist.all_reduce(value, group=dp_group)
    mean_loss = float(value) / dist.get_world_size(dp_group)
    if not dp_reduce:
        return mean_loss, None
    first_stage, first_tp = dist.get_rank(pp_group) == 0, dist.get_rank(tp_group) == 0
    total = torch.zeros(1, dtype=torch.float64)
    for name, g in grads.items():
        if layout[name]["tied"] and not first_stage:
            continue  # the first stage counts the tied embedding
        if layout[name]["tp"] != "split" and not first_tp:
            continue  # the same numbers on every tp rank: tp rank 0 counts them
        total += g.double().pow(2).sum()
    dist.all_reduce(total, group=tp_group)
    dist.all_reduce(total, group=pp_group)
    norm = float(total.sqrt())
    if max_norm is not None:
        coef = min(1.0, max_norm / (norm + 1e-6))
        for g in grads.values():
            g.mul_(coef)
    return mean_loss, norm


def torch_finish_step(case: dict):
    return call_finish_step(course_finish_step, case)
