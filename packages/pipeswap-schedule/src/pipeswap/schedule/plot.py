"""A picture of a simulation: each rank's streams over time, and its activation memory.

Needs matplotlib: ``pip install pipeswap-schedule[plot]``. The format follows the file's
suffix (``.png``, ``.svg``, ``.pdf``).
"""

from __future__ import annotations

from pathlib import Path

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.simulate import SimulationResult

_ROWS = {"compute": 0, "d2h": 1, "copy": 1, "h2d": 2}
_COLOURS = {"F": "#4c78a8", "B": "#f58518", "I": "#e45756", "W": "#72b7b2", "wait": "#d62728",
            "LO": "#54a24b", "LL": "#b279a2"}


def _colour(label: str) -> str:
    if label.startswith("wait"):
        return _COLOURS["wait"]
    for code in ("LO", "LL", "I", "W", "B", "F"):
        if code in label.lstrip("0123456789")[:2]:
            return _COLOURS[code]
    return "#999999"


def plot(result: SimulationResult, path: str | Path) -> None:
    """Draw the timeline (top) and the activation memory of every rank (bottom) to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ScheduleError("plotting needs matplotlib: pip install 'pipeswap-schedule[plot]'"
                            ) from None
    ranks = result.ranks
    figure, (timeline, memory) = plt.subplots(
        2, 1, figsize=(12, 2 + 0.9 * len(ranks)), sharex=True,
        gridspec_kw={"height_ratios": [max(1, len(ranks)), 1.5]})
    for rank in ranks:
        base = rank.rank * 4
        for span in rank.spans:
            timeline.broken_barh([(span.start, span.end - span.start)],
                                 (base + _ROWS[span.stream], 0.8),
                                 facecolors=_colour(span.label), edgecolors="white",
                                 linewidth=0.5)
        times = [0.0, *(t for t, _ in rank.memory)]
        held = [0, *(h / 2**20 for _, h in rank.memory)]
        memory.step(times, held, where="post", label=f"rank {rank.rank}")
    timeline.set_yticks([r.rank * 4 + row + 0.4 for r in ranks for row in range(3)],
                        [f"{r.rank} {name}" for r in ranks for name in ("compute", "d2h", "h2d")])
    timeline.invert_yaxis()
    timeline.set_title(f"simulated step: {result.step_time:.4g} s")
    memory.set_ylabel("activations (MiB)")
    memory.set_xlabel("time (s)")
    memory.legend(loc="upper right", fontsize="small")
    figure.tight_layout()
    try:
        figure.savefig(Path(path))
    except ValueError as exc:  # a suffix no matplotlib backend writes
        raise ScheduleError(f"cannot draw {path}: {exc}; name it .png, .svg or .pdf") from None
    finally:
        plt.close(figure)
