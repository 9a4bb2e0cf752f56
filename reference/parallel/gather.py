"""Gather a parallel model back into the plain GPT's parameters, on every rank.

`full_state_dict(pm)` undoes each split of `parallelize`:

* ZeRO-3: `FSDP.full_state_dict` (tp = pp = 1), or composed, every parameter's dim-0 rows
  all-gathered over dp x cp first (data-parallel replicas hold equal values);
* the pipeline: each stage's names are collected over the pp group;
* expert parallelism: expert l of ep rank r is renamed expert r * E / ep + l, collected over ep;
* tensor parallelism: each parameter all-gathered as its layer cut it (``p.tp_cut``,
  `reference.tensor_parallel.cut`: q|k|v block by block, the vocabulary cut back from V_pad
  to V); replicated tensors (LayerNorms, row biases) taken as they are.

Buffers that state_dict saves (a router's ``expert_bias``) are whole on every rank holding
them. Keys are the plain GPT's own (`h.3.attn.c_attn.weight`), values CPU tensors: what
`GPT.load_state_dict` takes, and what the parity tests compare with one process."""
from __future__ import annotations

import torch
import torch.distributed as dist

from reference.expert_parallel import ExpertParallelMoE
from reference.model import saved_buffers

__all__ = ["full_state_dict", "tensor_parallel_full", "expert_names"]


def tensor_parallel_full(module_of: dict, name: str, p: torch.Tensor, tp_group):
    """Parameter ``name``'s whole value from this rank's piece ``p`` (a weight or its gradient;
    collective over tp), gathered as its layer cut it; a parameter whole on every tp rank as it is."""
    owner, leaf = name.rsplit(".", 1)
    cut = getattr(getattr(module_of[owner], leaf), "tp_cut", None)
    return p if cut is None else cut.gather(p, tp_group)


def expert_names(stage) -> dict[str, str]:
    """Local expert parameter names -> global ones, for this rank's ExpertParallelMoE layers."""
    renames = {}
    for mod_name, mod in stage.named_modules():
        if isinstance(mod, ExpertParallelMoE):
            for local, global_id in enumerate(mod.expert_ids):
                for pname, _ in mod.experts[local].named_parameters():
                    renames[f"{mod_name}.experts.{local}.{pname}"] = f"{mod_name}.experts.{global_id}.{pname}"
    return renames


@torch.no_grad()
def full_state_dict(pm) -> dict[str, torch.Tensor]:
    """The plain GPT's state (its parameters, and the routers' ``expert_bias``) from a
    `ParallelGPT`, whole, on every rank (collective: every rank of the mesh calls it)."""
    return pm.data_parallel.full_state_dict(pm, _stages_state_dict)  # ZeRO-3: gathered first


def _stages_state_dict(pm) -> dict[str, torch.Tensor]:
    """`full_state_dict` of whole (TP-local) stages: undo TP, rename experts, merge ep and pp."""
    mesh = pm.mesh
    tp_group = mesh.group("tp") if mesh.tp > 1 else None
    mine: dict[str, torch.Tensor] = {}
    for stage in pm.stages:
        module_of = dict(stage.named_modules())
        renames = expert_names(stage) if mesh.ep > 1 else {}
        for name, p in stage.named_parameters():
            value = p.detach()
            if tp_group is not None:
                value = tensor_parallel_full(module_of, name, value, tp_group)
            mine[renames.get(name, name)] = value.cpu().clone()
        for name, b in saved_buffers(stage).items():  # a router's bias: whole on every rank
            mine[name] = b.detach().cpu().clone()
    for dim in ("ep", "pp"):
        if getattr(mesh, dim) > 1:
            parts = [None] * getattr(mesh, dim)
            dist.all_gather_object(parts, mine, group=mesh.group(dim))
            merged: dict[str, torch.Tensor] = {}
            for part in parts:
                merged.update(part)
            mine = merged
    return mine  # a GPTStage names its blocks by the model's index (h.<i>.*), as the GPT does
