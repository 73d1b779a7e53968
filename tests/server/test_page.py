"""The chat page at / driven in a real headless browser (Debian's chromium and chromium-driver, through
selenium) against live servers over smollm2-135m: a streamed VIA-SD answer, its speed line and its
tokens coloured by who settled them, checked against what the server said; and a server with an API key."""

from __future__ import annotations

import json
import re
import shutil

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("selenium", reason="selenium is not installed (pip install 'viasd[test]')")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402
from viasd.server import ServeSettings, create_app  # noqa: E402
from live_server import LiveServer  # noqa: E402
from helpers import MODEL  # noqa: E402

SOURCES = ("grammar", "draft", "slim", "full")
TITLES = {"grammar": "grammar-forced", "draft": "accepted draft", "slim": "slim verifier", "full": "full model"}
KEY = "page-test-key"
QUESTION = "Write a Python function that adds two numbers."


def _chromium() -> tuple[str, str] | None:
    """(browser, driver) of the system's Chromium, or None."""
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (the tests name it before their server, so that they skip before loading a model)."""
    found = _chromium()
    if found is None:
        pytest.skip("chromium and chromedriver are not installed (Debian: apt-get install chromium chromium-driver; "
                    "`make test` installs them when run as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(found[1]), options=options)  # a given driver: nothing downloaded
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, condition, what: str, limit: float = 120):
    return WebDriverWait(driver, limit, poll_frequency=0.05).until(lambda d: condition(d), message=f"waited for {what}")


def open_page(driver, url: str, ready: bool = True) -> None:
    driver.get(url + "/")
    if ready:  # /v1/models answered: the model's name in the header
        wait(driver, lambda d: d.find_element(By.ID, "model").text == MODEL, "the page to load /v1/models")


def ask(driver, question: str, **settings) -> None:
    for name, value in settings.items():
        el = driver.find_element(By.ID, name.replace("_", "-"))
        if el.tag_name == "select":
            Select(el).select_by_value(value)
        else:
            el.clear()
            el.send_keys(str(value))
    driver.find_element(By.ID, "prompt").send_keys(question)
    driver.find_element(By.ID, "send").click()


def answer(driver):
    """The last answer, once finished."""
    return wait(driver, lambda d: next((a for a in d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1:]
                                        if a.get_attribute("data-finish")), False), "the answer to finish")


def spans(el) -> list[tuple[str, str, str]]:
    """(class, title, text) of the answer's token spans, read in one script call."""
    return [tuple(x) for x in el.parent.execute_script(
        "return [...arguments[0].querySelectorAll('.body .tok')].map(s => [s.className, s.title, s.textContent])", el)]


@pytest.mark.model
def test_page_streams_a_viasd_answer_with_every_token_coloured_by_its_source(browser, live):
    r = httpx.get(live.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    for path in re.findall(r'(?:src|href)="(/static/[^"]+)"', r.text):
        assert httpx.get(live.url + path).status_code == 200, path
    info = httpx.get(live.url + "/v1/models").json()["data"][0]["viasd"]

    open_page(browser, live.url)
    offered = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#strategy option")]
    assert offered == info["strategies"]
    drafts = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#draft option")]
    assert "pld" in drafts and "self" in drafts and ("model" in drafts) == (info["drafter"] is not None)
    ask(browser, QUESTION, strategy="viasd", draft="pld", mode="lossless", temperature=0, max_tokens=24)
    a = answer(browser)

    assert int(a.get_attribute("data-chunks")) > 1  # the text came in several events, read as they came
    stats = json.loads(a.get_attribute("data-stats"))
    sources = json.loads(a.get_attribute("data-sources"))
    assert sources == stats["sources"] and set(sources) <= set(SOURCES)
    speed = a.find_element(By.CSS_SELECTOR, ".meta .speed").text
    line = r"first token \d+\.\d\d s · \d+\.\d tokens/s · \d+\.\d\d tokens per full-model pass · \d+ tokens"
    assert re.fullmatch(line, speed), speed
    assert a.find_element(By.CSS_SELECTOR, ".meta").text.startswith("viasd · pld · lossless")

    tokens = spans(a)
    counts = {s: sum(f"tok-{s}" in cls.split() for cls, _, _ in tokens) for s in SOURCES}
    assert counts == {s: sources.get(s, 0) for s in SOURCES}, (counts, sources)
    assert sum(counts.values()) == len(tokens) == stats["new_tokens"]
    assert counts["full"] >= 1  # lossless VIA-SD: every round ends with the full model's token
    for cls, title, _ in tokens:
        by = next(s for s in SOURCES if f"tok-{s}" in cls.split())
        assert title.startswith(TITLES[by])
    # the same question answered by the server without the page: greedy and lossless, the same text
    r = httpx.post(live.url + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 0,
        "viasd": {"strategy": "viasd", "draft": "pld", "mode": "lossless"}})
    text = r.json()["choices"][0]["message"]["content"]
    assert "".join(t for _, _, t in tokens) == text

    html = browser.execute_script("return markdown(arguments[0])",  # what the page makes of hostile Markdown
                                  "<img src=x onerror=alert(1)><script>alert(2)</script> [a](javascript:alert(3)) [b](https://x.org)")
    assert "onerror" not in html and "<script" not in html and "javascript:" not in html
    assert 'href="https://x.org"' in html and 'rel="noopener noreferrer"' in html

    browser.find_element(By.ID, "colour-toggle").click()  # off: the answer as rendered Markdown
    assert not a.find_elements(By.CSS_SELECTOR, ".tok")
    assert a.find_element(By.CSS_SELECTOR, ".body").find_elements(By.XPATH, "./*")  # HTML elements, not a text node
    browser.find_element(By.ID, "colour-toggle").click()  # on again
    assert len(a.find_elements(By.CSS_SELECTOR, ".body .tok")) == len(tokens)


@pytest.fixture(scope="module")
def live_with_key(smollm2):
    app = create_app(smollm2, settings=ServeSettings(defaults={"strategy": "pld", "max_new_tokens": 8}, served_name=MODEL,
                                                     api_key=KEY))
    with LiveServer(app) as server:
        yield server


@pytest.mark.model
def test_page_with_an_api_key_asks_for_it_once_and_then_answers(browser, live_with_key):
    url = live_with_key.url
    assert httpx.get(url + "/").status_code == 200 and httpx.get(url + "/static/app.js").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401

    open_page(browser, url, ready=False)
    notice, form = browser.find_element(By.ID, "notice"), browser.find_element(By.ID, "key-form")
    wait(browser, lambda d: notice.is_displayed() and "401" in notice.text, "the error of /v1/models without the key")
    assert form.is_displayed()
    ask(browser, "Say hello.")  # without the key: an error, no answer, the message kept for sending again
    wait(browser, lambda d: not d.find_element(By.ID, "send").get_attribute("disabled"), "the request to fail")
    assert "401" in notice.text and notice.is_displayed()
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg")
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "Say hello."

    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.ID, "key-save").click()
    wait(browser, lambda d: d.find_element(By.ID, "model").text == MODEL, "/v1/models with the key")
    assert not form.is_displayed() and not notice.is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('viasd-api-key')") == KEY
    browser.find_element(By.ID, "send").click()
    a = answer(browser)
    assert a.find_element(By.CSS_SELECTOR, ".body").text.strip()
    assert json.loads(a.get_attribute("data-stats"))["new_tokens"] >= 1
    assert not notice.is_displayed() and not form.is_displayed()
