"""The browser the UIs are checked and pictured in: Debian's chromium driven by Playwright (whose own browser is never
fetched), and what a person does first on MLflow's pages. The browser tests (tests/test_mlflow_ui.py,
test_prefect_server.py, test_feedback_browser.py) and `make docs-images` (flows/docs_images.py) share it.
"""

from __future__ import annotations

import shutil

# A light door: playwright is imported inside the functions that drive a page.

BROWSER_ARGS = ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"]
MISSING_CHROMIUM = (
    "Debian's chromium is not installed: `make browser` (as root) installs it "
    "(apt-get install -y --no-install-recommends chromium)"
)


def chromium_path() -> str | None:
    """Where Debian's chromium is, or None."""
    return shutil.which("chromium")


def launch_chromium(playwright, chromium: str):
    """A headless Chromium browser (Playwright's `Browser`)."""
    return playwright.chromium.launch(executable_path=chromium, headless=True, args=BROWSER_ARGS)


def close_mlflow_assistant(page) -> None:
    """The MLflow Assistant side panel (open by default) hides half the runs table."""
    close = page.get_by_role("button", name="Close", exact=True)
    if close.count() == 1 and close.is_visible():
        close.click()


def expand_mlflow_run(page, run_link, child_names) -> None:
    """Show the child runs `child_names` of the run whose name link is `run_link` on a runs page: its row's expand
    button, unless the UI kept them shown (it remembers an expanded row), then each child's link visible."""
    from playwright.sync_api import expect

    first_child = page.get_by_role("link", name=child_names[0], exact=True)
    if not first_child.first.is_visible():
        row = page.get_by_role("row").filter(has=run_link)
        row.locator("button[data-component-id*=runnamecellrenderer]").click()
    for name in child_names:
        expect(page.get_by_role("link", name=name, exact=True).first).to_be_visible()
