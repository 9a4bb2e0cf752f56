"""Every option of the composed GPT against every other: an all-pairs sweep of configurations.

    cases, refused = covering_set()          # accepted cases covering every pair of values
    for case in cases: ...                   # train 3 steps, compare with one process

A run is a `ParallelConfig` plus two things outside it: whether the gradients are clipped
(`clip`) and whether the model has experts (`moe`). `OPTIONS` lists the values each option
takes here, within world sizes 1 to 8. The full product is hundreds of thousands of cases;
an *all-pairs* set is much smaller and still puts every value of every option next to every
value of every other option in at least one case that trains.

Which pairs count. A value only matters where the run uses it (`effective`): `cp_kind`
where cp > 1, sequence parallelism where tp > 1, the schedule, its virtual stages and the
embedding stage where pp > 1, the ZeRO stage where there are data-parallel replicas
(dp x cp > 1), optimizer post-validation where the step has a global check to complete after
it (clipping, or fp16's overflow test). The pairs to cover are the pairs of effective values, and besides them the
pairs of each data-parallel way (`dp_way`: replicas, ZeRO-1, ZeRO-2, ZeRO-3 by blocks or per
parameter, resharded after forward, HSDP; several options together pick it) with each thing
that changes what the loss is made of (`WAY_PAIRED`): the experts (none, at ep 1, at ep > 1),
the precision (fp16's loss scale) and the experts' bias. Every case trains on padded
documents with the token mean, so every way meets it.

How the set is built (greedy, as AETG does): draw candidates at random, keep those
`ParallelConfig.validate` accepts, take the one that covers the most pairs not yet covered
for what it costs to run (`COST`: a case of eight ranks costs six of four on two cores),
repeat. A pair no random draw covers is searched for directly (both values fixed, the rest
drawn); a pair that no accepted case can hold is *refused*, and `covering_set` returns one
refused case for it with `validate`'s reason. Everything is seeded: the same set every time.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

from reference.parallel.config import ParallelConfig

__all__ = ["OPTIONS", "SweepCase", "covering_set", "effective", "pairs_of", "dp_way", "WAYS", "MODEL_SIZES",
           "BATCH", "N_EXPERTS", "full_product", "names_pair", "pair_reason"]

OPTIONS = {
    "dp": (1, 2, 4),
    "tp": (1, 2),
    "pp": (1, 2),
    "cp": (1, 2),
    "cp_kind": ("ring", "ulysses"),
    "ep": (1, 2),
    "zero_stage": (0, 1, 2, 3),
    "sequence_parallel": (False, True),
    "schedule": ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev", "dualpipe"),
    "virtual_stages": (1, 2),
    "activation_checkpointing": (False, True),
    "precision": ("fp32", "bf16", "fp16"),
    "microbatches": (1, 2, 4),
    "embedding_stage": (False, True),
    "clip": (False, True),
    "moe": (False, True),
    "dp_replicate": (1, 2),
    "bias": (False, True),
    "reshard_after_forward": (False, True),  # paired through `dp_way` only
    "optimizer_post_validation": (False, True),  # acts where there is a check: clip or fp16
}
# The model and batch every case trains: 4 heads and d_ff 128 split over tp and cp, four
# layers cut into up to four stages, 16 sequences split over dp x microbatches up to 16.
MODEL_SIZES = dict(n_layer=4, block_size=16)   # GPTConfig.tiny(**MODEL_SIZES)
BATCH = (16, 16)                               # (B, T)
N_EXPERTS = 4
# What a case costs to train, roughly, by world size: the greedy weighs each draw's new pairs
# by it, so that it covers with cases of four ranks what they can hold. Measured on 2 cores
# (`pytest --durations`) with the unweighted greedy's 55 cases: eight ranks about 3.5 s a case,
# four 0.6 s, two 0.4 s (the cases differ in what they compose: a rough guide). Weighted, the
# 77 cases train in about 110 s, where those 55 took 134 s.
COST = {1: 0.3, 2: 0.4, 4: 0.6, 8: 3.5}
# `reference.parallel.post_validation` refuses bias-balanced experts when the step runs (a router's
# bias is the model's, not the ParallelConfig's, so `validate` cannot): the sweep refuses the pair
POST_VALIDATION_WITH_BIAS = ("optimizer_post_validation with bias-balanced experts: their bias moves in "
                             "an optimizer pre-hook, outside what a rollback restores")
_CONFIG_KEYS = [k for k in OPTIONS if k not in ("clip", "moe", "bias")]

# The data-parallel ways (`reference.parallel.data_parallelism`), the experts' kinds, and what
# each way is paired with besides the plain options.
WAYS = ("replicas", "zero1", "zero2", "zero3-blocks", "zero3-params", "resharded", "hsdp")
EXPERTS = ("dense", "ep1", "ep>1")
WAY_PAIRED = {"experts": EXPERTS, "precision": OPTIONS["precision"], "bias": OPTIONS["bias"]}
# FSDP by blocks is the engine of ZeRO-3 at tp = pp = ep = 1: no case can pair it with ep > 1
_NOT_A_PAIR = {(("experts", "ep>1"), ("way", "zero3-blocks"))}


@dataclass(frozen=True)
class SweepCase:
    config: ParallelConfig
    clip: bool = False
    moe: bool = False
    bias: bool = False   # experts balanced by a bias too (`moe_factory(bias_update_rate=...)`)

    def __str__(self) -> str:
        extra = [x for x, on in (("clip", self.clip), ("moe", self.moe), ("bias", self.bias and self.moe)) if on]
        return " ".join([str(self.config)] + extra)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def values(self) -> dict:
        out = {k: getattr(self.config, k) for k in _CONFIG_KEYS}
        out.update(clip=self.clip, moe=self.moe, bias=self.bias)
        return out

    def problems(self) -> list[str]:
        from reference.model import GPTConfig

        c = self.config
        out = c.problems(c.world_size, GPTConfig.tiny(**MODEL_SIZES), BATCH, N_EXPERTS if self.moe else None)
        if c.optimizer_post_validation and self.moe and self.bias:  # refused by the step (the bias is no config's)
            out.append(POST_VALIDATION_WITH_BIAS)
        return out


def effective(values: dict) -> dict:
    """The values a run uses: options that do nothing in this case are left out."""
    out = dict(values)
    if values["cp"] == 1:
        out.pop("cp_kind")
    if values["tp"] == 1:
        out.pop("sequence_parallel")
    if values["pp"] == 1:
        for k in ("schedule", "virtual_stages", "embedding_stage"):
            out.pop(k)
    if values["dp"] * values["cp"] == 1:
        out.pop("zero_stage")
    if values["dp"] == 1 or values["zero_stage"] != 3:  # HSDP splits ZeRO-3's dp ranks
        out.pop("dp_replicate")
    if not values["moe"]:
        out.pop("bias")
    out.pop("reshard_after_forward")  # it acts through the way (`dp_way`)
    if not values["clip"] and values["precision"] != "fp16":  # no check: the step is the plain one
        out.pop("optimizer_post_validation")
    return out


def dp_way(values: dict) -> Optional[str]:
    """The data-parallel way the case runs (one of `WAYS`), None without replicas."""
    if values["dp"] * values["cp"] == 1:
        return None
    if values["zero_stage"] < 3:
        return WAYS[values["zero_stage"]]
    if values["dp_replicate"] > 1:
        return "hsdp"
    if values["reshard_after_forward"]:
        return "resharded"
    # the config's own rule, read on the values (building a ParallelConfig per draw is slow)
    by_blocks = ParallelConfig.zero3_by_blocks.fget(SimpleNamespace(**values, zero3_engine="auto"))
    return "zero3-blocks" if by_blocks else "zero3-params"


def experts_of(values: dict) -> str:
    return "dense" if not values["moe"] else "ep1" if values["ep"] == 1 else "ep>1"


def pairs_of(values: dict) -> set:
    acting = effective(values)
    eff = sorted(acting.items())
    out = {(a, b) for a, b in itertools.combinations(eff, 2)}
    way = dp_way(values)
    if way is not None:
        acting["experts"] = experts_of(values)
        out |= {((option, acting[option]), ("way", way)) for option in WAY_PAIRED if option in acting}
    return out


# Settings that let every other option act (cp > 1 for cp_kind, and so on).
_ENABLING = dict(dp=2, cp=2, tp=2, pp=2)


def _all_pairs() -> set:
    """Every pair of values of two options that can both act in one case."""
    items = [(k, v) for k, vals in OPTIONS.items() for v in vals]
    out = set()
    for a, b in itertools.combinations(sorted(items, key=lambda kv: (kv[0], str(kv[1]))), 2):
        if a[0] == b[0]:
            continue
        values = {k: vals[0] for k, vals in OPTIONS.items()}
        values.update(_ENABLING)
        for option in (a[0], b[0]):  # what lets each act (HSDP: ZeRO-3)
            values.update(_ENABLE.get(option, {}))
        values.update({a[0]: a[1], b[0]: b[1]})
        eff = effective(values)
        if a[0] in eff and b[0] in eff:
            out.add((a, b))
    for option, kinds in WAY_PAIRED.items():
        out |= {((option, v), ("way", w)) for v in kinds for w in WAYS} - _NOT_A_PAIR
    return out


def _case(values: dict) -> SweepCase:
    kw = {k: values[k] for k in _CONFIG_KEYS}
    return SweepCase(ParallelConfig(**kw), clip=values["clip"], moe=values["moe"],
                     bias=values["bias"] and values["moe"])


def _draw(rng: random.Random, fixed: Optional[dict] = None) -> dict:
    values = {k: rng.choice(vals) for k, vals in OPTIONS.items()}
    # Draw the options most often refused into their working region half of the time, so
    # that accepted cases come up often enough: ep only with experts, interleaving with v=2.
    if rng.random() < 0.5:
        values["virtual_stages"] = 2 if values["schedule"] in ("interleaved", "zb-v", "dualpipev", "dualpipe") else 1
    if values["ep"] > 1 and rng.random() < 0.7:
        values["moe"] = True
    values.update(fixed or {})
    return values


def _key(pair) -> tuple:
    (a, va), (b, vb) = pair
    return ((a, str(va)), (b, str(vb)))


def covering_set(seed: int = 5, draws: int = 600, max_world: int = 8):
    """(accepted, refused): accepted `SweepCase`s covering every pair of effective values that
    some accepted case can hold, and for each pair none can, (pair, a refused case, reason).
    Seed 5: 103 cases, cost 133 (by `COST`); seeds 0 to 7 give 133 to 152 (seed 4's 132.6 the
    cheapest, not worth a new set). Before DualPipe joined, seed 5's 102 cases cost 109, the
    cheapest of seeds 0 to 5; before ZB-H2 and post-validation, seed 1's 93 was."""
    rng = random.Random(seed)
    wanted = {_key(p) for p in _all_pairs()}
    covered: set = set()
    accepted: list[SweepCase] = []
    cache: dict = {}

    def ok(values):
        case = _case(values)
        if case.world_size > max_world:
            return None
        if case not in cache:
            cache[case] = not case.problems()
        return case if cache[case] else None

    def gain(values):
        return len({_key(p) for p in pairs_of(values)} & (wanted - covered))

    stale = 0
    while stale < 3:
        best, best_gain = None, 0.0
        for _ in range(draws):
            values = _draw(rng)
            case = ok(values)
            if case is not None:
                g = gain(values) / COST[case.world_size]  # new pairs per second of the run
                if g > best_gain:
                    best, best_gain = values, g
        if best is None:
            stale += 1
            continue
        stale = 0
        accepted.append(_case(best))
        covered |= {_key(p) for p in pairs_of(best)}
    refused = []
    for pair in sorted(wanted - covered):
        if pair in covered:
            continue
        (a, va), (b, vb) = pair
        fixed = {**_fixing(a, va), **_fixing(b, vb)}
        found, first_refusal = None, None
        for _ in range(3000):
            values = _draw(rng, fixed)
            if not _acts(pair, values):
                continue  # one of the two values would do nothing in this draw
            case = _case(values)
            if case.world_size > max_world:
                continue
            if ok(values) is not None:
                found = values
                break
            if first_refusal is None:
                first_refusal = case
        if found is not None:
            accepted.append(_case(found))
            covered |= {_key(p) for p in pairs_of(found)}
        else:
            case = _nearest_refusal(accepted, pair, fixed, max_world)
            refused.append(((a, _named(a, va)), (b, _named(b, vb)), case, "; ".join(case.problems())))
    return accepted, refused


