"""Draw the latency benchmark's decode figures: decode tokens/s against batch
size (log x), measured points beside the memory-roofline curve (and HF
transformers' points when `--compare hf` ran).

Owns only the drawing, from the latency result dict (the same dict `--json`
writes), so a PNG can also be drawn later on another machine from a JSON:

    python -m tinyengine.bench.plot latency.json decode.png

matplotlib is optional (`pip install matplotlib`); it is imported only here,
only when a plot is asked for, with the Agg backend (no display needed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tinyengine.bench.common import BenchError


def plot_decode(result: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise BenchError(
            "--plot needs matplotlib (pip install matplotlib); or write --json here and "
            "draw it elsewhere with python -m tinyengine.bench.plot RESULT.json OUT.png"
        ) from e

    runs = sorted(result["runs"], key=lambda r: r["batch_size"])
    batches = [r["batch_size"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    curve = result.get("roofline_curve") or [
        [r["batch_size"], r["roofline"]["tokens_per_s"]] for r in runs
    ]
    ax.plot(
        [b for b, _ in curve], [t for _, t in curve], "--", color="gray",
        label=f"roofline ({result['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s read)",
    )  # fmt: skip
    ax.plot(batches, [r["decode_tokens_per_s"] for r in runs], "o-", label="tinyengine")
    hf = [r for r in runs if "hf" in r]
    if hf:
        ax.plot(
            [r["batch_size"] for r in hf],
            [r["hf"]["decode_tokens_per_s"] for r in hf],
            "s-",
            label="HF transformers",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(
        f"{result['model']} ({result['dtype']}, {result['device']}): decode, "
        f"prompt {result['input_len']}, output {result['output_len']}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m tinyengine.bench.plot LATENCY.json OUT.png", file=sys.stderr)
        return 2
    plot_decode(json.loads(Path(argv[0]).read_text()), argv[1])
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
