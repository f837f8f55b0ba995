// fleetprof collector UI: the A/B comparison (/api/v1/diff): two selectors or time ranges, set by hand
// or by dragging across the chart, their totals, the functions whose share changed most (a Python
// function's lines as one row unless "Python lines apart"), and the diff flame graph (the collector's SVG,
// drawn by app.flame.js inside it; it keeps lines).
'use strict';

window.FleetprofCompare = (function () {
  const F = FleetprofFormat;
  const SIDES = { a: 'A · baseline', b: 'B · comparison' };
  const FIELDS = ['query', 'from', 'until'];

  // el: the comparison's elements and el.side.{a,b}.{query,from,until,total}; page: {chart, selector(),
  // timeRange(), typeParams() (type and threads, as the page's views count), saveHash()}.
  function create(el, page) {
    const compared = { a: null, b: null };  // each side's resolved {from, until}, for the chart's bands
    let controller = null;

    const isOpen = () => !el.section.hidden;

    function dragTarget() {
      const checked = el.form.querySelector('input[name="drag-sets"]:checked');
      return checked ? checked.value : 'a';
    }

    function setDragTarget(key) {
      el.form.querySelector('input[name="drag-sets"][value="' + key + '"]').checked = true;
      updateChartHint();
    }

    function updateChartHint() {
      el.chartHint.textContent = isOpen()
        ? '· drag across it to set ' + SIDES[dragTarget()]
        : '· drag across it to zoom into a time range';
    }

    function drawBands() {
      const bands = [];
      if (isOpen()) {
        for (const key of ['a', 'b']) {
          const r = compared[key];
          if (r) bands.push({ from: r.from, until: r.until, name: key.toUpperCase(), cls: key });
        }
      }
      page.chart.setBands(bands);
    }

    // A drag across the chart picked the range of the side it sets: the next drag sets the other side,
    // and once B is set both are compared.
    function pick(from, until) {
      const key = dragTarget();
      el.side[key].from.value = F.isoLocal(from);
      el.side[key].until.value = F.isoLocal(until);
      compared[key] = { from, until };
      drawBands();
      setDragTarget(key === 'a' ? 'b' : 'a');
      if (key === 'b') run();
      else page.saveHash();
    }

    function open(yes) {
      el.section.hidden = !yes;
      el.toggle.setAttribute('aria-pressed', String(yes));
      if (yes) {
        const range = page.timeRange();
        for (const side of Object.values(el.side)) {
          if (!side.query.value.trim()) side.query.value = page.selector();
          if (!side.from.value.trim()) side.from.value = range.from;
          if (!side.until.value.trim()) side.until.value = range.until;
        }
      } else if (controller) {
        controller.abort();
        controller = null;
        el.run.disabled = false;
        el.status.textContent = '';
      }
      updateChartHint();
      drawBands();
      page.saveHash();
    }

    // The sides into the URL hash's params while the comparison is open.
    function addHashParams(params) {
      if (!isOpen()) return params;
      for (const [key, side] of Object.entries(el.side)) {
        for (const field of FIELDS) params[key + '_' + field] = side[field].value.trim();
      }
      if (el.lines.checked) params.compare_lines = '1';
      return params;
    }

    // The sides from the URL hash's params (URLSearchParams); true when it held a comparison.
    function loadHashParams(params) {
      if (!['a', 'b'].some((key) => params.has(key + '_from') || params.has(key + '_query'))) return false;
      for (const [key, side] of Object.entries(el.side)) {
        for (const field of FIELDS) side[field].value = params.get(key + '_' + field) || '';
      }
      el.lines.checked = params.get('compare_lines') === '1';
      el.section.hidden = false;
      return true;
    }

    function diffParams() {
      const a = el.side.a, b = el.side.b;
      return Object.assign({
        query: a.query.value.trim() || '{}', from: a.from.value.trim() || 'now-1h', until: a.until.value.trim() || 'now',
        query2: b.query.value.trim() || '{}', from2: b.from.value.trim() || 'now-1h', until2: b.until.value.trim() || 'now',
      }, page.typeParams());
    }

    async function run() {
      if (controller) controller.abort();
      const mine = new AbortController();
      controller = mine;
      const params = diffParams();
      page.saveHash();
      el.status.textContent = 'comparing…';
      el.status.classList.remove('failed');
      el.run.disabled = true;
      let body = null, failure = null;
      try {
        const query = Object.assign({ format: 'json', sort: el.sort.value, limit: '50' }, params);
        if (el.lines.checked) query.lines = '1';
        body = await FleetprofApi.getJSON('diff', query, mine.signal);
      } catch (err) {
        failure = err;
      }
      if (controller !== mine) return;  // a newer comparison, or the view was closed
      controller = null;
      el.run.disabled = false;
      if (failure) {
        // Shown beside the Compare button, not in the page's error box: the flame graph above is still right.
        el.status.textContent = 'cannot compare: ' + failure.message;
        el.status.classList.add('failed');
        el.result.hidden = true;
        return;
      }
      el.status.textContent = 'compared at ' + new Date().toLocaleTimeString();
      show(body, params);
    }

    // The type (or its threads) changed: redo the comparison shown, or drop the one a closed view holds.
    function retype() {
      if (!isOpen()) el.result.hidden = true;
      else if (!el.result.hidden) run();
    }

    function showSideTotal(box, key, side, measure) {
      const total = Number(side.total) || 0, hz = Number(side.frequency_hz) || 0;
      const from = Number(side.from), until = Number(side.until);
      box.textContent = '';
      box.dataset.samples = String(total);
      const lines = [
        ['side-title', SIDES[key]],
        measure.ns
          ? ['side-cpu', F.fmtNs(total) + ' ' + F.TYPES[measure.type].word]
          : ['side-cpu', hz > 0 ? (total / hz).toFixed(2) + ' CPU s' : total + ' ' + measure.counts],
        ['side-detail', measure.ns ? total + ' ns' : total + ' ' + measure.counts + (hz > 0 ? ' at ' + hz + ' Hz' : '')],
        ['side-query', String(side.query == null ? '' : side.query)],
        ['side-range', Number.isFinite(from) && Number.isFinite(until) ? F.fmtSpan(from, until) : ''],
      ];
      for (const [cls, text] of lines) {
        const div = document.createElement('div');
        div.className = cls;
        div.textContent = text;
        box.appendChild(div);
      }
    }

    function show(body, params) {
      const sides = { a: body.baseline || {}, b: body.comparison || {} };
      const measure = F.measureOf(body);
      for (const key of ['a', 'b']) {
        const from = Number(sides[key].from), until = Number(sides[key].until);
        compared[key] = Number.isFinite(from) && Number.isFinite(until) ? { from, until } : null;
        showSideTotal(el.side[key].total, key, sides[key], measure);
      }
      el.measure.textContent = F.TYPES[measure.type].word + (measure.ns || measure.type === 'cpu' ? ' time' : 's');
      const warnings = Array.isArray(body.warnings) ? body.warnings.map(String) : [];
      el.warnings.textContent = warnings.join('\n');
      el.warnings.hidden = !warnings.length;
      drawBands();

      const kind = body.sort === 'total' ? 'total' : 'self';
      const heads = el.table.querySelectorAll('thead th');
      heads[2].textContent = 'A ' + kind;
      heads[3].textContent = 'B ' + kind;
      // A function with no time of this kind on either side (a caller, ranked by self time) says nothing here.
      const rows = (Array.isArray(body.functions) ? body.functions : [])
        .filter((fn) => Number(fn['baseline_' + kind]) > 0 || Number(fn['comparison_' + kind]) > 0);
      const tbody = el.table.querySelector('tbody');
      tbody.textContent = '';
      if (!rows.length) {
        const tr = document.createElement('tr');
        const td = document.createElement('td');
        td.colSpan = 6;
        td.className = 'empty';
        const nothing = [sides.a, sides.b].every((side) => side.empty_reason === 'no_match');
        td.textContent = nothing ? F.nothingFor({ empty_reason: 'no_match' }, measure, 'on either side')
          : F.nothingIn(measure, 'on either side');
        tr.appendChild(td);
        tbody.appendChild(tr);
      }
      const hzA = Number(sides.a.frequency_hz) || 0, hzB = Number(sides.b.frequency_hz) || 0;
      const amount = (n, hz) => (measure.ns ? F.fmtNs(n) : hz > 0 ? F.fmtCpu(n, hz) : n + ' ' + measure.counts);
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
      el.svg.src = FleetprofApi.url('diff', Object.assign({ format: 'svg' }, params));
      el.result.hidden = false;
    }

    // The diff SVG sets its own height, and changes it as a zoom brings deeper frames into view: the
    // frame follows, so the graph needs no scrolling of its own.
    let watching = null;
    function fitDiffFrame() {
      try {
        const svg = el.svg.contentDocument && el.svg.contentDocument.documentElement;
        if (!svg || svg.localName !== 'svg') return;
        const fit = () => {
          const height = Number(svg.getAttribute('height'));
          if (height > 0) el.svg.style.height = (height + 4) + 'px';
        };
        fit();
        if (watching) watching.disconnect();
        watching = new MutationObserver(fit);
        watching.observe(svg, { attributes: true, attributeFilter: ['height'] });
      } catch (_) { /* a frame from elsewhere (a proxy's login page) keeps the default height */ }
    }

    el.toggle.addEventListener('click', () => open(!isOpen()));
    el.form.addEventListener('submit', (e) => { e.preventDefault(); run(); });
    el.form.addEventListener('change', (e) => { if (e.target.name === 'drag-sets') updateChartHint(); });
    el.sort.addEventListener('change', () => { if (!el.result.hidden) run(); });
    el.lines.addEventListener('change', () => { if (!el.result.hidden) run(); else page.saveHash(); });
    el.svg.addEventListener('load', fitDiffFrame);

    return { isOpen, open, run, pick, retype, drawBands, addHashParams, loadHashParams };
  }

  return { create };
})();
