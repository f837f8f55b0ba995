// fleetprof collector UI: the way to the collector's /api/v1, wherever the UI is mounted, and JSON
// answers read with the collector's own error messages.
'use strict';

window.FleetprofApi = (function () {
  // The API lives next to the UI's mount point: "/" or "/ui/..." here, or under a proxy's prefix.
  const BASE = (() => {
    const path = location.pathname;
    const ui = path.lastIndexOf('/ui/');
    return (ui >= 0 ? path.slice(0, ui + 1) : path.slice(0, path.lastIndexOf('/') + 1)) + 'api/v1/';
  })();

  function url(endpoint, params) {
    return BASE + endpoint + (params ? '?' + new URLSearchParams(params).toString() : '');
  }

  // The JSON object an endpoint answers; a failure throws an Error saying why (the collector's message
  // for a 4xx/5xx), an abort throws the AbortError itself.
  async function getJSON(endpoint, params, signal) {
    const where = url(endpoint, params);
    let res;
    try {
      res = await fetch(where, { signal, headers: { Accept: 'application/json' } });
    } catch (err) {
      if (err && err.name === 'AbortError') throw err;
      throw new Error('cannot reach the collector (' + where + '): ' + (err && err.message ? err.message : err));
    }
    const text = await res.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (_) { body = null; }
    if (!res.ok) {
      const msg = body && typeof body.error === 'string' ? body.error : (text.trim().slice(0, 300) || res.statusText);
      throw new Error(msg + ' (HTTP ' + res.status + ')');
    }
    if (body === null || typeof body !== 'object') {
      throw new Error('unexpected response from ' + BASE + endpoint + ': not a JSON object');
    }
    return body;
  }

  return { url, getJSON };
})();
