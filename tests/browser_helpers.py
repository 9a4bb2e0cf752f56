"""JupyterLab driven in a real browser, for tests/test_browser.py.

The server is started by the Makefile's own `lab` recipe (`make lab`), on a temporary
copy of the course's notebooks; Chromium is Debian's (/usr/bin/chromium), driven by
Playwright. Every wait here watches the page, as a student would: the prompts
(`[*]:` while a cell runs or waits, `[3]:` once it ran) and the kernel's indicator.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
# No GPU, no sandbox (containers run as root), and none of Chromium's own traffic:
# the page talks to the local JupyterLab only.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage"]
VIEWPORT = {"width": 1400, "height": 900}
# What the ranks of a launch print is shown rank by rank with this prefix.
RANK_LINE = re.compile(r"^\[rank (\d+)\] ", re.M)


def missing_reason() -> str | None:
    """Why the browser test cannot run here, or None when it can."""
    if not os.path.exists(CHROMIUM):
        return (f"Chromium not found at {CHROMIUM}: install it with apt-get install chromium, "
                f"or run make browser-test on a machine that has it")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as err:
        return (f"playwright is not importable ({err}): `make browser-test` installs it "
                f"from requirements.txt")
    if shutil.which("make") is None:
        return "make not found: the test starts JupyterLab with `make lab`"
    if not (Path(sys.executable).parent / "jupyter").exists():
        return f"jupyter not found next to {sys.executable}: JupyterLab is not installed there"
    return None


def code_cells(notebook: Path) -> list[tuple[int, str]]:
    """(index among all cells, source) of each code cell of a notebook file."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def cell_containing(notebook: Path, text: str) -> int:
    """Index of the first code cell whose source contains `text`."""
    for index, source in code_cells(notebook):
        if text in source:
            return index
    raise AssertionError(f"no code cell of {notebook.name} contains {text!r}")


