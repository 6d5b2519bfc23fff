// Draws the plotly figures the server put in <script type="application/json"
// id="NAME-data"> elements into the element with id NAME, on load and after
// every htmx swap.  The page has no inline script (Content-Security-Policy).
//
// A live region is swapped every few seconds; what the reader did in it
// stays: a chart marked hx-preserve keeps its zoom (plotly's uirevision),
// and a <details> stays open or closed as the reader left it (the server
// opens an open outcome item's evidence; a reader who closed it keeps it
// closed).  plotly.js is loaded only on pages that have a chart.
"use strict";

function drawCharts(root) {
  root.querySelectorAll('script[type="application/json"][id$="-data"]').forEach((data) => {
    const target = document.getElementById(data.id.slice(0, -"-data".length));
    if (!target || typeof Plotly === "undefined") return;
    const figure = JSON.parse(data.textContent);
    Plotly.react(target, figure.data, figure.layout, { displaylogo: false, responsive: true });
    // A point whose customdata is a path of this site opens it: the list
    // behind a bar of the overview.
    if (target.dataset.linked !== "1" && typeof target.on === "function") {
      target.dataset.linked = "1";
      target.on("plotly_click", (event) => {
        const link = event.points?.[0]?.customdata;
        if (typeof link === "string" && link.startsWith("/") && !link.startsWith("//")) {
          window.location.assign(link);
        }
      });
    }
  });
}

let detailsState = new Map();

document.addEventListener("DOMContentLoaded", () => drawCharts(document));
document.addEventListener("htmx:beforeSwap", (event) => {
  detailsState = new Map(
    [...event.detail.target.querySelectorAll("details[id]")].map((d) => [d.id, d.open]),
  );
});
document.addEventListener("htmx:afterSettle", (event) => {
  detailsState.forEach((open, id) => {
    const details = document.getElementById(id);
    if (details) details.open = open;
  });
  detailsState = new Map();
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
