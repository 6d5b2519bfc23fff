// Draws the plotly figures the server put in <script type="application/json"
// id="NAME-data"> elements into the element with id NAME, on load and after
// every htmx swap.  The page has no inline script (Content-Security-Policy).
"use strict";

function drawCharts(root) {
  root.querySelectorAll('script[type="application/json"][id$="-data"]').forEach((data) => {
    const target = document.getElementById(data.id.slice(0, -"-data".length));
    if (!target || typeof Plotly === "undefined") return;
    const figure = JSON.parse(data.textContent);
    Plotly.react(target, figure.data, figure.layout, { displaylogo: false, responsive: true });
  });
}

document.addEventListener("DOMContentLoaded", () => drawCharts(document));
document.addEventListener("htmx:afterSettle", (event) => drawCharts(event.detail.elt));
// A chart about to be swapped out lets go of plotly's resize handler.
document.addEventListener("htmx:beforeCleanupElement", (event) => {
  if (event.detail.elt.classList?.contains("chart") && typeof Plotly !== "undefined") {
    Plotly.purge(event.detail.elt);
  }
});
