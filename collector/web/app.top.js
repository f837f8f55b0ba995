// fleetprof collector UI: the top functions table (/api/v1/top); a click on a row highlights that
// function in the flame graph.
'use strict';

window.FleetprofTop = (function () {
  const F = FleetprofFormat;

  // tbody: the table's body; onPick(name): a row was clicked.
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
        td.textContent = body ? F.nothingIn(measure, 'in this range') : '';
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

    tbody.addEventListener('click', (e) => {
      const tr = e.target.closest ? e.target.closest('tr.top-row') : null;
      if (tr) onPick(tr.dataset.name);
    });

    return { show };
  }

  return { create };
})();
