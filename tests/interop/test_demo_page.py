"""The demo page at GET /, end to end in a real headless browser (Debian chromium via Playwright).

A person uploads a Fashion-MNIST image and sees its label, the score bars and the attention overlay;
draws on the canvas and gets a prediction; sends a file that is not an image and reads why in words;
and, on a service with an API key, is asked for it. Screenshots go to test-artifacts/ (gitignored).

Skipped only where /usr/bin/chromium is absent and CI is unset; in CI it runs (and fails without it).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from export.data import FASHION_MNIST_LABELS
from tests.support import INTEROP, MODEL_NAME, REPO, encode, running_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = REPO / "test-artifacts"
TIMEOUT_MS = 20_000

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists() and not os.environ.get("CI"),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium); runs in CI",
)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        yield launched
        launched.close()


@pytest.fixture
def page(browser, server):
    """A fresh page on the served demo; fails the test on any uncaught script error or any request
    to another origin (the page must load nothing from a CDN)."""
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    opened = context.new_page()
    opened.set_default_timeout(TIMEOUT_MS)
    script_errors: list[str] = []
    foreign: list[str] = []
    opened.on("pageerror", lambda error: script_errors.append(str(error)))
    opened.on(
        "request",
        lambda request: (
            None
            if request.url.startswith((server.url, "blob:", "data:"))
            else foreign.append(request.url)
        ),
    )
    yield opened
    context.close()
    assert not script_errors, script_errors
    assert not foreign, f"the page fetched from elsewhere: {foreign}"


@contextmanager
def opened_page(browser, url: str) -> Iterator[object]:
    """A page of its own browser context at ``url``, for a test that runs its own server; the
    context is closed when the test leaves it, failed or not."""
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    try:
        page.goto(url)
        yield page
    finally:
        context.close()


def predict_upload(http: httpx.Client, files: list[bytes]) -> list[dict]:
    """/predict as the page calls it: multipart parts named 'files', invert auto."""
    parts = [("files", (f"{i}.png", data, "image/png")) for i, data in enumerate(files)]
    response = http.post("/predict", files=parts, data={"top_k": "5", "invert": "auto"})
    assert response.status_code == 200, response.text
    return response.json()["predictions"]


@pytest.fixture(scope="module")
def correct_image(http, fashion_test_set, reference, tmp_path_factory) -> tuple[Path, str]:
    """A Fashion-MNIST test image, rendered to PNG, that the model file classifies correctly when
    run here with onnxruntime (a trouser when one is, else the first correct one); its label. What
    the page shows is checked against this outside reference and the dataset's label, never
    against the served /predict."""
    images, labels = fashion_test_set
    names = http.get("/models").json()["models"][0]["labels"]
    assert names == list(FASHION_MNIST_LABELS)
    chosen = reference.probabilities(images).argmax(axis=1)
    correct = [int(label) for label, best in zip(labels, chosen, strict=True) if label == best]
    assert correct, "the model classifies none of 200 test images correctly"
    label = names.index("Trouser") if names.index("Trouser") in correct else correct[0]
    index = next(i for i, (t, b) in enumerate(zip(labels, chosen, strict=True)) if t == b == label)
    path = tmp_path_factory.mktemp("demo") / f"{names[label].replace('/', '-')}.png"
    path.write_bytes(encode(images[index]))
    return path, names[label]


def overlay_loaded(page) -> None:
    page.wait_for_function(
        "() => { const img = document.getElementById('overlay');"
        " return !img.hidden && img.complete && img.naturalWidth > 0; }"
    )


def test_upload_shows_label_scores_and_overlay(page, server, correct_image):
    image, label = correct_image
    page.goto(f"{server.url}/")
    page.wait_for_function(
        f"() => document.getElementById('model-info').textContent.includes('{MODEL_NAME}')"
    )
    page.set_input_files("#file-input", str(image))
    page.wait_for_function(
        "(label) => document.getElementById('prediction-label').textContent === label", arg=label
    )
    rows = page.locator("#scores li")
    assert rows.count() == 5
    assert rows.nth(0).locator(".label").inner_text() == label
    widths = [
        float(rows.nth(i).locator(".fill").evaluate("e => e.style.width").rstrip("%"))
        for i in range(5)
    ]
    assert widths == sorted(widths, reverse=True) and widths[0] > 0
    overlay_loaded(page)
    size = page.eval_on_selector("#overlay", "img => [img.naturalWidth, img.naturalHeight]")
    assert min(size) >= 224, f"the overlay is {size}: not upscaled for a person to see"
    assert page.locator("#error").is_hidden()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo-upload.png"), full_page=True)


def test_drawing_gets_the_prediction_of_the_drawn_image(page, server, http):
    page.goto(f"{server.url}/")
    box = page.locator("#canvas").bounding_box()
    assert box is not None
    # Two legs and a waistband, in white on the black canvas.
    strokes = [
        [(0.35, 0.15), (0.65, 0.15)],
        [(0.37, 0.15), (0.33, 0.9)],
        [(0.63, 0.15), (0.67, 0.9)],
    ]
    for stroke in strokes:
        (x0, y0), (x1, y1) = stroke
        page.mouse.move(box["x"] + x0 * box["width"], box["y"] + y0 * box["height"])
        page.mouse.down()
        page.mouse.move(box["x"] + x1 * box["width"], box["y"] + y1 * box["height"], steps=12)
        page.mouse.up()
    drawn = page.eval_on_selector("#canvas", "c => c.toDataURL('image/png')")
    pixels = base64.b64decode(drawn.split(",", 1)[1])
    expected = predict_upload(http, [pixels])[0]["label"]
    page.click("#classify-drawing")
    page.wait_for_function(
        "(label) => document.getElementById('prediction-label').textContent === label",
        arg=expected,
    )
    overlay_loaded(page)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo-drawing.png"), full_page=True)


def test_an_api_error_is_shown_in_words(page, server, tmp_path):
    not_an_image = tmp_path / "notes.txt"
    not_an_image.write_text("these are notes, not a picture\n")
    page.goto(f"{server.url}/")
    page.set_input_files("#file-input", str(not_an_image))
    error = page.locator("#error")
    error.wait_for(state="visible")
    assert "not a recognisable image" in error.inner_text()
    assert page.inner_text("#prediction-label") == ""
    assert page.locator("#scores li").count() == 0
    page.locator("#preview").wait_for(state="hidden")  # no broken-image preview of a text file
    assert page.locator("#overlay").is_hidden()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo-error.png"), full_page=True)


def test_the_page_asks_for_the_api_key(browser, model_repository, tmp_path, correct_image):
    image, label = correct_image
    with (
        running_server(
            model_repository, tmp_path / "service.log", suite=INTEROP, api_key="demo-key"
        ) as keyed,
        opened_page(browser, f"{keyed.url}/") as page,
    ):
        page.wait_for_function(
            "() => document.getElementById('model-info').textContent.includes('API key')"
        )
        page.set_input_files("#file-input", str(image))
        error = page.locator("#error")
        error.wait_for(state="visible")
        assert "Enter the service's API key" in error.inner_text()

        page.fill("#api-key", "wrong")
        page.dispatch_event("#api-key", "change")
        page.set_input_files("#file-input", str(image))
        page.wait_for_function(
            "() => document.getElementById('error').textContent.includes('not valid')"
        )

        page.fill("#api-key", "demo-key")
        page.dispatch_event("#api-key", "change")
        page.wait_for_function(
            f"() => document.getElementById('model-info').textContent.includes('{MODEL_NAME}')"
        )
        page.set_input_files("#file-input", str(image))
        page.wait_for_function(
            "(label) => document.getElementById('prediction-label').textContent === label",
            arg=label,
        )
        overlay_loaded(page)
        assert page.locator("#error").is_hidden()


def test_page_and_assets_are_served_from_the_package(http):
    """GET / and its two assets come from service/frontend/static, with a policy that allows no other origin."""
    index = http.get("/")
    assert index.status_code == 200
    assert index.headers["content-type"].startswith("text/html")
    policy = index.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy
    static = REPO / "service" / "frontend" / "static"
    for path, kind in (("/static/demo.js", "text/javascript"), ("/static/demo.css", "text/css")):
        asset = http.get(path)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert asset.content == (static / path.rsplit("/", 1)[1]).read_bytes()
    assert "http://" not in index.text.replace(f"{http.base_url}", "")
    assert "https://" not in index.text
    assert http.get("/static/other.js").status_code == 404


def test_the_person_picks_the_model(browser, model_repository, tmp_path, correct_image):
    """Two models, the second without an attention graph: the page lists both (the default first),
    sends the image to the chosen one, and says that the second has no overlay."""
    import shutil

    repository = tmp_path / "models"
    shutil.copytree(model_repository, repository)
    shutil.copytree(repository / MODEL_NAME, repository / "plain")
    (repository / "plain" / "1" / "attention.onnx").unlink()
    image, label = correct_image
    log = tmp_path / "service.log"
    with running_server(repository, log, suite=INTEROP) as two_models:
        with opened_page(browser, f"{two_models.url}/") as page:
            page.wait_for_function("() => document.getElementById('model').options.length === 2")
            options = page.eval_on_selector_all("#model option", "all => all.map(o => o.value)")
            assert options == ["plain", MODEL_NAME] or options == [MODEL_NAME, "plain"]
            assert page.eval_on_selector("#model", "s => s.value") == MODEL_NAME  # the default
            page.select_option("#model", "plain")
            page.wait_for_function(
                "() => document.getElementById('model-info').textContent.includes('No attention graph')"
            )
            page.set_input_files("#file-input", str(image))
            page.wait_for_function(
                "() => document.getElementById('status').textContent.includes('plain version 1')"
            )
            assert page.locator("#prediction-label").inner_text() == label
            assert "no attention graph" in page.locator("#error").inner_text()
            assert page.locator("#overlay").is_hidden()
        metrics = httpx.get(f"{two_models.url}/metrics").text
    assert 'vitserve_batch_size_count{graph="classifier",model="plain"} 1.0' in metrics
    # every batcher's series exist from the start, at 0: the model not picked ran no batch
    assert f'vitserve_batch_size_count{{graph="classifier",model="{MODEL_NAME}"}} 0.0' in metrics


def trying_repository(model_repository: Path, tmp_path: Path, **parameters: str) -> Path:
    """A copy of the repository whose model tries version 2 (the same files as version 1) with
    ``parameters`` (vitserve's, without the prefix) in its config.pbtxt."""
    import shutil

    from service.contract.model_config import read_model_config, write_model_config

    repository = tmp_path / "models"
    shutil.copytree(model_repository, repository)
    shutil.copytree(repository / MODEL_NAME / "1", repository / MODEL_NAME / "2")
    config = read_model_config(repository / MODEL_NAME / "config.pbtxt")
    config.version_policy.specific.versions[:] = [1, 2]
    for key, value in {"candidate_version": "2", **parameters}.items():
        config.parameters[f"vitserve_{key}"].string_value = value
    write_model_config(config, repository / MODEL_NAME / "config.pbtxt")
    return repository


def test_the_page_shows_a_candidates_comparison(browser, model_repository, tmp_path, correct_image):
    """A model trying version 2 (the same files as version 1, so onnxruntime gives both the same
    answer: agreement 100%) in the shadow of every request: after one upload the page says so."""
    repository = trying_repository(model_repository, tmp_path, shadow_percent="100")
    image, label = correct_image
    with (
        running_server(repository, tmp_path / "service.log", suite=INTEROP) as trying,
        opened_page(browser, f"{trying.url}/") as page,
    ):
        page.wait_for_function(
            "() => document.getElementById('shadow').textContent.includes('no request compared')"
        )
        page.set_input_files("#file-input", str(image))
        page.wait_for_function(
            "() => document.getElementById('shadow').textContent.includes('requests compared: 1,')"
        )
        shown = page.locator("#shadow").inner_text()
        assert page.locator("#prediction-label").inner_text() == label
        assert "version 1 says" in page.locator("#status").inner_text()  # live answered
    assert shown.startswith("Candidate version 2 against live version 1 (shadow 100%, canary 0%)")
    assert "top-1 agreement 100.0%" in shown and "0 shed" in shown


def test_the_page_names_the_canarys_answer_and_follows_the_models_polarity(
    browser, model_repository, tmp_path, correct_image
):
    """With the candidate answering every unversioned request (canary 100%), the answer is named
    as the candidate's, beside the live version the header describes; a model trained on natural
    photos gets no polarity control and a drawing hint of its own."""
    import shutil

    from tests.service.test_shadow import retag

    repository = trying_repository(
        model_repository, tmp_path, live_version="1", canary_percent="100"
    )
    shutil.copytree(repository / MODEL_NAME / "1", repository / "photos" / "1")
    for graph in ("model.onnx", "attention.onnx"):
        retag(repository / "photos" / "1" / graph, preprocessing={"polarity": "natural"})
    image, _ = correct_image
    with (
        running_server(repository, tmp_path / "service.log", suite=INTEROP) as trying,
        opened_page(browser, f"{trying.url}/") as page,
    ):
        page.wait_for_function("() => document.getElementById('shadow').textContent !== ''")
        assert f"{MODEL_NAME} version 1" in page.locator("#model-info").inner_text()
        assert "White strokes on black" in page.locator("#drawing-hint").inner_text()
        assert page.locator("#polarity-row").is_visible()
        page.set_input_files("#file-input", str(image))
        page.wait_for_function(
            "() => document.getElementById('status').textContent.includes('says')"
        )
        status = page.locator("#status").inner_text()
        page.select_option("#model", "photos")
        page.wait_for_function(
            "() => document.getElementById('drawing-hint').textContent.includes('photos')"
        )
        polarity_hidden = page.locator("#polarity-row").is_hidden()
    assert status == (
        f"{MODEL_NAME} version 2 (the candidate, answering its canary share of requests) says:"
    )
    assert polarity_hidden
