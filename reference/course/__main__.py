"""python -m reference.course {exercises, check, grade}: the instructor's commands."""
from __future__ import annotations

import sys

USAGE = """usage: python -m reference.course COMMAND [options]

commands:
  exercises   write exercises/NN_topic.ipynb from solutions/
  check       exit 1 and list the files when exercises/ is stale
  grade       execute and grade submitted notebooks:
              python -m reference.course grade submissions/*.ipynb --out results.json

`python -m reference.course COMMAND --help` describes each command's options."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in ("exercises", "check"):
        from reference.course.exercises import main as exercises_main
        return exercises_main([command, *rest])
    if command == "grade":
        from reference.course.grade import main as grade_main
        return grade_main(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
