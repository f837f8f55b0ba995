// fleetprof collector UI: the top functions table (/api/v1/top), a Python function's lines as one row
// unless "Python lines apart" is on; a click on a row highlights that function in the flame graph (a
// function row: each of its lines, which the flame graph keeps apart). Off-CPU and wall answers rank by
// where threads blocked (rank "blocked"): the function of their own code, the reason and the time; "By
// frame" asks for the self/total ranking instead.
'use strict';

window.FleetprofTop = (function () {
  const F = FleetprofFormat;

  // The flame graph's names of a row: a Python function's row ("f (a.py)", lines [3, 7]) stands for its
  // frames "f (a.py:3)" and "f (a.py:7)"; any other row for its own name. A regex, whole names only.
  function namesPattern(name, lines) {
    if (Array.isArray(lines) && lines.length && name.endsWith(')')) {
      return '^' + F.escapeRegex(name.slice(0, -1)) + ':(' + lines.map(Number).join('|') + ')\\)$';
    }
    return '^' + F.escapeRegex(name) + '$';
  }

  // The table's columns, by how the answer ranks: [heading, cell class]; a heading takes its column's
  // alignment ("num") only.
  const COLUMNS = {
    frame: [['Function', ''], ['Module', 'module'], ['Self', 'num'], ['Self %', 'num'], ['Total', 'num'], ['Total %', 'num']],
    blocked: [['Where it blocked', ''], ['Module', 'module'], ['Reason', 'reason'], ['Time', 'num'], ['Share', 'num']],
  };
  const TITLES = { frame: 'Top functions', blocked: 'Where threads blocked, and why' };

  function rankOf(body) {
    return body && body.rank === 'blocked' ? 'blocked' : 'frame';
  }

  // The cells of a row, as text, in COLUMNS' order.
  function cellsOf(fn, rank, amount) {
    const module = fn.module ? String(fn.module) : (fn.kernel ? '[kernel]' : '');
    if (rank === 'blocked') {
      return [fn.function, module, String(fn.reason || ''), amount(fn.value), Number(fn.pct || 0).toFixed(2) + '%'];
    }
    return [
      fn.function, module, amount(fn.self), Number(fn.self_pct || 0).toFixed(2) + '%',
      amount(fn.total), Number(fn.total_pct || 0).toFixed(2) + '%',
    ];
  }

  // tbody: the table's body (its table's thead is redrawn for the answer's ranking); title: the section's
  // heading; onPick(pattern): a row was clicked (namesPattern of it).
  function create(tbody, title, onPick) {
    const head = tbody.parentNode.querySelector('thead tr');

    function showHead(rank) {
      head.textContent = '';
      for (const [text, cls] of COLUMNS[rank]) {
        const th = document.createElement('th');
        if (cls === 'num') th.className = cls;
        th.textContent = text;
        head.appendChild(th);
      }
      if (title) title.textContent = TITLES[rank];
    }

    // body: the top answer, or null (none yet, or it failed).
    function show(body) {
      tbody.textContent = '';
      const rank = rankOf(body);
      showHead(rank);
      const rows = body && Array.isArray(body.functions) ? body.functions : [];
      const measure = F.measureOf(body);
      // Samples as counted for CPU; seconds for the nanosecond types.
      const amount = (n) => (measure.ns ? F.fmtNs(Number(n) || 0) : String(n));
      if (!rows.length) {
        const tr = document.createElement('tr');
        const td = document.createElement('td');
        td.colSpan = COLUMNS[rank].length;
        td.className = 'empty';
        td.textContent = body ? F.nothingFor(body, measure, 'in this range') : '';
        tr.appendChild(td);
        tbody.appendChild(tr);
        return;
      }
      for (const fn of rows) {
        const tr = document.createElement('tr');
        tr.className = fn.kernel ? 'top-row kernel' : 'top-row';
        const name = String(fn.function == null ? '' : fn.function);
        tr.dataset.name = name;
        tr.dataset.pattern = namesPattern(name, fn.lines);
        const texts = cellsOf(Object.assign({}, fn, { function: name }), rank, amount);
        COLUMNS[rank].forEach(([, cls], i) => {
          const td = document.createElement('td');
          if (cls) td.className = cls;
          td.textContent = texts[i];
          tr.appendChild(td);
        });
        tr.title = 'highlight ' + name + ' in the flame graph';
        tbody.appendChild(tr);
      }
    }

    tbody.addEventListener('click', (e) => {
      const tr = e.target.closest ? e.target.closest('tr.top-row') : null;
      if (tr) onPick(tr.dataset.pattern);
    });

    return { show };
  }

  return { create, namesPattern };
})();
