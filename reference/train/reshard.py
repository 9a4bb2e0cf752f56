"""What a rank holds, named without its layout: what makes a checkpoint reshardable.

A rank of a 3D run holds slices (tensor-parallel rows or columns, one stage's blocks, its
experts, a ZeRO flat shard), which under the rank's own names would load only into the same
layout. This module names each by the plain GPT's parameter, with its whole shape:

    entries(pm)              this rank's distinct parameters (a tied weight once): local name,
                             plain-GPT name (experts by global id), the owning module
    buffer_entries(pm)       the buffers state_dict saves (a router's expert_bias), whole
    full_shape(e, shape)     the whole tensor's shape, from this rank's slice of it
    full_shapes(pm)          every parameter's whole shape, on every rank (collective)
    flat_groups              ZeRO-1/2 and FSDP's flat shard (S,) and its layout
    load_optimizer_local_state   an optimizer's states and hyper-parameters, given back

A weight tied to the embedding (`lm_head.weight` when `tie_weights`) is stored once, as
`wte.weight`, and both pipeline copies load from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from reference.model import saved_buffers
from reference.parallel.gather import expert_names

__all__ = ["Entry", "entries", "buffer_entries", "canonical_name", "full_shape", "full_shapes", "is_head", "is_sharded",
           "flat_groups", "load_optimizer_local_state"]


def canonical_name(pm, name: str) -> str:
    """The plain GPT's name of a parameter: a tied lm_head is the embedding's matrix."""
    return "wte.weight" if name == "lm_head.weight" and pm.model_config.tie_weights else name


@dataclass
class Entry:
    """One parameter this rank holds: its local name, its plain-GPT name, the module owning it."""
    local: str
    name: str
    param: torch.nn.Parameter
    owner: Optional[torch.nn.Module]
    module_of: Optional[dict]          # the stage's modules by name, for the TP gather


def entries(pm) -> list[Entry]:
    """This rank's distinct parameters (a tied weight once), in an order every rank of a
    tp group shares (the stages' own order), with their plain-GPT names."""
    out, seen = [], set()
    for stage in pm.data_parallel.modules(pm):  # the stages (under FSDP: the one it wraps)
        module_of = dict(stage.named_modules())
        renames = expert_names(stage) if pm.mesh.ep > 1 else {}  # local expert -> global id
        for local, p in stage.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            out.append(Entry(local, canonical_name(pm, renames.get(local, local)), p,
                             module_of[local.rsplit(".", 1)[0]], module_of))
    return out


def buffer_entries(pm) -> list[Entry]:
    """The buffers this rank's modules save in state_dict (a router's ``expert_bias``), as entries
    by their plain-GPT names: never cut, whole on every rank holding their module (a LayerNorm's
    way), so they are saved once and any layout loads them."""
    modules = pm.data_parallel.modules(pm)  # the stages, or what wraps them (FSDP by blocks)
    return [Entry(name, name, b, None, None) for m in modules for name, b in saved_buffers(m).items()]


def is_head(e: Entry) -> bool:
    return e.local.startswith("lm_head.")


def full_shape(e: Entry, local_shape: torch.Size) -> tuple[int, ...]:
    """The whole tensor's shape from this rank's slice: the inverse of the ``tp_cut`` its
    tensor-parallel layer recorded (the vocabulary's padding dropped), or the slice itself."""
    cut = getattr(e.param, "tp_cut", None)
    return tuple(local_shape) if cut is None else cut.whole_shape(local_shape)


def is_sharded(p) -> bool:
    """Whether ``p`` is a per-parameter ZeRO-3 shard (its dim-0 rows of the TP-local tensor)."""
    return hasattr(p, "zero_rows")  # recorded by `ShardedParameters` where it cut p


def flat_groups(pm, optimizer):
    """[(flat shard, layout, its parameters, their shapes, dp group)] of ZeRO-1/2 or FSDP, or []."""
    return pm.data_parallel.flat_states(optimizer)


def load_optimizer_local_state(pm, optimizer, per_param: dict, hyper: list[dict]) -> None:
    """Give ``optimizer`` (its `load_state_dict`) the states ``per_param`` ({id(its parameter or flat
    shard): {key: tensor}}) and ``hyper``, one dict per param group (`checkpoint_groups`)."""
    if len(hyper) != len(optimizer.param_groups):
        raise ValueError(f"{len(hyper)} param groups' hyper-parameters for an optimizer of "
                         f"{len(optimizer.param_groups)}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {i: per_param[id(p)] for i, p in enumerate(params) if per_param.get(id(p))}
    param_groups, index = [], 0  # torch's state_dict numbers the parameters across the groups
    for group, saved in zip(optimizer.param_groups, hyper):
        param_groups.append({**saved, "params": list(range(index, index + len(group["params"])))})
        index += len(group["params"])
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def full_shapes(pm) -> dict[str, tuple[int, ...]]:
    """{plain-GPT name: whole shape} of every parameter and saved buffer of the model, on every
    rank (collective)."""
    shapes = {e.name: full_shape(e, e.param.zero_rows.whole if is_sharded(e.param)
                                 else e.param.shape) for e in entries(pm) + buffer_entries(pm)}
    if not dist.is_initialized():
        return shapes
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, shapes)  # the other stages' and experts' names
    return {k: v for part in parts for k, v in part.items()}
