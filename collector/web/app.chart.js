// fleetprof collector UI: the time chart (CPU, off-CPU or wall time per step), one bar per step as
// positioned divs (as the flame graph is drawn); a drag across it reports a time range snapped to whole
// steps. It fetches nothing itself.
'use strict';

window.FleetprofChart = (function () {
  const PLOT_H = 120;          // px, matches .chart-plot height in app.css
  const MIN_DRAG_PX = 4;       // a shorter drag is a click, which selects nothing
  const NICE = [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10];
  const TICKS_S = [10, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800];
  const MAX_TICKS = 8;

  // The smallest "nice" number (1, 1.2, 1.5, 2, 2.5 … × 10^k) at or above x, so the top bar nearly fills.
  function niceCeil(x) {
    if (!(x > 0)) return 1;
    const mag = Math.pow(10, Math.floor(Math.log10(x)));
    for (const n of NICE) if (n * mag >= x * (1 - 1e-9)) return n * mag;
    return 10 * mag;
  }

  function pad2(n) {
    return String(n).padStart(2, '0');
  }

  function clock(t, seconds, date) {
    const d = new Date(t * 1000);
    let text = pad2(d.getHours()) + ':' + pad2(d.getMinutes());
    if (seconds) text += ':' + pad2(d.getSeconds());
    if (date) text = pad2(d.getMonth() + 1) + '-' + pad2(d.getDate()) + ' ' + text;
    return text;
  }

  // [from, until] in unix seconds covering whole steps, from the step holding t0 to the one holding t1.
  // The stores keep every bucket that starts at or before `until`, so `until` stops one second short of
  // the next step's start rather than on it: ending on it would take in a bucket the user did not pick.
  function snap(t0, t1, step, lo, hi) {
    const from = Math.max(lo, Math.floor(t0 / step) * step);
    let until = Math.ceil(t1 / step) * step - 1;
    if (until < from) until = from + step - 1;
    return { from, until: Math.min(until, Math.floor(hi)) };
  }

  function div(cls, parent) {
    const d = document.createElement('div');
    d.className = cls;
    if (parent) parent.appendChild(d);
    return d;
  }

  // box: the element to draw into. handlers.onSelect(from, until) after a drag; handlers.onHover(point
  // or null, event) with point {t, step, samples} for the step under the pointer.
  function create(box, handlers) {
    box.textContent = '';
    const yaxis = div('chart-yaxis', box);
    const plot = div('chart-plot', box);
    const xaxis = div('chart-xaxis', box);
    const empty = div('chart-empty', box);
    let data = null;      // {from, until, step, hz, points: Map t -> samples}
    let lo = 0, hi = 1;   // the plot's time domain: whole steps around [from, until]
    let bands = [];
    let drag = null;

    const pct = (t) => ((t - lo) / (hi - lo) * 100) + '%';

    function timeAt(clientX) {
      const r = plot.getBoundingClientRect();
      const frac = r.width > 0 ? Math.min(1, Math.max(0, (clientX - r.left) / r.width)) : 0;
      return lo + frac * (hi - lo);
    }

    function place(node, from, until) {
      const a = Math.max(lo, from), b = Math.min(hi, until);
      node.hidden = !(b > a);
      node.style.left = pct(a);
      node.style.width = ((b - a) / (hi - lo) * 100) + '%';
    }

    // series: the /api/v1/series answer, or null (no answer yet, or it failed); emptyText: what an answer
    // without points says.
    function draw(series, emptyText) {
      plot.textContent = '';
      yaxis.textContent = '';
      xaxis.textContent = '';
      drag = null;
      if (!series) {
        data = null;
        empty.textContent = '';
        return;
      }
      const step = Number(series.step) > 0 ? Number(series.step) : 10;
      const points = new Map();
      for (const line of Array.isArray(series.series) ? series.series : []) {
        for (const [t, n] of Array.isArray(line.points) ? line.points : []) {
          points.set(Number(t), (points.get(Number(t)) || 0) + (Number(n) || 0));
        }
      }
      const hz = Number(series.frequency_hz) > 0 ? Number(series.frequency_hz) : null;
      data = { from: Number(series.from), until: Number(series.until), step, hz, points };
      lo = Math.floor(data.from / step) * step;
      hi = Math.max(lo + step, Math.floor(data.until / step) * step + step);
      empty.textContent = points.size ? '' : emptyText || 'no samples in this range';

      // The y axis in seconds per step where the frequency is known (nanosecond types come at 1e9 Hz),
      // else in samples.
      const unit = hz ? hz : 1;
      let max = 0;
      for (const n of points.values()) max = Math.max(max, n / unit);
      const top = niceCeil(max);
      for (const frac of [1, 0.5, 0]) {
        div('chart-grid', plot).style.bottom = (frac * PLOT_H) + 'px';
        const label = div('chart-ylabel', yaxis);
        label.style.bottom = (frac * PLOT_H) + 'px';
        label.textContent = frac === 0 ? '0' : fmtAxis(top * frac) + (hz ? ' s' : '');
      }

      const width = (step / (hi - lo) * 100) + '%';
      const frag = document.createDocumentFragment();
      for (const [t, n] of [...points.entries()].sort((x, y) => x[0] - y[0])) {
        if (!(n > 0)) continue;
        const bar = div('bar');
        bar.dataset.t = String(t);
        bar.dataset.samples = String(n);
        bar.style.left = pct(t);
        bar.style.width = width;
        bar.style.height = (n / unit / top * PLOT_H) + 'px';
        frag.appendChild(bar);
      }
      plot.appendChild(frag);

      const span = hi - lo;
      const every = TICKS_S.find((s) => span / s <= MAX_TICKS) || TICKS_S[TICKS_S.length - 1];
      // Ticks on local-time boundaries ("14:00", not "13:00 UTC" shifted by the offset).
      const offset = -new Date(lo * 1000).getTimezoneOffset() * 60;
      for (let t = Math.ceil((lo + offset) / every) * every - offset; t <= hi; t += every) {
        const tick = div('chart-tick', xaxis);
        tick.style.left = pct(t);
        tick.textContent = clock(t, every < 60, span > 86400);
      }

      for (const band of bands) plot.appendChild(band);
      drawBands();
    }

    function fmtAxis(x) {
      if (x >= 100) return x.toFixed(0);
      if (x >= 10) return x.toFixed(1).replace(/\.0$/, '');
      return String(Number(x.toPrecision(3)));
    }

    // ranges: [{from, until, name, cls}] drawn as labelled shaded spans (the comparison's A and B).
    function setBands(ranges) {
      for (const band of bands) band.remove();
      bands = ranges.map((r) => {
        const band = div('chart-band ' + r.cls);
        band.dataset.from = String(r.from);
        band.dataset.until = String(r.until);
        div('chart-band-label', band).textContent = r.name;
        plot.appendChild(band);
        return band;
      });
      drawBands();
    }

    function drawBands() {
      // until is a last second, not a step's end: a band reaches to the end of that second's bucket.
      for (const band of bands) place(band, Number(band.dataset.from), Number(band.dataset.until) + 1);
    }

    function moveDrag(event) {
      if (!drag) return;
      const [a, b] = [drag.t0, timeAt(event.clientX)].sort((x, y) => x - y);
      const range = snap(a, b, data.step, lo, hi);
      place(drag.box, range.from, range.until + 1);
    }

    function endDrag(event) {
      window.removeEventListener('mousemove', moveDrag);
      window.removeEventListener('mouseup', endDrag);
      if (!drag) return;
      const { x0, t0, box: sel } = drag;
      drag = null;
      sel.remove();
      if (Math.abs(event.clientX - x0) < MIN_DRAG_PX || !data) return;
      const [a, b] = [t0, timeAt(event.clientX)].sort((x, y) => x - y);
      const range = snap(a, b, data.step, lo, hi);
      handlers.onSelect(range.from, range.until);
    }

    plot.addEventListener('mousedown', (event) => {
      if (event.button !== 0 || !data || !data.points.size) return;
      event.preventDefault();  // no text selection while dragging
      handlers.onHover(null, event);
      drag = { x0: event.clientX, t0: timeAt(event.clientX), box: div('chart-selection', plot) };
      moveDrag(event);
      window.addEventListener('mousemove', moveDrag);
      window.addEventListener('mouseup', endDrag);
    });
    plot.addEventListener('mousemove', (event) => {
      if (drag || !data) return;
      const t = Math.floor(timeAt(event.clientX) / data.step) * data.step;
      handlers.onHover({ t, step: data.step, samples: data.points.get(t) || 0 }, event);
    });
    plot.addEventListener('mouseleave', (event) => handlers.onHover(null, event));

    return { draw, setBands };
  }

  return { create, snap, clock };
})();
