"""The dashboard in a real headless Chromium, on the real default model behind a live server.

- the page shows what /stats says (a cache hit included), a chart draws its points, no console errors;
- behind --api-key the page is locked until the key is given, and keeps it in session storage only;
- a page from another origin (another loopback port) and a DNS-rebound name cannot run a generation or clear
  the cache through the user's browser.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import threading
import time

import httpx
import pytest

from tests.integration.browser import REBOUND_NAME, ConsoleLog, browser  # noqa: F401 (fixture)
from tests.serverproc import ServerProc

pytestmark = pytest.mark.model

SERIES_RGB = (0xE4, 0x57, 0x2E)  # the first series' stroke in dashboard.js (COLORS.a)
# paths whose DOM value must equal /stats once the page has caught up
COMPARED = ["prompt_cache.hits", "prompt_cache.tokens_hit", "prompt_cache.entries", "lane.cached_tokens",
            "lane.requests_served", "lane.completion_tokens", "model", "device", "dtype"]


def chat(url, content, max_tokens=8, headers=None):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def dom_values(page) -> dict:
    return page.evaluate("""(paths) => Object.fromEntries(paths.map(p => {
        const el = document.querySelector(`[data-stat="${p}"]`);
        return [p, el && el.dataset.value !== undefined ? JSON.parse(el.dataset.value) : undefined];
    }))""", COMPARED)


def wait_until_page_matches(page, url, headers=None, timeout=20.0) -> dict:
    """Poll until the page's values equal a fresh /stats (the page polls every 0.5 s here)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(url + "/stats", headers=headers, timeout=10).json()
        want = {p: _get(stats, p) for p in COMPARED}
        got = dom_values(page)
        if got == want:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed /stats' values:\npage  {got}\nstats {want}")
        time.sleep(0.3)


def _get(obj, path):
    for key in path.split("."):
        obj = obj[key]
    return obj


def series_pixels(page, chart_id: str) -> int:
    """Pixels of the first series' colour on a chart's canvas: > 0 only once a line or point was drawn."""
    return page.evaluate("""([id, rgb]) => {
        const c = document.querySelector(`#${id} canvas`);
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4)
            if (d[i+3] > 200 && Math.abs(d[i]-rgb[0]) < 12 && Math.abs(d[i+1]-rgb[1]) < 12 && Math.abs(d[i+2]-rgb[2]) < 12) n++;
        return n;
    }""", [chart_id, list(SERIES_RGB)])


