"""A real headless Chromium for the dashboard tests (Playwright for Python driving Debian's ``chromium``).

``playwright install`` cannot download its own browsers on these machines, so the system browser is launched by
path (``make browser`` installs it with apt, as root). ``evil.example`` resolves to 127.0.0.1 inside this browser:
a DNS-rebinding attack without a DNS server.
"""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = os.environ.get("MLX_LANE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
REBOUND_NAME = "evil.example"


@pytest.fixture(scope="module")
def browser():
    """Module-scoped, not session-scoped: Playwright's sync API keeps an asyncio loop marked running in the main
    thread until it stops, and every later ``asyncio.run`` in the session would fail."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the dashboard tests need Playwright for Python: pip install -e '.[test]' (make test does it)")
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"no Chromium at {CHROMIUM}: run 'make browser' as root (apt-get install chromium), "
                    "or point MLX_LANE_CHROMIUM at a Chromium binary")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                               args=["--no-sandbox", f"--host-resolver-rules=MAP {REBOUND_NAME} 127.0.0.1"])
        yield b
        b.close()


class ConsoleLog:
    """Console errors and uncaught page errors of one page."""

    def __init__(self, page):
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
