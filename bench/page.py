"""The page's panels (not a test): how long after a click they appear, on a trained run.

    make demo && python bench/page.py              # runs/demo, 128-token prompts
    python bench/page.py --run RUN --tokens 64 --repeats 5

Starts `tlm serve RUN` on a loopback port and drives Debian's Chromium (headless, 1280x800)
through Selenium, as a user would: types a prompt of --tokens tokens (<|endoftext|> and
the first --tokens - 1 tokens of the run's validation text), clicks "Inspect the prompt"
and reads how long the page took from the click to the four attention panels drawn (the
page writes it to `#attention-section[data-ms]`: tokenizing, the /v1/attention request for
one layer and head, building its three grids and the contributions); then clicks the prompt's
last token and reads the same for the distribution panel (`#dist-section[data-ms]`: the
/v1/distribution request and its 20 rows). Each is repeated, alternating layers; the
first click's time (on a page just loaded), the median and the worst are printed (later
clicks share the machine with the previous click's explorer), with the sizes of the
answers and of the page. The goal (issue 28): both within 1 s of the click on the CI
machine.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

from _peers import host

from tlm.data.tokens import TokenData
from tlm.load import load_tokenizer


def serve(run: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tlm", "serve", run, "--port", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"tlm serve {run} did not start")


def post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(url, data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,800"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def timed(driver, click, section: str) -> float:
    """Milliseconds from the click to the panel, as the page measured them."""
    driver.execute_script(f"delete document.getElementById('{section}').dataset.ms")
    click()
    deadline = time.monotonic() + 30
    while (ms := driver.find_element("id", section).get_attribute("data-ms")) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"no {section} after 30 s: {driver.find_element('id', 'error').text}")
        time.sleep(0.01)
    return float(ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", default="runs/demo")
    parser.add_argument("--data", default="data/demo", help="the run's prepared data")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.run)
    val = TokenData(args.data).split("val")
    prompt = tokenizer.decode([int(t) for t in val[: args.tokens - 1]])
    print(f"host: {host()}")
    proc, url = serve(args.run)
    driver = browser()
    try:
        ids = json.loads(post(url + "/tokenize", {"prompt": prompt}))["tokens"]
        while len(ids) > args.tokens:  # decoding and encoding again can merge differently
            prompt = prompt[:-1]
            ids = json.loads(post(url + "/tokenize", {"prompt": prompt}))["tokens"]
        sizes = {
            "page": len(urllib.request.urlopen(url + "/").read()),
            "/v1/attention": len(post(url + "/v1/attention", {"prompt": prompt})),
            "/v1/distribution": len(post(url + "/v1/distribution", {"prompt": ids})),
        }
        driver.get(url + "/")
        box = driver.find_element("id", "prompt")
        box.clear()
        box.send_keys(prompt)
        layers = len(driver.find_element("id", "layer").find_elements("tag name", "option"))
        attention, dist = [], []
        for r in range(args.repeats):
            driver.execute_script(f"document.getElementById('layer').value = '{r % layers}'")
            inspect = driver.find_element("id", "inspect")
            attention.append(timed(driver, inspect.click, "attention-section"))
            last = driver.find_element("css selector", f".token[data-index='{len(ids) - 1}']")
            dist.append(timed(driver, last.click, "dist-section"))
    finally:
        driver.quit()
        proc.terminate()
        proc.wait(timeout=10)
    print(f"run {args.run}, a prompt of {len(ids)} tokens, {args.repeats} clicks each:")
    for name, times in (("attention panels", attention), ("distribution panel", dist)):
        print(
            f"  {name:18s} first {times[0]:5.0f} ms, median {statistics.median(times):5.0f} ms,"
            f" worst {max(times):5.0f} ms"
        )
    print("  sizes: " + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in sizes.items()))


if __name__ == "__main__":
    main()
