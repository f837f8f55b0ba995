// fleetprof collector UI, the page: the query form (selector, range, type and threads), the URL hash
// that holds the view, and one refresh that asks /api/v1 for the profile, the top functions and the
// series, and hands each answer to its part: the flame graph (app.profile.js), the top table
// (app.top.js), the chart (app.chart.js). The label chips (app.labels.js) and the A/B comparison
// (app.compare.js) are wired here too.
'use strict';

(function () {
  const F = FleetprofFormat;
  const AUTO_REFRESH_MS = 15000;

  const $ = (id) => document.getElementById(id);
  const el = {
    form: $('query-form'), selector: $('selector'), range: $('range'), customRange: $('custom-range'),
    from: $('from'), until: $('until'), typeSwitch: $('type-switch'), threadsField: $('threads-field'),
    threadsSwitch: $('threads-switch'), typeNote: $('type-note'), refresh: $('refresh'), auto: $('auto-refresh'),
    error: $('error'), warnings: $('warnings'), status: $('status'), chartTitle: $('chart-title'),
    chartUnit: $('chart-unit'), zoomOut: $('zoom-out'), topLines: $('top-lines'),
    topByFrame: $('top-by-frame'), topByFrameField: $('top-by-frame-field'),
  };

  const state = {
    controller: null,    // AbortController of the refresh in flight
    timer: null,         // the auto-refresh interval
    seriesHz: null,      // the chart's sampling frequency, for CPU seconds in its tooltip
    seriesMeasure: F.measureOf(null),  // what the chart counts, for its tooltip
    timeStack: [],       // the ranges before each drag on the chart, for "Zoom out"
  };

  function showError(message) {
    el.error.textContent = message;
    el.error.hidden = false;
  }

  function clearError() {
    el.error.textContent = '';
    el.error.hidden = true;
  }

  // The collector's warnings about the query (a label no series has, a selector that matched nothing),
  // each once, from every answer of a refresh.
  function showWarnings(bodies) {
    const seen = new Set();
    for (const body of bodies) {
      for (const w of (body && Array.isArray(body.warnings) ? body.warnings : [])) seen.add(String(w));
    }
    el.warnings.textContent = Array.from(seen).join('\n');
    el.warnings.hidden = !seen.size;
  }

  // ---- the query: selector, range, type and threads ----------------------------------------------

  function timeRange() {
    if (el.range.value === 'custom') {
      return { from: el.from.value.trim() || 'now-1h', until: el.until.value.trim() || 'now' };
    }
    return { from: 'now-' + el.range.value, until: 'now' };
  }

  function setRange(range, from, until) {
    el.range.value = range;
    el.from.value = from;
    el.until.value = until;
    syncCustomRange();
  }

  function syncCustomRange() {
    el.customRange.hidden = el.range.value !== 'custom';
  }

  function profileType() {
    const checked = el.typeSwitch.querySelector('input[name="type"]:checked');
    return checked && F.isType(checked.value) ? checked.value : 'cpu';
  }

  function setProfileType(type) {
    el.typeSwitch.querySelector('input[name="type"][value="' + type + '"]').checked = true;
  }

  // Which threads the off-CPU and wall views count (the API's `threads`): null for CPU, which counts
  // every running thread.
  function threads() {
    if (!F.TYPES[profileType()].threads) return null;
    const checked = el.threadsSwitch.querySelector('input[name="threads"]:checked');
    return checked ? checked.value : F.TYPES[profileType()].threads;
  }

  function setThreads(value) {
    const input = el.threadsSwitch.querySelector('input[name="threads"][value="' + value + '"]');
    if (input) input.checked = true;
  }

  // The threads switch shows for the types it applies to, with a line on what the view counts.
  function syncThreads() {
    const type = F.TYPES[profileType()];
    el.threadsField.hidden = !type.threads;
    el.typeNote.hidden = !type.threads;
    el.typeNote.textContent = type.threads ? type.counts[threads()] : '';
    el.topByFrameField.hidden = profileType() === 'cpu';  // CPU samples rank by frame only
  }

  // type, and threads where the type tells threads apart: what every request of the page counts.
  function typeParams() {
    const params = { type: profileType() };
    const which = threads();
    if (which) params.threads = which;
    return params;
  }

  function queryParams() {
    const range = timeRange();
    const query = el.selector.value.trim() || '{}';
    return Object.assign({ query, from: range.from, until: range.until }, typeParams());
  }

  // ---- the URL hash: the query, range, type and threads, and the comparison's sides while it is open ----

  function saveHash() {
    const params = queryParams();
    if (el.topLines.checked) params.lines = '1';
    if (byFrame()) params.rank = 'frame';
    try {
      history.replaceState(null, '', '#' + new URLSearchParams(compare.addHashParams(params)).toString());
    } catch (_) { /* file:// or sandboxed frames may refuse; the page works without it */ }
  }

  function loadHash() {
    const params = new URLSearchParams(location.hash.replace(/^#/, ''));
    if (params.has('query')) el.selector.value = params.get('query');
    el.topLines.checked = params.get('lines') === '1';
    el.topByFrame.checked = params.get('rank') === 'frame';
    if (F.isType(params.get('type'))) setProfileType(params.get('type'));
    const type = F.TYPES[profileType()];
    setThreads(type.threads && type.counts[params.get('threads')] ? params.get('threads') : type.threads);
    compare.loadHashParams(params);
    const from = params.get('from'), until = params.get('until');
    if (!from) return;
    const preset = /^now-(\d+[mh])$/.exec(from);
    const hasOption = preset && Array.from(el.range.options).some((o) => o.value === preset[1]);
    if (hasOption && (!until || until === 'now')) {
      el.range.value = preset[1];
    } else {
      setRange('custom', from, until || 'now');
    }
  }

  // ---- the parts -------------------------------------------------------------------------------------

  const profile = FleetprofProfile.create({
    graph: $('flamegraph'), deeper: $('flame-deeper'), total: $('total'), search: $('search'), searchStatus: $('search-status'),
    invert: $('invert'), resetZoom: $('reset-zoom'),
  });
  const top = FleetprofTop.create(document.querySelector('#top-table tbody'), $('top-title'), profile.highlight);
  const labels = FleetprofLabels.create(
    { labels: $('labels'), labelValues: $('label-values'), selector: el.selector }, () => refresh(), showError,
  );
  const chart = FleetprofChart.create($('chart'), { onSelect: onChartSelect, onHover: onChartHover });
  const compare = FleetprofCompare.create({
    section: $('compare-section'), toggle: $('compare-toggle'), form: $('compare-form'), sort: $('compare-sort'),
    lines: $('compare-lines'), warnings: $('compare-warnings'),
    run: $('compare-run'), status: $('compare-status'), result: $('compare-result'), measure: $('compare-measure'),
    table: $('compare-table'), svg: $('compare-svg'), chartHint: $('chart-hint'),
    side: {
      a: { query: $('a-query'), from: $('a-from'), until: $('a-until'), total: $('a-total') },
      b: { query: $('b-query'), from: $('b-from'), until: $('b-until'), total: $('b-total') },
    },
  }, {
    chart, timeRange, typeParams, saveHash, selector: () => el.selector.value.trim() || '{}',
  });

  // ---- the chart: CPU, off-CPU or wall time over time ------------------------------------------------

  function onChartHover(point, event) {
    if (!point) { FleetprofTooltip.hide(); return; }
    const measure = state.seriesMeasure;
    if (measure.ns) {
      // Seconds of thread time per second of the clock: how many threads were off-CPU (or running or
      // waiting) at once, on average.
      const seconds = point.samples / 1e9;
      const what = measure.type === 'offcpu' ? ' threads off-CPU' : ' threads running or waiting';
      FleetprofTooltip.show([
        F.fmtSpan(point.t, point.t + point.step - 1),
        F.fmtTime(seconds) + ' ' + F.TYPES[measure.type].word,
        (seconds / point.step).toFixed(3) + what + ' on average',
      ], event);
      return;
    }
    const lines = [F.fmtSpan(point.t, point.t + point.step - 1), point.samples + ' samples'];
    if (state.seriesHz > 0) {
      const cpu = point.samples / state.seriesHz;
      lines.push(cpu.toFixed(2) + ' CPU s, ' + (cpu / point.step).toFixed(3) + ' cores on average');
    }
    FleetprofTooltip.show(lines, event);
  }

  // A drag zooms the page into the range it covers, or, with the comparison open, sets one of its sides.
  function onChartSelect(from, until) {
    if (compare.isOpen()) { compare.pick(from, until); return; }
    state.timeStack.push({ range: el.range.value, from: el.from.value, until: el.until.value });
    setRange('custom', F.isoLocal(from), F.isoLocal(until));
    refresh();
  }

  function zoomOutTime() {
    const previous = state.timeStack.pop();
    if (!previous) return;
    setRange(previous.range, previous.from, previous.until);
    refresh();
  }

  function drawChart(body) {
    const measure = F.measureOf(body);
    state.seriesHz = body && Number(body.frequency_hz) > 0 ? Number(body.frequency_hz) : null;
    state.seriesMeasure = measure;
    chart.draw(body, F.nothingFor(body, measure, 'in this range'));
    // Titled by the type asked for, so a failed answer still shows which view this is.
    el.chartTitle.textContent = F.TYPES[profileType()].chart;
    const unit = measure.ns ? F.TYPES[measure.type].word + ' seconds' : state.seriesHz ? 'CPU seconds' : 'samples';
    el.chartUnit.textContent = body ? unit + ' per ' + F.fmtDuration(Number(body.step) || 10) + ' step' : '';
    el.zoomOut.disabled = !state.timeStack.length;
    compare.drawBands();
  }

  // ---- refresh ---------------------------------------------------------------------------------------

  async function refresh() {
    if (state.controller) state.controller.abort();
    const controller = new AbortController();
    state.controller = controller;
    const params = queryParams();
    saveHash();
    el.status.textContent = 'loading…';
    el.refresh.disabled = true;
    const get = (endpoint, extra) => FleetprofApi.getJSON(endpoint, Object.assign(extra, params), controller.signal);
    const [prof, tops, series] = await Promise.allSettled([
      get('profile', { format: 'json' }), get('top', topParams()), get('series', {}),
    ]);
    if (state.controller !== controller) return;  // a newer refresh owns the page now
    state.controller = null;
    el.refresh.disabled = false;
    el.status.textContent = 'updated ' + new Date().toLocaleTimeString();

    const failure = [prof, tops, series].find((r) => r.status === 'rejected');
    if (failure) showError(failure.reason && failure.reason.message ? failure.reason.message : String(failure.reason));
    else clearError();

    let body = prof.status === 'fulfilled' ? prof.value : null;
    if (body && !(body.root && typeof body.root === 'object')) {
      showError('unexpected profile response: no "root" tree');
      body = null;
    }
    profile.show(body);
    top.show(tops.status === 'fulfilled' ? tops.value : null);
    drawChart(series.status === 'fulfilled' ? series.value : null);
    showWarnings([prof, tops, series].map((r) => (r.status === 'fulfilled' ? r.value : null)));
  }

  // Off-CPU and wall ranked by frame rather than by where threads blocked (the collector's default).
  function byFrame() {
    return el.topByFrame.checked && profileType() !== 'cpu';
  }

  // The top table's request: a Python function's lines apart, and off-CPU or wall by frame, only when
  // asked for.
  function topParams() {
    const params = { limit: '50' };
    if (el.topLines.checked) params.lines = '1';
    if (byFrame()) params.rank = 'frame';
    return params;
  }

  // The lines switch redraws the table alone: the flame graph keeps lines either way.
  async function refreshTop() {
    saveHash();
    const params = Object.assign(topParams(), queryParams());
    try {
      top.show(await FleetprofApi.getJSON('top', params));
    } catch (err) {
      showError(err && err.message ? err.message : String(err));
    }
  }

  function setAutoRefresh(on) {
    if (state.timer) { clearInterval(state.timer); state.timer = null; }
    if (on) {
      state.timer = setInterval(() => {
        // Skip ticks while hidden or while a request is still running, so a slow collector is not piled on.
        if (!document.hidden && !state.controller) refresh();
      }, AUTO_REFRESH_MS);
    }
  }

  // ---- wiring ----------------------------------------------------------------------------------------

  el.form.addEventListener('submit', (e) => { e.preventDefault(); refresh(); });
  el.range.addEventListener('change', () => {
    syncCustomRange();
    state.timeStack = [];  // a range picked by hand starts a new zoom history
    if (el.range.value !== 'custom') refresh();
  });
  el.typeSwitch.addEventListener('change', () => {
    setThreads(F.TYPES[profileType()].threads);  // each type opens on its own default
    syncThreads();
    refresh();
    compare.retype();  // a comparison counts in one type too
  });
  el.threadsSwitch.addEventListener('change', () => {
    syncThreads();
    refresh();
    compare.retype();
  });
  el.topLines.addEventListener('change', refreshTop);
  el.topByFrame.addEventListener('change', refreshTop);
  el.zoomOut.addEventListener('click', zoomOutTime);
  el.auto.addEventListener('change', () => setAutoRefresh(el.auto.checked));

  loadHash();
  syncCustomRange();
  syncThreads();
  compare.open(compare.isOpen());
  labels.load();
  refresh();
  if (compare.isOpen()) compare.run();
})();
