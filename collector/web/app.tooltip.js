// fleetprof collector UI: the one floating tooltip (#tooltip) the flame graph and the chart share, kept
// inside the window beside the pointer.
'use strict';

window.FleetprofTooltip = (function () {
  const PAD = 14;  // px between the pointer and the tooltip

  function show(lines, event) {
    const tip = document.getElementById('tooltip');
    tip.textContent = lines.join('\n');
    tip.hidden = false;
    const rect = tip.getBoundingClientRect();
    let left = event.clientX + PAD, top = event.clientY + PAD;
    if (left + rect.width > window.innerWidth) left = Math.max(0, event.clientX - rect.width - PAD);
    if (top + rect.height > window.innerHeight) top = Math.max(0, event.clientY - rect.height - PAD);
    tip.style.left = left + 'px';
    tip.style.top = top + 'px';
  }

  function hide() {
    document.getElementById('tooltip').hidden = true;
  }

  return { show, hide };
})();
