// fleetprof collector UI: the label chips under the query form (/api/v1/labels and their values); a
// click on a value adds that matcher to the selector.
'use strict';

window.FleetprofLabels = (function () {
  const MAX_LABEL_VALUES = 200;  // chips beyond this would bury the page; the selector still takes any value

  // The selector with name="value" added, or null when the selector is not a {…} this can extend.
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

  // el: {labels, labelValues, selector}; onPick(): the selector was extended; onError(message).
  function create(el, onPick, onError) {
    let active = null;  // the label whose values are shown

    async function load() {
      el.labels.textContent = '';
      try {
        const body = await FleetprofApi.getJSON('labels');
        const names = Array.isArray(body.labels) ? body.labels.map(String) : [];
        if (!names.length) { note(el.labels, 'no labels yet'); return; }
        note(el.labels, 'labels:');
        for (const name of names) {
          el.labels.appendChild(chip(name, '', (e) => toggle(name, e.currentTarget)));
        }
      } catch (err) {
        note(el.labels, 'labels unavailable: ' + err.message);
      }
    }

    async function toggle(name, button) {
      el.labelValues.textContent = '';
      for (const b of el.labels.querySelectorAll('.chip.active')) b.classList.remove('active');
      if (active === name) { active = null; return; }
      active = name;
      button.classList.add('active');
      try {
        const body = await FleetprofApi.getJSON('labels/' + encodeURIComponent(name) + '/values?limit=' + MAX_LABEL_VALUES);
        if (active !== name) return;  // another label was clicked meanwhile
        const values = Array.isArray(body.values) ? body.values.map(String) : [];
        note(el.labelValues, name + ' =');
        if (!values.length) note(el.labelValues, '(no values)');
        for (const value of values) {
          el.labelValues.appendChild(chip(value, 'value', () => {
            const next = addMatcher(el.selector.value, name, value);
            if (next === null) { onError('cannot add ' + name + ' to this selector; edit it by hand'); return; }
            el.selector.value = next;
            onPick();
          }));
        }
        if (body.truncated) note(el.labelValues, '… and more (type the value in the selector)');
      } catch (err) {
        if (active === name) note(el.labelValues, 'values unavailable: ' + err.message);
      }
    }

    return { load };
  }

  return { create, addMatcher };
})();
