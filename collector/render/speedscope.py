"""Merged stacks as a speedscope file: one "sampled" profile (www.speedscope.app/file-format-schema.json)."""

from __future__ import annotations

from fleetprof.collector.model.profile import FrameKey, Stacks
from fleetprof.collector.render.names import Names, as_stored
from fleetprof.collector.render.tree import UNKNOWN_FRAME

SCHEMA_URL = "https://www.speedscope.app/file-format-schema.json"
KERNEL_FILE = "[kernel]"


def to_speedscope(
    stacks: Stacks, frequency_hz: int | None, name: str = "fleetprof CPU profile", names: Names = as_stored
) -> dict:
    """A speedscope "sampled" profile: one sample per distinct stack (root first), weighted by CPU time.

    Weights are nanoseconds (samples × 1e9 / frequency) when the frequency is known, else plain sample
    counts with unit "none". Stacks are sorted by their frames' names so the output is deterministic.
    Frames are named by their shown (demangled) names; two raw names that demangle alike stay two frames.
    """
    frames: list[dict] = []
    index: dict[FrameKey, int] = {}

    def frame_index(frame: FrameKey) -> int:
        i = index.get(frame)
        if i is None:
            i = index[frame] = len(frames)
            entry = {"name": names(frame.function) or UNKNOWN_FRAME}
            file = frame.module or (KERNEL_FILE if frame.kernel else "")
            if file:
                entry["file"] = file
            frames.append(entry)
        return i

    unknown = (FrameKey(UNKNOWN_FRAME),)
    ns_per_sample = 1e9 / frequency_hz if frequency_hz else None
    samples, weights = [], []
    ordered = sorted(
        ((s, c) for s, c in stacks.items() if c > 0),
        key=lambda sc: [(f.function, f.module, f.kernel) for f in sc[0]],
    )
    for stack, count in ordered:
        samples.append([frame_index(f) for f in (stack or unknown)])
        weights.append(round(count * ns_per_sample) if ns_per_sample else count)
    total = sum(weights)
    return {
        "$schema": SCHEMA_URL,
        "exporter": "fleetprof",
        "name": name,
        "activeProfileIndex": 0,
        "shared": {"frames": frames},
        "profiles": [
            {
                "type": "sampled",
                "name": name,
                "unit": "nanoseconds" if ns_per_sample else "none",
                "startValue": 0,
                "endValue": total,
                "samples": samples,
                "weights": weights,
            }
        ],
    }
