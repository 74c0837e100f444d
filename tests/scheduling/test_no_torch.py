"""The scheduling layer is pure Python bookkeeping: importing it must never
pull in torch (the layer rule: tinyengine/scheduling/ has no torch import)."""

from __future__ import annotations

import subprocess
import sys


def test_scheduling_layer_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "import tinyengine.scheduling.request, tinyengine.scheduling.block_manager\n"
        "import tinyengine.scheduling.scheduler, tinyengine.sampling_params\n"
        "assert 'torch' not in sys.modules, 'the scheduling layer imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
