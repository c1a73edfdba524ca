"""The chat page at GET /, against a real `blockserve serve` (with an API key), in headless Chromium.

The browser test needs Debian's `chromium` and `chromium-driver` (`make install-browser`; `.ci/run`
does it) and skips, saying so, only when they are absent. It saves a screenshot of the page
mid-conversation to test-artifacts/ (or $BLOCKSERVE_TEST_ARTIFACTS).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.server.test_openai_server import metrics, wait_idle
from tests.server_process import ServerProcess

pytestmark = pytest.mark.slow  # a `blockserve serve` process

KEY = "page-key"
CLI_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--max-num-seqs", "4", "--num-threads", "1",
            "--api-key", KEY]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
ARTIFACTS = Path(os.environ.get("BLOCKSERVE_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts"))
needs_browser = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="headless Chromium is not installed: run `make install-browser` (Debian's chromium and chromium-driver)")


@pytest.fixture(scope="module")
def server():
    with ServerProcess(CLI_ARGS) as proc:
        yield proc


def test_page_is_served_self_contained_without_a_key(server):
    status, page = server.request("GET", "/")
    assert status == 200 and isinstance(page, str) and "<title>blockserve chat</title>" in page
    for needed in ('id="api-key"', 'id="temperature"', 'id="top-p"', 'id="max-tokens"', 'id="stop"',
                   "/v1/chat/completions", "include_usage", "cached_tokens", "/v1/models", "AbortController"):
        assert needed in page
    assert "http://" not in page and "https://" not in page and "<script src" not in page  # nothing from outside
    assert server.request("GET", "/v1/models")[0] == 401  # the API itself still needs the key


def _wait(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1100,800"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.browser
@needs_browser
def test_chat_streams_stops_and_shows_the_cache_hit(server, browser):
    from selenium.webdriver.common.by import By

    def element(element_id: str):
        return browser.find_element(By.ID, element_id)

    def replies():
        return browser.find_elements(By.CSS_SELECTOR, ".message.assistant")

    def set_value(element_id: str, value: str) -> None:
        element(element_id).clear()
        element(element_id).send_keys(value)

    browser.get(server.base_url + "/")
    assert element("model-name").text != "SmolLM2-135M-Instruct"  # no key yet: /v1/models said 401
    element("api-key").send_keys(KEY)
    element("temperature").click()  # the key field's change event loads the model name
    _wait(lambda: element("model-name").text == "SmolLM2-135M-Instruct", 10, "the model name")
    set_value("temperature", "0")
    set_value("max-tokens", "600")
    aborted_before = metrics(server).get("blockserve_request_finished_total{finished_reason=abort}", 0)

    # A long reply: it streams in growing pieces, then Stop cancels it mid-reply.
    element("prompt").send_keys("Count from 1 to 300, one number per line.")
    element("send").click()
    lengths = []
    _wait(lambda: lengths.append(len(replies()[-1].text)) or len(set(n for n in lengths if n)) >= 3, 90,
          "the reply to grow over several chunks")
    assert element("send").get_attribute("disabled") and not element("stop").get_attribute("disabled")
    running = metrics(server)
    assert running["blockserve_num_requests_running"] == 1 and running["blockserve_kv_cache_usage_ratio{group=0}"] > 0
    element("stop").click()
    _wait(lambda: replies()[-1].get_attribute("data-state") == "stopped", 10, "the reply to show it stopped")
    idle = wait_idle(server)
    assert idle["blockserve_num_requests_running"] == 0 and idle["blockserve_kv_cache_usage_ratio{group=0}"] == 0
    assert idle["blockserve_request_finished_total{finished_reason=abort}"] == aborted_before + 1
    stopped_text = replies()[-1].text
    assert "(stopped)" in stopped_text and element("stop").get_attribute("disabled")  # idle again

    # The next turn carries the conversation; its prompt starts with the first one's, so the
    # status line reports a prefix-cache hit from the usage chunk.
    set_value("max-tokens", "8")
    element("prompt").send_keys("Thanks. Now say hello.")
    element("send").click()
    _wait(lambda: len(replies()) == 2 and replies()[-1].get_attribute("data-state") == "done", 60,
          "the second reply to finish")
    hit = element("cache-hit").text
    cached, prompt = (int(word) for word in hit.replace("prefix cache:", "").replace("prompt tokens", "").split(" of "))
    assert 0 < cached < prompt, hit
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "chat-page.png"))
    errors = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"
              and not ("/v1/models" in entry["message"] and "status of 401" in entry["message"])]  # before the key
    assert not errors, errors  # a blocked outside resource (CSP) or a script error would be here
