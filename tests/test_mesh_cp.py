"""The mesh with context parallelism: cp between dp and tp, its groups, and cp = 1 changing nothing."""
import itertools

import pytest

from reference.mesh import CP_DIMS, DIMS, Coords, Mesh


def _shapes():
    """Every (pp, dp, cp, tp) with a world of at most 16 ranks and cp > 1."""
    for pp, dp, cp, tp in itertools.product((1, 2), (1, 2, 4), (2, 4), (1, 2)):
        if pp * dp * cp * tp <= 16:
            yield pp, dp, cp, tp


SHAPES = list(_shapes())


@pytest.mark.parametrize("pp,dp,cp,tp", SHAPES)
def test_rank_layout_puts_cp_between_dp_and_tp(pp, dp, cp, tp):
    mesh = Mesh(pp=pp, dp=dp, cp=cp, tp=tp)
    assert mesh.world_size == pp * dp * cp * tp
    seen = set()
    for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        rank = ((p * dp + d) * cp + c) * tp + t  # written out independently of the module
        assert mesh.coords(rank) == Coords(pp=p, dp=d, tp=t, ep=0, edp=d, cp=c)  # ep = 1
        assert mesh.rank_of(pp=p, dp=d, cp=c, tp=t) == rank
        seen.add(rank)
    assert seen == set(range(mesh.world_size))


@pytest.mark.parametrize("pp,dp,cp,tp", SHAPES)
def test_groups_partition_the_world_and_fix_the_other_axes(pp, dp, cp, tp):
    mesh = Mesh(pp=pp, dp=dp, cp=cp, tp=tp)
    sizes = dict(tp=tp, dp=dp, pp=pp, ep=1, edp=dp, cp=cp, dp_cp=dp * cp)
    fixed = dict(tp="pp dp cp", dp="pp cp tp", pp="dp cp tp", ep="pp cp tp edp",
                 edp="pp cp tp ep", cp="pp dp tp", dp_cp="pp tp")
    for dim in DIMS + CP_DIMS:
        groups = mesh.group_ranks(dim)
        assert sorted(r for g in groups for r in g) == list(range(mesh.world_size)), dim
        assert all(len(g) == sizes[dim] == mesh.size(dim) for g in groups), dim
        for g in groups:
            coords = [mesh.coords(r) for r in g]
            for other in fixed[dim].split():
                assert len({getattr(c, other) for c in coords}) == 1, (dim, other)
    # tp stays a block of consecutive ranks; cp groups step by tp
    for g in mesh.group_ranks("tp"):
        assert g == list(range(g[0], g[0] + tp))
    for g in mesh.group_ranks("cp"):
        assert g == list(range(g[0], g[0] + cp * tp, tp))
    # dp_cp is exactly the ranks holding the same weights: every dp and cp coordinate once
    for g in mesh.group_ranks("dp_cp"):
        assert sorted((mesh.coords(r).dp, mesh.coords(r).cp) for r in g) == \
            list(itertools.product(range(dp), range(cp)))


