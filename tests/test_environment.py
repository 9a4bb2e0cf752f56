"""The pip and conda environments list the same packages, and the set-up files agree."""
import os
import re

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
