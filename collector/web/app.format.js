// fleetprof collector UI: the profile types in the page's words, and numbers, times and ranges as the
// page writes them. Pure functions; it touches no element.
'use strict';

window.FleetprofFormat = (function () {
  // The profile types (the API's `type`) in the page's words. cpu counts samples and cuda_launch kernel
  // launches; offcpu, wall and gpu count nanoseconds (unit "nanoseconds", frequency_hz 1e9), which the page
  // shows as seconds. `threads`: the API's default for `threads` (which threads' off-CPU time counts), and
  // what each choice counts.
  const TYPES = {
    cpu: { word: 'CPU', chart: 'CPU over time', threads: null },
    offcpu: {
      word: 'off-CPU', chart: 'Off-CPU over time', threads: 'all',
      counts: {
        all: 'Off-CPU counts every thread\'s waits, idle pools included; wall counts active threads only, ' +
          'so it can read smaller.',
        active: 'Off-CPU of active threads only, as wall counts by default: pools waiting for work are left out.',
      },
    },
    wall: {
      word: 'wall', chart: 'Wall time over time', threads: 'active',
      counts: {
        active: 'Wall counts active threads only (their CPU and waits): pools waiting for work are left out, ' +
          'so it can read smaller than off-CPU, which counts every thread.',
        all: 'Wall of every thread (CPU and all waits), idle pools included, as off-CPU counts by default.',
      },
    },
    gpu: { word: 'GPU kernel', chart: 'GPU kernel time over time', threads: null },
    cuda_launch: { word: 'CUDA launch', chart: 'CUDA launches over time', threads: null },
  };

  function isType(type) {
    return typeof type === 'string' && Object.prototype.hasOwnProperty.call(TYPES, type);
  }

  // What an answer counts: the type it was served as (a collector without types serves CPU samples),
  // whether its values are nanoseconds, and else what they count ("samples", "launches").
  function measureOf(body) {
    const unit = body && typeof body.unit === 'string' ? body.unit : 'samples';
    return {
      type: body && isType(body.type) ? body.type : 'cpu',
      ns: unit === 'nanoseconds',
      counts: unit === 'nanoseconds' ? 'samples' : unit,
    };
  }

  // "no samples in this range" for CPU, "no launches …" for CUDA launches, "no off-CPU time …" for the rest.
  function nothingIn(measure, where) {
    return 'no ' + (measure.ns ? TYPES[measure.type].word + ' time' : measure.counts) + ' ' + where;
  }

  // Why an answer is empty, by its empty_reason: the selector matched nothing ("no_match": the range holds
  // other data), or the range holds nothing at all.
  function nothingFor(body, measure, where) {
    if (body && body.empty_reason === 'no_match') return 'the selector matched nothing ' + where + ' (it holds other data)';
    return nothingIn(measure, where);
  }

  function fmtPct(part, whole) {
    return whole > 0 ? (100 * part / whole).toFixed(2) + '%' : '0.00%';
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

  function escapeRegex(text) {
    return text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
  }

  return {
    TYPES, isType, measureOf, nothingIn, nothingFor, fmtPct, fmtCpu, fmtTime, fmtNs, fmtDuration, isoLocal, fmtSpan,
    escapeRegex,
  };
})();
