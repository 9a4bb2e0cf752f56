"""Choose a configuration: which (dp, tp, pp, ep, zero, m) fit a model on a cluster, and their costs.

    rows = feasible_configs(GPT3_175B, n_gpus=1024, gpus_per_node=8, device_bytes=80e9,
                            global_batch=1536)
    explorer = config_explorer()        # the same as an ipywidgets explorer

`feasible_configs` tries every factorisation n_gpus = dp x tp x pp with tp inside a node (TP
communicates in every layer, so it needs the node's fast links) and pp dividing the layers,
with ZeRO 0-3 (composed ZeRO-3 also resharded after forward, and as HSDP), with and without
sequence parallelism and full recomputation, each schedule of ``schedules``, and with
``n_experts`` every ep that divides dp and the experts. It keeps what `ParallelConfig.validate`
accepts and whose peak memory (`estimate`'s `total_bytes`, on the heaviest pipeline rank)
fits, fastest first by `step_time`: compute + exposed tp, pp and dp communication + bubble,
under `Hardware`'s assumptions (the explorer prints them above its table). A pipeline can win:
it divides the parameters each GPU reduces over dp by pp, which pays when that traffic
outlasts the backward it hides under and m keeps the bubble small. Like the course's other
explorers it works with no frontend (`.html` holds the table of the current settings)."""
from __future__ import annotations

import html
from dataclasses import replace
from itertools import product
from typing import Optional, Sequence

import ipywidgets as widgets

from reference.memory import human_bytes
from reference.model import GPTConfig
from reference.parallel.config import V_SHAPED, ParallelConfig
from reference.parallel.estimate import Hardware, estimate, link_of, step_time

__all__ = ["MODELS", "feasible_configs", "ConfigExplorer", "config_explorer"]

