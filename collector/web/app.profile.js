// fleetprof collector UI: the flame graph panel. A /api/v1/profile tree drawn by app.flame.js, with the
// total above it, the search box, "root at bottom", "Reset zoom", the frame tooltip, and the zoom kept
// across refreshes while the same frame is still there.
'use strict';

window.FleetprofProfile = (function () {
  const F = FleetprofFormat;

  // Every field made safe to use, parent and depth added, and the nodes listed in preorder (the order
  // app.flame.js draws from); iterative, so deep stacks cannot overflow.
  function flatten(root) {
    const nodes = [];
    const pending = [[root, null, 0]];
    while (pending.length) {
      const [node, parent, depth] = pending.pop();
      node.name = String(node.name == null ? '' : node.name);
      node.module = String(node.module == null ? '' : node.module);
      node.kernel = Boolean(node.kernel);
      node.value = Number(node.value) || 0;
      node.self = Number(node.self) || 0;
      if (!Array.isArray(node.children)) node.children = [];
      node.parent = parent;
      node.depth = depth;
      node.index = nodes.length;
      node.colour = FleetprofFlame.nodeColour(node.name, node.module, node.kernel, depth);
      nodes.push(node);
      for (let i = node.children.length - 1; i >= 0; i--) pending.push([node.children[i], node, depth + 1]);
    }
    return nodes;
  }

  function pathOf(node) {
    const path = [];
    for (let n = node; n && n.parent; n = n.parent) path.unshift([n.name, n.module, n.kernel]);
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

  // el: {graph, deeper (the line that says frames are below the box), total, search, searchStatus, invert,
  // resetZoom}.
  function create(el) {
    let nodes = [], total = 0, hz = null, measure = F.measureOf(null);
    el.deeper.textContent = FleetprofFlame.deeperText();
    const empty = document.createElement('div');
    empty.className = 'empty';
    const surface = FleetprofFlame.htmlSurface(el.graph, {
      invert: () => el.invert.checked,
      decorate: (div, node) => {
        div.dataset.module = node.module;
        if (node.kernel) div.dataset.kernel = 'true';
      },
    });
    const flame = FleetprofFlame.create(surface, {
      hover: (k, event) => { if (k >= 0) showTooltip(nodes[k], event); else FleetprofTooltip.hide(); },
      zoom: (k, deeper) => {
        el.resetZoom.disabled = k === 0;
        el.deeper.hidden = !deeper;
      },
    });

    function showTooltip(node, event) {
      const lines = [node.name];
      if (node.module) lines.push('module: ' + node.module);
      if (node.kernel) lines.push('kernel frame');
      const share = (n) => ' (' + F.fmtPct(n, total) + ')';
      if (measure.ns) {
        lines.push(F.TYPES[measure.type].word + ' time: ' + F.fmtNs(node.value) + share(node.value));
        lines.push('self: ' + F.fmtNs(node.self) + share(node.self));
      } else {
        lines.push(measure.counts + ': ' + node.value + share(node.value));
        lines.push('self: ' + node.self + share(node.self));
        if (hz > 0) lines.push('time: ' + (node.value / hz).toFixed(2) + ' s at ' + hz + ' Hz');
      }
      FleetprofTooltip.show(lines, event);
    }

    function setTotal(body) {
      if (!body) { el.total.textContent = 'no data'; return; }
      if (measure.ns) { el.total.textContent = F.fmtNs(total) + ' ' + F.TYPES[measure.type].word; return; }
      let text = total + ' ' + measure.counts;
      if (hz > 0) text += ' (' + (total / hz).toFixed(1) + ' s at ' + hz + ' Hz)';
      el.total.textContent = text;
    }

    // body: the profile answer, or null (none yet, or it failed).
    function show(body) {
      const zoomPath = nodes.length && flame.zoomed() > 0 ? pathOf(nodes[flame.zoomed()]) : null;
      FleetprofTooltip.hide();
      empty.remove();
      const root = body ? body.root : null;
      measure = F.measureOf(body);
      total = body ? Number(body.total) || 0 : 0;
      hz = body && Number(body.frequency_hz) > 0 ? Number(body.frequency_hz) : null;
      setTotal(body);
      nodes = root && Number(root.value) > 0 ? flatten(root) : [];
      flame.load(nodes);
      if (!nodes.length) {
        el.graph.style.height = '';
        el.graph.style.overflowY = 'hidden';
        empty.textContent = root ? F.nothingFor(body, measure, 'in this range') : '';
        el.graph.appendChild(empty);
        el.resetZoom.disabled = true;
        el.deeper.hidden = true;
        el.searchStatus.textContent = '';
        return;
      }
      if (!total) total = nodes[0].value;
      // Keep the zoom across auto-refreshes when the same frame still exists.
      const zoomed = zoomPath ? findPath(nodes[0], zoomPath) : null;
      flame.draw(zoomed ? zoomed.index : 0);
      onSearchInput();
    }

    function onSearchInput() {
      const result = flame.search(el.search.value);
      if (result.error) el.searchStatus.textContent = 'invalid regex: ' + result.error;
      else el.searchStatus.textContent = result.share === null ? '' : 'matched: ' + F.fmtPct(result.share, 1);
    }

    // Highlights every frame of one function (a click in the top table) and brings the graph into view.
    // pattern: a regex of whole frame names (the top table's namesPattern).
    function highlight(pattern) {
      el.search.value = pattern;
      onSearchInput();
      el.graph.scrollIntoView({ block: 'nearest' });
    }

    el.search.addEventListener('input', onSearchInput);
    el.invert.addEventListener('change', () => { if (nodes.length) flame.redraw(); });
    el.resetZoom.addEventListener('click', () => flame.draw(0));
    document.addEventListener('keydown', (e) => {
      if ((e.ctrlKey || e.metaKey) && (e.key === 'f' || e.key === 'F') && nodes.length) {
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
      resizeTimer = setTimeout(() => { if (nodes.length) flame.redraw(); }, 150);
    });

    return { show, highlight };
  }

  return { create };
})();
