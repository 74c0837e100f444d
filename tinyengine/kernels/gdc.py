"""Grid dependency control, the device side of programmatic dependent launch
(kernels/launch.py: `programmatic_launch`): Triton's `gdc_wait` and
`gdc_launch_dependents`, which the decode step's kernels call under their
USE_PDL constexpr.

Owns where those names come from. They exist from Triton 3.4 on; before
that they are None, `AVAILABLE` is False and no kernel is launched with PDL,
so the constexpr branch that calls them is never compiled.
"""

from __future__ import annotations

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = True
except ImportError:  # Triton < 3.4
    gdc_wait = gdc_launch_dependents = None
    AVAILABLE = False

__all__ = ["AVAILABLE", "gdc_launch_dependents", "gdc_wait"]
