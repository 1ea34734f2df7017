"""The dashboard: one static page at ``GET /`` and ``GET /dashboard`` that polls ``/stats``.

Everything it needs ships in the package (``server/http/static/``: our HTML/CSS/JS and uPlot vendored from npm with its
license); no CDN, no build step. The page holds no data of its own, so it is served without the API key; behind
``--api-key`` it asks for the key and sends it with each ``/stats`` poll. Its Content-Security-Policy allows
scripts, styles and requests from this server only.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

__all__ = ["STATIC_DIR", "mount_dashboard"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def mount_dashboard(app: FastAPI) -> None:
    """Add the page routes and its assets under ``/dashboard/assets/`` to ``app``."""
    page = STATIC_DIR / "dashboard" / "index.html"
    if not page.is_file():
        raise RuntimeError(f"the dashboard's files are missing from the package ({page}); reinstall mlx-lane "
                           "or start it with --no-dashboard")

    async def dashboard_page():
        return FileResponse(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    app.add_api_route("/", dashboard_page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard", dashboard_page, methods=["GET"], include_in_schema=False)
    app.mount("/dashboard/assets", StaticFiles(directory=STATIC_DIR), name="dashboard-assets")
