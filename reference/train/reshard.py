"""The training state without its layout, and back: what makes a checkpoint reshardable.

A rank of a 3D run holds slices: rows of a column-parallel weight, columns of a
row-parallel one, V_pad / tp rows of the vocabulary, one pipeline stage's blocks, its
experts, and under ZeRO a flat shard of the optimizer state. A checkpoint that stored
those slices could only be loaded by the same layout. This module turns them into
**layout-free** tensors, the plain GPT's parameters whole under the plain GPT's names,
and each optimizer state (AdamW's exp_avg, exp_avg_sq, step) whole in the same way; and
it cuts such tensors back into any layout's slices:

    save   ZeRO-1/2, FSDP flat shard (S,) --all-gather over dp--> (P,) --views--> per-parameter
           ZeRO-3 per parameter: rows (c, *rest) --all-gather over dp x cp--> (d0, *rest)
           per-parameter local tensor --undo TP (`reference.parallel.gather`), rename experts
           to global ids, merge pipeline stages--> full tensor, under its plain-GPT name
    load   full tensor --exactly as `parallelize` slices a weight (column rows with q|k|v
           chunks, row columns, padded vocabulary rows, this stage's names, experts by
           global id)--> per-parameter local --ZeRO / FSDP: flatten into this optimizer's
           layout, keep this rank's shard (per parameter: its dim-0 rows)--> the optimizer's state

Checkpoints no longer build whole tensors (`reference.train.checkpoint_shards` maps each
rank's slices to boxes of them with `entries`, `full_shape` and the same cuts); they use
`full_shapes` (to check a checkpoint fits) and hand the optimizer its states through
`_load_optimizer_local_state`. `full_model_state`, `full_optimizer_state`, `load_weights`
and `load_optimizer_state` are the whole-tensor round trip, kept as the simple version. A weight tied to the
embedding (`lm_head.weight` when `tie_weights`) is stored once, as `wte.weight`; both
pipeline copies are loaded from it. Every function here that moves data is collective over
the mesh: every rank calls it, in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference import comms
from reference.parallel.gather import expert_names, tensor_parallel_full
from reference.runtime import device
from reference.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                       column_shard, padded_vocab_size, row_shard)
from reference.zero import ZeroOptimizer

__all__ = ["Entry", "entries", "canonical_name", "full_shape", "local_slice", "gather_full",
           "full_model_state", "full_optimizer_state", "full_shapes", "load_weights",
           "load_optimizer_state"]


def canonical_name(pm, name: str) -> str:
    """The plain GPT's name of a parameter: a tied lm_head is the embedding's matrix."""
    if name == "lm_head.weight" and pm.model_config.tie_weights:
        return "wte.weight"
    return name


@dataclass
class Entry:
    """One parameter this rank holds: its local name, its plain-GPT name, the module owning it."""

    local: str
    name: str
    param: torch.nn.Parameter
    owner: Optional[torch.nn.Module]   # None under FSDP (the module there is the whole model)
    module_of: Optional[dict]          # the stage's modules by name, for the TP gather


def entries(pm) -> list[Entry]:
    """This rank's distinct parameters (a tied weight once), in an order every rank of a
    tp group shares (the stages' own order), with their plain-GPT names."""
    if pm.fsdp is not None:
        return [Entry(n, canonical_name(pm, n), p, None, None)
                for n, p in pm.fsdp.module.named_parameters(remove_duplicate=True)]
    out, seen = [], set()
    for stage in pm.stages:
        module_of = dict(stage.named_modules())
        renames = expert_names(stage) if pm.mesh.ep > 1 else {}  # local expert -> global id
        for local, p in stage.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            out.append(Entry(local, canonical_name(pm, renames.get(local, local)), p,
                             module_of[local.rsplit(".", 1)[0]], module_of))
    return out


def _is_head(e: Entry) -> bool:
    return e.local.startswith("lm_head.")


def full_shape(pm, e: Entry, local_shape: torch.Size) -> tuple[int, ...]:
    """The whole tensor's shape, given this rank's slice of it (the inverse of `local_slice`)."""
    shape, o = tuple(local_shape), e.owner
    if isinstance(o, VocabParallelEmbedding):  # (V_pad / tp, C) -> (V, C)
        return (o.num_embeddings,) + shape[1:]
    if isinstance(o, ColumnParallelLinear):    # (out / tp, in) -> (out, in); the head's out is V
        return (pm.model_config.vocab_size if _is_head(e) else o.out_features,) + shape[1:]
    if isinstance(o, RowParallelLinear) and e.local.endswith(".weight"):  # (out, in / tp)
        return shape[:1] + (o.in_features,)
    return shape


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """(V, ...) -> (V_pad, ...), zero rows appended: the padding `parallelize` gives the vocabulary."""
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0]))


