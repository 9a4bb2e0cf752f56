"""`make lab` serves JupyterLab on the course."""
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_lab_serves_jupyterlab():
    args = ("--no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port=0 "
            "--IdentityProvider.token=course-test")
    proc = subprocess.Popen(["make", "--no-print-directory", "lab", f"LAB_ARGS={args}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        url, seen, deadline = None, [], time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            match = re.search(r"(http://127\.0\.0\.1:\d+)/lab", line)
            url = match.group(1) if match else None
        assert url, "JupyterLab did not report its address:\n" + "".join(seen[-20:])
        # The address is printed as the server starts listening; allow it a moment.
        for attempt in range(30):
            try:
                page = urllib.request.urlopen(f"{url}/lab?token=course-test", timeout=30)
                break
            except urllib.error.URLError:
                time.sleep(1)
        else:
            raise AssertionError(f"JupyterLab announced {url} but does not answer there")
        with page:
            assert page.status == 200
            assert "JupyterLab" in page.read().decode()
        with urllib.request.urlopen(f"{url}/api/contents/notebooks?token=course-test",
                                    timeout=30) as listing:
            assert "00_distributed_primer.ipynb" in listing.read().decode()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
