"""Topology-aware placement: Megatron's TP-innermost order keeps TP inside a node; a scrambled
order sends TP's bytes over the slow links."""
from reference.mesh import Mesh
from reference.parallel.config import ParallelConfig
from reference.parallel.explorer import MODELS
from reference.parallel.placement import MEGATRON_ORDER, crossing_fraction, group_ranks, placement_costs


def test_megatron_order_is_the_meshs():
    mesh = Mesh(dp=4, tp=2, pp=2)
    for dim in ("tp", "dp", "pp"):
        assert group_ranks(MEGATRON_ORDER, 4, 2, 2, dim) == sorted(mesh.group_ranks(dim))


def test_crossing_edges_are_counted():
    assert crossing_fraction([[0, 1, 2, 3]], 4) == 0.0
    assert crossing_fraction([[0, 8]], 8) == 1.0            # two edges, 0->8 and 8->0
    assert crossing_fraction([[0, 1, 8, 9]], 8) == 0.5      # 1->8 and 9->0 cross


def test_tp_innermost_keeps_the_heaviest_traffic_on_nvlink():
    """The article's GPT-3 175B on DP 32 x TP 8 x PP 4, 8 GPUs a node: with TP innermost no TP
    byte crosses a node; with TP outermost every TP ring crosses nodes and the step's
    communication takes several times longer."""
    config = ParallelConfig(dp=32, tp=8, pp=4, sequence_parallel=True, microbatches=48,
                            precision="bf16", zero_stage=1)
    kw = dict(micro_batch=1, global_batch=1536)
    good = placement_costs(MODELS["GPT-3 175B"], config, MEGATRON_ORDER, **kw)
    bad = placement_costs(MODELS["GPT-3 175B"], config, ("pp", "dp", "tp"), **kw)
    assert good["tp"][1] == 0.0 and bad["tp"][1] == 1.0
    assert bad["slow_bytes"] > 10 * good["slow_bytes"]
    assert bad["seconds"] > 5 * good["seconds"]
