// vitserve demo page: plain JavaScript, no build step, nothing loaded from elsewhere.
// Calls /models (the models and their descriptions), /models/{name}/predict (top classes) and
// /models/{name}/attention with format=png (overlay), and /models/{name}/shadow (a candidate version
// compared with the live one on live requests, when the model tries one).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const keyInput = $("api-key");
  const fileInput = $("file-input");
  const dropzone = $("dropzone");
  const canvas = $("canvas");
  const invert = $("invert");
  const statusLine = $("status");
  const errorBox = $("error");
  const labelHeading = $("prediction-label");
  const scores = $("scores");
  const preview = $("preview");
  const overlay = $("overlay");
  const TOP_K = 5;
  const KEY_STORAGE = "vitserve-api-key";
  let latest = 0; // only the newest request may write the results
  let onTrial = null; // the selected model's shadow report, while it tries a candidate
  const ink = { light: true }; // the drawing's strokes: white on black, or black on white
  const urls = { preview: null, overlay: null };

  keyInput.value = sessionStorage.getItem(KEY_STORAGE) || "";
  keyInput.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, keyInput.value.trim());
    describeModel();
  });

  function authHeaders() {
    const key = keyInput.value.trim();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  // The service answers errors as {"error": {"message": ...}} (the /v2 routes as {"error": "..."}).
  async function errorMessage(response) {
    let message = `the service answered ${response.status} ${response.statusText}`.trim();
    try {
      const body = await response.json();
      const error = body && body.error;
      if (typeof error === "string") message = error;
      else if (error && error.message) message = error.message;
    } catch (_) {
      // not JSON: keep the status line
    }
    if (response.status === 401) message += ". Enter the service's API key above.";
    if (response.status === 503) {
      const retry = response.headers.get("Retry-After");
      message += retry ? ` (retry in ${retry} s)` : "";
    }
    return message;
  }

  function showError(message) {
    errorBox.textContent = message;
    errorBox.hidden = false;
  }

  function clearResults() {
    errorBox.hidden = true;
    errorBox.textContent = "";
    labelHeading.textContent = "";
    scores.replaceChildren();
    showFigure(overlay, false);
    overlay.removeAttribute("src");
  }

  // An image and its caption are shown or hidden together.
  function showFigure(img, visible) {
    img.hidden = !visible;
    img.closest("figure").hidden = !visible;
  }

  function setImage(img, key, blob) {
    if (urls[key]) URL.revokeObjectURL(urls[key]);
    urls[key] = URL.createObjectURL(blob);
    img.src = urls[key];
    showFigure(img, true);
  }
  // A file the browser cannot show (not an image, or a format it lacks) gets no broken preview.
  preview.addEventListener("error", () => showFigure(preview, false));

  // Every model /models lists, the default one chosen first; requests go to /models/{name}/....
  const modelSelect = $("model");
  let models = [];

  function describe(model) {
    const info = $("model-info");
    if (!model || model.version == null) {
      info.textContent = model ? `${model.name}: no version is ready.` : "No model is served.";
      return;
    }
    const accuracy =
      model.test_accuracy == null ? "" : `, ${(100 * model.test_accuracy).toFixed(1)}% test accuracy`;
    const attention = model.attention ? "" : " No attention graph: no overlay.";
    info.textContent =
      `${model.name} version ${model.version} (${model.precision}): ${model.labels.length} classes ` +
      `(${model.labels.join(", ")}), input ${model.input.width}×${model.input.height}` +
      `${accuracy}, on ${model.provider}.${attention}`;
    drawFor(model.preprocessing ? model.preprocessing.polarity : "light-on-dark");
  }

  // The drawing and the polarity control follow what the model was trained on: strokes of the
  // training images' colours, and no polarity choice for a model of natural photos (never inverted).
  function drawFor(polarity) {
    const hints = {
      "light-on-dark": "White strokes on black, like the training images.",
      "dark-on-light": "Black strokes on white, like the training images.",
      natural: "This model was trained on photos: a drawing is sent as it is, black on white.",
    };
    $("drawing-hint").textContent = hints[polarity] || hints.natural;
    $("polarity-row").hidden = polarity === "natural";
    if (polarity === "natural") invert.value = "auto";
    const light = polarity === "light-on-dark";
    if (ink.light !== light) {
      ink.light = light;
      clearCanvas();
    }
  }

  async function describeModel() {
    const info = $("model-info");
    try {
      const response = await fetch("/models", { headers: authHeaders() });
      if (!response.ok) {
        info.textContent = `Model description unavailable: ${await errorMessage(response)}`;
        if (response.status === 401) keyInput.focus();
        return;
      }
      models = (await response.json()).models;
      const chosen = modelSelect.value;
      modelSelect.replaceChildren(
        ...models.map((model) => {
          const option = document.createElement("option");
          option.value = model.name;
          option.textContent = model.default ? `${model.name} (default)` : model.name;
          return option;
        }),
      );
      const fallback = models.find((model) => model.default) || models[0];
      modelSelect.value = models.some((m) => m.name === chosen) ? chosen : fallback && fallback.name;
      describe(models.find((model) => model.name === modelSelect.value));
      showShadow();
    } catch (error) {
      info.textContent = `Cannot reach the service (${error.message}).`;
    }
  }
  modelSelect.addEventListener("change", () => {
    describe(models.find((model) => model.name === modelSelect.value));
    showShadow();
  });

  const percent = (value) => (value == null ? "–" : `${(100 * value).toFixed(1)}%`);

  // The candidate the selected model tries on live traffic, if any: how it compares with the live
  // version on the same requests (GET /models/{name}/shadow).
  async function showShadow() {
    const line = $("shadow");
    const name = modelSelect.value;
    if (!name) return;
    try {
      const response = await fetch(`/models/${encodeURIComponent(name)}/shadow`, {
        headers: authHeaders(),
      });
      const report = response.ok ? await response.json() : null;
      if (name !== modelSelect.value) return;
      if (!report || report.candidate_version == null) {
        onTrial = null;
        line.hidden = true;
        return;
      }
      onTrial = report;
      const pair = report.pairs.find(
        (p) => p.live_version === report.live_version && p.candidate_version === report.candidate_version,
      );
      const trial =
        `Candidate version ${report.candidate_version} against live version ${report.live_version} ` +
        `(shadow ${report.shadow_percent}%, canary ${report.canary_percent}%): `;
      const outcomes = (p) =>
        `${p.outcomes.shed} shed, ${p.outcomes.incompatible} incompatible, ` +
        `${p.outcomes.failed + p.outcomes.timeout} failed or timed out.`;
      if (report.comparable === false) {
        line.textContent = `${trial}not comparable: ${report.why}` + (pair ? ` (${outcomes(pair)})` : "");
      } else if (!pair) {
        line.textContent = `${trial}no request compared yet.`;
      } else {
        const moves = pair.confusion
          .filter((c) => c.live_class !== c.candidate_class)
          .sort((a, b) => b.images - a.images)
          .slice(0, 3)
          .map((c) => `${labelOf(c.live_class)} → ${labelOf(c.candidate_class)} (${c.images})`);
        const ratio = pair.model_ms.ratio_p50;
        line.textContent =
          `${trial}requests compared: ${pair.requests_compared}, top-1 agreement ` +
          `${percent(pair.top1_agreement)}, probability difference mean ` +
          `${fmt(pair.probability_difference.mean)} p99 ${fmt(pair.probability_difference.p99)}, ` +
          `model time ${ratio == null ? "–" : ratio.toFixed(2) + "×"} the live version's ` +
          `(${pair.model_ms.pairs} timed pairs), ${outcomes(pair)}` +
          (moves.length ? ` Moves: ${moves.join(", ")}.` : "");
      }
      line.hidden = false;
    } catch (error) {
      line.hidden = true;
    }
  }

  setInterval(showShadow, 2000);

  const fmt = (value) => (value == null ? "–" : value.toFixed(4));

  function labelOf(index) {
    const model = selectedModel();
    return model && model.labels && model.labels[index] != null ? model.labels[index] : `class ${index}`;
  }

  function selectedModel() {
    return models.find((model) => model.name === modelSelect.value);
  }

  function renderPrediction(prediction) {
    labelHeading.textContent = prediction.label;
    const items = prediction.top_k.map((entry) => {
      const item = document.createElement("li");
      const name = document.createElement("span");
      name.className = "label";
      name.textContent = entry.label;
      const bar = document.createElement("span");
      bar.className = "bar";
      const fill = document.createElement("span");
      fill.className = "fill";
      fill.style.display = "block";
      fill.style.width = `${(100 * entry.score).toFixed(1)}%`;
      bar.append(fill);
      const score = document.createElement("span");
      score.className = "score";
      score.textContent = `${(100 * entry.score).toFixed(1)}%`;
      item.append(name, bar, score);
      return item;
    });
    scores.replaceChildren(...items);
  }

  async function post(path, blob, filename, fields) {
    const form = new FormData();
    form.append(path === "/predict" ? "files" : "file", blob, filename);
    for (const [key, value] of Object.entries(fields)) form.append(key, value);
    // before /models has answered (say, for want of the API key) the default model's route
    const route = modelSelect.value ? `/models/${encodeURIComponent(modelSelect.value)}${path}` : path;
    return fetch(route, { method: "POST", headers: authHeaders(), body: form });
  }

  async function classify(blob, filename) {
    const ticket = ++latest;
    clearResults();
    setImage(preview, "preview", blob);
    statusLine.textContent = "Asking the model…";
    const options = { invert: invert.value };
    try {
      const model = selectedModel();
      const topK = String(Math.min(TOP_K, model && model.labels ? model.labels.length : TOP_K));
      const [predicted, attended] = await Promise.all([
        post("/predict", blob, filename, { ...options, top_k: topK }),
        model && !model.attention ? null : post("/attention", blob, filename, { ...options, format: "png" }),
      ]);
      if (ticket !== latest) return;
      if (!predicted.ok) {
        statusLine.textContent = "The model could not classify this image.";
        showError(await errorMessage(predicted));
        return;
      }
      const body = await predicted.json();
      if (ticket !== latest) return;
      renderPrediction(body.predictions[0]);
      const byCanary =
        onTrial !== null &&
        onTrial.model === body.model.name &&
        onTrial.candidate_version === body.model.version;
      statusLine.textContent =
        `${body.model.name} version ${body.model.version}` +
        (byCanary ? ` (the candidate, answering its canary share of requests)` : "") +
        " says:";
      showShadow(); // and again every few seconds: the shadow runs once the live answer is in
      if (attended === null) {
        showError("This model has no attention graph, so there is no overlay.");
      } else if (attended.ok) {
        setImage(overlay, "overlay", await attended.blob());
      } else {
        showError(`No attention overlay: ${await errorMessage(attended)}`);
      }
    } catch (error) {
      if (ticket !== latest) return;
      statusLine.textContent = "No answer.";
      showError(`Cannot reach the service (${error.message}).`);
    }
  }

  // --- file input and drag and drop -----------------------------------------------------------
  fileInput.addEventListener("change", () => {
    const file = fileInput.files[0];
    if (file) classify(file, file.name);
    fileInput.value = ""; // choosing the same file again classifies again
  });
  dropzone.addEventListener("dragover", (event) => {
    event.preventDefault();
    dropzone.classList.add("over");
  });
  dropzone.addEventListener("dragleave", () => dropzone.classList.remove("over"));
  dropzone.addEventListener("drop", (event) => {
    event.preventDefault();
    dropzone.classList.remove("over");
    const file = event.dataTransfer.files[0];
    if (file) classify(file, file.name);
    else showError("Nothing to classify: drop an image file.");
  });
  dropzone.addEventListener("keydown", (event) => {
    if (event.key === "Enter" || event.key === " ") {
      event.preventDefault();
      fileInput.click();
    }
  });

  // --- drawing ---------------------------------------------------------------------------------
  const context = canvas.getContext("2d");
  function clearCanvas() {
    context.fillStyle = ink.light ? "#000" : "#fff";
    context.fillRect(0, 0, canvas.width, canvas.height);
    context.strokeStyle = ink.light ? "#fff" : "#000";
  }
  clearCanvas();
  context.lineWidth = 22;
  context.lineCap = "round";
  context.lineJoin = "round";
  let drawing = false;

  function point(event) {
    const box = canvas.getBoundingClientRect();
    return [
      ((event.clientX - box.left) * canvas.width) / box.width,
      ((event.clientY - box.top) * canvas.height) / box.height,
    ];
  }
  canvas.addEventListener("pointerdown", (event) => {
    drawing = true;
    canvas.setPointerCapture(event.pointerId);
    const [x, y] = point(event);
    context.beginPath();
    context.moveTo(x, y);
    context.lineTo(x + 0.01, y);
    context.stroke();
  });
  canvas.addEventListener("pointermove", (event) => {
    if (!drawing) return;
    const [x, y] = point(event);
    context.lineTo(x, y);
    context.stroke();
  });
  const stop = () => {
    drawing = false;
  };
  canvas.addEventListener("pointerup", stop);
  canvas.addEventListener("pointercancel", stop);

  $("clear-canvas").addEventListener("click", clearCanvas);
  $("classify-drawing").addEventListener("click", () => {
    canvas.toBlob((blob) => {
      if (blob) classify(blob, "drawing.png");
      else showError("The drawing could not be turned into an image.");
    }, "image/png");
  });

  describeModel();
})();
