// fleetprof collector UI: the top functions table (/api/v1/top), a Python function's lines as one row
// unless "Python lines apart" is on; a click on a row highlights that function in the flame graph (a
// function row: each of its lines, which the flame graph keeps apart).
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

  // tbody: the table's body; onPick(pattern): a row was clicked (namesPattern of it).
  function create(tbody, onPick) {
    // body: the top answer, or null (none yet, or it failed).
    function show(body) {
      tbody.textContent = '';
      const rows = body && Array.isArray(body.functions) ? body.functions : [];
      const measure = F.measureOf(body);
      // Samples as counted for CPU; seconds for the nanosecond types.
      const amount = (n) => (measure.ns ? F.fmtNs(Number(n) || 0) : String(n));
      if (!rows.length) {
        const tr = document.createElement('tr');
        const td = document.createElement('td');
        td.colSpan = 6;
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

    tbody.addEventListener('click', (e) => {
      const tr = e.target.closest ? e.target.closest('tr.top-row') : null;
      if (tr) onPick(tr.dataset.pattern);
    });

    return { show };
  }

  return { create, namesPattern };
})();
