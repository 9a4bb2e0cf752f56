"""The README and the manuals in docs/: every relative link leads to a file that exists (and
to a heading there, when it names one), the README stays short and links every manual, and
its picture is the one the course's own plotting code draws (`docs/pictures.py`)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_anchor(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _broken(source: Path, markdown: str) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", markdown)):
        if re.match(r"[a-z]+:", target):  # https:, mailto: — not this repository's
            continue
        path, _, anchor = target.partition("#")
        page = (source.parent / path).resolve() if path else source
        if not page.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
            shown = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
            broken.append(f"{target} (no heading #{anchor} in {shown})")
    return broken


def test_anchor_follows_githubs_rule():
    assert _anchor("How close is close: one tolerance policy, checked under other CPUs' kernels") \
        == "how-close-is-close-one-tolerance-policy-checked-under-other-cpus-kernels"
    assert _anchor("The 3D-parallel GPT") == "the-3d-parallel-gpt"


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## A section\n")
    page = tmp_path / "b.md"
    markdown = ("[ok](a.md) [ok](a.md#a-section) [web](https://example.org/x) "
                "[gone](missing.md) [no heading](a.md#nowhere)\n```\n[in code](nowhere.md)\n```\n")
    assert _broken(page, markdown) == ["missing.md (no such file)",
                                       "a.md#nowhere (no heading #nowhere in a.md)"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert not _broken(page, page.read_text()), _broken(page, page.read_text())


def test_notebooks_links_to_the_manuals_resolve():
    """The markdown cells of the lectures and the homework that cite a manual link to it."""
    broken = []
    for folder in ("notebooks", "solutions", "exercises"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            for cell in nbformat.read(path, 4).cells:
                if cell.cell_type == "markdown":
                    broken += [f"{path.name}: {b}" for b in _broken(path, cell.source)]
                    # the course's README, not another project's ("DualPipe's README")
                    cites = re.search(r"(?<!'s )\bREADME\b", cell.source)
                    assert not cites or "README.md" in cell.source, \
                        f"{path.name} cites the README, whose manuals moved to docs/: link the manual"
    assert not broken, broken


def test_the_readme_is_short_and_links_every_manual():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert readme.index("make lab") < readme.index("## ") and readme.index("make test") < readme.index("## ")
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(readme) if t.startswith("docs/")}
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= linked
    lectures = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert [line for line in readme.splitlines() if "](notebooks/" in line] and \
        all(f"](notebooks/{name})" in readme for name in lectures)


def test_the_readmes_picture_is_the_one_the_course_draws(tmp_path):
    """docs/pictures.py redraws every picture; the committed ones have the same size, so a
    picture left behind by a change of what is drawn shows here (rerun the script)."""
    import matplotlib.image

    spec = importlib.util.spec_from_file_location("pictures", ROOT / "docs" / "pictures.py")
    pictures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pictures)
    readme = (ROOT / "README.md").read_text()
    for drawn in pictures.main(tmp_path):
        committed = ROOT / "docs" / "img" / drawn.name
        assert f"](docs/img/{drawn.name})" in readme or any(
            f"](img/{drawn.name})" in p.read_text() for p in PAGES[1:]), drawn.name
        assert committed.exists(), f"rerun: python docs/pictures.py ({drawn.name} is not committed)"
        assert matplotlib.image.imread(committed).shape == matplotlib.image.imread(drawn).shape, \
            f"rerun: python docs/pictures.py ({drawn.name} differs in size from what it draws)"
    # the caption's numbers, as the pictures' titles print them (F = 1, B = 2)
    from reference.pipeline_parallel import build_schedule

    one_f_one_b, zb_v = build_schedule("1f1b", 4, 8), build_schedule("zb-v", 4, 8, 2)
    assert f"{one_f_one_b.bubble_fraction(1, 2):.0%}" == "27%" and "1F1B idles 27 %" in readme
    assert f"{zb_v.bubble_fraction(1, 2):.0%}" == "6%" and "where 1F1B waits, 6 %" in readme
