// fleetprof collector UI: fetches /api/v1 profile, top, labels, series and diff, all of one profile type
// (CPU, off-CPU or wall); draws the flame graph as positioned divs, the chart through app.chart.js, and
// the A/B comparison.
'use strict';

(function () {
  const FRAME_H = 18;               // px per level, matches #flamegraph .frame height + border in app.css
  const AUTO_REFRESH_MS = 15000;
  const MAX_LABEL_VALUES = 200;     // chips beyond this would bury the page; the selector still takes any value
  // The profile types (the API's `type`) in the page's words. cpu counts samples; offcpu and wall count
  // nanoseconds (unit "nanoseconds", frequency_hz 1e9), which the page shows as seconds.
  const TYPES = {
    cpu: { word: 'CPU', chart: 'CPU over time' },
    offcpu: { word: 'off-CPU', chart: 'Off-CPU over time' },
    wall: { word: 'wall', chart: 'Wall time over time' },
  };

  // The API lives next to the UI's mount point: "/" or "/ui/..." here, or under a proxy's prefix.
  const API = (() => {
    const path = location.pathname;
    const ui = path.lastIndexOf('/ui/');
    return (ui >= 0 ? path.slice(0, ui + 1) : path.slice(0, path.lastIndexOf('/') + 1)) + 'api/v1/';
  })();

  const $ = (id) => document.getElementById(id);
  const el = {
    form: $('query-form'), selector: $('selector'), range: $('range'), customRange: $('custom-range'),
    from: $('from'), until: $('until'), typeSwitch: $('type-switch'), refresh: $('refresh'),
    auto: $('auto-refresh'),
    labels: $('labels'), labelValues: $('label-values'), error: $('error'), total: $('total'),
    status: $('status'), search: $('search'), searchStatus: $('search-status'), invert: $('invert'),
    resetZoom: $('reset-zoom'), graph: $('flamegraph'), topBody: document.querySelector('#top-table tbody'),
    tooltip: $('tooltip'), chartTitle: $('chart-title'), chartUnit: $('chart-unit'), chartHint: $('chart-hint'),
    zoomOut: $('zoom-out'), compareMeasure: $('compare-measure'),
    compareToggle: $('compare-toggle'), compareSection: $('compare-section'), compareForm: $('compare-form'),
    compareSort: $('compare-sort'), compareRun: $('compare-run'), compareStatus: $('compare-status'),
    compareResult: $('compare-result'), compareBody: document.querySelector('#compare-table tbody'),
    compareSvg: $('compare-svg'),
    side: {
      a: { query: $('a-query'), from: $('a-from'), until: $('a-until'), total: $('a-total') },
      b: { query: $('b-query'), from: $('b-from'), until: $('b-until'), total: $('b-total') },
    },
  };
  const SIDES = { a: 'A · baseline', b: 'B · comparison' };

  // Everything the page shows lives here; there is one page, so one state object.
  const state = {
    root: null,          // profile tree with _parent/_depth added
    total: 0,
    hz: null,
    measure: { type: 'cpu', ns: false },  // what the profile shown counts (measureOf its answer)
    zoom: null,          // node the graph is zoomed into, null for the root
    regex: null,
    controller: null,    // AbortController of the request in flight
    timer: null,
    activeLabel: null,
    seriesHz: null,      // the chart's sampling frequency, for CPU seconds in its tooltip
    seriesMeasure: { type: 'cpu', ns: false },  // what the chart counts, for its tooltip
    timeStack: [],       // the ranges before each drag on the chart, for "Zoom out"
    compared: { a: null, b: null },  // each side's resolved {from, until}, for the chart's bands
    compareController: null,
  };

  // ---- helpers -------------------------------------------------------------------------------------

  function showError(message) {
    el.error.textContent = message;
    el.error.hidden = false;
  }

  function clearError() {
    el.error.textContent = '';
    el.error.hidden = true;
  }

  function fmtPct(part, whole) {
    return whole > 0 ? (100 * part / whole).toFixed(2) + '%' : '0.00%';
  }

  function fmtSeconds(samples) {
    return state.hz > 0 ? (samples / state.hz).toFixed(2) + ' s' : '';
  }

  function fmtCpu(samples, hz) {
    return hz > 0 ? (samples / hz).toFixed(2) + ' CPU s' : samples + ' samples';
  }

  // Seconds of off-CPU or wall time: hundredths, and below 10 ms in ms or µs so a short wait is not "0.00 s".
  function fmtTime(seconds) {
    if (!(seconds > 0) || seconds >= 0.01) return (seconds || 0).toFixed(2) + ' s';
    if (seconds >= 1e-5) return (seconds * 1e3).toFixed(2) + ' ms';
    return (seconds * 1e6).toFixed(2) + ' µs';
  }

  function fmtNs(ns) {
    return fmtTime(ns / 1e9);
  }

  function isType(type) {
    return typeof type === 'string' && Object.prototype.hasOwnProperty.call(TYPES, type);
  }

  // What an answer counts: the type it was served as (a collector without types serves CPU samples) and
  // whether its values are nanoseconds.
  function measureOf(body) {
    return {
      type: body && isType(body.type) ? body.type : 'cpu',
      ns: Boolean(body) && body.unit === 'nanoseconds',
    };
  }

  // "no samples in this range" for CPU, "no off-CPU time in this range" for the others.
  function nothingIn(measure, where) {
    return 'no ' + (measure.ns ? TYPES[measure.type].word + ' time' : 'samples') + ' ' + where;
  }

  function fmtDuration(seconds) {
    if (seconds < 60) return seconds + ' s';
    if (seconds < 3600) return (seconds / 60).toFixed(seconds % 60 ? 1 : 0) + ' min';
    return (seconds / 3600).toFixed(seconds % 3600 ? 1 : 0) + ' h';
  }

  // A time the collector parses (RFC 3339 with the local offset) and a person can read: the ranges the
  // chart picks go into the From/Until fields and the URL in this form.
  function isoLocal(t) {
    const d = new Date(t * 1000);
    const off = -d.getTimezoneOffset();
    const p = (n) => String(Math.floor(Math.abs(n))).padStart(2, '0');
    return d.getFullYear() + '-' + p(d.getMonth() + 1) + '-' + p(d.getDate()) + 'T' + p(d.getHours()) + ':' +
      p(d.getMinutes()) + ':' + p(d.getSeconds()) + (off < 0 ? '-' : '+') + p(off / 60) + ':' + p(off % 60);
  }

  function fmtSpan(from, until) {
    const sameDay = new Date(from * 1000).toDateString() === new Date(until * 1000).toDateString();
    const far = Math.abs(Date.now() / 1000 - from) > 86400;
    return FleetprofChart.clock(from, true, far) + ' → ' + FleetprofChart.clock(until, true, far || !sameDay);
  }

  // FNV-1a over code points: the same hash collector/render/svg.py uses, so both views colour alike.
  function nameHash(name) {
    let h = 0x811c9dc5;
    for (const ch of name) {
      h = Math.imul(h ^ ch.codePointAt(0), 0x01000193) >>> 0;
    }
    return h;
  }

  function frameColour(node, depth) {
    if (depth === 0 || (node.name === 'other' && node.module === '[truncated]')) return 'rgb(200,200,200)';
    const h = nameHash(node.name);
    const a = (h & 0xff) / 255, b = ((h >>> 8) & 0xff) / 255, c = ((h >>> 16) & 0xff) / 255;
    const rgb = node.kernel
      ? [70 + 60 * a, 140 + 60 * b, 200 + 55 * c]
      : [200 + 55 * a, 60 + 150 * b, 30 + 40 * c];
    return 'rgb(' + rgb.map(Math.floor).join(',') + ')';
  }

  async function getJSON(path, params, signal) {
    const url = path + (params ? '?' + new URLSearchParams(params).toString() : '');
    let res;
    try {
      res = await fetch(url, { signal, headers: { Accept: 'application/json' } });
    } catch (err) {
      if (err && err.name === 'AbortError') throw err;
      throw new Error('cannot reach the collector (' + url + '): ' + (err && err.message ? err.message : err));
    }
    const text = await res.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (_) { body = null; }
    if (!res.ok) {
      const msg = body && typeof body.error === 'string' ? body.error : (text.trim().slice(0, 300) || res.statusText);
      throw new Error(msg + ' (HTTP ' + res.status + ')');
    }
    if (body === null || typeof body !== 'object') {
      throw new Error('unexpected response from ' + path + ': not a JSON object');
    }
    return body;
  }

  // ---- query parameters and the URL hash -----------------------------------------------------------

  function timeRange() {
    if (el.range.value === 'custom') {
      return { from: el.from.value.trim() || 'now-1h', until: el.until.value.trim() || 'now' };
    }
    return { from: 'now-' + el.range.value, until: 'now' };
  }

  function profileType() {
    const checked = el.typeSwitch.querySelector('input[name="type"]:checked');
    return checked && isType(checked.value) ? checked.value : 'cpu';
  }

  function setProfileType(type) {
    el.typeSwitch.querySelector('input[name="type"][value="' + type + '"]').checked = true;
  }

  function queryParams() {
    const range = timeRange();
    const query = el.selector.value.trim() || '{}';
    return { query, from: range.from, until: range.until, type: profileType() };
  }

  // The page's state in the URL hash: the query, range and type, and the comparison's sides while it is open.
  function hashParams() {
    const params = queryParams();
    if (!el.compareSection.hidden) {
      for (const [key, side] of Object.entries(el.side)) {
        for (const field of ['query', 'from', 'until']) params[key + '_' + field] = side[field].value.trim();
      }
    }
    return params;
  }

  function saveHash(params) {
    try {
      history.replaceState(null, '', '#' + new URLSearchParams(params).toString());
    } catch (_) { /* file:// or sandboxed frames may refuse; the page works without it */ }
  }

  function loadHash() {
    const params = new URLSearchParams(location.hash.replace(/^#/, ''));
    if (params.has('query')) el.selector.value = params.get('query');
    if (isType(params.get('type'))) setProfileType(params.get('type'));
    if (['a', 'b'].some((key) => params.has(key + '_from') || params.has(key + '_query'))) {
      for (const [key, side] of Object.entries(el.side)) {
        for (const field of ['query', 'from', 'until']) side[field].value = params.get(key + '_' + field) || '';
      }
      el.compareSection.hidden = false;
    }
    const from = params.get('from'), until = params.get('until');
    if (!from) return;
    const preset = /^now-(\d+[mh])$/.exec(from);
    const hasOption = preset && Array.from(el.range.options).some((o) => o.value === preset[1]);
    if (hasOption && (!until || until === 'now')) {
      el.range.value = preset[1];
    } else {
      el.range.value = 'custom';
      el.from.value = from;
      el.until.value = until || 'now';
    }
  }

  function syncCustomRange() {
    el.customRange.hidden = el.range.value !== 'custom';
  }

  // ---- profile tree ----------------------------------------------------------------------------------

  // Adds _parent and _depth and makes every field safe to use; iterative so deep stacks cannot overflow.
  function prepareTree(root) {
    const stack = [[root, null, 0]];
    while (stack.length) {
      const [node, parent, depth] = stack.pop();
      node.name = String(node.name == null ? '' : node.name);
      node.module = String(node.module == null ? '' : node.module);
      node.kernel = Boolean(node.kernel);
      node.value = Number(node.value) || 0;
      node.self = Number(node.self) || 0;
      if (!Array.isArray(node.children)) node.children = [];
      node._parent = parent;
      node._depth = depth;
      for (const child of node.children) stack.push([child, node, depth + 1]);
    }
    return root;
  }

  function pathOf(node) {
    const path = [];
    for (let n = node; n && n._parent; n = n._parent) path.unshift([n.name, n.module, n.kernel]);
    return path;
  }

  function findPath(root, path) {
    let node = root;
    for (const [name, module, kernel] of path) {
      node = node.children.find((c) => c.name === name && c.module === module && c.kernel === kernel);
      if (!node) return null;
    }
    return node;
  }

  // ---- flame graph -------------------------------------------------------------------------------------

  function renderGraph() {
    const box = el.graph;
    box.textContent = '';
    box.style.height = '';
    hideTooltip();
    el.resetZoom.disabled = !state.zoom;
    if (!state.root || !(state.root.value > 0)) {
      const empty = document.createElement('div');
      empty.className = 'empty';
      empty.textContent = state.root ? nothingIn(state.measure, 'in this range') : '';
      box.appendChild(empty);
      el.searchStatus.textContent = '';
      return;
    }
    const zoom = state.zoom || state.root;
    const widthPx = box.clientWidth || 1000;
    const minFrac = 0.5 / widthPx;  // sub-half-pixel frames are invisible and would only cost DOM nodes
    const rows = [];
    const ancestors = [];
    for (let n = zoom._parent; n; n = n._parent) ancestors.unshift(n);
    ancestors.forEach((n, i) => rows.push([n, i, 0, 1, true]));
    const pending = [[zoom, ancestors.length, 0, 1]];
    while (pending.length) {
      const [node, depth, x, w] = pending.pop();
      rows.push([node, depth, x, w, false]);
      if (!(node.value > 0)) continue;
      const perSample = w / node.value;
      let cx = x;
      const placed = [];
      for (const child of node.children) {
        const cw = child.value * perSample;
        if (cw >= minFrac) placed.push([child, depth + 1, cx, cw]);
        cx += cw;
      }
      for (let i = placed.length - 1; i >= 0; i--) pending.push(placed[i]);
    }
    let maxDepth = 0;
    for (const row of rows) maxDepth = Math.max(maxDepth, row[1]);
    box.style.height = ((maxDepth + 1) * FRAME_H) + 'px';
    const invert = el.invert.checked;
    const frag = document.createDocumentFragment();
    for (const [node, depth, x, w, isAncestor] of rows) {
      const div = document.createElement('div');
      div.className = isAncestor ? 'frame ancestor' : 'frame';
      div.dataset.name = node.name;
      div.dataset.module = node.module;
      if (node.kernel) div.dataset.kernel = 'true';
      div.style.left = (x * 100) + '%';
      div.style.width = (w * 100) + '%';
      div.style.top = ((invert ? maxDepth - depth : depth) * FRAME_H) + 'px';
      div.style.backgroundColor = frameColour(node, node._depth);
      div.textContent = node.name;
      div._node = node;
      frag.appendChild(div);
    }
    box.appendChild(frag);
    applySearch();
  }

  function zoomTo(node) {
    state.zoom = node && node._parent ? node : null;
    renderGraph();
  }

  // ---- search --------------------------------------------------------------------------------------

  function compileSearch() {
    const text = el.search.value;
    if (!text) { state.regex = null; return true; }
    try {
      state.regex = new RegExp(text);
      return true;
    } catch (err) {
      state.regex = null;
      el.searchStatus.textContent = 'invalid regex: ' + err.message;
      return false;
    }
  }

  function applySearch() {
    const re = state.regex;
    for (const div of el.graph.querySelectorAll('.frame')) {
      div.classList.toggle('match', re !== null && re.test(div.dataset.name));
    }
    if (!re || !state.root) {
      if (re === null && el.search.value === '') el.searchStatus.textContent = '';
      return;
    }
    // Over the whole tree, not just drawn frames; a match inside a matched subtree is not counted twice.
    let matched = 0;
    const pending = [state.root];
    while (pending.length) {
      const node = pending.pop();
      if (re.test(node.name)) { matched += node.value; continue; }
      for (const child of node.children) pending.push(child);
    }
    el.searchStatus.textContent = 'matched: ' + fmtPct(matched, state.total || state.root.value);
  }

  function onSearchInput() {
    if (compileSearch()) applySearch();
    else for (const div of el.graph.querySelectorAll('.frame.match')) div.classList.remove('match');
  }

  function escapeRegex(text) {
    return text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
  }

  // ---- tooltip -------------------------------------------------------------------------------------

  function showTooltip(node, event) {
    const total = state.total || (state.root ? state.root.value : 0);
    const lines = [node.name];
    if (node.module) lines.push('module: ' + node.module);
    if (node.kernel) lines.push('kernel frame');
    const share = (n) => ' (' + fmtPct(n, total) + ')';
    if (state.measure.ns) {
      lines.push(TYPES[state.measure.type].word + ' time: ' + fmtNs(node.value) + share(node.value));
      lines.push('self: ' + fmtNs(node.self) + share(node.self));
    } else {
      lines.push('samples: ' + node.value + share(node.value));
      lines.push('self: ' + node.self + share(node.self));
      const secs = fmtSeconds(node.value);
      if (secs) lines.push('time: ' + secs + ' at ' + state.hz + ' Hz');
    }
    placeTooltip(lines, event);
  }

  function placeTooltip(lines, event) {
    el.tooltip.textContent = lines.join('\n');
    el.tooltip.hidden = false;
    const pad = 14;
    const rect = el.tooltip.getBoundingClientRect();
    let left = event.clientX + pad, top = event.clientY + pad;
    if (left + rect.width > window.innerWidth) left = Math.max(0, event.clientX - rect.width - pad);
    if (top + rect.height > window.innerHeight) top = Math.max(0, event.clientY - rect.height - pad);
    el.tooltip.style.left = left + 'px';
    el.tooltip.style.top = top + 'px';
  }

  function hideTooltip() {
    el.tooltip.hidden = true;
  }

  // ---- top functions --------------------------------------------------------------------------------

  function renderTop(body) {
    const tbody = el.topBody;
    tbody.textContent = '';
    const rows = body && Array.isArray(body.functions) ? body.functions : [];
    const measure = measureOf(body);
    // Samples as counted for CPU; seconds for the nanosecond types.
    const amount = (n) => (measure.ns ? fmtNs(Number(n) || 0) : String(n));
    if (!rows.length) {
      const tr = document.createElement('tr');
      const td = document.createElement('td');
      td.colSpan = 6;
      td.className = 'empty';
      td.textContent = body ? nothingIn(measure, 'in this range') : '';
      tr.appendChild(td);
      tbody.appendChild(tr);
      return;
    }
    for (const fn of rows) {
      const tr = document.createElement('tr');
      tr.className = fn.kernel ? 'top-row kernel' : 'top-row';
      const name = String(fn.function == null ? '' : fn.function);
      tr.dataset.name = name;
      const cells = [
        [name, ''],
        [fn.module ? String(fn.module) : (fn.kernel ? '[kernel]' : ''), 'module'],
        [amount(fn.self), 'num'],
        [Number(fn.self_pct || 0).toFixed(2) + '%', 'num'],
        [amount(fn.total), 'num'],
        [Number(fn.total_pct || 0).toFixed(2) + '%', 'num'],
      ];
      for (const [text, cls] of cells) {
        const td = document.createElement('td');
        if (cls) td.className = cls;
        td.textContent = text;
        tr.appendChild(td);
      }
      tr.title = 'highlight ' + name + ' in the flame graph';
      tbody.appendChild(tr);
    }
  }

  // ---- labels --------------------------------------------------------------------------------------

  function addMatcher(selector, name, value) {
    const quoted = '"' + value.replace(/\\/g, '\\\\').replace(/"/g, '\\"').replace(/\n/g, '\\n') + '"';
    const matcher = name + '=' + quoted;
    const s = selector.trim();
    if (s === '' || /^\{\s*\}$/.test(s)) return '{' + matcher + '}';
    if (s.endsWith('}')) return s.slice(0, -1).replace(/[\s,]*$/, '') + ', ' + matcher + '}';
    return null;
  }

  function chip(text, cls, onClick) {
    const b = document.createElement('button');
    b.type = 'button';
    b.className = 'chip' + (cls ? ' ' + cls : '');
    b.textContent = text;
    b.addEventListener('click', onClick);
    return b;
  }

  function note(container, text) {
    const span = document.createElement('span');
    span.className = 'note';
    span.textContent = text;
    container.appendChild(span);
  }

  async function loadLabels() {
    el.labels.textContent = '';
    try {
      const body = await getJSON(API + 'labels');
      const names = Array.isArray(body.labels) ? body.labels.map(String) : [];
      if (!names.length) { note(el.labels, 'no labels yet'); return; }
      note(el.labels, 'labels:');
      for (const name of names) {
        el.labels.appendChild(chip(name, '', (e) => toggleLabel(name, e.currentTarget)));
      }
    } catch (err) {
      note(el.labels, 'labels unavailable: ' + err.message);
    }
  }

  async function toggleLabel(name, button) {
    el.labelValues.textContent = '';
    for (const b of el.labels.querySelectorAll('.chip.active')) b.classList.remove('active');
    if (state.activeLabel === name) { state.activeLabel = null; return; }
    state.activeLabel = name;
    button.classList.add('active');
    try {
      const body = await getJSON(API + 'labels/' + encodeURIComponent(name) + '/values?limit=' + MAX_LABEL_VALUES);
      if (state.activeLabel !== name) return;  // another label was clicked meanwhile
      const values = Array.isArray(body.values) ? body.values.map(String) : [];
      note(el.labelValues, name + ' =');
      if (!values.length) note(el.labelValues, '(no values)');
      for (const value of values) {
        el.labelValues.appendChild(chip(value, 'value', () => {
          const next = addMatcher(el.selector.value, name, value);
          if (next === null) { showError('cannot add ' + name + ' to this selector; edit it by hand'); return; }
          el.selector.value = next;
          refresh();
        }));
      }
      if (body.truncated) note(el.labelValues, '… and more (type the value in the selector)');
    } catch (err) {
      if (state.activeLabel === name) note(el.labelValues, 'values unavailable: ' + err.message);
    }
  }

  // ---- the chart: CPU, off-CPU or wall time over time ----------------------------------------------

  const chart = FleetprofChart.create($('chart'), { onSelect: onChartSelect, onHover: onChartHover });

  function onChartHover(point, event) {
    if (!point) { hideTooltip(); return; }
    const measure = state.seriesMeasure;
    if (measure.ns) {
      // Seconds of thread time per second of the clock: how many threads were off-CPU (or running or
      // waiting) at once, on average.
      const seconds = point.samples / 1e9;
      const threads = measure.type === 'offcpu' ? ' threads off-CPU' : ' threads running or waiting';
      placeTooltip([
        fmtSpan(point.t, point.t + point.step - 1),
        fmtTime(seconds) + ' ' + TYPES[measure.type].word,
        (seconds / point.step).toFixed(3) + threads + ' on average',
      ], event);
      return;
    }
    const lines = [fmtSpan(point.t, point.t + point.step - 1), point.samples + ' samples'];
    if (state.seriesHz > 0) {
      const cpu = point.samples / state.seriesHz;
      lines.push(cpu.toFixed(2) + ' CPU s, ' + (cpu / point.step).toFixed(3) + ' cores on average');
    }
    placeTooltip(lines, event);
  }

  // A drag zooms the page into the range it covers, or, with the comparison open, sets one of its sides.
  function onChartSelect(from, until) {
    if (!el.compareSection.hidden) { setSide(dragTarget(), from, until); return; }
    state.timeStack.push({ range: el.range.value, from: el.from.value, until: el.until.value });
    setRange('custom', isoLocal(from), isoLocal(until));
    refresh();
  }

  function setRange(range, from, until) {
    el.range.value = range;
    el.from.value = from;
    el.until.value = until;
    syncCustomRange();
  }

  function zoomOutTime() {
    const previous = state.timeStack.pop();
    if (!previous) return;
    setRange(previous.range, previous.from, previous.until);
    refresh();
  }

  function drawChart(body) {
    const measure = measureOf(body);
    state.seriesHz = body && Number(body.frequency_hz) > 0 ? Number(body.frequency_hz) : null;
    state.seriesMeasure = measure;
    chart.draw(body, nothingIn(measure, 'in this range'));
    // Titled by the type asked for, so a failed answer still shows which view this is.
    el.chartTitle.textContent = TYPES[profileType()].chart;
    const unit = measure.ns ? TYPES[measure.type].word + ' seconds' : state.seriesHz ? 'CPU seconds' : 'samples';
    el.chartUnit.textContent = body ? unit + ' per ' + fmtDuration(Number(body.step) || 10) + ' step' : '';
    el.zoomOut.disabled = !state.timeStack.length;
    drawBands();
  }

  function updateChartHint() {
    el.chartHint.textContent = el.compareSection.hidden
      ? '· drag across it to zoom into a time range'
      : '· drag across it to set ' + SIDES[dragTarget()];
  }

  // ---- comparison ----------------------------------------------------------------------------------

  function dragTarget() {
    const checked = el.compareForm.querySelector('input[name="drag-sets"]:checked');
    return checked ? checked.value : 'a';
  }

  function setDragTarget(key) {
    el.compareForm.querySelector('input[name="drag-sets"][value="' + key + '"]').checked = true;
    updateChartHint();
  }

  // A drag picked this side's range: the next drag sets the other side, and once B is set both are compared.
  function setSide(key, from, until) {
    el.side[key].from.value = isoLocal(from);
    el.side[key].until.value = isoLocal(until);
    state.compared[key] = { from, until };
    drawBands();
    setDragTarget(key === 'a' ? 'b' : 'a');
    if (key === 'b') runCompare();
    else saveHash(hashParams());
  }

  function drawBands() {
    const bands = [];
    if (!el.compareSection.hidden) {
      for (const key of ['a', 'b']) {
        const r = state.compared[key];
        if (r) bands.push({ from: r.from, until: r.until, name: key.toUpperCase(), cls: key });
      }
    }
    chart.setBands(bands);
  }

  function openCompare(open) {
    el.compareSection.hidden = !open;
    el.compareToggle.setAttribute('aria-pressed', String(open));
    if (open) {
      const range = timeRange();
      for (const side of Object.values(el.side)) {
        if (!side.query.value.trim()) side.query.value = el.selector.value.trim() || '{}';
        if (!side.from.value.trim()) side.from.value = range.from;
        if (!side.until.value.trim()) side.until.value = range.until;
      }
    } else if (state.compareController) {
      state.compareController.abort();
      state.compareController = null;
      el.compareRun.disabled = false;
      el.compareStatus.textContent = '';
    }
    updateChartHint();
    drawBands();
    saveHash(hashParams());
  }

  function diffParams() {
    const a = el.side.a, b = el.side.b;
    return {
      query: a.query.value.trim() || '{}', from: a.from.value.trim() || 'now-1h', until: a.until.value.trim() || 'now',
      query2: b.query.value.trim() || '{}', from2: b.from.value.trim() || 'now-1h', until2: b.until.value.trim() || 'now',
      type: profileType(),
    };
  }

  async function runCompare() {
    if (state.compareController) state.compareController.abort();
    const controller = new AbortController();
    state.compareController = controller;
    const params = diffParams();
    saveHash(hashParams());
    el.compareStatus.textContent = 'comparing…';
    el.compareStatus.classList.remove('failed');
    el.compareRun.disabled = true;
    let body = null, failure = null;
    try {
      const query = Object.assign({ format: 'json', sort: el.compareSort.value, limit: '50' }, params);
      body = await getJSON(API + 'diff', query, controller.signal);
    } catch (err) {
      failure = err;
    }
    if (state.compareController !== controller) return;  // a newer comparison, or the view was closed
    state.compareController = null;
    el.compareRun.disabled = false;
    if (failure) {
      // Shown beside the Compare button, not in the page's error box: the flame graph above is still right.
      el.compareStatus.textContent = 'cannot compare: ' + failure.message;
      el.compareStatus.classList.add('failed');
      el.compareResult.hidden = true;
      return;
    }
    el.compareStatus.textContent = 'compared at ' + new Date().toLocaleTimeString();
    renderCompare(body, params);
  }

  function renderSideTotal(box, key, side, measure) {
    const total = Number(side.total) || 0, hz = Number(side.frequency_hz) || 0;
    const from = Number(side.from), until = Number(side.until);
    box.textContent = '';
    box.dataset.samples = String(total);
    const lines = [
      ['side-title', SIDES[key]],
      measure.ns
        ? ['side-cpu', fmtNs(total) + ' ' + TYPES[measure.type].word]
        : ['side-cpu', hz > 0 ? (total / hz).toFixed(2) + ' CPU s' : total + ' samples'],
      ['side-detail', measure.ns ? total + ' ns' : total + ' samples' + (hz > 0 ? ' at ' + hz + ' Hz' : '')],
      ['side-query', String(side.query == null ? '' : side.query)],
      ['side-range', Number.isFinite(from) && Number.isFinite(until) ? fmtSpan(from, until) : ''],
    ];
    for (const [cls, text] of lines) {
      const div = document.createElement('div');
      div.className = cls;
      div.textContent = text;
      box.appendChild(div);
    }
  }

  function renderCompare(body, params) {
    const sides = { a: body.baseline || {}, b: body.comparison || {} };
    const measure = measureOf(body);
    for (const key of ['a', 'b']) {
      const from = Number(sides[key].from), until = Number(sides[key].until);
      state.compared[key] = Number.isFinite(from) && Number.isFinite(until) ? { from, until } : null;
      renderSideTotal(el.side[key].total, key, sides[key], measure);
    }
    el.compareMeasure.textContent = TYPES[measure.type].word + ' time';
    drawBands();

    const kind = body.sort === 'total' ? 'total' : 'self';
    const heads = document.querySelectorAll('#compare-table thead th');
    heads[2].textContent = 'A ' + kind;
    heads[3].textContent = 'B ' + kind;
    // A function with no time of this kind on either side (a caller, ranked by self time) says nothing here.
    const rows = (Array.isArray(body.functions) ? body.functions : [])
      .filter((fn) => Number(fn['baseline_' + kind]) > 0 || Number(fn['comparison_' + kind]) > 0);
    const tbody = el.compareBody;
    tbody.textContent = '';
    if (!rows.length) {
      const tr = document.createElement('tr');
      const td = document.createElement('td');
      td.colSpan = 6;
      td.className = 'empty';
      td.textContent = nothingIn(measure, 'on either side');
      tr.appendChild(td);
      tbody.appendChild(tr);
    }
    const hzA = Number(sides.a.frequency_hz) || 0, hzB = Number(sides.b.frequency_hz) || 0;
    const amount = (n, hz) => (measure.ns ? fmtNs(n) : fmtCpu(n, hz));
    const maxDelta = Math.max(1e-9, ...rows.map((fn) => Math.abs(Number(fn[kind + '_delta_pct']) || 0)));
    for (const fn of rows) {
      const a = Number(fn['baseline_' + kind]) || 0, b = Number(fn['comparison_' + kind]) || 0;
      const aPct = Number(fn['baseline_' + kind + '_pct']) || 0, bPct = Number(fn['comparison_' + kind + '_pct']) || 0;
      const delta = Number(fn[kind + '_delta_pct']) || 0;
      const direction = delta > 0 ? 'increased' : delta < 0 ? 'decreased' : 'unchanged';
      const name = String(fn.function == null ? '' : fn.function);
      let change = (delta > 0 ? '▲ +' : delta < 0 ? '▼ −' : '= ') + Math.abs(delta).toFixed(2) + ' pp';
      if (a === 0 && b > 0) change += ' (new)';
      if (b === 0 && a > 0) change += ' (gone)';
      const tr = document.createElement('tr');
      tr.className = 'diff-row ' + direction;
      tr.dataset.name = name;
      tr.dataset.delta = String(delta);
      tr.dataset.direction = direction;
      const cells = [
        [name, ''],
        [fn.module ? String(fn.module) : (fn.kernel ? '[kernel]' : ''), 'module'],
        [amount(a, hzA) + ' · ' + aPct.toFixed(2) + '%', 'num side-a'],
        [amount(b, hzB) + ' · ' + bPct.toFixed(2) + '%', 'num side-b'],
        [change, 'num change'],
      ];
      for (const [text, cls] of cells) {
        const td = document.createElement('td');
        if (cls) td.className = cls;
        td.textContent = text;
        tr.appendChild(td);
      }
      const barCell = document.createElement('td');
      barCell.className = 'delta-bar-col';
      const bar = document.createElement('div');
      bar.className = 'delta-bar';
      bar.style.width = (Math.abs(delta) / maxDelta * 100) + '%';
      barCell.appendChild(bar);
      tr.appendChild(barCell);
      tr.title = name + ': ' + aPct.toFixed(2) + '% of A, ' + bPct.toFixed(2) + '% of B';
      tbody.appendChild(tr);
    }
    el.compareSvg.src = API + 'diff?' + new URLSearchParams(Object.assign({ format: 'svg' }, params)).toString();
    el.compareResult.hidden = false;
  }

  // The diff SVG sets its own height; the frame takes it so the graph needs no scrolling of its own.
  function fitDiffFrame() {
    try {
      const svg = el.compareSvg.contentDocument && el.compareSvg.contentDocument.documentElement;
      const height = svg ? Number(svg.getAttribute('height')) : 0;
      if (height > 0) el.compareSvg.style.height = (height + 4) + 'px';
    } catch (_) { /* a frame from elsewhere (a proxy's login page) keeps the default height */ }
  }

  // ---- refresh -------------------------------------------------------------------------------------

  function setTotal(total, hz, measure) {
    if (measure.ns) {
      el.total.textContent = fmtNs(total) + ' ' + TYPES[measure.type].word;
      return;
    }
    let text = total + ' samples';
    if (hz > 0) text += ' (' + (total / hz).toFixed(1) + ' s at ' + hz + ' Hz)';
    el.total.textContent = text;
  }

  async function refresh() {
    if (state.controller) state.controller.abort();
    const controller = new AbortController();
    state.controller = controller;
    const params = queryParams();
    saveHash(hashParams());
    el.status.textContent = 'loading…';
    el.refresh.disabled = true;
    const [profile, top, series] = await Promise.allSettled([
      getJSON(API + 'profile', Object.assign({ format: 'json' }, params), controller.signal),
      getJSON(API + 'top', Object.assign({ limit: '50' }, params), controller.signal),
      getJSON(API + 'series', params, controller.signal),
    ]);
    if (state.controller !== controller) return;  // a newer refresh owns the page now
    state.controller = null;
    el.refresh.disabled = false;
    el.status.textContent = 'updated ' + new Date().toLocaleTimeString();

    const failure = [profile, top, series].find((r) => r.status === 'rejected');
    if (failure) showError(failure.reason && failure.reason.message ? failure.reason.message : String(failure.reason));
    else clearError();

    if (profile.status === 'fulfilled' && profile.value.root && typeof profile.value.root === 'object') {
      const body = profile.value;
      const zoomPath = state.zoom ? pathOf(state.zoom) : null;
      state.root = prepareTree(body.root);
      state.total = Number(body.total) || 0;
      state.hz = Number(body.frequency_hz) > 0 ? Number(body.frequency_hz) : null;
      state.measure = measureOf(body);
      // Keep the zoom across auto-refreshes when the same frame still exists.
      state.zoom = zoomPath ? findPath(state.root, zoomPath) : null;
      setTotal(state.total, state.hz, state.measure);
    } else {
      if (profile.status === 'fulfilled') showError('unexpected profile response: no "root" tree');
      state.root = null;
      state.zoom = null;
      state.total = 0;
      el.total.textContent = 'no data';
    }
    renderGraph();
    renderTop(top.status === 'fulfilled' ? top.value : null);
    drawChart(series.status === 'fulfilled' ? series.value : null);
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

  // ---- wiring --------------------------------------------------------------------------------------

  function frameOf(event) {
    const t = event.target;
    return t && t.closest ? t.closest('.frame') : null;
  }

  el.form.addEventListener('submit', (e) => { e.preventDefault(); refresh(); });
  el.range.addEventListener('change', () => {
    syncCustomRange();
    state.timeStack = [];  // a range picked by hand starts a new zoom history
    if (el.range.value !== 'custom') refresh();
  });
  el.typeSwitch.addEventListener('change', () => {
    refresh();
    // A comparison counts in one type too: redo the one shown, or drop the one a closed view still holds.
    if (el.compareSection.hidden) el.compareResult.hidden = true;
    else if (!el.compareResult.hidden) runCompare();
  });
  el.zoomOut.addEventListener('click', zoomOutTime);
  el.compareToggle.addEventListener('click', () => openCompare(el.compareSection.hidden));
  el.compareForm.addEventListener('submit', (e) => { e.preventDefault(); runCompare(); });
  el.compareForm.addEventListener('change', (e) => { if (e.target.name === 'drag-sets') updateChartHint(); });
  el.compareSort.addEventListener('change', () => { if (!el.compareResult.hidden) runCompare(); });
  el.compareSvg.addEventListener('load', fitDiffFrame);
  el.auto.addEventListener('change', () => setAutoRefresh(el.auto.checked));
  el.search.addEventListener('input', onSearchInput);
  el.invert.addEventListener('change', renderGraph);
  el.resetZoom.addEventListener('click', () => zoomTo(null));
  el.graph.addEventListener('click', (e) => {
    const div = frameOf(e);
    if (div && div._node) zoomTo(div._node === state.zoom ? div._node._parent : div._node);
  });
  el.graph.addEventListener('mousemove', (e) => {
    const div = frameOf(e);
    if (div && div._node) showTooltip(div._node, e); else hideTooltip();
  });
  el.graph.addEventListener('mouseleave', hideTooltip);
  el.topBody.addEventListener('click', (e) => {
    const tr = e.target.closest ? e.target.closest('tr.top-row') : null;
    if (!tr) return;
    el.search.value = '^' + escapeRegex(tr.dataset.name) + '$';
    onSearchInput();
    el.graph.scrollIntoView({ block: 'nearest' });
  });
  document.addEventListener('keydown', (e) => {
    if ((e.ctrlKey || e.metaKey) && (e.key === 'f' || e.key === 'F') && state.root) {
      e.preventDefault();
      el.search.focus();
      el.search.select();
    } else if (e.key === 'Escape' && document.activeElement === el.search) {
      el.search.value = '';
      onSearchInput();
    }
  });
  let resizeTimer = null;
  window.addEventListener('resize', () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(renderGraph, 150);
  });

  loadHash();
  syncCustomRange();
  openCompare(!el.compareSection.hidden);
  loadLabels();
  refresh();
  if (!el.compareSection.hidden) runCompare();
})();
