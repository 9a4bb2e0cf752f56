"""The mesh: coordinate arithmetic without processes, then real groups on 4 ranks."""
import itertools
import pickle

import pytest

from reference.mesh import DIMS, Coords, Mesh


def _shapes():
    """Every (pp, dp, tp, ep) with pp * dp * tp in {1, 2, 4, 8, 16} and ep dividing dp."""
    for world in (1, 2, 4, 8, 16):
        for pp, dp in itertools.product(range(1, world + 1), repeat=2):
            if world % (pp * dp):
                continue
            tp = world // (pp * dp)
            for ep in range(1, dp + 1):
                if dp % ep == 0:
                    yield pp, dp, tp, ep


SHAPES = list(_shapes())


def test_shapes_cover_expert_parallelism():
    # The sweep below is only worth something if it includes ep > 1 and every axis > 1.
    assert any(ep > 1 and pp > 1 and tp > 1 for pp, dp, tp, ep in SHAPES)
    assert len(SHAPES) > 50


@pytest.mark.parametrize("pp,dp,tp,ep", SHAPES)
def test_coordinate_round_trip(pp, dp, tp, ep):
    mesh = Mesh(dp=dp, pp=pp, tp=tp, ep=ep)
    assert mesh.world_size == pp * dp * tp
    seen = set()
    # Megatron's layout, written out independently of the module.
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        rank = (p * dp + d) * tp + t
        c = mesh.coords(rank)
        assert c == Coords(pp=p, dp=d, tp=t, ep=d % ep, edp=d // ep)
        assert mesh.rank_of(pp=p, dp=d, tp=t) == rank
        assert mesh.rank_of(pp=p, tp=t, ep=c.ep, edp=c.edp) == rank
        seen.add(rank)
    assert seen == set(range(mesh.world_size))


@pytest.mark.parametrize("pp,dp,tp,ep", SHAPES)
def test_groups_partition_the_world(pp, dp, tp, ep):
    mesh = Mesh(dp=dp, pp=pp, tp=tp, ep=ep)
    sizes = dict(tp=tp, dp=dp, pp=pp, ep=ep, edp=dp // ep)
    for dim in DIMS:
        groups = mesh.group_ranks(dim)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(mesh.world_size)), dim
        assert all(len(g) == sizes[dim] == mesh.size(dim) for g in groups), dim
        assert all(g == sorted(g) for g in groups) and groups == sorted(groups), dim
        for g in groups:
            coords = [mesh.coords(r) for r in g]
            # Members differ in their own coordinate, one member per value ...
            assert sorted(getattr(c, dim) for c in coords) == list(range(sizes[dim])), dim
            # ... and agree on the coordinates the dimension keeps fixed.
            for other in {"tp": "pp dp", "dp": "pp tp", "pp": "dp tp",
                          "ep": "pp tp edp", "edp": "pp tp ep"}[dim].split():
                assert len({getattr(c, other) for c in coords}) == 1, (dim, other)
            for r in g:
                assert mesh.group_ranks_of(r, dim) == g


@pytest.mark.parametrize("pp,dp,tp,ep", SHAPES)
def test_tp_groups_are_contiguous(pp, dp, tp, ep):
    mesh = Mesh(dp=dp, pp=pp, tp=tp, ep=ep)
    for g in mesh.group_ranks("tp"):
        assert g == list(range(g[0], g[0] + tp))
        assert g[0] % tp == 0


def test_worked_example_pp2_dp2_tp2():
    mesh = Mesh(pp=2, dp=2, tp=2)
    assert mesh.world_size == 8
    assert mesh.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.group_ranks("ep") == [[r] for r in range(8)]
    assert mesh.group_ranks("edp") == mesh.group_ranks("dp")
    assert mesh.coords(5) == Coords(pp=1, dp=0, tp=1, ep=0, edp=0)
    assert mesh.rank_of(pp=1, dp=1, tp=0) == 6


def test_worked_example_expert_parallel_dp4_tp2_ep2():
    # The second example of the module docstring.
    mesh = Mesh(dp=4, tp=2, ep=2)
    assert [mesh.coords(r).ep for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [mesh.coords(r).edp for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert mesh.group_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert mesh.group_ranks("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.group_ranks("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.edp == 2


def test_text_forms():
    mesh = Mesh(pp=2, dp=2, tp=2)
    assert str(mesh) == "Mesh(world=8: pp=2 x dp=2 x tp=2, ep=1)"
    assert repr(mesh) == str(mesh)
    lines = mesh.table().splitlines()
    assert lines[0].split() == ["rank", "pp", "dp", "tp"]
    assert [list(map(int, line.split())) for line in lines[1:]] == [
        [r, *mesh.coords(r)[:3]] for r in range(8)
    ]
    ep_lines = Mesh(dp=4, tp=2, ep=2).table().splitlines()
    assert ep_lines[0].split() == ["rank", "pp", "dp", "tp", "ep", "edp"]
    assert ep_lines[7].split() == ["6", "0", "3", "0", "1", "1"]


def test_from_world_infers_dp():
    assert Mesh.from_world(16, tp=2, pp=2, ep=2) == Mesh(dp=4, pp=2, tp=2, ep=2)
    with pytest.raises(ValueError) as err:
        Mesh.from_world(12, tp=8)
    for part in ("pp=1", "tp=8", "ep=1", "world_size=12"):
        assert part in str(err.value)


def test_equality_and_pickle_ignore_groups():
    mesh = Mesh(dp=2, tp=2)
    assert mesh == Mesh(dp=2, tp=2, world_size=4) != Mesh(dp=4)
    mesh._rank, mesh._groups = 0, {"tp": object()}  # as if built on rank 0
    copy = pickle.loads(pickle.dumps(mesh))
    assert copy == mesh and copy._groups == {} and copy._rank is None


@pytest.mark.parametrize("kwargs,parts", [
    (dict(dp=2, tp=3, world_size=8), ["dp=2", "pp=1", "tp=3", "= 6", "world_size=8", "ep=1"]),
    (dict(dp=4, tp=2, ep=3), ["ep=3 must divide dp=4", "pp=1", "tp=2", "world_size=8"]),
    (dict(dp=0, tp=2), ["dp=0", "pp=1", "tp=2", "ep=1", "world_size", "positive"]),
    (dict(dp=2, pp=-1), ["pp=-1", "dp=2", "tp=1", "ep=1", "world_size"]),
    (dict(tp=2.0), ["tp=2.0", "dp=1", "pp=1", "ep=1", "world_size"]),
    (dict(dp=True), ["dp=True", "pp=1", "tp=1", "ep=1", "world_size"]),
    (dict(dp=2, world_size=0), ["world_size=0", "dp=2", "pp=1", "tp=1", "ep=1"]),
])
def test_errors_name_every_degree_and_the_world_size(kwargs, parts):
    with pytest.raises(ValueError) as err:
        Mesh(**kwargs)
    for part in parts:
        assert part in str(err.value)


def test_bad_coordinates_and_dimensions():
    mesh = Mesh(pp=2, dp=2, tp=2)
    with pytest.raises(ValueError, match=r"rank=8 is out of range \[0, 8\)"):
        mesh.coords(8)
    with pytest.raises(ValueError, match=r"tp=2 is out of range \[0, 2\)"):
        mesh.rank_of(tp=2)
    with pytest.raises(ValueError, match="contradicts"):
        Mesh(dp=4, ep=2).rank_of(dp=1, ep=0, edp=0)
    with pytest.raises(ValueError, match="unknown mesh dimension 'sp'.*tp, dp, pp, ep, edp, cp"):
        mesh.group_ranks("sp")


def test_groups_need_build_groups():
    mesh = Mesh(dp=2)
    with pytest.raises(RuntimeError, match="build_groups"):
        mesh.group("dp")
    with pytest.raises(RuntimeError, match="build_groups"):
        mesh.tp_rank
    with pytest.raises(RuntimeError, match="torch.distributed"):
        mesh.build_groups()  # no process group in the test process


def _all_reduce_over_mesh_groups(mesh):
    """On each rank: build the groups, then sum the global rank over each of them."""
    import sys
    import types

    import torch
    import torch.distributed as dist

    from reference.runtime import device

    # Stand-in communication meter, to see build_groups label each group it keeps.
    names = []
    fake = types.ModuleType("reference.comms")
    fake.name_group = lambda group, name: names.append(name)
    saved = sys.modules.get("reference.comms")
    sys.modules["reference.comms"] = fake
    try:
        mesh.build_groups()
    finally:
        if saved is None:
            del sys.modules["reference.comms"]
        else:
            sys.modules["reference.comms"] = saved

    sums, local = {}, {}
    for dim in ("tp", "dp", "pp", "ep", "edp"):
        x = torch.tensor([float(dist.get_rank())], device=device())  # a GPU tensor under NCCL
        dist.all_reduce(x, group=mesh.group(dim))
        sums[dim] = x.item()
        local[dim] = dist.get_rank(mesh.group(dim))
    mine = dict(tp=mesh.tp_rank, dp=mesh.dp_rank, pp=mesh.pp_rank, ep=mesh.ep_rank, edp=mesh.edp_rank)
    return dict(rank=mesh.rank, sums=sums, local=local, mine=mine, names=names,
                tp_is_group=mesh.tp_group is mesh.group("tp"))


def test_groups_on_four_ranks_sum_the_ranks_the_arithmetic_says():
    from reference.runtime import launch

    mesh = Mesh(dp=2, tp=2)
    results = launch(_all_reduce_over_mesh_groups, 4, mesh, timeout=120.0, quiet=True)
    for rank, res in enumerate(results):
        coords = mesh.coords(rank)
        assert res["rank"] == rank
        for dim in ("tp", "dp", "pp", "ep", "edp"):
            assert res["sums"][dim] == sum(mesh.group_ranks_of(rank, dim)), (rank, dim)
            # A rank's rank inside its group is its coordinate on that axis.
            assert res["local"][dim] == getattr(coords, dim) == res["mine"][dim], (rank, dim)
        assert res["names"] == list(DIMS)
        assert res["tp_is_group"]
    # Spelled out, for the 2 x 2 case: tp groups {0,1},{2,3}; dp groups {0,2},{1,3}.
    assert [r["sums"]["tp"] for r in results] == [1, 1, 5, 5]
    assert [r["sums"]["dp"] for r in results] == [2, 4, 2, 4]


def test_build_groups_rejects_a_mesh_that_does_not_fit_the_world():
    from reference.runtime import RankError, launch

    with pytest.raises(RankError, match=r"dp=4 x pp=1 x tp=1 = 4 does not equal the running world_size=2"):
        launch(Mesh(dp=4).build_groups, 2, timeout=60.0, quiet=True)


def _built_twice():
    """The groups of two meshes of the same degrees, one of others, and whether they still sum."""
    import torch
    import torch.distributed as dist

    first, again, other = Mesh(dp=2, tp=2).build_groups(), Mesh(dp=2, tp=2).build_groups(), \
        Mesh(dp=4).build_groups()
    x = torch.ones(1)
    dist.all_reduce(x, group=again.group("tp"))
    return dict(same=all(again.group(d) is first.group(d) for d in ("tp", "dp", "pp", "ep", "edp")),
                other_dp=other.group("dp") is not first.group("dp"), tp_sum=x.item(),
                own_dict=again._groups is not first._groups)


def test_a_second_mesh_of_the_same_degrees_takes_the_groups_built_before():
    """`new_group`'s groups live as long as the process: a launch trying configuration after
    configuration would pile them up (and slow every collective), so a mesh of degrees already
    built takes their groups; other degrees get their own, and each mesh its own dict."""
    from reference.runtime import launch

    for res in launch(_built_twice, 4, timeout=120.0, quiet=True):
        assert res == dict(same=True, other_dp=True, tp_sum=2.0, own_dict=True), res