def _acts(pair, values: dict) -> bool:
    """Whether both values of ``pair`` (`_key`'s form) act in the case ``values``."""
    acting = {k: str(v) for k, v in effective(values).items()}
    way = dp_way(values)
    if way is not None:
        acting.update(way=way, experts=experts_of(values))
    return all(acting.get(option) == text for option, text in pair)


# The options' values that make each data-parallel way and each kind of experts.
_WAY_SETTINGS = {
    "replicas": dict(zero_stage=0, dp=2), "zero1": dict(zero_stage=1, dp=2), "zero2": dict(zero_stage=2, dp=2),
    "zero3-blocks": dict(zero_stage=3, dp=2, tp=1, pp=1, ep=1, dp_replicate=1, reshard_after_forward=False),
    "zero3-params": dict(zero_stage=3, dp=2, pp=2, dp_replicate=1, reshard_after_forward=False),
    "resharded": dict(zero_stage=3, dp=2, pp=2, dp_replicate=1, reshard_after_forward=True),
    "hsdp": dict(zero_stage=3, dp=4, dp_replicate=2, reshard_after_forward=False)}
_EXPERT_SETTINGS = {"dense": dict(moe=False), "ep1": dict(moe=True, ep=1), "ep>1": dict(moe=True, ep=2)}


