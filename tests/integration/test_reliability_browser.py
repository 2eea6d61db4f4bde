"""The chat page in headless Chromium with both --api-key and --allowed-origins set (issue 8,
item 6): opened as http://host:port/?api_key=KEY it streams an answer; from an origin
not on the list its WebSocket is refused (HTTP 403); without the key the page is 401.
Skipped without Debian's /usr/bin/chromium, like test_browser_chat.py."""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from service.config import ServerConfig

from tests.integration.reliability_support import wait_idle, wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
WAIT_MS = 120_000  # generous: the CPU model shares this machine with other work
KEY = "chat-page-key_1"

pytestmark = [
    pytest.mark.model,
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium"),
]


def _free_port() -> int:
    """A port to name in --allowed-origins before the server listens on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def page() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                           args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            page.set_default_timeout(WAIT_MS)
            yield page
        finally:
            await browser.close()


async def test_chat_page_works_with_api_key_and_allowed_origins(make_server, page):
    from playwright.async_api import expect

    port = _free_port()
    engine, server = await make_server(ServerConfig(
        port=port, api_key=KEY, allowed_origins=(f"http://127.0.0.1:{port}",)))
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    # without the key: the page itself is refused
    response = await page.goto(f"http://127.0.0.1:{port}/")
    assert response is not None and response.status == 401
    assert "api_key" in await page.content()

    # with the key in the page's URL: the socket carries it over, the origin is listed
    await page.goto(f"http://127.0.0.1:{port}/?api_key={KEY}")
    await expect(page.locator("#model")).to_contain_text("SmolLM2-135M-Instruct")
    await page.get_by_label("Max tokens").fill("16")
    await page.get_by_label("Temperature").fill("0")
    await page.get_by_role("textbox", name="Message").fill("What is the capital of France?")
    await page.get_by_role("button", name="Send").click()
    answer = page.locator('[role="log"] .msg.assistant').last
    await expect(answer).to_have_attribute("data-state", re.compile("^(done|error)$"))
    assert await answer.get_attribute("data-state") == "done"
    assert "Paris" in (await answer.locator(".text").text_content() or "")
    await wait_idle(engine)

    # the same page from another origin (localhost is not listed): the WebSocket gets 403
    with structlog.testing.capture_logs() as logs:
        await page.goto(f"http://localhost:{port}/?api_key={KEY}")
        await wait_until(lambda: any(e["event"] == "request_refused" and e["status"] == 403
                                     for e in logs), WAIT_MS / 1000, "the refused socket")
    refused = [e for e in logs if e["event"] == "request_refused"]
    assert refused[0]["origin"] == f"http://localhost:{port}"
    assert refused[0]["route"] == "/v1/stream" and KEY not in repr(logs)
    assert errors == []
