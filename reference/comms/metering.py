"""Count collectives and the bytes each rank sends, per collective and per group.

While a `CommMeter` is open, every collective issued through `reference.comms` adds one call to
the row keyed by (collective, group label), with ``payload_bytes`` (the tensor handed to the
operation) and ``sent_bytes`` (what this rank sends: the ring operations count what they hand
to ``isend``, the wrappers what a ring would send, `reference.comms.collectives`). Each rank
keeps its own meters, and they nest: a record goes to every open meter.

    with CommMeter() as m:
        comms.all_reduce(grad, group=dp_group)
    m.sent_bytes("all_reduce")          # bytes this rank sent
    per_rank = m.gather(dst=0)          # on rank 0: every rank's records
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.distributed as dist

__all__ = ["CommMeter", "meter", "name_group", "group_label", "record", "format_records"]

# Meters open in this process, innermost last: process state, like a profiler's.
_ACTIVE: list["CommMeter"] = []

# Labels given to process groups by whoever created them (the mesh names "tp", ...), keyed by
# the group itself: the entry keeps it alive, so its id is never reused by another group.
_GROUP_NAMES: dict[object, str] = {}


def name_group(group, name: str) -> None:
    """Register `name` as the label under which meters record `group`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a group name must be a non-empty string, got {name!r}")
    _GROUP_NAMES[group] = name


def group_label(group=None) -> str:
    """The label a meter records for `group`: its `name_group` name, else "world" for the default
    group, else its global ranks, e.g. "ranks[0,2]"."""
    if group in _GROUP_NAMES:
        return _GROUP_NAMES[group]
    if group is None or group is dist.group.WORLD:
        return "world"
    ranks = dist.get_process_group_ranks(group)
    return "ranks[" + ",".join(str(r) for r in ranks) + "]"


def record(op: str, group, payload_bytes: int, sent_bytes: int) -> None:
    """Add one call of `op` on `group` to every open meter (no-op when none is open)."""
    if not _ACTIVE:
        return
    label = group_label(group)
    for m in _ACTIVE:
        m._add(op, label, int(payload_bytes), int(sent_bytes))


class CommMeter:
    """Calls, payload bytes and sent bytes per (collective, group label) on this rank."""

    def __init__(self) -> None:
        # (op, group label) -> [calls, payload_bytes, sent_bytes]
        self._rows: dict[tuple[str, str], list[int]] = {}

    # -- context manager -------------------------------------------------
    def __enter__(self) -> "CommMeter":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        # This meter, not merely the last: one closed out of order leaves no stale entry.
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _add(self, op: str, group: str, payload: int, sent: int) -> None:
        calls, payload_total, sent_total = self._rows.get((op, group), (0, 0, 0))
        self._rows[(op, group)] = [calls + 1, payload_total + payload, sent_total + sent]

    # -- queries ---------------------------------------------------------
    def _total(self, column: int, op: str | None, group: str | None) -> int:
        return sum(row[column] for (o, g), row in self._rows.items()
                   if (op is None or o == op) and (group is None or g == group))

    def calls(self, op: str | None = None, group: str | None = None) -> int:
        """Number of calls, optionally only of collective `op` and/or group label `group`."""
        return self._total(0, op, group)

    def payload_bytes(self, op: str | None = None, group: str | None = None) -> int:
        """Bytes of the tensors handed to the recorded calls."""
        return self._total(1, op, group)

    def sent_bytes(self, op: str | None = None, group: str | None = None) -> int:
        """Bytes this rank sent in the recorded calls."""
        return self._total(2, op, group)

    def records(self) -> list[dict]:
        """The rows as plain dicts, sorted by group then op: strings and ints, which a rank can
        return from `launch` even with ``safe_results=True``."""
        return [{"op": op, "group": g, "calls": c, "payload_bytes": p, "sent_bytes": s}
                for (op, g), (c, p, s) in sorted(self._rows.items(), key=lambda kv: (kv[0][1], kv[0][0]))]

    def gather(self, dst: int = 0, group=None) -> list[list[dict]] | None:
        """Every rank's `records()` on global rank `dst`, indexed by rank in `group` (None on other
        ranks); all ranks of `group` call it. The gather itself is not recorded."""
        out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
        dist.gather_object(self.records(), out, dst=dst, group=group)
        return out

    def table(self) -> str:
        """This rank's rows as an aligned text table."""
        return format_records(self.records())

    def summary(self) -> None:
        """Print `table()`."""
        print(self.table())

    def __repr__(self) -> str:
        return f"CommMeter(calls={self.calls()}, sent_bytes={self.sent_bytes()})"


def meter() -> CommMeter:
    """A new `CommMeter`: ``with comms.meter() as m: ...``."""
    return CommMeter()


def format_records(records: Sequence[dict] | Sequence[Sequence[dict]]) -> str:
    """An aligned text table of one rank's `m.records()`, or, with a rank column, of a list of
    them indexed by rank (what `m.gather()` or `launch` returned)."""
    columns = ("op", "group", "calls", "payload_bytes", "sent_bytes")
    per_rank = bool(records) and not isinstance(records[0], dict)
    by_rank = enumerate(records) if per_rank else [(None, records)]
    header = ("rank",) * per_rank + columns  # a rank column only for per-rank records
    rows = [(rank,) * per_rank + tuple(r[c] for c in columns) for rank, recs in by_rank for r in recs]
    if not rows:
        return "(no communication recorded)"
    return _align(header, rows)


def _align(header: tuple, rows: Iterable[tuple]) -> str:
    """Text columns left-aligned; numbers right-aligned, with thousands separators."""
    numeric = [h in ("rank", "calls", "payload_bytes", "sent_bytes") for h in header]
    cells = [list(header)] + [[f"{x:,}" if num else str(x) for x, num in zip(row, numeric)] for row in rows]
    widths = [max(len(row[j]) for row in cells) for j in range(len(header))]
    lines = ["  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
