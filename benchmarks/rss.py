"""Peak resident memory per phase of a run, for the benchmarks (issue 15: where the build's peak sits)."""

from __future__ import annotations

_PHASE = ["setup"]
"""The build phase :class:`RssPhases` attributes samples to (set by its wrappers)."""
_HIGH: dict[str, float] = {}
"""Phase -> the process's high-water RSS (:func:`high_water_mib`) when it last rose during that phase."""
_LAST = [0.0]


def high_water_mib() -> float:
    """This process's peak resident memory (MiB): ``VmHWM`` of ``/proc/self/status``, the kernel's
    high-water mark of the current address space.

    Not ``ru_maxrss``: on Linux ``execve`` keeps the old address space's high-water mark in it
    (``signal->maxrss``), so a child started by ``spawn`` (fork + exec) reports at least its parent's
    resident memory at the fork, the benchmark's events table included.
    """
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _enter(name: str) -> None:
    """Credit a rise of the high-water mark since the last phase change to the phase being left, then
    enter ``name``: the kernel's mark misses no spike, unlike sampling (a sampler thread needs the GIL,
    which a long call may hold)."""
    high = high_water_mib()
    if high > _LAST[0]:
        _HIGH[_PHASE[0]] = high
        _LAST[0] = high
    _PHASE[0] = name


class RssPhases:
    """Peak resident memory (MiB) of this process per phase of the build, sampled every ``every_s``
    seconds from ``/proc/self/statm`` by a daemon thread; a phase is the build function running last
    (:meth:`watch` wraps functions of :mod:`sequences.pipeline` that its Beam graph calls by name).
    Fused Beam stages interleave, so a phase is the one that was entered most recently: a guide to
    where the peak sits, not an exact attribution."""

    def __init__(self, every_s: float = 0.05) -> None:
        import os
        import threading

        _PHASE[0], _LAST[0] = "setup", 0.0
        _HIGH.clear()
        self.peaks: dict[str, float] = {}
        self._page_mib = os.sysconf("SC_PAGE_SIZE") / 2**20
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)
        self._thread.start()

    def _rss_mib(self) -> float:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self._page_mib

    def _sample(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            rss, phase = self._rss_mib(), _PHASE[0]
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), rss)
            _enter(phase)

    def watch(self, module, name: str) -> None:
        """Make ``module.name`` (a function or generator function) set the phase to ``name`` when called."""
        import inspect

        original = getattr(module, name)

        # Beam pickles the functions of its graph (a copy of this object would take the phase), so the
        # phase lives in this module's _PHASE (not __main__'s), looked up where the wrapper runs.
        if inspect.isgeneratorfunction(original):
            def wrapped(*args, **kwargs):
                import benchmarks.rss as bench

                bench._enter(name)
                yield from original(*args, **kwargs)
        else:
            def wrapped(*args, **kwargs):
                import benchmarks.rss as bench

                bench._enter(name)
                return original(*args, **kwargs)
        setattr(module, name, wrapped)

    def stop(self) -> dict[str, dict[str, float]]:
        """Stop sampling; ``{"sampled": peak by phase, "high_water": ru_maxrss by the phase it rose in}``
        (MiB, highest first)."""
        self._stop.set()
        self._thread.join()
        _enter("stopped")
        return {"sampled": dict(sorted(self.peaks.items(), key=lambda kv: -kv[1])),
                "high_water": dict(sorted(_HIGH.items(), key=lambda kv: -kv[1]))}