# Brown et al. (2020), Table 2.1: layers, width and heads of 128 channels. For GPT-3 XL (1.3B) the
# table lists 24 heads of 128 on a width of 2048, which do not multiply out (24 x 128 = 3072);
# the width fixes the parameters, so the course keeps 2048 and the heads' width, 128: 16 heads
# (what the score terms of the activations, a s^2 per layer, count)
MODELS = {
    "GPT-3 175B": GPTConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, n_embd=12288),
    "GPT-3 13B": GPTConfig(vocab_size=50257, block_size=2048, n_layer=40, n_head=40, n_embd=5120),
    "GPT-3 6.7B": GPTConfig(vocab_size=50257, block_size=2048, n_layer=32, n_head=32, n_embd=4096),
    "GPT-3 1.3B": GPTConfig(vocab_size=50257, block_size=2048, n_layer=24, n_head=16, n_embd=2048),
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _zero3_options(config: ParallelConfig, gpus_per_node: int) -> tuple:
    """Composed ZeRO-3's choices: FSDP2's resharding after forward, and HSDP with the shards
    inside a node (dp_shard = the dp ranks one node holds beside tp) and replicas across nodes,
    where the data-parallel ranks span more than a node."""
    if not (config.zero_stage == 3 and config.dp > 1 and not config.zero3_by_blocks):
        return (config,)
    out = [config, config.with_(reshard_after_forward=True)]
    shard = gpus_per_node // config.tp
    if config.ep == config.cp == 1 and 1 < shard < config.dp and config.dp % shard == 0:
        out.append(config.with_(dp_replicate=config.dp // shard))
    return tuple(out)


def feasible_configs(model: GPTConfig, n_gpus: int, gpus_per_node: int = 8,
                     device_bytes: float = 80e9, global_batch: int = 1536,
                     micro_batch: int = 1, n_experts: Optional[int] = None,
                     hardware: Optional[Hardware] = None,
                     schedules: Sequence[str] = ("1f1b",)) -> list[dict]:
    """Every candidate that validates and fits, fastest estimated step first; a row holds config,
    estimate, memory, bubble, time (`step_time`'s parts), step_time, and cross_node and inside:
    the bytes one GPU sends per step over links that leave / stay in its node."""
    hardware = hardware or Hardware(gpus_per_node=gpus_per_node)
    if hardware.gpus_per_node != gpus_per_node:
        hardware = replace(hardware, gpus_per_node=gpus_per_node)
    batch = (global_batch, model.block_size)
    rows = []
    for tp in _divisors(n_gpus):
        if tp > gpus_per_node:
            continue
        for pp in _divisors(n_gpus // tp):
            if model.n_layer % pp:  # balanced stages only: step_time assumes equal ones
                continue
            dp = n_gpus // (tp * pp)
            if global_batch % (dp * micro_batch):
                continue
            m = global_batch // (dp * micro_batch)
            eps = [e for e in _divisors(dp) if n_experts % e == 0] if n_experts else [1]
            for ep, zero, sp, ckpt, sched in product(eps, (0, 1, 2, 3), (True, False) if tp > 1 else
                                                     (False,), (False, True), schedules if pp > 1 else ("1f1b",)):
                base = ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ep, zero_stage=zero, microbatches=m,
                                      sequence_parallel=sp, activation_checkpointing=ckpt,
                                      precision="bf16", schedule=sched,
                                      virtual_stages=2 if sched in V_SHAPED else 1)
                for config in _zero3_options(base, gpus_per_node):
                    if config.problems(n_gpus, model, batch, n_experts):
                        continue  # only what `ParallelConfig.validate` accepts
                    row = _row(model, config, micro_batch, global_batch, n_experts, hardware)
                    if row["estimate"].fits(device_bytes):
                        rows.append(row)
    rows.sort(key=lambda r: (r["step_time"], r["memory"]))
    return rows


def _row(model, config, micro_batch, global_batch, n_experts, hardware) -> dict:
    """The estimate of the pipeline rank whose peak is largest (the first, unless experts or
    the head tip it), its step time and the bytes it sends inside and across nodes."""
    kw = dict(micro_batch=micro_batch, global_batch=global_batch, n_experts=n_experts)
    e = max((estimate(model, config, stage=r, **kw) for r in sorted({0, config.pp - 1})),
            key=lambda x: x.total_bytes)
    time = step_time(e, hardware)
    sent = {"inter": 0.0, "intra": 0.0}
    for kind, nbytes in e.bytes_per_step.items():
        sent[link_of(config, kind, hardware)] += nbytes
    return dict(config=config, estimate=e, memory=e.total_bytes, bubble=e.bubble, time=time,
                step_time=time["total"], cross_node=sent["inter"], inside=sent["intra"])


def _table(rows: list[dict], limit: int) -> str:
    head = ("dp", "tp", "pp", "schedule", "ep", "ZeRO", "SP", "m", "recompute", "memory / GPU", "step (s)",
            "compute (s)", "exposed comm (s)", "bubble", "sent across nodes", "sent inside a node")
    cells = ["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for r in rows[:limit]:
        c, t = r["config"], r["time"]
        zero = (f"{c.zero_stage}{' reshard' if c.reshard_after_forward else ''}"
                f"{f' HSDP {c.dp_replicate}x{c.dp // c.dp_replicate}' if c.dp_replicate > 1 else ''}")
        values = (c.dp, c.tp, c.pp, c.schedule if c.pp > 1 else "", c.ep, zero,
                  "yes" if c.sequence_parallel else "no", c.microbatches,
                  "full" if c.activation_checkpointing else "none",
                  human_bytes(r["memory"]), f"{r['step_time']:.2f}", f"{t['compute']:.2f}",
                  f"{t['tp'] + t['pp'] + t['dp']:.2f}", f"{r['bubble']:.1%} ({t['bubble']:.2f} s)",
                  human_bytes(r["cross_node"]), human_bytes(r["inside"]))
        cells.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in values) + "</tr>")
    return "<table>" + "".join(cells) + "</table>"


class ConfigExplorer(widgets.VBox):
    """Model, experts, GPUs, GPU memory and global batch -> the configurations that fit, best
    first (``n_experts``: None for the dense model, else an MoE layer in every block)."""

    EXPERTS = [("dense", 0), ("8 experts", 8), ("64 experts", 64)]
    SCHEDULES = [("1F1B", ("1f1b",)), ("1F1B or zero-bubble", ("1f1b", "zb-h1", "zb-v", "dualpipev"))]

    def __init__(self, model: str = "GPT-3 175B", n_gpus: int = 1024, device_gb: int = 80,
                 global_batch: int = 1536, limit: int = 8, n_experts: Optional[int] = None,
                 schedules: Sequence[str] = ("1f1b",)):
        if model not in MODELS:
            raise ValueError(f"model must be one of {list(MODELS)}, got {model!r}")
        if (n_experts or 0) not in dict((v, k) for k, v in self.EXPERTS):
            raise ValueError(f"n_experts must be one of None, 8, 64, got {n_experts!r}")
        self.limit = limit
        self.experts = widgets.Dropdown(options=self.EXPERTS, value=n_experts or 0,
                                        description="experts")
        self.model = widgets.Dropdown(options=list(MODELS), value=model, description="model")
        self.n_gpus = widgets.SelectionSlider(options=[2 ** k for k in range(3, 13)], value=n_gpus,
                                              description="GPUs")
        self.device = widgets.Dropdown(options=[24, 40, 80, 141], value=device_gb, description="GB / GPU")
        self.batch = widgets.Dropdown(options=[256, 512, 1024, 1536, 2048], value=global_batch,
                                      description="batch")
        self.schedules = widgets.Dropdown(options=self.SCHEDULES, value=tuple(schedules),
                                          description="pipeline")
        self.summary = widgets.HTML()
        self.output = widgets.HTML()
        for control in (self.model, self.experts, self.n_gpus, self.device, self.batch, self.schedules):
            control.observe(lambda _change: self.update(), names="value")
        super().__init__([widgets.HBox([self.model, self.experts, self.n_gpus]),
                          widgets.HBox([self.device, self.batch, self.schedules]), self.summary, self.output])
        self.update()

    def update(self) -> None:
        experts = self.experts.value or None
        self.rows = feasible_configs(MODELS[self.model.value], self.n_gpus.value,
                                     device_bytes=self.device.value * 1e9,
                                     global_batch=self.batch.value, n_experts=experts,
                                     schedules=self.schedules.value)
        what = self.model.value + (f" with {experts} experts per layer" if experts else "")
        self.summary.value = (f"<b>{len(self.rows)}</b> configurations fit {what} on "
                              f"{self.n_gpus.value} GPUs of {self.device.value} GB "
                              f"(8 per node); the first {min(self.limit, len(self.rows))}, "
                              f"fastest estimated step first.<br><small>Step = compute + exposed "
                              f"communication + bubble, assuming "
                              f"{html.escape(Hardware().describe())}.</small>")
        self.output.value = _table(self.rows, self.limit) if self.rows else \
            "<i>nothing fits: more GPUs, more memory per GPU, or a smaller model</i>"
        self.html = self.output.value


def config_explorer(**kwargs) -> ConfigExplorer:
    return ConfigExplorer(**kwargs)
