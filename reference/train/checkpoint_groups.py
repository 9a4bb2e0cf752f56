"""The optimizer's and the schedule's param-group state, saved by parameter, not by group.

A param group belongs to the layout, not to the model: the trainer's two groups (matrices
decayed, biases and gains not) fold into ZeRO-1/2's one flat shard, become one per FSDP unit,
and one on a pipeline stage without a bias. A scheduler keeps one entry per group (`base_lrs`,
`_last_lr`, `lr_lambdas`). So a checkpoint keeps them by plain-GPT parameter name:

    meta/param_groups   {"records": [record, ...], "of": {name: index of its record}}, where a
                        record is {"hyper": the group's hyper-parameters but params and
                        weight_decay, "scheduler": {key: the group's entry of each per-group
                        list}}; equal records are stored once
    meta/scheduler      the scheduler's state without those lists (last_epoch, ...)

Loading gives each new group the record of the parameters it updates and rebuilds the
scheduler's lists; a group joining different records (two learning rates in one ZeRO shard) is
a ValueError on every rank. `weight_decay` comes from the run's configuration (the layout
decides where it applies). A meta/param_groups that is a list of groups loads by position, or
into any number of groups when they differ in weight_decay only.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from reference.train.reshard import flat_groups, entries

__all__ = ["PER_GROUP", "local_groups", "merge_groups", "resolve_groups"]

# torch's per-group scheduler lists (lr_lambdas of LambdaLR, MultiplicativeLR: None or an object's __dict__)
PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas")


def _group_names(pm, optimizer) -> list[list[str]]:
    """For each param group of ``optimizer``, the plain-GPT names of the parameters it updates."""
    name_of = {id(e.param): e.name for e in entries(pm)}
    flat = {id(shard): params for shard, _, params, _, _ in flat_groups(pm, optimizer)}
    out = []
    for i, group in enumerate(optimizer.param_groups):
        names = set()
        for p in group["params"]:
            for q in flat.get(id(p), [p]):
                if id(q) not in name_of:
                    raise ValueError(f"param group {i} of the optimizer updates a tensor of shape "
                                     f"{tuple(q.shape)} that is not a parameter of the model")
                names.add(name_of[id(q)])
        out.append(sorted(names))
    return out


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names", "weight_decay")}


def _per_group_keys(state: dict, n_groups: int) -> list[str]:
    return [k for k in PER_GROUP
            if isinstance(state.get(k), (list, tuple)) and len(state[k]) == n_groups]


def _records(groups: list[dict], state, keys: list[str]) -> tuple[list[dict], object]:
    """Each group's record, and the scheduler's ``state`` without its per-group lists ``keys``."""
    records = [{"hyper": _hyper(g), "scheduler": {k: state[k][i] for k in keys}}
               for i, g in enumerate(groups)]
    return records, ({k: v for k, v in state.items() if k not in keys} if isinstance(state, dict) else state)


def local_groups(pm, optimizer, scheduler) -> tuple[dict, Optional[dict]]:
    """({name: record} of every parameter this rank's optimizer updates, the scheduler's state
    without its per-group lists); the state of a scheduler of another optimizer stays whole."""
    state = None if scheduler is None else scheduler.state_dict()
    groups = optimizer.param_groups
    keys = (_per_group_keys(state, len(groups))
            if state is not None and getattr(scheduler, "optimizer", None) is optimizer else [])
    records, rest = _records(groups, state, keys)
    return {name: record for record, names in zip(records, _group_names(pm, optimizer)) for name in names}, rest


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # a tensor of several numbers
        return False


def _differences(a: dict, b: dict) -> list[str]:
    return sorted(f"{part}.{k}" for part in ("hyper", "scheduler")
                  for k in set(a[part]) | set(b[part])
                  if not _same(a[part].get(k), b[part].get(k)))


def merge_groups(parts: list[dict]) -> dict:
    """meta/param_groups from every rank's {name: record}, in rank order (one name, one record)."""
    records, of, clashes = [], {}, []
    for rank, part in enumerate(parts):
        for name, record in sorted(part.items()):
            index = next((i for i, r in enumerate(records) if _same(r, record)), None)
            if index is None:
                records.append(record)
                index = len(records) - 1
            if of.setdefault(name, index) != index:
                differ = ", ".join(_differences(records[of[name]], record))
                clashes.append(f"{name} on rank {rank} ({differ})")
    if clashes:
        more = f"; ... {len(clashes) - 4} more" if len(clashes) > 4 else ""
        raise ValueError("the ranks hold these parameters in param groups that differ: "
                         + "; ".join(clashes[:4]) + more)
    return {"records": records, "of": of}


