"""Every pair of options of the composed GPT, trained and compared with one process.

`sweep.covering_set` (tests/sweep.py) picks accepted configurations (dp, tp, pp, cp and its
kind, ep, ZeRO stage, SP, schedule and virtual stages, recompute, precision, clipping,
accumulation, embedding stage, experts, optimizer post-validation where the step clips or runs
fp16; world sizes 1 to 8) so that every pair of values
that can act together trains in at least one of them, and every data-parallel way (replicas,
ZeRO-1, ZeRO-2, ZeRO-3 by blocks or per parameter, resharded after forward, HSDP) trains with
no experts, experts at ep 1 and at ep > 1, each precision and the experts' bias (`sweep.dp_way`).
Every case trains on padded documents with the token mean. Each trains 3 AdamW steps and must
equal one process within `sweep_run.TOLERANCES`, the course's policy
(`reference.tolerance`): every loss, every weight and the mean weight differences (overall and
per tensor), the routers' biases likewise within the bias rule's own bound, bf16 and fp16
against the same-precision single process. Each pair no accepted case can hold is refused by
`ParallelConfig.validate` (post-validation with bias-balanced experts by the step itself:
`sweep.POST_VALIDATION_WITH_BIAS`), with a reason that names one of the two options.

One launch per world size runs all of that size's cases in turn. The full product of the
options is `python bench/sweep_3d.py --full` (hours on a laptop).
"""
from __future__ import annotations

import pytest

from sweep import covering_set, names_pair
from reference.runtime import launch

pytestmark = pytest.mark.timeout(900)

ACCEPTED, REFUSED = covering_set()


def test_the_covering_set_covers_every_pair_that_can_train():
    from sweep import OPTIONS, WAYS, _all_pairs, _key, dp_way, pairs_of

    covered = set()
    for case in ACCEPTED:
        assert not case.problems(), case
        covered |= {_key(p) for p in pairs_of(case.values())}
    refused = {_key(((a, va), (b, vb))) for (a, va), (b, vb), _, _ in REFUSED}
    assert {_key(p) for p in _all_pairs()} == covered | refused
    assert not covered & refused
    for option, values in OPTIONS.items():  # every value of every option trains somewhere
        for v in values:
            assert any(case.values()[option] == v for case in ACCEPTED), (option, v)
    assert {dp_way(case.values()) for case in ACCEPTED} == set(WAYS) | {None}
    for way in WAYS:  # each way with experts at ep 1, and at ep > 1 where it holds them
        with_experts = {case.config.ep > 1 for case in ACCEPTED if case.moe and dp_way(case.values()) == way}
        assert with_experts == ({False} if way in ("zero1", "zero2", "zero3-blocks", "hsdp")
                                else set() if way == "resharded" else {False, True}), (way, with_experts)


def test_every_refused_pair_names_its_reason():
    for (a, _), (b, _), case, reason in REFUSED:
        assert case.problems(), case  # validate really refuses it
        assert names_pair(reason, a, b), (a, b, reason)


@pytest.mark.parametrize("world_size", sorted({c.world_size for c in ACCEPTED}))
def test_every_accepted_case_equals_one_process(world_size, record_property):
    from sweep_run import compare, run_cases, single_process

    cases = [c for c in ACCEPTED if c.world_size == world_size]
    ranks = launch(run_cases, world_size, cases, timeout=800)
    rows = []
    for i, case in enumerate(cases):
        for r in ranks[1:]:  # every rank reports the same global losses
            assert r[i][0] == ranks[0][i][0], f"{case}: ranks disagree on the loss"
        rows.append(compare(case, ranks[0][i], single_process(case)))
    record_property("sweep", rows)
    bad = [row for row in rows if not row["ok"]]
    assert not bad, bad
