"""The configuration explorer offers only what `ParallelConfig.validate` accepts, and ranks it
by the estimated step time of `reference.parallel.estimate.step_time` (pure arithmetic)."""
import pytest

from reference.parallel.estimate import Hardware
from reference.parallel.explorer import MODELS, ConfigExplorer, feasible_configs


@pytest.mark.parametrize("model, n_gpus, device_gb, batch, n_experts", [
    ("GPT-3 175B", 1024, 80, 1536, None),    # the notebook's default
    ("GPT-3 13B", 64, 40, 1536, None),       # notebook 06's exercise 4
    ("GPT-3 1.3B", 64, 80, 512, 8),          # experts: ep divides dp and the experts
])
def test_every_offered_configuration_validates(model, n_gpus, device_gb, batch, n_experts):
    cfg = MODELS[model]
    experts = {} if n_experts is None else dict(n_experts=n_experts)
    rows = feasible_configs(cfg, n_gpus, device_bytes=device_gb * 1e9, global_batch=batch, **experts)
    assert rows
    for r in rows:
        c = r["config"]
        assert c.problems(n_gpus, cfg, (batch, cfg.block_size), n_experts) == [], c
        c.validate(n_gpus, cfg, batch=(batch, cfg.block_size), n_experts=n_experts)
        assert not (c.zero_stage == 2 and c.pp > 1)  # ZeRO-3 composes with tp and pp (per parameter)
        assert r["estimate"].fits(device_gb * 1e9)


def test_rows_are_ranked_by_estimated_step_time_with_the_assumptions_shown():
    rows = feasible_configs(MODELS["GPT-3 175B"], 1024, device_bytes=80e9, global_batch=1536)
    times = [r["step_time"] for r in rows]
    assert times == sorted(times)
    for r in rows:
        t = r["time"]
        assert t["total"] == r["step_time"] == pytest.approx(
            t["compute"] + t["tp"] + t["pp"] + t["dp"] + t["bubble"])
        assert t["compute"] > 0
    explorer = ConfigExplorer(model="GPT-3 175B", n_gpus=1024, device_gb=80, global_batch=1536)
    assert explorer.rows[0]["step_time"] == times[0]
    summary = explorer.summary.value
    assert "GPT-3 175B on 1024 GPUs" in summary and "fastest estimated step first" in summary
    for shown in ("989 TFLOP/s", "450 GB/s", "50 GB/s", "exposed"):  # comms.links' speeds
        assert shown in summary, shown
    assert "step (s)" in explorer.html and "exposed comm (s)" in explorer.html
    assert Hardware().describe() in summary.replace("&#x27;", "'")


def test_a_pipeline_wins_when_its_bubble_is_small_and_dp_traffic_dominates():
    """GPT-3 1.3B on 64 GPUs (8 nodes), 512 sequences: without a pipeline each GPU reduces
    its whole share of the gradients across nodes, more than one micro-batch's backward can
    hide; pp = 8 keeps dp inside a node for an 8/71 bubble. On one node (8 GPUs) dp's
    reduction runs on NVLink and hides: there pp = 1 wins."""
    rows = feasible_configs(MODELS["GPT-3 1.3B"], 64, device_bytes=80e9, global_batch=512)
    best = rows[0]
    flat = next(r for r in rows if r["config"].pp == 1 and r["config"].dp_replicate == 1)
    assert best["config"].pp > 1 and best["bubble"] < 0.1
    assert flat["bubble"] == 0 and flat["step_time"] > best["step_time"]
    assert flat["time"]["dp"] > best["time"]["bubble"] + best["time"]["pp"] + best["time"]["dp"]
    assert rows.index(flat) > 0

    # HSDP keeps ZeRO-3's gathers inside a node: its flat rows expose less dp time than plain ZeRO-3's
    hsdp = next(r for r in rows if r["config"].pp == 1 and r["config"].dp_replicate > 1)
    plain = next(r for r in rows if r["config"].with_(dp_replicate=1) == hsdp["config"].with_(dp_replicate=1)
                 and r["config"].dp_replicate == 1)
    assert hsdp["time"]["dp"] < plain["time"]["dp"] and hsdp["cross_node"] < plain["cross_node"]

    one_node = feasible_configs(MODELS["GPT-3 1.3B"], 8, device_bytes=80e9, global_batch=512)
    assert one_node[0]["config"].pp == 1 and one_node[0]["time"]["dp"] == 0


def test_experts_and_resharding_are_offered_with_their_costs():
    """With experts the explorer tries every ep dividing dp and the experts (ZeRO-1/2 refused
    with ep > 1), each row's estimate counting the experts (E / ep per rank, their rows over
    dp / ep under ZeRO-3); composed ZeRO-3 both gathering once and resharding after forward
    (3 m transfers of the stage over dp instead of 2); every row's estimate is its heaviest
    pipeline rank's."""
    from reference.parallel.estimate import estimate

    model = MODELS["GPT-3 1.3B"]
    rows = feasible_configs(model, 64, device_bytes=80e9, global_batch=512, n_experts=8)
    eps = {r["config"].ep for r in rows}
    assert {1, 2, 4, 8} <= eps
    assert all(r["config"].zero_stage in (0, 3) for r in rows if r["config"].ep > 1)
    row = next(r for r in rows if r["config"].ep == 8 and r["config"].zero_stage == 3)
    c, e = row["config"], row["estimate"]
    assert e.expert_params and e.expert_params == estimate(
        model, c, micro_batch=1, global_batch=512, n_experts=8, stage=e.stage).expert_params
    stages = [estimate(model, c, micro_batch=1, global_batch=512, n_experts=8, stage=s).total_bytes
              for s in range(c.pp)]
    assert row["memory"] == max(stages)
    dense = feasible_configs(model, 64, device_bytes=80e9, global_batch=512)
    reshard = [r for r in dense if r["config"].reshard_after_forward]
    assert reshard and all(r["config"].zero_stage == 3 for r in reshard)
    r = reshard[0]
    once = next(x for x in dense if x["config"] == r["config"].with_(reshard_after_forward=False))
    m = r["config"].microbatches
    assert r["estimate"].bytes_per_step["dp"] == pytest.approx(1.5 * m * once["estimate"].bytes_per_step["dp"])
    explorer = ConfigExplorer(model="GPT-3 1.3B", n_gpus=64, device_gb=80, global_batch=512, n_experts=8)
    assert "GPT-3 1.3B with 8 experts per layer on 64 GPUs" in explorer.summary.value
    assert "<th>ep</th>" in explorer.html
    explorer.experts.value = 0
    assert "GPT-3 1.3B on 64 GPUs" in explorer.summary.value

