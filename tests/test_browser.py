"""The course as a student sees it: JupyterLab, started by `make lab`, driven in Chromium.

Headless runs (tests/test_notebooks.py) prove that every cell executes; they cannot see
what only a browser shows: widgets that need JupyterLab's front-end extension, outputs
drawn in the page, the kernel's interrupt button. Here a real Chromium opens a temporary
copy of notebooks/ (the committed notebooks are never opened, so nothing is saved into
them), runs cells through the menus and the keyboard, and reads the page.

Needs Debian's Chromium at /usr/bin/chromium (`apt-get install chromium`) and the
`playwright` package (requirements.txt); without them every test here skips and says
why. `make browser-test` runs this file alone; each notebook's end state is saved as a
PNG in the folder the first test prints.
"""
import os
import shutil
import time

import psutil
import pytest

import browser_helpers as bh
from proc_helpers import alive

MISSING = bh.missing_reason()
pytestmark = [pytest.mark.browser, pytest.mark.timeout(300),
              pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    base = tmp_path_factory.mktemp("browser")
    root = base / "lab"
    # The lab's folder is a copy: outputs, checkpoints and autosaves stay in it.
    shutil.copytree(bh.ROOT / "notebooks", root / "notebooks",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    server = bh.Lab(root).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser(lab):
    with bh.chromium(lab.root.parent / "chromium-profile") as context:
        yield context


@pytest.fixture(scope="module")
def screenshots(lab, pytestconfig):
    folder = lab.root.parent / "screenshots"
    folder.mkdir()
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\nbrowser screenshots: {folder}")
    return folder


@pytest.fixture
def open_notebook(lab, browser, screenshots):
    """open_notebook(path) -> a NotebookPage; its page is closed and every kernel shut
    down afterwards, with a screenshot of the end state (also when the test failed)."""
    opened = []

    def open_(path):
        nb = bh.NotebookPage(browser.new_page(), lab, path)
        opened.append(nb)
        return nb.open()

    yield open_
    for nb in opened:
        nb.screenshot(screenshots, os.path.splitext(os.path.basename(nb.path))[0])
        nb.page.close()
    lab.shutdown_kernels()


def _assert_no_errors(nb, state):
    assert not state["errors"], (f"{nb.path}: red outputs (tracebacks or stderr) in the page:\n"
                                 + "\n".join(state["errors"]))
    assert "Traceback" not in state["outputs"], f"{nb.path}: a traceback is printed in an output"
    assert "Error displaying widget" not in state["outputs"], f"{nb.path}: a widget did not render"


def test_primer_runs_all_cells_from_the_run_menu(open_notebook):
    nb = open_notebook("notebooks/00_distributed_primer.ipynb")
    start = time.monotonic()
    nb.menu("Run", "Run All Cells")
    state = nb.wait_ran(len(bh.code_cells(nb.file)), timeout=180)
    print(f"{nb.path}: every cell ran in {time.monotonic() - start:.0f} s")
    _assert_no_errors(nb, state)
    unrun = [p for p in state["prompts"] if p == "[ ]:"]
    assert not unrun, f"{nb.path}: {len(unrun)} cells did not run: {state['prompts']}"
    # A launch's ranks print through the caller, each line prefixed by its rank.
    ranks = set(bh.RANK_LINE.findall(state["outputs"]))
    assert {"0", "1"} <= ranks, f"{nb.path}: no '[rank 0]' and '[rank 1]' lines in the page (saw {ranks})"
    assert state["images"] >= 1, f"{nb.path}: no matplotlib figure is drawn in the page"


def _build_widget(open_notebook, path, call):
    """Open `path`, run its setup cell and the cell calling `call`; the widget's cell."""
    nb = open_notebook(path)
    setup, widget = bh.code_cells(nb.file)[0][0], bh.cell_containing(nb.file, call)
    nb.run_cells([setup, widget])
    _assert_no_errors(nb, nb.wait_ran(2, timeout=120))
    cell = nb.cell(widget)
    deadline = time.monotonic() + 30
    while not bh.widget_output(cell)["widgets"] and time.monotonic() < deadline:
        time.sleep(0.25)
    before = bh.widget_output(cell)
    # Without ipywidgets' front-end extension (the jupyterlab_widgets package) the
    # cell shows the widget's repr as plain text instead.
    assert before["widgets"], (f"{path}: the widget did not render; the cell shows "
                               f"{before['text']!r}. Is jupyterlab_widgets installed?")
    assert cell.locator(".widget-slider").count() >= 1, f"{path}: no slider rendered:\n{before['text']}"
    assert "Error displaying widget" not in before["text"], f"{path}: {before['text']}"
    return nb, cell, before


def _slider(cell, label):
    return cell.locator(".widget-slider", has_text=label).locator(".noUi-handle")


def test_zero_memory_calculator_follows_its_controls(open_notebook):
    nb, cell, before = _build_widget(open_notebook, "notebooks/02_zero_fsdp.ipynb",
                                     "memory_calculator(")
    assert before["images"], f"{nb.path}: the calculator draws no picture"
    assert "80 GB device" in before["html"].replace("\xa0", " ")
    cell.locator(".widget-dropdown", has_text="device memory").locator("select").select_option("24 GB")
    after = bh.wait_widget_change(cell, before)
    assert "24 GB device" in after["html"].replace("\xa0", " "), after["html"]
    # The log slider of Ψ, one keyboard step (0.01 decades) to the right.
    _slider(cell, "parameters").press("ArrowRight")
    moved = bh.wait_widget_change(cell, after)
    assert "7,500,000,000 parameters" in after["html"]
    assert "7,500,000,000 parameters" not in moved["html"], moved["html"]
    _assert_no_errors(nb, nb.state())


def test_pipeline_schedule_explorer_follows_its_controls(open_notebook):
    nb, cell, before = _build_widget(open_notebook, "notebooks/04_pipeline_parallel.ipynb",
                                     "schedule_explorer(")
    assert "m = 8" in before["html"] and before["images"], before
    _slider(cell, "micro-batches m").press("ArrowLeft")
    after = bh.wait_widget_change(cell, before)
    assert "m = 7" in after["html"], after["html"]
    cell.locator(".widget-toggle-button", has_text="gpipe").click()
    gpipe = bh.wait_widget_change(cell, after)
    assert gpipe["html"].startswith("gpipe, pp = 4, m = 7"), gpipe["html"]
    _assert_no_errors(nb, nb.state())


def test_configuration_explorer_follows_its_controls(open_notebook):
    nb, cell, before = _build_widget(open_notebook, "notebooks/06_3d_parallel.ipynb",
                                     "config_explorer(")
    assert "GPT-3 175B on 1024 GPUs" in before["html"].replace("\xa0", " "), before["html"]
    cell.locator(".widget-dropdown", has_text="model").locator("select").select_option("GPT-3 13B")
    after = bh.wait_widget_change(cell, before)
    assert "GPT-3 13B on 1024 GPUs" in after["html"].replace("\xa0", " "), after["html"]
    _assert_no_errors(nb, nb.state())


# Typed into a scratch notebook: two ranks that note their pid, then sleep.
SLEEPING_LAUNCH = """import os, time
from reference.runtime import launch

def sleeper(folder):
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(60)

launch(sleeper, 2, {folder!r})"""




def test_interrupting_a_launch_leaves_no_rank_running(open_notebook, lab):
    import nbformat

    folder = lab.root.parent / "rank-pids"
    folder.mkdir()
    scratch = lab.root / "scratch.ipynb"
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("")])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    nbformat.write(notebook, scratch)
    nb = open_notebook(scratch.name)
    code = SLEEPING_LAUNCH.format(folder=str(folder))
    nb.cell(0).locator(".cm-content").click()
    nb.page.keyboard.insert_text(code)  # as pasted: no auto-indent, no closing brackets added
    # The page renders an empty line as a line break of its own: compare the others.
    typed = nb.cell(0).locator(".cm-content").inner_text()
    assert [l for l in typed.splitlines() if l.strip()] == [l for l in code.splitlines() if l.strip()]
    nb.page.keyboard.press("Control+Enter")
    deadline = time.monotonic() + 90
    while len(os.listdir(folder)) < 2:
        assert time.monotonic() < deadline, "the 2 ranks did not start within 90 s"
        time.sleep(0.25)
    pids = [int(name) for name in os.listdir(folder)]
    try:
        assert len(alive(pids)) == 2, f"a rank ended before the interrupt: {pids}"
        nb.menu("Kernel", "Interrupt Kernel")
        # The launcher kills its ranks when the cell is interrupted: allow 10 s.
        start = time.monotonic()
        while alive(pids) and time.monotonic() < start + 10:
            time.sleep(0.1)
        assert not alive(pids), f"ranks {alive(pids)} still run 10 s after the interrupt"
        print(f"both ranks ended {time.monotonic() - start:.1f} s after the interrupt")
        state = nb.wait_ran(1, timeout=30)
        assert any("KeyboardInterrupt" in e for e in state["errors"]), state["errors"]
    finally:
        for pid in alive(pids):  # leave nothing behind, even when the test failed
            psutil.Process(pid).kill()
