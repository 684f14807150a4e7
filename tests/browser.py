"""Open a report in a real headless Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright)
and say what a reader would see: errors, images, headings; a full-page screenshot on the side.

Never downloads a browser: ``require_browser()`` skips the calling test when Chromium or
Playwright is missing, or fails it where ``TANDEM_REQUIRE_BROWSER=1`` (CI) says it must run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 20_000  # every launch, navigation, wait and screenshot


def require_browser() -> None:
    """Skip (or, with TANDEM_REQUIRE_BROWSER=1, fail) when Chromium or Playwright is not here."""
    missing = []
    if not CHROMIUM.is_file():
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("playwright for Python (pip install -e '.[dev]')")
    if missing:
        reason = "no browser to open the report: " + ", ".join(missing)
        if os.environ.get("TANDEM_REQUIRE_BROWSER") == "1":
            pytest.fail(reason + " (TANDEM_REQUIRE_BROWSER=1)")
        pytest.skip(reason)


def open_report(html_path: str | Path, screenshot_path: str | Path, timeout_ms: int = TIMEOUT_MS) -> dict:
    """Load ``html_path`` from disk, wait for its images, screenshot the full page to ``screenshot_path``.

    Returns ``errors`` (console errors and uncaught page errors, as text), ``images`` (one dict per
    ``<img>``: ``id``, ``alt``, ``width`` and ``height``, the natural size, 0 for an image that did not
    load), ``headings`` (the text of each ``h1``/``h2``, in order) and ``requests`` (every URL the page
    asked for beyond its own file and data: URIs; a self-contained page asks for none)."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    requests: list[str] = []
    url = Path(html_path).resolve().as_uri()
    Path(screenshot_path).parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, timeout=timeout_ms)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(timeout_ms)
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.on("request", lambda r: None if r.url.startswith("data:") or r.url == url else requests.append(r.url))
            page.goto(url, wait_until="load", timeout=timeout_ms)
            page.wait_for_function("Array.from(document.images).every(i => i.complete)", timeout=timeout_ms)
            images = page.eval_on_selector_all(
                "img", "els => els.map(e => ({id: e.id, alt: e.alt, width: e.naturalWidth, height: e.naturalHeight}))"
            )
            headings = page.eval_on_selector_all("h1, h2", "els => els.map(e => e.textContent.trim())")
            page.screenshot(path=str(screenshot_path), full_page=True, timeout=timeout_ms)
        finally:
            browser.close()
    return {"errors": errors, "images": images, "headings": headings, "requests": requests}
