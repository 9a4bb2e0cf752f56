"""Each rank's idle over one step when DualPipe's forward/backward pairs run as one action: the
simulation `tests/test_pipeline_dualpipe.py` (DualPipe) and `tests/test_pipeline_multistep.py`
(DualPipeV) hold DeepSeek's README rows to. A test helper, not the course's simulator: the
course's own (`Schedule.simulate`, `multistep`) runs each action alone."""
from reference.pipeline_parallel import overlap_pairs


def paired_idle(schedule, t_f, t_i, t_w, t_fb):
    """Each rank's idle over one step (times per chunk) when every pair `overlap_pairs` marks is
    ONE action of time ``t_fb`` that starts once the forward's input and the backward's gradient
    are both there, as DeepSeek's overlapped F&B does. Messages are free."""
    paired = overlap_pairs(schedule)
    dur, done = {"F": t_f, "I": t_i, "W": t_w, "B": t_i + t_w}, {}
    items = {r: [st for st in paired.steps(r) if not st[0].is_comm] for r in range(schedule.pp)}

    def ready(a, r):  # when the inputs of action a on rank r are there; None: not yet
        s = schedule.stage(r, a.chunk)
        first, last = schedule.ends(s)
        if a.op == "F":
            return 0.0 if first else done.get(("F", a.mb, s - 1))
        if a.op == "W":
            return done.get(("I", a.mb, s))
        need = [done.get(("F", a.mb, s))] + ([] if last else [done.get(("I", a.mb, s + 1))])
        return None if None in need else max(need)

    free, busy = [0.0] * schedule.pp, [0.0] * schedule.pp
    while any(items.values()):
        moved = False
        for r in range(schedule.pp):
            while items[r]:
                starts = [ready(a, r) for a in items[r][0]]
                if None in starts:
                    break
                group = items[r].pop(0)
                d = t_fb if len(group) == 2 else dur[group[0].op]
                free[r], busy[r], moved = max([free[r]] + starts) + d, busy[r] + d, True
                for a in group:
                    for op in ("I", "F") if a.op == "B" else (a.op,):
                        done[(op, a.mb, schedule.stage(r, a.chunk))] = free[r]
        assert moved, "the paired order deadlocks"
    return [max(free) - b for b in busy]