def _legacy(saved: list, scheduler_state) -> tuple[dict, Optional[dict]]:
    """A list of groups, the scheduler's state whole, as positional records."""
    keys = _per_group_keys(scheduler_state, len(saved)) if isinstance(scheduler_state, dict) else []
    records, rest = _records(saved, scheduler_state, keys)
    return {"records": records, "of": None}, rest


def _records_for(pm, optimizer, saved: dict) -> list[dict]:
    """The record of each of ``optimizer``'s groups; a ValueError when one cannot be chosen."""
    records, of, n = saved["records"], saved["of"], len(optimizer.param_groups)
    if of is None:  # a list of groups: by position
        if len(records) == n:
            return list(records)
        if all(_same(r, records[0]) for r in records):
            return [records[0]] * n
        other = next(r for r in records if not _same(r, records[0]))
        raise ValueError(f"the checkpoint holds {len(records)} param groups, this optimizer {n}, "
                         f"and the saved groups differ in more than weight_decay "
                         f"({', '.join(_differences(records[0], other))})")
    out = []
    for i, names in enumerate(_group_names(pm, optimizer)):
        missing = [name for name in names if name not in of]
        if missing:
            raise ValueError(f"the checkpoint holds no optimizer hyper-parameters for "
                             f"{', '.join(missing[:4])} (param group {i} of this optimizer)")
        found = sorted({of[name] for name in names})
        if len(found) > 1:
            a, b = (records[j] for j in found[:2])
            where = {j: [name for name in names if of[name] == j] for j in found[:2]}
            one, two = (f"{where[j][0]}" + (f" (and {len(where[j]) - 1} more)" if len(where[j]) > 1 else "")
                        for j in found[:2])
            raise ValueError(f"param group {i} of this optimizer updates {one} and {two}, which "
                             f"the checkpoint holds in groups that differ in "
                             f"{', '.join(_differences(a, b))}; one group cannot take both "
                             f"(ZeRO-1/2 keeps one group for its whole shard)")
        out.append(records[found[0]] if found else {"hyper": {}, "scheduler": {}})
    return out


def resolve_groups(pm, optimizer, saved, scheduler_state) -> tuple[list[dict], Optional[dict]]:
    """Collective: (each of ``optimizer``'s groups' hyper-parameters, the scheduler's state for them)
    from meta/param_groups and meta/scheduler; one rank's refusal is a ValueError on every rank."""
    if isinstance(saved, list):
        saved, scheduler_state = _legacy(saved, scheduler_state)
    problem = None
    try:
        records = _records_for(pm, optimizer, saved)
        keys = sorted({k for r in saved["records"] for k in r["scheduler"]})
        if any(k not in r["scheduler"] for r in records for k in keys):
            raise ValueError(f"the checkpoint's scheduler has {', '.join(keys)} for some param "
                             f"groups only")
    except ValueError as err:
        problem = str(err)
    problems = [problem]
    if dist.is_initialized():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if failed:
        rank, p = failed[0]
        raise ValueError(f"rank {rank}: {p}" if dist.is_initialized() else p)
    hyper = []
    for group, record in zip(optimizer.param_groups, records):
        mine = {**_hyper(group), **record["hyper"]}
        if "weight_decay" in group:
            mine["weight_decay"] = group["weight_decay"]  # the configuration's, where this layout applies it
        hyper.append(mine)
    if isinstance(scheduler_state, dict):
        scheduler_state = {**scheduler_state, **{k: [r["scheduler"][k] for r in records] for k in keys}}
    return hyper, scheduler_state
