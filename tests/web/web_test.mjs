// Drives the web page of two running `kimi-infer serve`s in headless Chromium: on the demo
// model (with an API key) a streamed chat, the stop button and the dashboard; on a tiny
// Kimi K3 MoE (no key) streamed reasoning and the expert heatmap. Any console error (CSP
// violations included), page exception or off-origin request fails the run.
// Usage: node web_test.mjs DEMO_URL API_KEY MOE_URL OUT_DIR
import { chromium } from "playwright-core";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const [base, apiKey, moeBase, outDir] = process.argv.slice(2);
const chromiumPath = process.env.CHROMIUM || "/usr/bin/chromium";
const problems = [];
const check = (ok, what) => {
  if (!ok) problems.push(what);
  console.log((ok ? "ok   " : "FAIL ") + what);
};

const profile = mkdtempSync(join(tmpdir(), "kimi-web-test-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: chromiumPath,
  headless: true,
  viewport: { width: 1280, height: 860 },
  args: [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
  ],
});
try {
  const page = context.pages()[0] || (await context.newPage());
  page.setDefaultTimeout(30000);
  // Before the key is typed in, the page's first /v1/models gets the 401 a keyed server
  // must give; Chromium logs that one failed load, and nothing else is allowed.
  let expected401 = 1;
  page.on("console", (msg) => {
    if (msg.type() !== "error") return;
    if (expected401 > 0 && /status of 401/.test(msg.text())) expected401 -= 1;
    else problems.push("console error: " + msg.text());
  });
  page.on("pageerror", (err) => problems.push("page error: " + err.message));
  // Nothing may leave the origin: no CDN, no fonts, no telemetry.
  page.on("request", (req) => {
    const url = req.url();
    if (![base, moeBase, "data:"].some((origin) => url.startsWith(origin))) {
      problems.push("off-origin request: " + req.url());
    }
  });

  const response = await page.goto(base + "/");
  check(response.status() === 200, "GET / is 200");
  // The server has a key: the key field feeds every API call (kept in sessionStorage).
  await page.fill("#api-key", apiKey);
  await page.press("#api-key", "Tab");
  await page.waitForFunction(() => document.getElementById("model-name").textContent !== "");
  check(
    await page.evaluate(() => sessionStorage.getItem("kimi-infer-api-key")) === apiKey,
    "API key kept in sessionStorage",
  );

  await page.fill("#system", "You are a helpful assistant.");
  await page.fill("#temperature", "0");
  await page.fill("#max-tokens", "24");
  await page.fill("#prompt", "Hello! Who are you?");
  await page.press("#prompt", "Enter");
  await page.waitForSelector(".msg.assistant[data-done='true']");
  const first = await page.evaluate(() => ({
    users: document.querySelectorAll(".msg.user").length,
    text: document.querySelector(".msg.assistant .content").textContent,
    finish: document.querySelector(".msg.assistant").dataset.finish,
    errors: [...document.querySelectorAll(".msg.error")].map((e) => e.textContent),
  }));
  check(first.users === 1, "user message rendered");
  check(first.text.length > 0, `streamed answer rendered (${JSON.stringify(first.text)})`);
  check(first.finish === "length" || first.finish === "stop", `finish reason ${first.finish}`);
  check(first.errors.length === 0, "no error message " + first.errors.join("; "));

  // Stop: a long answer is aborted once its first delta shows.
  await page.fill("#max-tokens", "1500");
  await page.fill("#prompt", "Tell me a long story.");
  await page.click("#send");
  await page.waitForFunction(() => {
    const all = document.querySelectorAll(".msg.assistant .content");
    return all.length === 2 && all[1].textContent.length > 0;
  });
  await page.click("#stop");
  await page.waitForSelector(".msg.assistant:nth-of-type(4)[data-done='true']");
  const stopped = await page.evaluate(() => document.querySelectorAll(".msg.assistant")[1].dataset.finish);
  check(stopped === "abort", `stop aborts the stream (finish ${stopped})`);
  check(await page.isEnabled("#send"), "send enabled again after stop");

  // The dashboard polls /metrics every second: wait for it to see the first request.
  await page.waitForFunction(() => Number(document.getElementById("stat-requests").textContent) >= 1);
  const dash = await page.evaluate(() => ({
    tokens: Number(document.getElementById("stat-tokens").textContent),
    ttft: document.getElementById("stat-ttft").textContent,
    tpot: document.getElementById("stat-tpot").textContent,
    cache: document.getElementById("stat-cache").textContent,
    throughput: document.getElementById("stat-throughput").textContent,
    rows: document.querySelectorAll("#heatmap .hm-row").length,
    cells: document.querySelectorAll("#heatmap .hm-cell").length,
    colored: [...document.querySelectorAll("#heatmap .hm-cell")].filter((c) => c.style.backgroundColor).length,
    imbalance: document.getElementById("imbalance").textContent,
  }));
  console.log("dashboard:", JSON.stringify(dash));
  check(dash.tokens >= 1, "dashboard counts output tokens");
  check(/s$/.test(dash.ttft) && /s$/.test(dash.tpot), "TTFT and TPOT shown");
  check(/%$/.test(dash.cache), "cache usage shown");
  check(dash.throughput !== "–", "throughput shown");
  check(dash.rows === 0, "a dense model has no heatmap rows");

  // The MoE server: reasoning streams apart from the answer, routing fills the heatmap.
  await page.goto(moeBase + "/");
  await page.fill("#max-tokens", "16");
  // Greedy: a sampled first token may end the thinking at once (random weights), leaving
  // no reasoning to render; the greedy one does not.
  await page.fill("#temperature", "0");
  await page.fill("#prompt", "Hi");
  await page.press("#prompt", "Enter");
  await page.waitForSelector(".msg.assistant[data-done='true']");
  const reasoning = await page.textContent(".msg.assistant .reasoning");
  check(reasoning.length > 0, "reasoning content rendered apart from the answer");
  await page.waitForFunction(() => Number(document.getElementById("stat-requests").textContent) >= 1);
  const heat = await page.evaluate(() => ({
    rows: document.querySelectorAll("#heatmap .hm-row").length,
    cells: document.querySelectorAll("#heatmap .hm-cell").length,
    colored: [...document.querySelectorAll("#heatmap .hm-cell")].filter((c) => c.style.backgroundColor).length,
    hot: document.querySelectorAll("#heatmap .hm-cell.hot").length,
    imbalance: document.getElementById("imbalance").textContent,
  }));
  console.log("heatmap:", JSON.stringify(heat));
  check(heat.rows >= 1 && heat.cells >= 2 * heat.rows, `heatmap has ${heat.rows} layers, ${heat.cells} cells`);
  check(heat.colored === heat.cells, "every heatmap cell coloured");
  check(heat.imbalance.startsWith(heat.hot ? "Imbalanced" : "No expert"), "imbalance line matches the flagged cells");
  await page.screenshot({ path: join(outDir, "web-page.png"), fullPage: true });

  // The flag itself, on counts the tiny model will not produce: expert 3 of layer 1 at 4.5x
  // the mean of its layer (rendered and read back in one task, between two polls).
  const flagged = await page.evaluate(() => {
    const lines = [0, 0, 0, 16, 0, 0, 0, 0].map(
      (n, e) => `kimi:moe_expert_tokens_total{model_name="m",layer="1",expert="${e}"} ${n + 2}`,
    );
    updateHeatmap(parseMetrics(lines.join("\n")));
    return {
      hot: [...document.querySelectorAll("#heatmap .hm-cell")].map((c) => c.classList.contains("hot")),
      note: document.getElementById("imbalance").textContent,
    };
  });
  check(
    flagged.hot.join() === [false, false, false, true, false, false, false, false].join(),
    "an expert past 3x its layer's mean is flagged",
  );
  check(flagged.note.startsWith("Imbalanced: layer 1 expert 3"), `imbalance named (${flagged.note})`);
} catch (err) {
  problems.push("driver: " + (err.stack || err));
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
if (problems.length) {
  console.error("web test failed:\n  " + problems.join("\n  "));
  process.exit(1);
}
console.log("web test passed");
