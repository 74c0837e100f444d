"""The fused-MoE sweep's report (benchmarks/sweep_moe.py): per GEMM the best
tile of each load mode (pointers, TMA weights, TMA activations too), and the
summary tables printed after the sweep, ending in a CLASS_CONFIGS snippet of
the tiles that are best across each size class's token counts.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from moe_grid import as_code, fmt, tile_key  # noqa: E402

import tinyengine.kernels.moe.triton as tm  # noqa: E402


def report_modes(r: dict) -> dict:
    """Per GEMM, the best tile of each load mode (pointers, tma1, tma2):
    {gemm: {mode: (ms, cfg)}}; printed with the pointer path as baseline."""
    by_mode: dict = {}
    for gemm in tm.GEMMS:
        modes: dict = {}
        for ms, c in r["gemm"][gemm].values():
            m = c.get("tma", 0)
            if m not in modes or ms < modes[m][0]:
                modes[m] = (ms, c)
        # The group_m runs of the overall best tile count for its mode.
        if modes and r["group_m"][gemm]:
            best_ms, best_c = min(r["gemm"][gemm].values(), key=lambda v: v[0])
            gm = min(r["group_m"][gemm], key=r["group_m"][gemm].get)
            m = best_c.get("tma", 0)
            if r["group_m"][gemm][gm] < modes[m][0]:
                modes[m] = (r["group_m"][gemm][gm], dict(best_c, group_m=gm))
        by_mode[gemm] = modes
        if len(modes) < 2:
            continue
        base = modes.get(0, (None, None))[0]
        parts = []
        for m in sorted(modes):
            ms, c = modes[m]
            rel = f" ({base / ms:4.2f}x)" if base and m else ""
            parts.append(f"{'tma' + str(m) if m else 'pointers'} {ms * 1e3:.1f} us{rel}")
        win = min(modes, key=lambda m: modes[m][0])
        print(f"  TMA vs pointers, {gemm:7s}: {' | '.join(parts)}  -> "
              f"{'tma' + str(win) if win else 'pointers'} fastest: "
              f"{fmt(modes[win][1])}")  # fmt: skip
    return by_mode


def summary(results: dict, skipped: int, copy_tbs: float, k: int, d: int, i: int) -> dict:
    """The tables after the sweep: per T heuristic vs best, TMA vs pointers,
    and per size class the best tiles as a CLASS_CONFIGS snippet (returned)."""
    print(f"\n## summary (copy bandwidth {copy_tbs:.2f} TB/s read+write)")
    print(f"{'T':>6} {'cls':>3} {'heuristic us':>13} {'TFLOP/s':>8} {'TB/s':>6} "
          f"{'best us':>10} {'TFLOP/s':>8} {'TB/s':>6} {'gain':>6} "
          f"{'group+sum us':>13}")  # fmt: skip
    for t in sorted(results):
        r = results[t]
        if "best_ms" not in r:
            continue
        fl = 2 * t * k * 3 * i * d
        by = r["touched"] * 3 * i * d * 2
        h, b = r["heur_ms"], r["best_ms"]
        print(f"{t:6d} {r['cls']:3d} {h * 1e3:13.1f} {fl / h / 1e9:8.1f} {by / h / 1e9:6.2f} "
              f"{b * 1e3:10.1f} {fl / b / 1e9:8.1f} {by / b / 1e9:6.2f} {h / b:6.2f}x "
              f"{(r['group_ms'] + r['sum_ms']) * 1e3:13.1f}")  # fmt: skip
    rows = [(t, r) for t, r in sorted(results.items())
            if any(len(m) > 1 for m in r.get("by_mode", {}).values())]  # fmt: skip
    if rows:
        print("\n## TMA vs pointer loads: best time of each mode per GEMM, us (tma1: "
              "weights by TMA; tma2: activations too, gate_up incl. its gather)")  # fmt: skip
        for t, r in rows:
            for gemm in tm.GEMMS:
                modes = r["by_mode"][gemm]
                cells = "  ".join(f"{'tma' + str(m) if m else 'ptr'} {modes[m][0] * 1e3:8.1f}"
                                  for m in sorted(modes))  # fmt: skip
                win = min(modes, key=lambda m: modes[m][0])
                gain = modes[0][0] / modes[win][0] if 0 in modes else float("nan")
                print(f"  T={t:<6d} {gemm:7s} {cells}   -> {'tma' + str(win) if win else 'ptr'}"
                      f" ({gain:4.2f}x vs ptr)")  # fmt: skip
    print("\n## per size class: tile with the best mean (time / best time) over the class's T")
    snippet = {}
    for cls in range(len(tm.CLASS_CONFIGS)):
        ts = [t for t, r in results.items() if r["cls"] == cls and "best_ms" in r]
        if not ts:
            snippet[cls] = tm.CLASS_CONFIGS[cls]
            continue
        snippet[cls] = {}
        for gemm in tm.GEMMS:
            common = set.intersection(*(set(results[t]["gemm"][gemm]) for t in ts))
            if not common:
                snippet[cls][gemm] = tm.CLASS_CONFIGS[cls][gemm]
                continue

            def score(key, gemm=gemm, ts=ts):
                return sum(
                    results[t]["gemm"][gemm][key][0]
                    / min(v[0] for v in results[t]["gemm"][gemm].values())
                    for t in ts
                ) / len(ts)

            ranked = sorted(common, key=score)
            heur_key = tile_key(tm.CLASS_CONFIGS[cls][gemm])
            for rank, key in enumerate(ranked[:3]):
                c = results[ts[0]]["gemm"][gemm][key][1]
                print(f"  class {cls} {gemm:7s} #{rank + 1} {fmt(c)} score {score(key):.3f}")
            if heur_key in common:
                print(f"  class {cls} {gemm:7s} heuristic score {score(heur_key):.3f}")
            best = dict(results[ts[0]]["gemm"][gemm][ranked[0]][1])
            # group_m: the order that won most often where this tile was the per-T best.
            wins = []
            for t in ts:
                orders = results[t]["group_m"][gemm]
                if orders and tile_key(results[t]["best_cfg"][gemm]) == ranked[0]:
                    wins.append(min(orders, key=orders.get))
            if wins:
                best["group_m"] = max(set(wins), key=wins.count)
            snippet[cls][gemm] = best
    print("\nCLASS_CONFIGS = (")
    for cls in range(len(tm.CLASS_CONFIGS)):
        c = snippet[cls]
        print(f'    {{"gate_up": {as_code(c["gate_up"])}, "down": {as_code(c["down"])}}},')
    print(")")
    if skipped:
        print(f"# budget: {skipped} timings skipped "
              "(raise --budget or pass fewer --tokens)")  # fmt: skip
    return snippet
