"""The pip and conda environments list the same packages, and the set-up files agree."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# conda-forge names that differ from PyPI's.
CONDA_TO_PIP = {"pytorch": "torch", "playwright-python": "playwright"}


def _split(requirement):
    match = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", requirement)
    name, spec = match.group(1).lower().replace("_", "-"), match.group(2).replace(" ", "")
    return name, spec


def pip_requirements():
    reqs = {}
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name, spec = _split(line)
                reqs[name] = spec
    return reqs


def conda_requirements():
    reqs, in_deps = {}, False
    with open(os.path.join(ROOT, "environment.yml")) as f:
        for line in f:
            stripped = line.split("#")[0].rstrip()
            if stripped.startswith("dependencies:"):
                in_deps = True
                continue
            if in_deps and stripped.strip().startswith("- "):
                name, spec = _split(stripped.strip()[2:])
                # conda pins with a single '=', pip with '=='.
                spec = re.sub(r"^=(?!=)", "==", spec)
                reqs[CONDA_TO_PIP.get(name, name)] = spec
            elif in_deps and stripped and not stripped.startswith(" "):
                in_deps = False
    return reqs


def test_conda_and_pip_list_the_same_packages_and_versions():
    pip, conda = pip_requirements(), conda_requirements()
    conda.pop("python")
    conda.pop("pip")
    assert pip == conda


def test_conda_uses_conda_forge_only():
    text = open(os.path.join(ROOT, "environment.yml")).read()
    channels = re.search(r"channels:\n((?:\s+- .*\n)+)", text).group(1)
    assert [c.strip()[2:] for c in channels.strip().splitlines()] == ["conda-forge"]


def test_install_pins_torch_and_metadata_accepts_a_range():
    assert pip_requirements()["torch"] == "==2.13.0"
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert '"torch>=2.8"' in pyproject


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "make test" in ci
    assert readme.index("make lab") < 800 and readme.index("make test") < 800


@pytest.mark.skipif(shutil.which("make") is None or not hasattr(os, "sched_getaffinity"),
                    reason="needs make and Linux's CPU affinity")
def test_make_test_takes_a_worker_per_core_it_may_use():
    """`make test`'s workers follow the cores this process may run on (at least 2), and
    PYTEST_WORKERS overrides them; `make -n` prints the commands without running them."""
    def workers(*args, cpus=None):
        cmd = ["make", "-n", "--no-print-directory", "test", *args]
        if cpus is not None:
            cmd = ["taskset", "-c", cpus, *cmd]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return {int(n) for n in re.findall(r"pytest -n (\d+)", out)}

    assert workers() == {max(2, len(os.sched_getaffinity(0)))}
    assert workers("CORES=8") == {8} and workers("CORES=3") == {3}
    assert workers("CORES=1") == {2}
    assert workers("PYTEST_WORKERS=5") == {5}
    if shutil.which("taskset"):
        assert workers(cpus="0") == {2}


def test_make_hands_out_the_test_files_in_the_order_conftest_gives():
    """pytest-xdist 3.5 and later sort the files by their number of tests unless told not to
    (3.8's --no-loadscope-reorder); the longest files would then start last."""
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    commands = re.findall(r"pytest -n \S+ [^\n]*", makefile)
    assert len(commands) == 3 and all("--dist loadfile --no-loadscope-reorder" in c for c in commands), commands
    assert pip_requirements()["pytest-xdist"] == ">=3.8"
