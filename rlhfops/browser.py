"""The browser the UIs are checked and pictured in: Debian's chromium driven by Playwright (whose own browser is never
fetched), and what a person does first on MLflow's and Label Studio's pages. The browser tests (tests/test_mlflow_ui.py,
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


def label_studio_page(playwright, chromium: str, url: str, user: str, password: str, timeout_ms: int):
    """A new headless browser's page logged in to Label Studio at `url`: (browser, page)."""
    browser = launch_chromium(playwright, chromium)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(timeout_ms)
    page.goto(f"{url}/user/login/")
    page.fill("input[name=email]", user)
    page.fill("input[name=password]", password)
    page.locator("button[type=submit]").first.click()
    page.wait_for_load_state("networkidle")
    return browser, page


def label_next(page, choice: str | None, comment: str = "") -> None:
    """Label the pair on screen by clicking `choice` ("A is better", ...; None: Label Studio's Skip button)."""
    page.get_by_text("Which answer is better?").wait_for()
    if choice is None:
        page.get_by_test_id("bottombar-skip-button").click()
    else:
        page.locator("label", has_text=choice).first.click()
        if comment:
            page.get_by_placeholder("Comment (optional)").fill(comment)
            page.get_by_placeholder("Comment (optional)").press("Enter")
        page.get_by_test_id("bottombar-submit-button").click()
    page.wait_for_timeout(2000)  # the next pair loads


def fold_label_studio_side_column(page) -> None:
    """Fold the right column of Label Studio's labeling page (its region panels, which a choice between two answers
    leaves empty) as its `>` button does; Label Studio keeps it folded in this browser."""
    from playwright.sync_api import expect

    collapse = page.locator('[data-tooltip="Collapse Group"]')
    if collapse.count():
        collapse.first.click()
    expect(page.get_by_text("Labeled regions will appear here")).to_be_hidden()
