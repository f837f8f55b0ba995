// Flame graphs, drawn the same way wherever fleetprof draws one: the web UI loads this file, and the
// HTML and SVG flame graphs (collector/render/html.py, svg.py) inline it, so they work offline.
//
// Rules this file keeps:
// - Frames come as one preorder array of {name, depth, value, colour}, root first at depth 0, so a
//   frame's subtree is the run of frames after it that are deeper than it. Nothing here recurses.
// - The root is drawn on top (icicle order, as Grafana and Pyroscope read), and the drawing opens as
//   deep as the deepest frame holding LOOK.deep_share of what is in view; frames below that (rare paths,
//   broken deep stacks) are reached by scrolling (HTML) or by zooming into them (both).
// - A drawing surface (HTML divs, SVG rects) only places, hides and marks elements; layout, zoom,
//   search and colours are decided here, once.
'use strict';

window.FleetprofFlame = (function () {
  // The one palette. collector/render/svg.py reads this object out of this file (between the two marker
  // comments) to colour the SVG's frames alike, so it stays one JSON object.
  const LOOK = /* LOOK: */ {
    "user": {"base": [200, 60, 30], "span": [55, 150, 40]},
    "kernel": {"base": [70, 140, 200], "span": [60, 60, 55]},
    "plain": "#c8c8c8",
    "match": "#e040e0",
    "deep_share": 0.001
  } /* :LOOK */;
  const FRAME_H = 18;  // px per level of the HTML drawing: a 17 px frame and a 1 px gap (app.flame.css)
  const TRUNCATED = '[truncated]';  // the module of the frame truncation folds light children into

  // FNV-1a over code points (svg.py hashes the same way).
  function nameHash(name) {
    let h = 0x811c9dc5;
    for (const ch of name) h = Math.imul(h ^ ch.codePointAt(0), 0x01000193) >>> 0;
    return h;
  }

  // Deterministic per name: warm reds, oranges and yellows for user code, blues for the kernel. Each
  // channel is base + span * byte / 255, floored, evaluated in this order in svg.py too so both round alike.
  function frameColour(name, kernel) {
    const h = nameHash(name), p = kernel ? LOOK.kernel : LOOK.user;
    const bytes = [h & 0xff, (h >>> 8) & 0xff, (h >>> 16) & 0xff];
    return '#' + p.base.map((b, i) => Math.floor(b + p.span[i] * bytes[i] / 255).toString(16).padStart(2, '0'))
      .join('');
  }

  // The colour of a frame of a profile: grey for the root and for truncation's "other" frame.
  function nodeColour(name, module, kernel, depth) {
    return depth === 0 || (name === 'other' && module === TRUNCATED) ? LOOK.plain : frameColour(name, kernel);
  }

  // ---- the drawing, whatever the surface ---------------------------------------------------------------

  // surface: htmlSurface() or svgSurface(). on.hover(k, event): the pointer is over frame k (-1: none);
  // on.zoom(k, deeper): frame k fills the width now; deeper: frames below the ones that hold deep_share
  // exist (out of view unless expand(true) asked for every level).
  function create(surface, on) {
    on = on || {};
    let nodes = [], X = [], END = [], PARENT = [];
    let els = [], shown = [], zoomed = 0, re = null, expanded = false;

    function load(list) {
      surface.clear();
      nodes = list;
      const n = nodes.length;
      X = new Array(n); END = new Array(n); PARENT = new Array(n); els = new Array(n);
      shown = [];
      zoomed = 0;
      // A frame starts where its parent does, after the siblings before it: one cursor per depth.
      const cursor = [], path = [];
      for (let i = 0; i < n; i++) {
        const d = nodes[i].depth;
        X[i] = cursor[d] || 0;
        cursor[d] = X[i] + nodes[i].value;
        cursor[d + 1] = X[i];
        PARENT[i] = d > 0 ? path[d - 1] : -1;
        path[d] = i;
      }
      for (let i = n - 1; i >= 0; i--) {  // END[i]: one past the last frame of i's subtree
        let e = i + 1;
        while (e < n && nodes[e].depth > nodes[i].depth) e = END[e];
        END[i] = e;
      }
    }

    // Zoom into frame z (0: the root): its subtree fills the width under its ancestors.
    function draw(z) {
      if (!nodes.length) return;
      zoomed = z >= 0 && z < nodes.length ? z : 0;
      const width = surface.width(), v0 = nodes[zoomed].value || 1, x0 = X[zoomed];
      const next = [];
      for (let a = PARENT[zoomed]; a >= 0; a = PARENT[a]) next.push([a, 0, 1, true]);
      const enough = LOOK.deep_share * v0;
      let inView = nodes[zoomed].depth, deepest = inView;
      for (let k = zoomed; k < END[zoomed];) {
        const fw = nodes[k].value / v0;
        if (!(fw * width >= surface.minPx)) { k = END[k]; continue; }  // its subtree is narrower still
        next.push([k, (X[k] - x0) / v0, fw, false]);
        if (nodes[k].value >= enough) inView = Math.max(inView, nodes[k].depth);
        deepest = Math.max(deepest, nodes[k].depth);
        k++;
      }
      surface.begin((expanded ? deepest : inView) + 1, deepest + 1, width);
      const placed = new Set();
      for (const [k, fx, fw, ancestor] of next) {
        if (!els[k]) els[k] = surface.make(k, nodes[k]);
        surface.place(els[k], nodes[k], fx, fw, ancestor);
        placed.add(k);
      }
      for (const [k] of shown) if (!placed.has(k)) surface.hide(els[k]);
      shown = next;
      surface.end();
      paint();
      if (on.zoom) on.zoom(zoomed, deepest > inView);
    }

    function paint() {
      for (const [k] of shown) surface.mark(els[k], nodes[k], re !== null && re.test(nodes[k].name));
    }

    // Highlights frames whose name matches the regular expression `pattern` ('' clears). Returns
    // {share}: the fraction of all samples under a match (a match inside a match counted once, over every
    // frame, drawn or not; null when cleared), or {error} for a pattern that is not a regular expression
    // (which clears the highlights).
    function search(pattern) {
      let next = null, error = null;
      if (pattern) {
        try { next = new RegExp(pattern); } catch (err) { error = err.message; }
      }
      re = next;
      paint();
      if (error !== null) return { error };
      if (!re) return { share: null };
      let sum = 0;
      for (let k = 0; k < nodes.length;) {
        if (re.test(nodes[k].name)) { sum += nodes[k].value; k = END[k]; } else k++;
      }
      return { share: nodes.length && nodes[0].value > 0 ? sum / nodes[0].value : 0 };
    }

    // A click zooms into the frame, or out to its parent when it is the one zoomed into.
    surface.events.addEventListener('click', (event) => {
      const k = surface.indexOf(event.target);
      if (k >= 0) draw(k === zoomed && k > 0 ? PARENT[k] : k);
    });
    // Over: entering a frame; move: the tooltip beside the UI's pointer follows it.
    for (const type of ['mouseover', 'mousemove']) {
      surface.events.addEventListener(type, (event) => {
        if (on.hover) on.hover(surface.indexOf(event.target), event);
      });
    }
    surface.events.addEventListener('mouseleave', (event) => { if (on.hover) on.hover(-1, event); });

    return {
      load, draw, search,
      redraw: () => draw(zoomed),
      // Every level in view (true), or down to the deepest frame holding deep_share (false, the default).
      expand: (yes) => { expanded = Boolean(yes); draw(zoomed); },
      expanded: () => expanded,
      zoomed: () => zoomed,
      parent: (k) => PARENT[k],
      node: (k) => nodes[k],
      size: () => nodes.length,
    };
  }

  // ---- surfaces --------------------------------------------------------------------------------------

  // Absolutely placed divs in `box`, which becomes a viewport as deep as the frames in view and scrolls to
  // the rest. options.invert(): draw the root at the bottom; options.decorate(div, node): extra attributes.
  function htmlSurface(box, options) {
    options = options || {};
    box.classList.add('fp-flame');
    const canvas = document.createElement('div');
    canvas.className = 'fp-canvas';
    box.appendChild(canvas);
    let rows = 1, invert = false, widthPx = 1000;
    return {
      minPx: 0.5,  // narrower frames would be invisible and only cost elements
      events: canvas,
      width: () => canvas.clientWidth || box.clientWidth || 1000,
      clear() {
        canvas.textContent = '';
        if (!canvas.parentNode) box.appendChild(canvas);
      },
      make(k, node) {
        const div = document.createElement('div');
        div.className = 'frame';
        div.dataset.i = String(k);
        div.dataset.name = node.name;
        if (options.decorate) options.decorate(div, node);
        return div;
      },
      begin(inView, drawn, width) {
        rows = drawn;
        widthPx = width;
        invert = Boolean(options.invert && options.invert());
        canvas.style.height = (drawn * FRAME_H) + 'px';
        box.style.height = (inView * FRAME_H) + 'px';
        box.style.overflowY = drawn > inView ? 'auto' : 'hidden';
      },
      place(div, node, fx, fw, ancestor) {
        const row = invert ? rows - 1 - node.depth : node.depth;
        div.style.left = (fx * 100) + '%';
        div.style.width = (fw * 100) + '%';
        div.style.top = (row * FRAME_H) + 'px';
        div.classList.toggle('ancestor', ancestor);
        div.textContent = fw * widthPx > 20 ? node.name : '';
        if (!div.parentNode) canvas.appendChild(div);
      },
      hide: (div) => div.remove(),
      end() {
        // Open on the root: the top of the drawing, or its bottom when the root is drawn there.
        box.scrollTop = invert ? box.scrollHeight : 0;
      },
      mark(div, node, hit) {
        div.classList.toggle('match', hit);
        div.style.backgroundColor = hit ? LOOK.match : node.colour;
      },
      indexOf(target) {
        const div = target && target.closest ? target.closest('.frame') : null;
        return div && canvas.contains(div) ? Number(div.dataset.i) : -1;
      },
    };
  }

  // The SVG document's own frames (svg.py draws them, so the file shows without scripts): groups of
  // <title>, <rect> and <text> in #frames, in preorder, with data-v their value and data-n their name
  // where the label is cut. cfg: the geometry svg.py drew with.
  function svgSurface(svg, cfg) {
    const NS = 'http://www.w3.org/2000/svg';
    const frames = svg.getElementById('frames');
    const groups = Array.from(frames.children);
    let rows = 1;
    function label(name, w) {
      const room = Math.floor((w - 2 * cfg.inset) / cfg.cw);
      if (room < 3) return '';
      return name.length <= room ? name : name.slice(0, room - 2) + '..';
    }
    return {
      minPx: 0,  // svg.py already left out what is too narrow to see
      events: frames,
      width: () => cfg.avail,
      nodes: () => groups.map((g) => {
        const rect = g.querySelector('rect'), text = g.querySelector('text');
        return {
          name: g.getAttribute('data-n') || (text ? text.textContent : ''),
          depth: Math.round((Number(rect.getAttribute('y')) - cfg.top) / cfg.fh),
          value: Number(g.getAttribute('data-v')) || 0,
          colour: rect.getAttribute('fill'),
          title: g.querySelector('title') ? g.querySelector('title').textContent : '',
        };
      }),
      clear() {},
      make(k) {
        groups[k].setAttribute('data-i', String(k));
        return groups[k];
      },
      begin(inView) {
        rows = inView;
        cfg.resize(inView);
      },
      place(g, node, fx, fw, ancestor) {
        const rect = g.querySelector('rect'), x = cfg.pad + fx * cfg.avail, w = fw * cfg.avail;
        g.setAttribute('class', node.depth >= rows ? 'hid' : ancestor ? 'anc' : '');
        rect.setAttribute('x', x.toFixed(2));
        rect.setAttribute('width', w.toFixed(2));
        let text = g.querySelector('text');
        const shown = label(node.name, w);
        if (shown && !text) {
          text = document.createElementNS(NS, 'text');
          text.setAttribute('y', String(Number(rect.getAttribute('y')) + cfg.fh - 5));
          g.appendChild(text);
        }
        if (text) {
          text.setAttribute('x', (x + cfg.inset).toFixed(2));
          text.textContent = shown;
        }
      },
      hide: (g) => g.setAttribute('class', 'hid'),
      end() {},
      mark(g, node, hit) {
        g.querySelector('rect').setAttribute('fill', hit ? LOOK.match : node.colour);
      },
      indexOf(target) {
        const g = target && target.closest ? target.closest('#frames > g') : null;
        return g && g.hasAttribute('data-i') ? Number(g.getAttribute('data-i')) : -1;
      },
    };
  }

  // ---- the two standalone documents ---------------------------------------------------------------------

  function percent(fraction) {
    return Number((100 * fraction).toPrecision(6)) + '%';
  }

  // The line under an HTML flame graph whose drawing goes deeper than its box shows.
  function deeperText() {
    return 'deeper frames hold under ' + percent(LOOK.deep_share) + ' each: scroll to them, or click a frame to zoom';
  }

  function matchedText(result) {
    if (result.error) return 'invalid regex: ' + result.error;
    return result.share === null ? '' : 'matched: ' + (100 * result.share).toFixed(2) + '%';
  }

  // The HTML flame graph (html.py): its data in #fp-data, a search box, a reset link, a details line.
  function htmlPage() {
    const $ = (id) => document.getElementById(id);
    const data = JSON.parse($('fp-data').textContent);
    const nodes = data.nodes.map(([name, module, depth, value, self, kernel]) => {
      const n = { name: data.names[name], module: data.names[module], depth, value, self, kernel: kernel === 1 };
      n.colour = nodeColour(n.name, n.module, n.kernel, depth);
      return n;
    });
    const box = $('flame');
    if (!nodes.length) { box.textContent = 'no samples'; return; }
    const total = nodes[0].value;
    function describe(n) {
      const module = n.module || (n.kernel ? 'kernel' : '');
      let text = n.name + (module ? ' (' + module + ')' : '') + ' — ' + n.value + ' ' + data.unit + ', ' +
        (100 * n.value / total).toFixed(2) + '%';
      if (data.hz) text += ', ' + (n.value / data.hz).toFixed(2) + ' s';
      return text;
    }
    const surface = htmlSurface(box, { decorate: (div, n) => { div.title = describe(n); } });
    const flame = create(surface, {
      hover: (k) => { $('details').textContent = k >= 0 ? describe(flame.node(k)) : ''; },
      zoom: (k, deeper) => {
        $('reset').hidden = k === 0;
        $('deeper').hidden = !deeper;
      },
    });
    $('deeper').textContent = deeperText();
    flame.load(nodes);
    flame.draw(0);
    const search = () => { $('matched').textContent = matchedText(flame.search($('search').value)); };
    $('search').addEventListener('input', search);
    $('reset').addEventListener('click', () => flame.draw(0));
    let timer = null;
    window.addEventListener('resize', () => { clearTimeout(timer); timer = setTimeout(flame.redraw, 100); });
  }

  // The SVG flame graph (svg.py): zoom on click, search through a prompt (Ctrl-F), details on hover, and
  // the document's height following the frames in view.
  function svgDocument(cfg) {
    const svg = document.documentElement;
    const $ = (id) => document.getElementById(id);
    cfg.resize = (rows) => {
      const framesBottom = cfg.top + rows * cfg.fh, height = framesBottom + cfg.bottom;
      svg.setAttribute('height', String(height));
      svg.setAttribute('viewBox', '0 0 ' + cfg.width + ' ' + height);
      $('background').setAttribute('height', String(height));
      $('deeper').setAttribute('y', String(framesBottom + 16));
    };
    const surface = svgSurface(svg, cfg);
    const nodes = surface.nodes(), share = percent(LOOK.deep_share);
    const flame = create(surface, {
      hover: (k) => { $('details').textContent = k >= 0 ? flame.node(k).title : ' '; },
      zoom: (k, deeper) => {
        $('reset').setAttribute('class', k === 0 ? 'ctl hid' : 'ctl');
        // An SVG cannot scroll: a click on this line shows every level, or hides the deep ones again.
        const note = $('deeper');
        note.setAttribute('class', deeper ? 'ctl' : 'ctl hid');
        note.textContent = flame.expanded()
          ? 'show only the levels down to the deepest frame holding ' + share + ' or more'
          : 'deeper frames hold under ' + share + ' each: click here to show them, or click a frame to zoom';
      },
    });
    flame.load(nodes);
    if (!nodes.length) return;
    flame.draw(0);
    function ask() {
      const pattern = window.prompt('Search frames (regular expression), empty to clear', '');
      if (pattern !== null) $('matched').textContent = matchedText(flame.search(pattern));
    }
    $('reset').addEventListener('click', () => flame.draw(0));
    $('deeper').addEventListener('click', () => flame.expand(!flame.expanded()));
    $('search').addEventListener('click', ask);
    document.addEventListener('keydown', (e) => {
      if ((e.ctrlKey || e.metaKey) && (e.key === 'f' || e.key === 'F')) { e.preventDefault(); ask(); }
      else if (e.key === 'Escape') $('matched').textContent = matchedText(flame.search(''));
    });
  }

  return {
    LOOK, FRAME_H, nameHash, frameColour, nodeColour, deeperText, create, htmlSurface, svgSurface, htmlPage,
    svgDocument,
  };
})();