class Lab:
    """A JupyterLab server started by `make lab` with `root` as its folder."""

    def __init__(self, root: Path, token: str = "course-browser-test"):
        self.root, self.token = Path(root), token
        self.url: str | None = None
        self.log_path = self.root.parent / "jupyterlab.log"
        self._proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> "Lab":
        args = ("--no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port=0 "
                f"--IdentityProvider.token={self.token}")
        # The Makefile's recipe, run in the copy: BIN points at this interpreter's
        # environment and STAMP= skips the install step (the tests already run in it).
        command = ["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "lab",
                   f"BIN={Path(sys.executable).parent}", "STAMP=", f"LAB_ARGS={args}"]
        # A student's first start: default settings and no saved workspace.
        state = self.root.parent / "jupyterlab-state"
        env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(state / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(state / "workspaces"))
        # The log goes to a file: a pipe nobody reads would fill up and stall the server.
        with open(self.log_path, "w") as log:
            self._proc = subprocess.Popen(command, cwd=self.root, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while self.url is None:
            match = re.search(r"(http://127\.0\.0\.1:\d+)/lab", self.log())
            if match:
                self.url = match.group(1)
            elif self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"JupyterLab did not report its address:\n{self.log()[-3000:]}")
            else:
                time.sleep(0.2)
        # The address is printed as the server starts listening; allow it a moment.
        while True:
            try:
                self.api("GET", "/api/status")
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"JupyterLab announced {self.url} but does not answer")
                time.sleep(0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def api(self, method: str, path: str):
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Shut down every kernel (and with it its ranks' fork server): frees the cores."""
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")

    def notebook_url(self, path: str, workspace: str) -> str:
        # A workspace of its own per notebook: the page opens that notebook alone.
        return f"{self.url}/lab/workspaces/{workspace}/tree/{path}?token={self.token}"

    def stop(self) -> None:
        if self._proc is None:
            return
        import psutil

        family = []  # the kernels and the ranks' fork servers descend from the server
        with contextlib.suppress(psutil.NoSuchProcess):
            family = psutil.Process(self._proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)
        _, alive = psutil.wait_procs(family, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self._proc = None


@contextlib.contextmanager
def chromium(user_data_dir: Path):
    """A Playwright browser context on Debian's Chromium with a fresh profile."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(user_data_dir), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport=VIEWPORT)
        try:
            yield context
        finally:
            context.close()


# The page's state, read in one call: every code cell's prompt, the kernel's
# indicator, the outputs' text, the red outputs and the rendered images. JupyterLab 4
# renders an exception (traceback) and a stderr stream alike, as an output of type
# application/vnd.jupyter.stderr; no output carries an "error" type in the page.
_STATE_JS = """() => {
  const q = (s, root) => Array.from((root || document).querySelectorAll(s));
  const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
  return {
    prompts: q('.jp-Notebook .jp-CodeCell .jp-InputPrompt').map(e => e.textContent.trim()),
    status: indicator ? indicator.getAttribute('data-status') : null,
    errors: q('.jp-OutputArea-output[data-mime-type*="stderr"], '
              + '.jp-OutputArea-output[data-mime-type*="error"]').map(e => e.innerText),
    outputs: q('.jp-OutputArea-output').map(e => e.textContent).join('\\n'),
    images: q('.jp-OutputArea-output img').length,
  };
}"""


class NotebookPage:
    """One notebook open in JupyterLab, driven through its menus and keyboard."""

    def __init__(self, page, lab: Lab, path: str):
        self.page, self.lab, self.path = page, lab, path
        self.file = lab.root / path

    def open(self, timeout: float = 90) -> "NotebookPage":
        workspace = re.sub(r"\W", "-", Path(self.path).stem)
        self.page.goto(self.lab.notebook_url(self.path, workspace), timeout=timeout * 1000)
        self.page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout * 1000)
        # The indicator reads "idle" for a moment before the session starts; a cell run
        # then would ask for a kernel. Ready = the server holds this notebook's kernel
        # and the page shows it idle.
        deadline = time.monotonic() + timeout
        while not any(s["path"] == self.path and s.get("kernel")
                      for s in self.lab.api("GET", "/api/sessions")):
            self.fail_on_dialog()
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.path}: no kernel started within {timeout:.0f} s")
            time.sleep(0.25)
        self.wait_idle(timeout)
        return self

    def fail_on_dialog(self) -> None:
        """A dialog (kernel choice, error) where the student expected none is a failure."""
        dialog = self.page.locator(".jp-Dialog")
        if dialog.count():
            raise AssertionError(f"{self.path}: JupyterLab shows a dialog: {dialog.first.inner_text()!r}")

    def state(self) -> dict:
        return self.page.evaluate(_STATE_JS)

    def wait_idle(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if state["status"] == "idle":
                return state
            self.fail_on_dialog()
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.path}: the kernel is not idle after {timeout:.0f} s "
                                     f"(indicator: {state['status']!r})")
            time.sleep(0.25)

    def menu(self, menu: str, item: str) -> None:
        """Click `item` in the menu bar's `menu` (as a student does)."""
        self.page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{re.escape(menu)}$")).click()
        self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()

    def cell(self, index: int):
        return self.page.locator(".jp-Notebook .jp-Cell").nth(index)

    def run_cells(self, indices: list[int]) -> None:
        """Select each cell by its prompt and run it with Ctrl+Enter (run, stay)."""
        for index in indices:
            self.cell(index).locator(".jp-InputPrompt").click()
            self.page.keyboard.press("Control+Enter")

    def wait_ran(self, expected: int, timeout: float) -> dict:
        """Wait until `expected` code cells show an execution count, none waits
        (`[*]`) and the kernel is idle; stop early at an error output."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            ran = sum(bool(re.fullmatch(r"\[\d+\]:", p)) for p in state["prompts"])
            waiting = any("*" in p for p in state["prompts"])
            if state["status"] == "idle" and not waiting and (ran >= expected or state["errors"]):
                return state
            self.fail_on_dialog()
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.path}: {ran} of {expected} cells ran in {timeout:.0f} s "
                    f"(kernel {state['status']!r}, prompts {state['prompts']})")
            time.sleep(0.5)

    def screenshot(self, folder: Path, name: str) -> None:
        # Answer Jupyter's news question (a toast over the outputs) as a student would.
        for no in self.page.locator(".jp-toast-button", has_text=re.compile("^No$")).all():
            with contextlib.suppress(Exception):
                no.click(timeout=1000)
        self.page.screenshot(path=str(folder / f"{name}.png"))


# A widget's output, as the page shows it: its HTML texts (summaries, tables), the
# sources of its images (an ipywidgets Image is a blob: URL, new for each new PNG).
_WIDGET_JS = """(cell) => {
  const q = (s) => Array.from(cell.querySelectorAll(s));
  const out = cell.querySelector('.jp-Cell-outputWrapper');
  return {
    html: q('.widget-html-content').map(e => e.textContent).join('\\n'),
    images: q('.jupyter-widgets img').map(e => e.getAttribute('src')),
    widgets: q('.jupyter-widgets').length,
    text: out ? out.innerText : '',
  };
}"""


def widget_output(cell) -> dict:
    return cell.evaluate(_WIDGET_JS)


def wait_widget_change(cell, before: dict, timeout: float = 30) -> dict:
    """The widget's output once its HTML, and its images if it has any, differ from `before`."""
    deadline = time.monotonic() + timeout
    while True:
        after = widget_output(cell)
        if after["html"] != before["html"] and (not before["images"]
                                                 or after["images"] != before["images"]):
            return after
        if time.monotonic() > deadline:
            raise AssertionError(f"the widget's output did not change within {timeout:.0f} s:\n"
                                 f"before {before}\nafter {after}")
        time.sleep(0.25)