def _fixing(option: str, text: str) -> dict:
    """The options' values that give ``option`` the value written ``text``."""
    if option == "way":
        return dict(_WAY_SETTINGS[text])
    if option == "experts":
        return dict(_EXPERT_SETTINGS[text])
    return {option: _value(option, text)}


def _named(option: str, text: str):
    return text if option in ("way", "experts") else _value(option, text)


def _nearest_refusal(accepted, pair, fixed: dict, max_world: int) -> SweepCase:
    """The accepted case that, given the two values, is refused for the fewest reasons: its
    reasons are the pair's own, not those of unrelated options."""
    words = [w for option in (pair[0][0], pair[1][0]) for w in _WORDS.get(option, (option,))]
    best = None
    for case in accepted:
        values = case.values()
        values.update(fixed)
        for option in fixed:  # let each fixed value act (cp_kind needs cp > 1, and so on)
            values.update({k: v for k, v in _ENABLE.get(option, {}).items() if k not in fixed})
        if values["dp"] * values["cp"] == 1 and "zero_stage" in fixed:
            values["dp"] = 2
        if not _acts(pair, values):
            continue  # the two values do not both act here
        candidate = _case(values)
        if candidate.world_size > max_world:
            continue
        problems = candidate.problems()
        if not problems:
            continue
        # the fewest reasons that do not name either option, then the fewest reasons
        score = (sum(not any(w in p for w in words) for p in problems), len(problems))
        if best is None or score < best[0]:
            best = (score, candidate)
    return best[1]


