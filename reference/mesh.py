"""The device mesh: the one place where ranks are computed.

A run arranges its ``world_size = pp * dp * cp * tp`` processes on a grid, one axis per kind
of parallelism:

* ``tp``  tensor parallelism: the ranks that split each weight matrix between them,
* ``dp``  data parallelism: the ranks that hold the same weights and see different data,
* ``pp``  pipeline parallelism: the ranks that hold successive stages of the layers,
* ``cp``  context parallelism: the ranks that hold the same weights and split each
  sequence between them (`reference.context_parallel`); 1 unless asked for.

A *group* of a dimension is the set of ranks whose coordinates differ on that axis only.
Layout (Megatron-LM's order: TP innermost, then CP, then DP, then PP outermost)::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

TP communicates inside every layer, so a TP group is a block of consecutive ranks (on a GPU
node they share the fastest links); PP sends the least (one activation per micro-batch), so
it is outermost. CP communicates in every attention, more often than DP's once-a-step
gradients, so it sits between them (as in Megatron-LM and torchtitan).

Worked example, world 8 = pp2 x dp2 x tp2::

                 tp=0  tp=1
    pp=0  dp=0     0     1
          dp=1     2     3
    pp=1  dp=0     4     5
          dp=1     6     7

    tp groups  [[0, 1], [2, 3], [4, 5], [6, 7]]   (a row: same pp and dp)
    dp groups  [[0, 2], [1, 3], [4, 6], [5, 7]]   (a column inside one stage)
    pp groups  [[0, 4], [1, 5], [2, 6], [3, 7]]   (same place in both stages)

With cp (world 8 = dp2 x cp2 x tp2): cp groups [[0, 2], [1, 3], [4, 6], [5, 7]] split
the sequence, dp groups are [[0, 4], [1, 5], [2, 6], [3, 7]]; weights are replicated over
dp *and* cp, so gradients are averaged over ``dp_cp`` [[0, 2, 4, 6], [1, 3, 5, 7]].

Expert parallelism is carved out of data parallelism (Megatron-LM, DeepSpeed-MoE): the ``dp``
ranks of one stage and one TP slice form ``dp // ep`` blocks of ``ep`` ranks, ``ep`` innermost::

    dp_rank = edp_rank * ep + ep_rank          (ep must divide dp)

The all-to-all that dispatches tokens to experts runs inside an ``ep`` group (same pp, tp and
edp: different experts). An ``edp`` (expert-data-parallel) group holds replicas of the same
experts (same pp, tp and ep) and averages their gradients; dense gradients are averaged over
the whole ``dp`` group.

Worked example, world 8 = dp4 x tp2 with ep=2 (so edp = 4 // 2 = 2)::

    rank        0  1  2  3  4  5  6  7
    tp          0  1  0  1  0  1  0  1
    dp          0  0  1  1  2  2  3  3
    ep          0  0  1  1  0  0  1  1
    edp         0  0  0  0  1  1  1  1

    dp groups   [[0, 2, 4, 6], [1, 3, 5, 7]]
    ep groups   [[0, 2], [1, 3], [4, 6], [5, 7]]
    edp groups  [[0, 4], [1, 5], [2, 6], [3, 7]]

ep > 1 with cp > 1 is refused: a router counts capacity per whole sequence.

HSDP (FSDP2's 2D mesh, torchtitan's ``dp_replicate x dp_shard``) splits the dp ranks the same
way, ``dp_rank = dp_replicate_rank * dp_shard + dp_shard_rank``: ZeRO-3 shards inside a
``dp_shard`` group of consecutive dp ranks (a node) and all-reduces across the ``dp_replicate``
group (same dp_shard rank: the same rows). Those groups exist when dp_replicate > 1
(`HSDP_DIMS`); HSDP is refused with experts (they have their own ``edp``) and with cp > 1
(`HSDP_WITH_CP` says why).

Everything but :meth:`Mesh.build_groups` is arithmetic that needs no process started.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

# The dimensions whose groups build_groups creates, in this fixed order (all ranks
# must call new_group in the same order); CP_DIMS only when cp > 1.
DIMS = ("tp", "dp", "pp", "ep", "edp")
CP_DIMS = ("cp", "dp_cp")
HSDP_DIMS = ("dp_shard", "dp_replicate")  # only when dp_replicate > 1
# Why HSDP is refused with context parallelism: said by the mesh and by ParallelConfig alike.
HSDP_WITH_CP = ("HSDP with context parallelism is not built: cp ranks hold the same weights as "
                "dp ranks, so the shards would have to span dp_shard x cp (torchtitan's dp_shard_cp "
                "mesh dimension) while the replicas still all-reduce across dp_replicate; the course's "
                "mesh has no dp_shard x cp group and its HSDP shards over dp_shard alone. Use cp with "
                "ZeRO-3 over dp x cp (dp_replicate=1), or HSDP without cp")

# For each dimension, the coordinates that stay fixed inside one of its groups;
# the group's members differ only in the dimension's own coordinate.
_FIXED = {
    "tp": ("pp", "dp", "cp"),
    "dp": ("pp", "cp", "tp"),
    "pp": ("dp", "cp", "tp"),
    "ep": ("pp", "cp", "tp", "edp"),
    "edp": ("pp", "cp", "tp", "ep"),
    "cp": ("pp", "dp", "tp"),
    "dp_cp": ("pp", "tp"),  # the ranks holding the same weights: dp x cp of them
    "dp_shard": ("pp", "cp", "tp", "dp_replicate"),
    "dp_replicate": ("pp", "cp", "tp", "dp_shard"),
}


class Coords(NamedTuple):
    """One rank's coordinates on every axis of the mesh (``dp = edp * ep_deg + ep``)."""

    pp: int
    dp: int
    tp: int
    ep: int
    edp: int
    cp: int = 0  # last, so that the 3D mesh's coordinates read as before


