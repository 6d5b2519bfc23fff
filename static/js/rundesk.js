// Draws the plotly figures the server put in <script type="application/json"
// id="NAME-data"> elements into the element with id NAME, on load and after
// every htmx swap.  The page has no inline script (Content-Security-Policy).
//
// A live region is swapped every few seconds; what the reader did in it
// stays: a chart marked hx-preserve keeps its zoom (plotly's uirevision),
// and <details> the reader opened stay open.
"use strict";

function drawCharts(root) {
  root.querySelectorAll('script[type="application/json"][id$="-data"]').forEach((data) => {
    const target = document.getElementById(data.id.slice(0, -"-data".length));
    if (!target || typeof Plotly === "undefined") return;
    const figure = JSON.parse(data.textContent);
    Plotly.react(target, figure.data, figure.layout, { displaylogo: false, responsive: true });
  });
}

let openDetails = [];

document.addEventListener("DOMContentLoaded", () => drawCharts(document));
document.addEventListener("htmx:beforeSwap", (event) => {
  openDetails = [...event.detail.target.querySelectorAll("details[open][id]")].map((d) => d.id);
});
document.addEventListener("htmx:afterSettle", (event) => {
  openDetails.forEach((id) => document.getElementById(id)?.setAttribute("open", ""));
  openDetails = [];
  drawCharts(event.detail.elt);
});
// A chart swapped out for good lets go of plotly's resize handler.
document.addEventListener("htmx:beforeCleanupElement", (event) => {
  const elt = event.detail.elt;
  const chart = elt.classList?.contains("chart") && !elt.hasAttribute("hx-preserve");
  if (chart && typeof Plotly !== "undefined") {
    Plotly.purge(elt);
  }
});
