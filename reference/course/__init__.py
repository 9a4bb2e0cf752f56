"""The course's machinery: what exists only to run the course, apart from the code students read.

Two commands, for instructors:

    python -m reference.course exercises        # write exercises/ from solutions/
    python -m reference.course check            # exit 1 when exercises/ is stale
    python -m reference.course grade submissions/*.ipynb --out results.json [--csv results.csv]

Where each part lives:

* `reference.course.exercises`: exercise notebooks generated from the solution
  notebooks (answers between `### BEGIN SOLUTION` and `### END SOLUTION` replaced
  by a stub that raises `NotImplementedError` naming the exercise);
* `reference.course.grade`: the grader (papermill in a runner process per
  submission, hidden checks, results.json and a CSV), with
  `reference.course.grade_runner` (executes one submission),
  `reference.course.procs` (leaves no process behind) and
  `reference.course.report` (the table and the files);
* `reference.course.checks`: the visible self-checks students call from a homework
  notebook (one PASS or FAIL line with a hint, never the grade);
* `reference.course.homework`: each homework's exercises and hidden checks, and the
  guard that forbids the collectives an exercise must build itself.

Nothing outside this package imports it; it may import everything else.
"""