def _is_positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0


# (the default group's id, the degrees) -> (that group, rank, its groups): what build_groups
# built in this process
_BUILT: dict = {}


@dataclass
class Mesh:
    """Degrees of parallelism and their rank arithmetic: ``Mesh(dp=2, tp=2)`` is a 4-rank mesh.
    ``world_size``, when given, is checked against ``pp * dp * cp * tp``."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    world_size: Optional[int] = None
    cp: int = 1
    dp_replicate: int = 1  # HSDP: blocks of dp // dp_replicate ranks that shard, replicated
    # Filled by build_groups on one rank; never compared, printed or pickled.
    _rank: Optional[int] = field(default=None, init=False, repr=False, compare=False)
    _groups: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        degrees = dict(dp=self.dp, pp=self.pp, tp=self.tp, ep=self.ep, cp=self.cp,
                       dp_replicate=self.dp_replicate)
        bad = [k for k, v in degrees.items() if not _is_positive_int(v)]
        if self.world_size is not None and not _is_positive_int(self.world_size):
            bad.append("world_size")
        if bad:
            raise ValueError(f"degrees must be positive integers, got {self._describe()} (bad: {', '.join(bad)})")
        self.dp, self.pp, self.tp, self.ep, self.cp, self.dp_replicate = (int(v) for v in degrees.values())
        product = self.dp * self.cp * self.pp * self.tp
        self.world_size = product if self.world_size is None else int(self.world_size)
        if product != self.world_size:
            raise ValueError(f"{self._product()} does not equal world_size={self.world_size} "
                             f"(ep={self.ep}, cp={self.cp})")
        if self.dp % self.ep != 0:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp} (experts are sharded inside the "
                             f"data-parallel group); mesh {self._describe()}")
        if self.ep > 1 and self.cp > 1:
            raise ValueError(f"ep={self.ep} with cp={self.cp} is not supported (a router counts capacity "
                             f"per whole sequence); mesh {self._describe()}")
        if self.dp % self.dp_replicate or (self.dp_replicate > 1 and self.ep > 1):
            raise ValueError(f"dp_replicate={self.dp_replicate} must divide dp={self.dp}, with ep = 1 "
                             f"(HSDP splits the dense data-parallel ranks only; experts shard over "
                             f"their own edp group); mesh {self._describe()}")
        if self.dp_replicate > 1 and self.cp > 1:
            raise ValueError(f"dp_replicate={self.dp_replicate} with cp={self.cp}: {HSDP_WITH_CP}; "
                             f"mesh {self._describe()}")

    @classmethod
    def from_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1) -> "Mesh":
        """The mesh whose ``dp`` takes whatever ``tp``, ``pp`` and ``cp`` leave of the world (as Megatron does)."""
        if not all(_is_positive_int(v) for v in (world_size, tp, pp, ep, cp)):
            raise ValueError(f"degrees must be positive integers, got tp={tp}, pp={pp}, ep={ep}, "
                             f"cp={cp}, world_size={world_size}")
        if world_size % (tp * pp * cp) != 0:
            raise ValueError(f"pp={pp} x tp={tp}{f' x cp={cp}' if cp > 1 else ''} = {pp * tp * cp} "
                             f"does not divide world_size={world_size}, so no dp fits (ep={ep}, cp={cp})")
        return cls(dp=world_size // (tp * pp * cp), pp=pp, tp=tp, ep=ep, cp=cp, world_size=world_size)

    # ------------------------------------------------------------------ text
    def _describe(self) -> str:
        return f"pp={self.pp}, dp={self.dp}, cp={self.cp}, tp={self.tp}, ep={self.ep}, world_size={self.world_size}"

    def _product(self) -> str:
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        return f"dp={self.dp}{cp} x pp={self.pp} x tp={self.tp} = {self.dp * self.cp * self.pp * self.tp}"

    def __str__(self) -> str:
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        hsdp = f" (dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard})" if self.dp_replicate > 1 else ""
        return f"Mesh(world={self.world_size}: pp={self.pp} x dp={self.dp}{hsdp}{cp} x tp={self.tp}, ep={self.ep})"

    __repr__ = __str__

    def table(self) -> str:
        """A text table with one line per rank: its coordinates (cp, ep and edp only when > 1)."""
        cols = ["pp", "dp"] + (["cp"] if self.cp > 1 else []) + ["tp"] + (["ep", "edp"] if self.ep > 1 else [])
        width = max(4, len(str(self.world_size - 1)))
        lines = ["rank".rjust(width) + "".join(c.rjust(5) for c in cols)]
        for rank in range(self.world_size):
            c = self.coords(rank)
            lines.append(str(rank).rjust(width) + "".join(str(getattr(c, k)).rjust(5) for k in cols))
        return "\n".join(lines)

    # ------------------------------------------------------- pure arithmetic
    @property
    def edp(self) -> int:
        """Degree of expert data parallelism: replicas of each expert, ``dp // ep``."""
        return self.dp // self.ep

    @property
    def dp_shard(self) -> int:
        """HSDP: the ranks that shard each tensor between them, ``dp // dp_replicate``."""
        return self.dp // self.dp_replicate

    def _coord(self, c: Coords, dim: str) -> int:
        """A coordinate of ``c``, the HSDP pair derived from its dp coordinate."""
        if dim == "dp_shard":
            return c.dp % self.dp_shard
        if dim == "dp_replicate":
            return c.dp // self.dp_shard
        return getattr(c, dim)

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same weights (same pp and tp): ``dp * cp``."""
        return self.dp * self.cp

    def size(self, dim: str) -> int:
        """Number of ranks in one group of ``dim``."""
        return getattr(self, self._check_dim(dim))

    def _check_dim(self, dim: str) -> str:
        if dim not in _FIXED:
            raise ValueError(f"unknown mesh dimension {dim!r}; expected one of {', '.join(DIMS + CP_DIMS + HSDP_DIMS)}")
        return dim

    def _check_coord(self, name: str, value, degree: int) -> int:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 <= value < degree:
            raise ValueError(f"{name}={value!r} is out of range [0, {degree}) in {self}")
        return int(value)

    def coords(self, rank: int) -> Coords:
        """Coordinates of ``rank``: the inverse of ``((pp * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``."""
        rank = self._check_coord("rank", rank, self.world_size)
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        return Coords(pp=pp_rank, dp=dp_rank, tp=tp_rank, ep=dp_rank % self.ep, edp=dp_rank // self.ep,
                      cp=cp_rank)

    def rank_of(self, *, pp: int = 0, dp: Optional[int] = None, tp: int = 0,
                ep: Optional[int] = None, edp: Optional[int] = None, cp: int = 0) -> int:
        """The rank at the given coordinates, missing ones 0; ``dp`` or the pair ``ep``, ``edp``."""
        if ep is not None or edp is not None:
            ep_rank = self._check_coord("ep", 0 if ep is None else ep, self.ep)
            edp_rank = self._check_coord("edp", 0 if edp is None else edp, self.edp)
            from_ep = edp_rank * self.ep + ep_rank
            if dp is not None and dp != from_ep:
                raise ValueError(f"dp={dp} contradicts ep={ep_rank}, edp={edp_rank} (dp would be {from_ep}) in {self}")
            dp = from_ep
        dp = self._check_coord("dp", 0 if dp is None else dp, self.dp)
        pp = self._check_coord("pp", pp, self.pp)
        tp = self._check_coord("tp", tp, self.tp)
        cp = self._check_coord("cp", cp, self.cp)
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def group_ranks(self, dim: str) -> list[list[int]]:
        """Every group of ``dim`` (they partition the world), each sorted, ordered by first rank."""
        fixed = _FIXED[self._check_dim(dim)]
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):  # increasing, so each group comes out sorted
            c = self.coords(rank)
            groups.setdefault(tuple(self._coord(c, k) for k in fixed), []).append(rank)
        return sorted(groups.values())

    def group_ranks_of(self, rank: int, dim: str) -> list[int]:
        """The ranks of the ``dim`` group that contains ``rank``."""
        rank = self._check_coord("rank", rank, self.world_size)
        return next(g for g in self.group_ranks(dim) if rank in g)

    # -------------------------------------------------------- process groups
    def build_groups(self) -> "Mesh":
        """Create the process group of every dimension; every rank calls it, after torch.distributed starts.

        All ranks call ``new_group`` for every group, members or not, in the same order. A group
        of size 1 is a real group too, so a collective on ``mesh.group("tp")`` works whatever the
        degree; with cp = 1 ``group("dp_cp")`` is the dp group. A process builds the groups of one
        set of degrees once and reuses them: nothing frees a group, and hundreds of live gloo
        groups slow every collective down. Returns the mesh: ``Mesh(dp=2, tp=2).build_groups()``.
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Mesh.build_groups() needs torch.distributed initialised: call it inside a "
                               "function started by reference.runtime.launch (or under torchrun)")
        world = dist.get_world_size()
        if world != self.world_size:
            raise ValueError(f"{self._product()} does not equal the running world_size={world} "
                             f"(ep={self.ep}, cp={self.cp})")
        key = (id(dist.group.WORLD), self.dp, self.pp, self.tp, self.ep, self.cp, self.dp_replicate)
        if key in _BUILT:
            self._rank, self._groups = _BUILT[key][1], dict(_BUILT[key][2])
            return self
        try:  # label groups for the communication meter, when it is there
            from reference.comms import name_group
        except (ImportError, AttributeError):
            name_group = None

        rank = dist.get_rank()
        groups = {}
        for dim in DIMS + (CP_DIMS if self.cp > 1 else ()) + (HSDP_DIMS if self.dp_replicate > 1 else ()):
            for ranks in self.group_ranks(dim):
                group = dist.new_group(ranks)
                if rank in ranks:
                    groups[dim] = group
                    if name_group is not None:
                        name_group(group, dim)
        groups.setdefault("dp_cp", groups["dp"])  # cp = 1: the same ranks
        _BUILT[key] = (dist.group.WORLD, rank, groups)  # held, so that its id names no later group
        self._rank, self._groups = rank, dict(groups)
        return self

    def _require_built(self):
        if not self._groups:
            raise RuntimeError(f"{self} has no process groups yet: call mesh.build_groups() on every rank first")

    def group(self, dim: str):
        """This rank's process group of ``dim`` (after :meth:`build_groups`)."""
        self._check_dim(dim)
        self._require_built()
        if dim not in self._groups:  # "cp" with cp = 1, HSDP's with dp_replicate = 1
            why = "cp=1: no cp group is built (check mesh.cp > 1 first)" if dim == "cp" else (
                f"dp_replicate=1: no {dim} group is built (HSDP's groups exist when dp_replicate > 1)")
            raise ValueError(f"{self} has {why}")
        return self._groups[dim]

    @property
    def rank(self) -> int:
        """This process's global rank (after :meth:`build_groups`)."""
        self._require_built()
        return self._rank

    @property
    def my_coords(self) -> Coords:
        """This process's coordinates (after :meth:`build_groups`)."""
        return self.coords(self.rank)

    # This rank's coordinate and group on each axis, named as in Megatron-LM.
    tp_rank = property(lambda self: self.my_coords.tp, doc="This rank's tensor-parallel rank.")
    dp_rank = property(lambda self: self.my_coords.dp, doc="This rank's data-parallel rank.")
    pp_rank = property(lambda self: self.my_coords.pp, doc="This rank's pipeline stage.")
    ep_rank = property(lambda self: self.my_coords.ep, doc="This rank's expert-parallel rank.")
    edp_rank = property(lambda self: self.my_coords.edp, doc="This rank's expert-data-parallel rank.")
    cp_rank = property(lambda self: self.my_coords.cp, doc="This rank's context-parallel rank.")
    dp_shard_rank = property(lambda self: self._coord(self.my_coords, "dp_shard"),
                             doc="HSDP: this rank's place in its dp_shard group (the rows it holds).")
    dp_replicate_rank = property(lambda self: self._coord(self.my_coords, "dp_replicate"),
                                 doc="HSDP: which replica of the shards this rank's dp_shard group is.")
    tp_group = property(lambda self: self.group("tp"), doc="This rank's tensor-parallel group.")
    dp_group = property(lambda self: self.group("dp"), doc="This rank's data-parallel group.")
    pp_group = property(lambda self: self.group("pp"), doc="This rank's pipeline group.")
    ep_group = property(lambda self: self.group("ep"), doc="This rank's expert-parallel group.")
    edp_group = property(lambda self: self.group("edp"), doc="This rank's expert-data-parallel group.")
    cp_group = property(lambda self: self.group("cp"), doc="This rank's context-parallel group.")
    dp_cp_group = property(lambda self: self.group("dp_cp"), doc="The dp x cp ranks that average gradients.")

    def __getstate__(self):
        # Process groups belong to one process: a pickled mesh carries only its degrees.
        state = dict(self.__dict__)
        state["_rank"], state["_groups"] = None, {}
        return state