def test_worked_example_dp2_cp2_tp2():
    # The module docstring's example.
    mesh = Mesh(dp=2, cp=2, tp=2)
    assert mesh.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.group_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.group_ranks("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.coords(6) == Coords(pp=0, dp=1, tp=0, ep=0, edp=1, cp=1)
    assert mesh.dp_cp == 4


@pytest.mark.parametrize("pp,dp,tp,ep", [(1, 1, 1, 1), (2, 2, 2, 1), (1, 4, 2, 2), (2, 4, 1, 4)])
def test_cp1_leaves_every_rank_and_group_of_the_3d_mesh(pp, dp, tp, ep):
    mesh = Mesh(pp=pp, dp=dp, tp=tp, ep=ep)
    assert mesh.cp == 1 and mesh == Mesh(pp=pp, dp=dp, tp=tp, ep=ep, cp=1)
    for rank in range(mesh.world_size):  # Megatron's 3D formula, unchanged
        c = mesh.coords(rank)
        assert rank == (c.pp * dp + c.dp) * tp + c.tp and c.cp == 0
    assert mesh.group_ranks("dp_cp") == mesh.group_ranks("dp")
    assert mesh.group_ranks("cp") == [[r] for r in range(mesh.world_size)]
    assert str(mesh) == f"Mesh(world={mesh.world_size}: pp={pp} x dp={dp} x tp={tp}, ep={ep})"
    assert "cp" not in mesh.table().splitlines()[0].split()


def test_text_forms_show_cp():
    mesh = Mesh(dp=2, cp=2, tp=2)
    assert str(mesh) == "Mesh(world=8: pp=1 x dp=2 x cp=2 x tp=2, ep=1)"
    lines = mesh.table().splitlines()
    assert lines[0].split() == ["rank", "pp", "dp", "cp", "tp"]
    assert lines[1 + 6].split() == ["6", "0", "1", "1", "0"]


@pytest.mark.parametrize("kwargs,parts", [
    (dict(dp=2, cp=2, tp=2, world_size=4), ["dp=2 x cp=2 x pp=1 x tp=2 = 8", "world_size=4"]),
    (dict(dp=2, ep=2, cp=2), ["ep=2 with cp=2", "dp=2", "pp=1", "tp=1", "world_size=4"]),
    (dict(cp=0), ["cp=0", "dp=1", "pp=1", "tp=1", "ep=1", "positive"]),
    (dict(cp=True), ["cp=True", "positive"]),
])
def test_errors_name_cp_with_every_degree(kwargs, parts):
    with pytest.raises(ValueError) as err:
        Mesh(**kwargs)
    for part in parts:
        assert part in str(err.value)


def test_from_world_leaves_dp_what_cp_tp_pp_do_not_take():
    assert Mesh.from_world(16, tp=2, cp=2, pp=2) == Mesh(dp=2, cp=2, tp=2, pp=2)
    with pytest.raises(ValueError, match=r"pp=1 x tp=2 x cp=4 = 8 does not divide world_size=12"):
        Mesh.from_world(12, tp=2, cp=4)
    with pytest.raises(ValueError, match="rank=8 is out of range"):
        Mesh(cp=2, tp=4).coords(8)
    with pytest.raises(ValueError, match=r"cp=2 is out of range \[0, 2\)"):
        Mesh(cp=2).rank_of(cp=2)


def _groups_on_ranks(mesh):
    import torch
    import torch.distributed as dist

    mesh.build_groups()
    out = dict(rank=mesh.rank, cp_rank=mesh.cp_rank, sums={}, local={})
    for dim in ("dp", "cp", "dp_cp") if mesh.cp > 1 else ("dp", "dp_cp"):
        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x, group=mesh.group(dim))
        out["sums"][dim] = x.item()
        out["local"][dim] = dist.get_rank(mesh.group(dim))
    out["dp_cp_is_dp"] = mesh.group("dp_cp") is mesh.group("dp")
    if mesh.cp == 1:
        try:
            mesh.cp_group
        except ValueError as err:
            out["cp_error"] = str(err)
    return out


def test_built_groups_on_four_ranks_sum_what_the_arithmetic_says():
    from reference.runtime import launch

    mesh = Mesh(dp=2, cp=2)  # rank = dp_rank * 2 + cp_rank
    results = launch(_groups_on_ranks, 4, mesh, timeout=120.0, quiet=True)
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["cp_rank"] == mesh.coords(rank).cp == rank % 2
        for dim in ("dp", "cp", "dp_cp"):
            assert res["sums"][dim] == sum(mesh.group_ranks_of(rank, dim)), (rank, dim)
        assert res["local"]["cp"] == rank % 2 and res["local"]["dp"] == rank // 2
        assert res["local"]["dp_cp"] == rank and not res["dp_cp_is_dp"]
    assert [r["sums"]["cp"] for r in results] == [1, 1, 5, 5]
    assert [r["sums"]["dp"] for r in results] == [2, 4, 2, 4]
    assert [r["sums"]["dp_cp"] for r in results] == [6, 6, 6, 6]
    # cp = 1: no cp group is built, dp_cp is the dp group itself
    flat = launch(_groups_on_ranks, 2, Mesh(dp=2), timeout=120.0, quiet=True)
    assert all(r["dp_cp_is_dp"] and r["sums"]["dp_cp"] == 1 for r in flat)
    assert all("cp=1: no cp group is built" in r["cp_error"] for r in flat)