# What each option needs of the others to act at all (`effective`).
_ENABLE = {"cp_kind": {"cp": 2}, "sequence_parallel": {"tp": 2}, "schedule": {"pp": 2},
           "virtual_stages": {"pp": 2}, "embedding_stage": {"pp": 2},
           "optimizer_post_validation": {"clip": True, "precision": "fp16"},
           "dp_replicate": {"dp": 2, "zero_stage": 3}, "bias": {"moe": True}}

# How `validate`'s reasons name each option.
_WORDS = {"moe": ("experts",), "cp_kind": ("cp=", "cp_kind"), "schedule": ("schedule", "1F1B", "interleaved"),
          "sequence_parallel": ("sequence_parallel", "sequence parallel"),
          "clip": ("clip",), "precision": ("fp16", "bf16", "precision"),
          "dp": ("dp=",), "tp": ("tp=",), "pp": ("pp=",), "cp": ("cp=",), "ep": ("ep=",),
          "dp_replicate": ("dp_replicate",), "bias": ("experts",),
          "way": ("zero_stage", "reshard_after_forward", "dp_replicate"), "experts": ("experts", "ep=")}


def pair_reason(reason: str, a: str, b: str) -> str:
    """The one of `validate`'s reasons (joined by "; ") that best explains refusing options a
    and b together: one naming both, else one naming either, else the first."""
    parts = reason.split("; ")
    both = [p for p in parts if names_pair(p, a, a) and names_pair(p, b, b)]
    either = [p for p in parts if names_pair(p, a, b)]
    return (both or either or parts)[0]


def names_pair(reason: str, a: str, b: str) -> bool:
    """Whether a refusal's reason names at least one of the two options (test helper)."""
    return any(w in reason for o in (a, b) for w in _WORDS.get(o, (o,)))


def _value(option: str, text: str):
    return next(v for v in OPTIONS[option] if str(v) == text)


def full_product(max_world: int = 8):
    """Every accepted case of the full product (with the options that do nothing in a case
    fixed at their defaults, so that no run is repeated), for `bench/sweep_3d.py --full`."""
    seen = set()
    keys = list(OPTIONS)
    for combo in itertools.product(*(OPTIONS[k] for k in keys)):
        values = dict(zip(keys, combo))
        eff = effective(values)
        defaults = dict(cp_kind="ring", sequence_parallel=False, schedule="1f1b",
                        virtual_stages=1, embedding_stage=False, zero_stage=0, dp_replicate=1, bias=False,
                        optimizer_post_validation=False)
        if "zero_stage" in eff and eff["zero_stage"] == 3:
            eff["reshard_after_forward"] = values["reshard_after_forward"]  # a way of its own
        values = {k: eff.get(k, defaults.get(k, values[k])) for k in keys}
        case = _case(values)
        if case in seen or case.world_size > max_world:
            continue
        seen.add(case)
        if not case.problems():
            yield case
