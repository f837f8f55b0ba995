// fleetprof collector UI: fetches /api/v1 profile, top and labels, draws the flame graph as positioned divs.
'use strict';

(function () {
  const FRAME_H = 18;               // px per level, matches #flamegraph .frame height + border in app.css
  const AUTO_REFRESH_MS = 15000;
  const MAX_LABEL_VALUES = 200;     // chips beyond this would bury the page; the selector still takes any value

  // The API lives next to the UI's mount point: "/" or "/ui/..." here, or under a proxy's prefix.
  const API = (() => {
    const path = location.pathname;
    const ui = path.lastIndexOf('/ui/');
    return (ui >= 0 ? path.slice(0, ui + 1) : path.slice(0, path.lastIndexOf('/') + 1)) + 'api/v1/';
  })();

  const $ = (id) => document.getElementById(id);
  const el = {
    form: $('query-form'), selector: $('selector'), range: $('range'), customRange: $('custom-range'),
    from: $('from'), until: $('until'), refresh: $('refresh'), auto: $('auto-refresh'),
    labels: $('labels'), labelValues: $('label-values'), error: $('error'), total: $('total'),
    status: $('status'), search: $('search'), searchStatus: $('search-status'), invert: $('invert'),
    resetZoom: $('reset-zoom'), graph: $('flamegraph'), topBody: document.querySelector('#top-table tbody'),
    tooltip: $('tooltip'),
  };

  // Everything the page shows lives here; there is one page, so one state object.
  const state = {
    root: null,          // profile tree with _parent/_depth added
    total: 0,
    hz: null,
    zoom: null,          // node the graph is zoomed into, null for the root
    regex: null,
    controller: null,    // AbortController of the request in flight
    timer: null,
    activeLabel: null,
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

  function queryParams() {
    const range = timeRange();
    return { query: el.selector.value.trim() || '{}', from: range.from, until: range.until };
  }

  function saveHash(params) {
    try {
      history.replaceState(null, '', '#' + new URLSearchParams(params).toString());
    } catch (_) { /* file:// or sandboxed frames may refuse; the page works without it */ }
  }

  function loadHash() {
    const params = new URLSearchParams(location.hash.replace(/^#/, ''));
    if (params.has('query')) el.selector.value = params.get('query');
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
      empty.textContent = state.root ? 'no samples in this range' : '';
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
    lines.push('samples: ' + node.value + ' (' + fmtPct(node.value, total) + ')');
    lines.push('self: ' + node.self + ' (' + fmtPct(node.self, total) + ')');
    const secs = fmtSeconds(node.value);
    if (secs) lines.push('time: ' + secs + ' at ' + state.hz + ' Hz');
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
    if (!rows.length) {
      const tr = document.createElement('tr');
      const td = document.createElement('td');
      td.colSpan = 6;
      td.className = 'empty';
      td.textContent = body ? 'no samples in this range' : '';
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
        [String(fn.self), 'num'],
        [Number(fn.self_pct || 0).toFixed(2) + '%', 'num'],
        [String(fn.total), 'num'],
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
      const body = await getJSON(API + 'labels/' + encodeURIComponent(name) + '/values');
      if (state.activeLabel !== name) return;  // another label was clicked meanwhile
      const values = Array.isArray(body.values) ? body.values.map(String) : [];
      note(el.labelValues, name + ' =');
      if (!values.length) note(el.labelValues, '(no values)');
      for (const value of values.slice(0, MAX_LABEL_VALUES)) {
        el.labelValues.appendChild(chip(value, 'value', () => {
          const next = addMatcher(el.selector.value, name, value);
          if (next === null) { showError('cannot add ' + name + ' to this selector; edit it by hand'); return; }
          el.selector.value = next;
          refresh();
        }));
      }
      if (values.length > MAX_LABEL_VALUES) note(el.labelValues, '… ' + (values.length - MAX_LABEL_VALUES) + ' more');
    } catch (err) {
      if (state.activeLabel === name) note(el.labelValues, 'values unavailable: ' + err.message);
    }
  }

  // ---- refresh -------------------------------------------------------------------------------------

  function setTotal(total, hz) {
    let text = total + ' samples';
    if (hz > 0) text += ' (' + (total / hz).toFixed(1) + ' s at ' + hz + ' Hz)';
    el.total.textContent = text;
  }

  async function refresh() {
    if (state.controller) state.controller.abort();
    const controller = new AbortController();
    state.controller = controller;
    const params = queryParams();
    saveHash(params);
    el.status.textContent = 'loading…';
    el.refresh.disabled = true;
    const [profile, top] = await Promise.allSettled([
      getJSON(API + 'profile', Object.assign({ format: 'json' }, params), controller.signal),
      getJSON(API + 'top', Object.assign({ limit: '50' }, params), controller.signal),
    ]);
    if (state.controller !== controller) return;  // a newer refresh owns the page now
    state.controller = null;
    el.refresh.disabled = false;
    el.status.textContent = 'updated ' + new Date().toLocaleTimeString();

    const failure = [profile, top].find((r) => r.status === 'rejected');
    if (failure) showError(failure.reason && failure.reason.message ? failure.reason.message : String(failure.reason));
    else clearError();

    if (profile.status === 'fulfilled' && profile.value.root && typeof profile.value.root === 'object') {
      const body = profile.value;
      const zoomPath = state.zoom ? pathOf(state.zoom) : null;
      state.root = prepareTree(body.root);
      state.total = Number(body.total) || 0;
      state.hz = Number(body.frequency_hz) > 0 ? Number(body.frequency_hz) : null;
      // Keep the zoom across auto-refreshes when the same frame still exists.
      state.zoom = zoomPath ? findPath(state.root, zoomPath) : null;
      setTotal(state.total, state.hz);
    } else {
      if (profile.status === 'fulfilled') showError('unexpected profile response: no "root" tree');
      state.root = null;
      state.zoom = null;
      state.total = 0;
      el.total.textContent = 'no data';
    }
    renderGraph();
    renderTop(top.status === 'fulfilled' ? top.value : null);
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
  el.range.addEventListener('change', () => { syncCustomRange(); if (el.range.value !== 'custom') refresh(); });
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
  loadLabels();
  refresh();
})();
