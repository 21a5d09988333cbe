"""The chat page in a real headless browser (Debian's chromium + chromedriver, installed by .ci/install_tests.sh):
sign up, chat and see the provenance, list memories and delete one. Skips, saying why, without them."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from persrag_lightning.serving.app import create_app
from tests.helpers.serve_helpers import ThreadServer, open_service
from tests.serving.test_serving import run_dir  # noqa: F401  (the tiny exported run, module-scoped)

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]


@pytest.fixture()
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    if not CHROMIUM or not DRIVER:
        pytest.skip("chromium / chromedriver not installed (apt-get install -y chromium chromium-driver, "
                    "as .ci/install_tests.sh does with root)")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="persrag-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_chat_page_sign_up_chat_provenance_and_memory_delete(browser, run_dir, tiny_bert, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    service = open_service(run_dir, tmp_path / "state", tiny_bert)
    wait = WebDriverWait(browser, 60)
    with ThreadServer(create_app(service)) as server:
        browser.get(server.url + "/")
        browser.find_element(By.ID, "signup-user").send_keys("web-ada")
        browser.find_element(By.ID, "q-goals").send_keys("I want to learn Rust this year.")
        browser.find_element(By.ID, "signup-button").click()
        wait.until(ec.visibility_of_element_located((By.ID, "chat")))
        assert "token" in browser.find_element(By.ID, "status").text
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#memory-list li")) == 1)

        browser.find_element(By.ID, "message").send_keys("My dog is called Biscuit.")
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".assistant"))
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#memory-list li")) == 2)
        browser.find_element(By.ID, "message").send_keys("What is my dog called?")
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant")) == 2)
        provenance = browser.find_elements(By.CSS_SELECTOR, "[data-testid=provenance]")[-1]
        assert "Biscuit" in provenance.text  # the recalled memory is shown with the answer
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#memory-list li")) == 3)

        items = browser.find_elements(By.CSS_SELECTOR, "#memory-list li")
        biscuit = next(li for li in items if "Biscuit" in li.text)
        biscuit.find_element(By.CSS_SELECTOR, ".delete-memory").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#memory-list li")) == 2)
        assert not any("Biscuit" in li.text for li in browser.find_elements(By.CSS_SELECTOR, "#memory-list li"))
    assert not any("Biscuit" in m.text for m in service.bank.list("web-ada"))