def local_slice(pm, e: Entry, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the whole tensor ``full``, cut as `parallelize` cuts the weight."""
    o = e.owner
    if isinstance(o, VocabParallelEmbedding):  # rows [vocab_start, vocab_end) of the padded table
        return _pad_rows(full, o.num_embeddings_padded)[o.vocab_start_index:o.vocab_end_index]
    if isinstance(o, ColumnParallelLinear):    # rows r of each chunk (q|k|v), the head padded first
        if _is_head(e):
            full = _pad_rows(full, padded_vocab_size(pm.model_config.vocab_size, o.tp))
        return column_shard(full, o.tp_rank, o.tp, o.chunks)
    if isinstance(o, RowParallelLinear) and e.local.endswith(".weight"):
        return row_shard(full, o.tp_rank, o.tp)  # (out, in / tp)
    return full  # replicated over tp: LayerNorms, row biases, wpe, experts (whole, by global id)


def gather_full(pm, local: list[tuple[Entry, dict]]) -> dict[str, dict[str, torch.Tensor]]:
    """{plain-GPT name: {key: whole tensor (CPU)}} from this rank's {key: slice} per entry.

    Collective over the mesh. The gather of `full_state_dict` applied to any tensor shaped
    like a parameter: all-gathered over tp, experts renamed, merged over ep and pp. A 0-dim
    value (AdamW's step) is the same on every rank and taken as it is."""
    if pm.fsdp is not None:  # already whole (ZeRO-3 runs with tp = pp = 1)
        return {e.name: {k: v.detach().cpu().clone() for k, v in values.items()} for e, values in local}
    mesh = pm.mesh
    tp_group = mesh.group("tp") if mesh.tp > 1 else None
    mine: dict[str, dict] = {}
    for e, values in local:
        whole = {}
        for key in sorted(values):  # the same order on every tp rank: the collectives pair up
            t = values[key].detach()
            if tp_group is not None and t.dim() > 0:
                t = tensor_parallel_full(e.module_of, e.local, t, tp_group, pm.model_config.vocab_size)
            whole[key] = t.cpu().clone()
        mine.setdefault(e.name, whole)
    for dim in ("ep", "pp"):
        if getattr(mesh, dim) > 1:
            parts = [None] * getattr(mesh, dim)
            dist.all_gather_object(parts, mine, group=mesh.group(dim))
            merged: dict = {}
            for part in parts:
                for name, whole in part.items():
                    merged.setdefault(name, whole)  # the tied pair's two copies are equal
            mine = merged
    return mine


def _sharded(pm, p) -> bool:
    """Whether ``p`` is a per-parameter ZeRO-3 shard (its dim-0 rows of the TP-local tensor)."""
    return getattr(pm, "sharded", None) is not None and getattr(p, "fsdp_sharded", False)


def _flat_groups(pm, optimizer):
    """(flat shard the optimizer steps on, layout, the parameters laid out in it, dp group) for
    ZeRO-1/2 (one) and FSDP (one per unit); empty for a plain optimizer."""
    if isinstance(optimizer, ZeroOptimizer):
        return [(optimizer.shard, optimizer.layout, optimizer.params,
                 [p.shape for p in optimizer.params], optimizer.group)]
    if pm.fsdp is not None:
        return [(u.shard, u.layout, u.params, u.shapes, u.group) for u in pm.fsdp.units]
    return []


def _optimizer_local_state(pm, optimizer) -> dict[int, dict[str, torch.Tensor]]:
    """{id(parameter): {key: tensor shaped like the rank's parameter, or 0-dim}} (collective
    over dp for ZeRO / FSDP: each flat state (S,) is all-gathered to (P,) and cut into views)."""
    groups = _flat_groups(pm, optimizer)
    if not groups and getattr(pm, "sharded", None) is not None:  # ZeRO-3 per parameter: rows
        return pm.sharded.full_optimizer_state(optimizer)          # all-gathered over dp x cp
    if not groups:
        return {id(p): dict(s) for p, s in optimizer.state.items() if s}
    out: dict[int, dict] = {}
    for shard, layout, params, shapes, group in groups:
        state = optimizer.state.get(shard, {})
        for key in sorted(state):
            value = state[key]
            if not torch.is_tensor(value):
                raise TypeError(f"optimizer state {key!r} is a {type(value).__name__}; a checkpoint "
                                f"stores tensor states only")
            if value.dim() == 0:  # one step count for the whole shard: every parameter's
                views = [value] * len(params)
            else:  # ZeRO's all-gather of the state: (S,) per rank -> (P,) -> one view per tensor
                flat = torch.empty(layout.padded_numel, dtype=value.dtype, device=device())
                comms.all_gather_into_tensor(flat, value.detach().to(device()), group=group)
                views = layout.views(flat.cpu(), shapes)
            for p, v in zip(params, views):
                out.setdefault(id(p), {})[key] = v
    return out


def _flat_state(per_param: dict, params, layout, rank: int, what: str) -> dict:
    """The flat shard state (S,) of `params` from their per-parameter states (ZeRO's layout)."""
    states = [per_param.get(id(p), {}) for p in params]
    keys = sorted({k for s in states for k in s})
    out = {}
    for key in keys:
        if any(key not in s for s in states):
            raise ValueError(f"{what}: state {key!r} exists for some of its parameters only; a "
                             f"flat shard needs it for all {len(params)}")
        values = [s[key] for s in states]
        if values[0].dim() == 0:  # step: one count for the shard, so every parameter must agree
            if any(not torch.equal(v, values[0]) for v in values):
                raise ValueError(f"{what}: {key!r} differs between parameters "
                                 f"({sorted({float(v) for v in values})}); one flat shard has one")
            out[key] = values[0].clone()
            continue
        flat = torch.zeros(layout.padded_numel, dtype=values[0].dtype)  # the padding stays 0
        layout.flatten(values, flat)
        out[key] = layout.shard(flat, rank).clone()  # (S,)
    return out


def _load_optimizer_local_state(pm, optimizer, per_param: dict, hyper: list[dict],
                                flat: bool = False) -> None:
    """Give ``optimizer`` the per-parameter states ``per_param`` ({id(p): {key: local tensor}}),
    flattened into its own layout under ZeRO / FSDP (``flat``: already its flat shards'
    states, by id of the shard), and the hyper-parameters ``hyper`` (one dict per param
    group), through its own `load_state_dict`."""
    if len(hyper) != len(optimizer.param_groups):
        # Weight-decay groups: a plain optimizer keeps one group per decay, ZeroOptimizer one
        # inner group (it applies each decay itself). Beyond weight_decay, which the run's
        # configuration sets, the groups share their hyper-parameters: those carry over.
        common = [{k: v for k, v in h.items() if k != "weight_decay"} for h in hyper]
        if any(c != common[0] for c in common) or not common:
            raise ValueError(f"the checkpoint holds {len(hyper)} param groups, this optimizer "
                             f"{len(optimizer.param_groups)}, and the saved groups differ in more "
                             f"than weight_decay")
        hyper = [{**common[0], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    groups = _flat_groups(pm, optimizer)
    if groups and not flat:  # ZeRO / FSDP: the optimizer's parameters are the flat shards
        per_param = {id(shard): _flat_state(per_param, params, layout, dist.get_rank(group),
                                            f"flat shard of {len(params)} tensors")
                     for shard, layout, params, _, group in groups}
    state, param_groups, index = {}, [], 0
    for group, saved in zip(optimizer.param_groups, hyper):
        ids = []
        for p in group["params"]:
            found = per_param.get(id(p))
            if found:
                state[index] = found
            ids.append(index)
            index += 1
        param_groups.append({**saved, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


@torch.no_grad()
def load_weights(pm, full: dict[str, torch.Tensor]) -> None:
    """Write the whole tensors ``full`` (plain-GPT names) into this rank's parameters."""
    es = entries(pm)
    if pm.fsdp is None:
        for e in es:  # ZeRO-3 per parameter: this rank's rows of its TP-local slice
            value = local_slice(pm, e, full[e.name])
            e.param.copy_(pm.sharded.shard_of(value) if _sharded(pm, e.param) else value)
        return
    name_of = {id(e.param): e.name for e in es}
    sharded = set()
    for unit in pm.fsdp.units:  # ZeRO-3: flatten the unit's tensors, keep this rank's shard
        flat = torch.zeros(unit.layout.padded_numel, dtype=unit.shard.dtype)
        unit.layout.flatten([full[name_of[id(p)]] for p in unit.params], flat)
        unit.shard.copy_(unit.layout.shard(flat, unit.dp_rank))
        sharded.update(id(p) for p in unit.params)
    for e in es:  # frozen parameters are whole on every rank, never sharded
        if id(e.param) not in sharded:
            e.param.copy_(full[e.name])


# ---------------------------------------------------------------------- what a checkpoint holds
def full_model_state(pm) -> dict[str, torch.Tensor]:
    """{plain-GPT name: whole parameter}, a tied pair once (collective: `full_state_dict`)."""
    from reference.parallel import full_state_dict

    out: dict = {}
    for name, value in full_state_dict(pm).items():
        out.setdefault(canonical_name(pm, name), value)  # both pipeline copies are equal
    return out


def full_optimizer_state(pm, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """{plain-GPT name: {key: whole state}} of any optimizer `make_optimizer` builds (collective)."""
    local = _optimizer_local_state(pm, optimizer)
    states = [(e, local[id(e.param)]) for e in entries(pm) if id(e.param) in local]
    for e, values in states:
        bad = sorted(k for k, v in values.items() if not torch.is_tensor(v))
        if bad:
            raise TypeError(f"optimizer state {bad} of {e.name} is not a tensor; a checkpoint "
                            f"stores tensor states only")
    return gather_full(pm, states)


def full_shapes(pm) -> dict[str, tuple[int, ...]]:
    """{plain-GPT name: whole shape} of every parameter of the model, on every rank (collective)."""
    shapes = {e.name: full_shape(pm, e, pm.sharded.full_shape(e.param) if _sharded(pm, e.param)
                                 else e.param.shape) for e in entries(pm)}
    if not dist.is_initialized():
        return shapes
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, shapes)  # the other stages' and experts' names
    return {k: v for part in parts for k, v in part.items()}


def load_optimizer_state(pm, optimizer, full: dict[str, dict[str, torch.Tensor]],
                         hyper: list[dict]) -> None:
    """Give ``optimizer`` this rank's slices of the whole states ``full`` and the
    hyper-parameters ``hyper`` (one dict per param group)."""
    per_param: dict = {}
    for e in entries(pm):
        for key, v in full.get(e.name, {}).items():
            if v.dim() > 0:
                v = local_slice(pm, e, v)
                v = pm.sharded.shard_of(v) if _sharded(pm, e.param) else v  # its dim-0 rows
            per_param.setdefault(id(e.param), {})[key] = v
    _load_optimizer_local_state(pm, optimizer, per_param, hyper)