def test_page_shows_stats_and_the_cache_hit(browser, server, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    log = ConsoleLog(page)
    page.goto(server.url + "/?interval=0.5")
    page.wait_for_selector("#dashboard:not([hidden])")
    before = wait_until_page_matches(page, server.url)
    assert page.locator("#conn").get_attribute("data-state") == "ok"

    prompt = f"List three colours of the rainbow. (dashboard {time.time()})"  # unique: the first is a miss
    chat(server.url, prompt, max_tokens=12)
    second = chat(server.url, prompt, max_tokens=12)  # the same prompt: its prefix comes from the cache
    assert second["prompt_tokens_details"]["cached_tokens"] > 0
    after = wait_until_page_matches(page, server.url)
    assert after["prompt_cache"]["hits"] > before["prompt_cache"]["hits"]
    assert after["lane"]["cached_tokens"] >= before["lane"]["cached_tokens"] + second["prompt_tokens_details"]["cached_tokens"]
    saved = page.locator("#tokens-saved").inner_text().replace(",", "")
    assert int(saved) == after["lane"]["cached_tokens"]  # the figure a person reads, not only data-value

    # the tokens/s chart: a point above zero was recorded after the requests, and its colour is on the canvas
    page.wait_for_function("() => window.mlxLaneDashboard.series.tok.some(v => v > 0)", timeout=10000)
    page.wait_for_timeout(1200)  # two more polls: the chart redraws with that point inside its window
    drawn = page.evaluate("() => window.mlxLaneDashboard.charts.tokens.data[1].filter(v => v > 0).length")
    assert drawn >= 1
    assert series_pixels(page, "chart-tokens") > 20
    page.set_viewport_size({"width": 900, "height": 1000})  # the charts follow the window (resize handler)
    page.wait_for_timeout(600)
    assert series_pixels(page, "chart-tokens") > 20
    assert log.errors == [], log.errors
    page.set_viewport_size({"width": 1400, "height": 1000})

    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("MLX_LANE_DASHBOARD_SCREENSHOT"):  # how README's screenshot is refreshed
        shutil.copy(shot, os.environ["MLX_LANE_DASHBOARD_SCREENSHOT"])
    page.close()


@pytest.fixture(scope="module")
def keyed_server(default_model_dir):
    srv = ServerProc("--model", "default", "--cache-bytes", "64M", "--api-key", "s3cret-dashboard-key")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_page_locked_until_the_key_is_given(browser, keyed_server):
    url, key = keyed_server.url, "s3cret-dashboard-key"
    assert httpx.get(url + "/health").status_code == 200  # stays open
    assert httpx.get(url + "/stats").status_code == 401
    context = browser.new_context()
    page = context.new_page()
    log = ConsoleLog(page)
    page.goto(url + "/dashboard?interval=0.5")
    page.wait_for_selector("#lock:not([hidden])")
    assert page.locator("#dashboard").is_hidden()
    assert page.locator('[data-stat="model"]').inner_text() == "-"  # nothing was read without the key

    page.fill("#lock-key", "wrong-key")
    page.click("#lock-form button")
    page.wait_for_selector("#lock-error:not([hidden])")
    assert "not accepted" in page.locator("#lock-error").inner_text()
    assert page.locator("#dashboard").is_hidden()
    assert page.evaluate("() => sessionStorage.getItem('mlx-lane-api-key')") is None
    # the refused /stats request is the only console error (Chromium logs every 4xx resource load)
    assert all("401" in e for e in log.errors) and len(log.errors) == 1, log.errors

    page.fill("#lock-key", key)
    page.click("#lock-form button")
    page.wait_for_selector("#dashboard:not([hidden])")
    wait_until_page_matches(page, url, headers={"Authorization": f"Bearer {key}"})
    assert page.evaluate("() => sessionStorage.getItem('mlx-lane-api-key')") == key
    assert page.evaluate("() => localStorage.length") == 0  # never kept past the browser session

    page.reload()  # same tab: the key is still there, no second prompt
    page.wait_for_selector("#dashboard:not([hidden])")
    assert page.locator("#lock").is_hidden()
    assert len(log.errors) == 1, log.errors
    context.close()

    fresh = browser.new_context()  # a new session asks again
    page = fresh.new_page()
    page.goto(url + "/")
    page.wait_for_selector("#lock:not([hidden])")
    fresh.close()


class _AttackerPage(http.server.BaseHTTPRequestHandler):
    html = b""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(self.html)

    def log_message(self, *args):
        pass


ATTACK_JS = """async (target) => {
    const body = JSON.stringify({messages: [{role: 'user', content: 'Write a poem.'}], max_tokens: 8});
    const out = [];
    for (const [path, payload] of [['/v1/chat/completions', body], ['/admin/cache/clear', '']]) {
        for (const mode of ['cors', 'no-cors']) {
            try {
                const r = await fetch(target + path, {method: 'POST', mode, headers: {'Content-Type': 'text/plain'}, body: payload});
                out.push({path, mode, status: r.status, text: mode === 'cors' ? await r.text() : ''});
            } catch (e) { out.push({path, mode, error: String(e)}); }
        }
    }
    return out;
}"""


def test_other_origins_and_rebound_names_are_refused(browser, server):
    url = server.url
    chat(url, f"Say something about rivers. ({time.time()})", max_tokens=4)  # the cache holds an entry to lose
    before = httpx.get(url + "/stats").json()
    assert before["prompt_cache"]["entries"] >= 1

    # a page served from another loopback port: its simple (text/plain) POSTs reach the server and are refused
    _AttackerPage.html = b"<!doctype html><title>a page the user opened</title><p>hello</p>"
    attacker = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AttackerPage)
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    page = browser.new_page()
    try:
        page.goto(f"http://127.0.0.1:{attacker.server_address[1]}/")
        results = page.evaluate(ATTACK_JS, url)
    finally:
        attacker.shutdown()
        attacker.server_close()
    # a cors-mode fetch may not even read the 403 (no Access-Control-Allow-Origin): the server's counters tell
    for r in results:
        assert r.get("status") in (None, 0), r  # nothing readable came back to the hostile page

    # DNS rebinding: evil.example resolves to 127.0.0.1, so the page is same-origin with the server
    port = url.rsplit(":", 1)[1]
    rebound = page.goto(f"http://{REBOUND_NAME}:{port}/")
    assert rebound.status == 403
    assert json.loads(rebound.text())["error"]["code"] == "host_not_allowed"
    same_origin = page.evaluate("""async () => {
        const out = [];
        for (const [path, method] of [['/stats', 'GET'], ['/admin/cache/clear', 'POST'], ['/v1/chat/completions', 'POST']]) {
            const r = await fetch(path, {method, headers: {'Content-Type': 'application/json'},
                body: method === 'POST' ? JSON.stringify({messages: [{role: 'user', content: 'hi'}], max_tokens: 4}) : undefined});
            out.push([path, r.status, (await r.json()).error.code]);
        }
        return out;
    }""")
    assert same_origin == [["/stats", 403, "host_not_allowed"], ["/admin/cache/clear", 403, "host_not_allowed"],
                           ["/v1/chat/completions", 403, "host_not_allowed"]]
    page.close()

    after = httpx.get(url + "/stats").json()
    for path in ("prompt_cache.entries", "prompt_cache.queries", "lane.requests_served", "lane.completion_tokens",
                 "lane.prompt_tokens"):
        assert _get(after, path) == _get(before, path), path  # no generation ran, nothing was cleared
    refused = after["http"]["by_status"].get("403", 0) - before["http"]["by_status"].get("403", 0)
    # 2 endpoints x 2 fetch modes, the rebound page load and its 3 fetches (Chromium may add a /favicon.ico)
    assert refused >= 4 + 1 + 3
