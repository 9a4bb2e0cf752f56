"""`ParallelConfig`: how one training run is spread over its ranks, checked before any starts.

    config = ParallelConfig.debug_3d()                 # dp 2 x tp 2 x pp 2 = 8 ranks
    config.validate(8, GPTConfig.tiny(n_layer=4), batch=(8, 32))   # raises, naming every value

The degrees follow the mesh (`reference.mesh.Mesh`): world = dp x cp x tp x pp, with ep carved
out of dp (the ranks holding the same experts form the expert-data-parallel group, dp / ep
ranks). Inside dp, `zero_stage` shards the training state (0 = plain data parallelism,
1 = optimizer state, 2 = and gradients, 3 = and parameters). The pipeline runs `microbatches`
micro-batches per step with `schedule` (`reference.pipeline_parallel`; "interleaved" with
`virtual_stages` chunks per rank, "zb-v" and "dualpipev" with two placed in a V, "dualpipe" with
two copies of the pp stages, one per direction); with pp = 1
the micro-batches are gradient accumulation, F0 B0 F1 B1 ..., one alive at a time.

ZeRO-2 is refused with pp > 1, as DeepSpeed's pipeline engine does: it would reduce-scatter
the gradients after every micro-batch's backward instead of once a step, m times the traffic.
ZeRO-3 composes with pp, tp and activation checkpointing as torchtitan does
(`reference.zero.fsdp_param`): each parameter sharded along dim 0 over dp (x cp), a stage
gathered once per step and kept whole through its m micro-batches (one all-gather and one
reduce-scatter a step instead of 3 m); with ep > 1 each expert is sharded over its
expert-data-parallel group. `reshard_after_forward=True` is `fully_shard`'s option
(`reference.zero.fsdp_reshard`): 2 m all-gathers and m reduce-scatters a step, for holding
the shards and about one block whole. `fully_shard` defaults to None (True for every module
but the root); this course to False, which is what torchtitan picks under a pipeline.

Context parallelism (`cp`, `cp_kind`: `reference.context_parallel`) splits each sequence over
the cp ranks of one dp rank; gradients are averaged over dp x cp. What each option needs, and
why a combination is refused, is in the messages of `problems`."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from reference.loss import LOSS_MEANS
from reference.mesh import HSDP_WITH_CP

__all__ = ["ParallelConfig", "SCHEDULES", "V_SHAPED", "PRECISIONS", "CP_KINDS"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe")
V_SHAPED = ("zb-v", "dualpipev")  # two chunks per rank in a V: rank r holds stages r and 2 pp - 1 - r
PRECISIONS = ("fp32", "bf16", "fp16")
CP_KINDS = ("ring", "ulysses")  # reference.context_parallel.KINDS
ZERO3_ENGINES = ("auto", "blocks", "parameters")  # `ParallelConfig.zero3_engine`
# The options that take one of a few values, each with its values: `problems` names a value
# outside them in one sentence of the same shape.
CHOICES = (("zero_stage", (0, 1, 2, 3)), ("schedule", SCHEDULES), ("precision", PRECISIONS),
           ("loss_mean", LOSS_MEANS), ("cp_kind", CP_KINDS), ("zero3_engine", ZERO3_ENGINES))


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees and options of one parallel run. Presets: `single`, `debug_3d`, `moe_4d`,
    `article_175b`; `with_(**changes)` gives a modified copy."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1                       # carved out of dp: ep divides dp
    zero_stage: int = 0               # 0-3, inside dp
    sequence_parallel: bool = False   # Megatron SP inside each tp group (no-op at tp = 1)
    virtual_stages: int = 1           # model chunks per pipeline rank (interleaved 1F1B)
    microbatches: int = 1             # per step, per data-parallel rank
    schedule: str = "1f1b"
    activation_checkpointing: bool = False
    precision: str = "fp32"           # "bf16" autocast, or "fp16" with dynamic loss scaling
    embedding_stage: bool = False     # embedding and head on pipeline stages of their own
    cp: int = 1                       # context parallelism: ranks splitting each sequence
    cp_kind: str = "ring"             # "ring" (zig-zag split) or "ulysses" (contiguous)
    # ZeRO-3's engine (`reference.parallel.data_parallelism`): "blocks", FSDP over the whole model,
    # each block gathered for every micro-batch's forward and again for its backward, its
    # gradient reduce-scattered then (about 3 m collectives a step), at tp = pp = ep = 1 without
    # HSDP only; "parameters", every parameter's dim-0 rows, gathered once a step and
    # reduce-scattered once (2 collectives; per block with reshard_after_forward); "auto":
    # blocks where they can run, else parameters. Activation checkpointing does not choose it.
    zero3_engine: str = "auto"
    # ZeRO-3 per parameter: free each block's gathered parameters after every forward (module docstring)
    reshard_after_forward: bool = False
    # the step's loss (reference.loss): "tokens", the counted tokens' sum over their count (one
    # process's F.cross_entropy, however padding falls), or "mean_of_means", each micro-batch's
    # mean averaged over micro-batches and ranks (right only when each counts as many tokens)
    loss_mean: str = "tokens"
    # HSDP (FSDP2's 2D mesh, torchtitan's data_parallel_replicate_degree): ZeRO-3 shards over
    # dp / dp_replicate ranks and all-reduces across dp_replicate such blocks; 1: over all of dp
    dp_replicate: int = 1
    # Qi et al.'s optimizer post-validation (reference.parallel.post_validation): step at once,
    # complete the global checks (clip norm, fp16 overflow) after, undo a step that fails them
    optimizer_post_validation: bool = False
    # DualPipe's overlapped F&B (reference.pipeline_parallel.overlap): each marked pair's forward
    # and backward in turns, the expert all-to-all of one in flight while the other computes;
    # False: the pairs run one after the other (DualPipe's own default without a model callback)
    overlap_forward_backward: bool = False

    # ------------------------------------------------------------------ presets
    @classmethod
    def single(cls) -> "ParallelConfig":
        """One process: every degree 1 (the reference run)."""
        return cls()

    @classmethod
    def debug_3d(cls) -> "ParallelConfig":
        """dp 2 x tp 2 x pp 2 on 8 ranks, SP on, 1F1B over 2 micro-batches: every kind of
        group and message on a laptop."""
        return cls(dp=2, tp=2, pp=2, sequence_parallel=True, microbatches=2)

    @classmethod
    def moe_4d(cls) -> "ParallelConfig":
        """dp 2 (ep 2 inside it) x tp 2 x pp 2 on 8 ranks: experts on top of 3D."""
        return cls(dp=2, tp=2, pp=2, ep=2, microbatches=2)

    @classmethod
    def article_175b(cls) -> "ParallelConfig":
        """The article's GPT-3 175B layout on 1024 GPUs: DP 32 x TP 8 x PP 4."""
        return cls(dp=32, tp=8, pp=4, zero_stage=1, sequence_parallel=True, microbatches=16,
                   activation_checkpointing=True, precision="bf16")

    def with_(self, **changes) -> "ParallelConfig":
        return replace(self, **changes)

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def n_stages(self) -> int:
        """Model stages: pp x virtual_stages, but pp under DualPipe, whose two chunks are copies."""
        return self.pp if self.schedule == "dualpipe" else self.pp * self.virtual_stages

    @property
    def zero3_by_blocks(self) -> bool:
        """Whether ZeRO-3 runs as FSDP by blocks (`reference.zero.FSDP`): ZeRO-3 over dp x cp > 1
        with ``zero3_engine`` "blocks", or "auto" where blocks can run (tp = pp = ep = 1, no
        HSDP). Otherwise ZeRO-3 shards each parameter (`ShardedParameters`)."""
        if self.zero_stage != 3 or self.dp * self.cp < 2:
            return False
        if self.zero3_engine == "auto":
            return self.tp == self.pp == self.ep == self.dp_replicate == 1
        return self.zero3_engine == "blocks"

    @property
    def zero3_engine_used(self) -> Optional[str]:
        """The ZeRO-3 engine this run uses ("blocks" or "parameters"), None without ZeRO-3."""
        if self.zero_stage != 3 or self.dp * self.cp < 2:
            return None
        return "blocks" if self.zero3_by_blocks else "parameters"

    def mesh(self):
        """The `reference.mesh.Mesh` of these degrees (groups not built yet)."""
        from reference.mesh import Mesh

        return Mesh(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp, dp_replicate=self.dp_replicate)

    def __str__(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.cp > 1:
            parts.append(f"cp={self.cp} {self.cp_kind}")
        extras = [f"zero={self.zero_stage}" if self.zero_stage else "",
                  "sp" if self.sequence_parallel and self.tp > 1 else "",
                  f"{self.schedule} m={self.microbatches}" if self.pp > 1 else "",
                  f"v={self.virtual_stages}" if self.virtual_stages > 1 else "",
                  "ckpt" if self.activation_checkpointing else "",
                  self.precision if self.precision != "fp32" else "",
                  "emb-stage" if self.embedding_stage else "",
                  "f&b-overlap" if self.overlap_forward_backward else "",
                  "post-validation" if self.optimizer_post_validation else "",
                  "mean-of-means" if self.loss_mean == "mean_of_means" else "",
                  f"hsdp={self.dp_replicate}x{self.dp // self.dp_replicate}" if self.dp_replicate > 1 else "",
                  f"zero3={self.zero3_engine}" if self.zero3_engine != "auto" else ""]
        return " ".join(parts + [e for e in extras if e])

    # ------------------------------------------------------------------ checks
    def validate(self, world_size: int, model_config=None,
                 batch: Union[int, tuple, None] = None, n_experts: Optional[int] = None
                 ) -> "ParallelConfig":
        """Raise ValueError listing every inconsistency; returns self. ``batch``: the global
        batch size B or (B, T); ``n_experts``: experts per MoE layer (None: a dense model)."""
        problems = self.problems(world_size, model_config, batch, n_experts)
        if problems:
            raise ValueError(f"invalid parallel configuration ({self}, world_size={world_size}):\n  - "
                             + "\n  - ".join(problems))
        return self

    def problems(self, world_size, cfg, batch, n_experts) -> list[str]:
        """Every inconsistency, each a sentence naming the values involved (empty: valid);
        `validate` raises with all of them, the sweep and the explorer only ask."""
        out = []
        ints = dict(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp,
                    virtual_stages=self.virtual_stages, microbatches=self.microbatches)
        bad = [f"{k}={v!r}" for k, v in ints.items()
               if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            return [f"degrees and counts must be positive ints: {', '.join(bad)}"]
        if self.world_size != world_size:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            out.append(f"dp={self.dp}{cp} x tp={self.tp} x pp={self.pp} = "
                       f"{self.world_size}, but world_size={world_size}")
        out += [f"{name} must be one of {', '.join(map(str, values))}, got {getattr(self, name)!r}"
                for name, values in CHOICES if getattr(self, name) not in values]
        if self.dp % self.ep:
            out.append(f"ep={self.ep} must divide dp={self.dp} (experts are carved out of the "
                       f"data-parallel ranks)")
        if self.zero_stage == 2 and self.pp > 1:
            out.append(f"zero_stage=2 with pp={self.pp}: a pipeline would reduce-scatter the "
                       f"gradients once per micro-batch (m={self.microbatches}); use zero_stage 0, "
                       f"1 or 3 with a pipeline (DeepSpeed refuses 2 and 3)")
        if self.zero_stage in (1, 2) and self.ep > 1:
            out.append(f"zero_stage={self.zero_stage} with ep={self.ep}: ZeRO-1/2's one flat shard "
                       f"over dp cannot hold experts, which are reduced over the expert-data-parallel "
                       f"group (dp/ep={self.dp // self.ep if self.dp % self.ep == 0 else '?'} ranks); "
                       f"use zero_stage 0, or 3 (each expert sharded over that group)")
        if self.zero3_engine == "blocks":
            out += self._blocks_problems()
        if self.reshard_after_forward:
            out += self._reshard_problems(n_experts)
        out += self._schedule_problems()
        if self.dp_replicate != 1:
            out += self._hsdp_problems()
        if cfg is not None:
            out += self._model_problems(cfg)
        if batch is not None:
            out += self._batch_problems(batch, cfg)
        if n_experts is not None and self.ep > 1 and n_experts % self.ep:
            out.append(f"n_experts={n_experts} is not a multiple of ep={self.ep}")
        if n_experts is None and self.ep > 1:
            out.append(f"ep={self.ep} needs a model with experts (pass n_experts)")
        if self.cp > 1 and self.cp_kind in CP_KINDS:
            T = None if batch is None or isinstance(batch, int) else tuple(batch)[1]
            out += self._context_problems(cfg, T, n_experts)
        return out

    def _hsdp_problems(self) -> list[str]:
        """HSDP against the data-parallel degree and what it composes with."""
        r = self.dp_replicate
        if not isinstance(r, int) or isinstance(r, bool) or r < 1 or self.dp % r:
            return [f"dp_replicate={r!r} must be a positive int dividing dp={self.dp}"]
        out = []
        if self.zero_stage != 3:
            out.append(f"dp_replicate={r} shards ZeRO-3 inside blocks of dp / dp_replicate = "
                       f"{self.dp // r} ranks: it needs zero_stage=3, got {self.zero_stage}")
        if self.ep > 1:
            out.append(f"dp_replicate={r} with ep={self.ep}: HSDP is built for the dense data-parallel "
                       f"ranks only (experts shard over their own edp group)")
        if self.cp > 1:
            out.append(f"dp_replicate={r} with cp={self.cp}: {HSDP_WITH_CP}")
        if self.reshard_after_forward:
            out.append(f"dp_replicate={r} with reshard_after_forward: resharding after forward "
                       f"reduce-scatters block by block, and its all-reduce across replicas is not "
                       f"built; use reshard_after_forward=False (gather once per step)")
        return out

    def _schedule_problems(self) -> list[str]:
        """The pipeline schedule against pp, its virtual stages and the micro-batches."""
        out = []
        if self.virtual_stages > 1 and self.schedule not in ("interleaved", "dualpipe") + V_SHAPED:
            out.append(f"virtual_stages={self.virtual_stages} needs schedule='interleaved' (or "
                       f"'zb-v' with 2), got {self.schedule!r}")
        out += self._zero_bubble_problems()
        if self.schedule == "interleaved":
            if self.pp < 2 or self.virtual_stages < 2:
                out.append(f"schedule='interleaved' needs pp >= 2 and virtual_stages >= 2, got "
                           f"pp={self.pp}, virtual_stages={self.virtual_stages}")
            elif self.microbatches >= self.pp and self.microbatches % self.pp:
                out.append(f"interleaved runs micro-batches in rounds of pp: microbatches="
                           f"{self.microbatches} must be a multiple of pp={self.pp} (or below it)")
        if self.schedule == "1f1b" and 1 < self.pp and self.microbatches < self.pp:
            out.append(f"1F1B with microbatches={self.microbatches} < pp={self.pp} never reaches "
                       f"its steady state (the bubble is the naive split's); use microbatches >= pp")
        return out

    def _zero_bubble_problems(self) -> list[str]:
        """The zero-bubble schedules (backward split into I and W) against pp, chunks and ZeRO."""
        out = []
        if self.schedule in V_SHAPED and (self.pp < 2 or self.virtual_stages != 2):
            out.append(f"schedule={self.schedule!r} places two chunks per rank in a V: it needs pp >= 2 "
                       f"and virtual_stages=2, got pp={self.pp}, virtual_stages={self.virtual_stages}")
        if self.schedule == "dualpipe":
            out += self._dualpipe_problems()
        if self.schedule == "dualpipev" and self.microbatches < 2 * self.pp:
            out.append(f"DualPipeV pairs a forward of each chunk with a backward of the other: it needs "
                       f"microbatches >= 2 pp = {2 * self.pp} stages, got {self.microbatches}")
        if self.schedule == "zb-h1" and 1 < self.pp and self.microbatches < self.pp:
            out.append(f"ZB-H1 with microbatches={self.microbatches} < pp={self.pp} never reaches "
                       f"1F1B's steady state, whose idle end its W's fill; use microbatches >= pp")
        if self.optimizer_post_validation and self.zero_stage > 0:
            out.append(f"optimizer_post_validation undoes a step from a copy of each rank's parameters "
                       f"and optimizer state; ZeRO-{self.zero_stage}'s sharded step is not undone here: "
                       f"use zero_stage=0 or optimizer_post_validation=False")
        paired = self.schedule in ("dualpipev", "dualpipe") and self.pp > 1
        needs = [(paired, f"overlaps DualPipeV's F&B pairs (or DualPipe's): it needs schedule='dualpipev' or "
                  f"'dualpipe' and pp >= 2, got {self.schedule!r} at pp={self.pp}"),
                 (self.ep > 1, f"hides the expert all-to-all (ep > 1) under the other micro-batch's compute: "
                  f"at ep={self.ep} there is none, the pair would run one after the other anyway"),
                 (not self.activation_checkpointing, "runs no recomputed chunk inside a pair: "
                  "activation_checkpointing=True")]
        out += [f"overlap_forward_backward {why}; or set overlap_forward_backward=False"
                for ok, why in needs if self.overlap_forward_backward and not ok]
        if self.schedule in ("zb-h1", "zb-h2") + V_SHAPED and self.zero_stage == 3 and self.dp * self.cp > 1:
            out.append(f"schedule={self.schedule!r} splits each backward into I and W, and composed "
                       f"ZeRO-3 gathers and reduce-scatters around a whole backward B: use zero_stage "
                       f"<= 1 or schedule='1f1b'")
        return out

    def _dualpipe_problems(self) -> list[str]:
        """DualPipe: half the micro-batches fed from each end, every stage held twice
        (`reference.pipeline_parallel.dualpipe`)."""
        out = []
        if self.pp < 2 or self.pp % 2 or self.microbatches % 2 or self.microbatches < 2 * self.pp:
            out.append(f"schedule='dualpipe' feeds half the micro-batches from each end of the pipeline: "
                       f"it needs an even pp and an even microbatches >= 2 pp (DualPipe's own asserts), "
                       f"got pp={self.pp}, microbatches={self.microbatches}")
        if self.virtual_stages != 2:
            out.append(f"schedule='dualpipe' runs two chunks per rank (stage r and a copy of stage "
                       f"pp - 1 - r): it needs virtual_stages=2, got {self.virtual_stages}")
        # not built with DualPipe's two copies yet: each names what it would need
        if self.zero_stage > 0:
            out.append(f"schedule='dualpipe' with zero_stage={self.zero_stage}: the copies' gradients are "
                       f"summed over the pipeline, and ZeRO's shards of two copies are not built here; "
                       f"use zero_stage=0")
        if self.cp > 1 or self.embedding_stage or self.optimizer_post_validation:
            out.append(f"schedule='dualpipe' is built with dp, tp (and SP), experts, recomputation and "
                       f"clipping; not yet with cp={self.cp}, embedding_stage={self.embedding_stage}, "
                       f"optimizer_post_validation={self.optimizer_post_validation}")
        return out

    def _batch_problems(self, batch, cfg) -> list[str]:
        """The global batch (B, or (B, T)) against dp x micro-batches, the block and SP."""
        out = []
        B, T = (batch, None) if isinstance(batch, int) else tuple(batch)
        if B % (self.dp * self.microbatches):
            out.append(f"global batch {B} does not divide into dp={self.dp} x microbatches="
                       f"{self.microbatches} = {self.dp * self.microbatches} equal micro-batches")
        if T is not None and cfg is not None and T > cfg.block_size:
            out.append(f"sequence length T={T} exceeds block_size={cfg.block_size}")
        if T is not None and self.sequence_parallel and self.tp > 1 and self.cp == 1 and T % self.tp:
            out.append(f"sequence parallelism splits the sequence: T={T} is not a multiple "
                       f"of tp={self.tp}")
        return out

    def _blocks_problems(self) -> list[str]:
        """ZeRO-3's engine named "blocks": only where FSDP by blocks runs."""
        bad = [f"{k}={v}" for k, v in dict(tp=self.tp, pp=self.pp, ep=self.ep,
                                           dp_replicate=self.dp_replicate).items() if v != 1]
        if bad:
            return [f"zero3_engine='blocks' with {', '.join(bad)}: FSDP by blocks wraps the whole "
                    f"model over dp x cp (tp = pp = ep = 1, no HSDP); use zero3_engine 'parameters' "
                    f"or 'auto'"]
        return []

    def _reshard_problems(self, n_experts) -> list[str]:
        """What ``reshard_after_forward=True`` needs: composed ZeRO-3, and a dense model."""
        if not isinstance(self.reshard_after_forward, bool):
            return [f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}"]
        degrees = (f"zero_stage={self.zero_stage}, dp={self.dp} x cp={self.cp} = {self.dp * self.cp}, "
                   f"tp={self.tp}, pp={self.pp}, zero3_engine={self.zero3_engine!r}")
        out = []
        if self.zero_stage != 3 or self.dp * self.cp < 2:
            out.append(f"reshard_after_forward=True needs ZeRO-3 over dp x cp > 1 ranks ({degrees}): "
                       f"with nothing sharded there is nothing to free after a forward")
        elif self.zero3_by_blocks:
            out.append(f"reshard_after_forward=True applies to ZeRO-3 per parameter: with {degrees} "
                       f"ZeRO-3 runs as FSDP by blocks, which already gathers each block in forward "
                       f"and again in backward; set zero3_engine='parameters' to reshard the rows")
        if self.ep > 1 or n_experts is not None:
            out.append(f"reshard_after_forward=True with experts (ep={self.ep}, n_experts={n_experts}): "
                       f"an expert that gets no token on one rank leaves its gradient unset there, so "
                       f"the ranks would finish their blocks' backwards, and start their reduce-"
                       f"scatters, in different orders (and with ep > 1 the experts are sharded over "
                       f"another group); use reshard_after_forward=False")
        return out

    def _context_problems(self, cfg, T, n_experts) -> list[str]:
        """What context parallelism (cp > 1) needs of the model and the sequence length T."""
        cp, tp, out = self.cp, self.tp, []
        if n_experts is not None or self.ep > 1:
            out.append(f"cp={cp} with experts (n_experts={n_experts}, ep={self.ep}): a router counts "
                       f"its capacity per whole sequence, and a cp rank holds T/cp of its tokens")
        if cfg is not None and cfg.dropout > 0:
            out.append(f"cp={cp} with dropout={cfg.dropout}: ring attention has no attention dropout "
                       f"and the cp ranks would need dropout streams of their own; use dropout=0")
        if cfg is not None and self.cp_kind == "ulysses" and cfg.n_head % (tp * cp):
            out.append(f"Ulysses deals each tp rank's n_head/tp heads out over cp: n_head={cfg.n_head} "
                       f"is not a multiple of tp={tp} x cp={cp} = {tp * cp}")
        if T is not None:
            parts = 2 * cp if self.cp_kind == "ring" else cp
            if T % parts:
                how = "2 x cp chunks (the zig-zag split)" if self.cp_kind == "ring" else "cp parts"
                out.append(f"cp_kind={self.cp_kind!r} splits each sequence into {how}: T={T} is not a "
                           f"multiple of {parts} (cp={cp})")
            elif self.sequence_parallel and tp > 1 and (T // cp) % tp:
                out.append(f"sequence parallelism splits each cp rank's T/cp={T // cp} tokens over "
                           f"tp={tp}: not a multiple (T={T}, cp={cp})")
        return out

    def _model_problems(self, cfg) -> list[str]:
        out = []
        tp = self.tp
        if cfg.n_head % tp:
            out.append(f"n_head={cfg.n_head} is not a multiple of tp={tp} (heads are split)")
        if cfg.d_ff % tp:
            out.append(f"d_ff={cfg.d_ff} is not a multiple of tp={tp} (the MLP is split by columns)")
        # the vocabulary is padded up to a multiple of tp (padded_vocab_size): always fine
        blocks_stages = self.n_stages - (2 if self.embedding_stage else 0)
        if self.embedding_stage and self.n_stages < 3:
            out.append(f"embedding_stage needs at least 3 stages (embedding, blocks, head), got "
                       f"pp={self.pp} x virtual_stages={self.virtual_stages} = {self.n_stages}")
        elif cfg.n_layer < max(blocks_stages, 1):
            cut = f"pp={self.pp} (dualpipe's two chunks are copies)" if self.schedule == "dualpipe" else \
                f"pp={self.pp} x virtual_stages={self.virtual_stages}"
            out.append(f"n_layer={cfg.n_layer} < {cut}"
                       f"{' - 2 (embedding and head stages)' if self.embedding_stage else ''}"
                       f" = {blocks_stages}: a stage would hold no block")
        return out
