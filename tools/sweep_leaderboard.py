"""A sweep's leaderboard (tools/sweep.py): the console table, leaderboard.csv and leaderboard.png, ranked trials
first, the best one named; the others listed with why they are not ranked."""

from __future__ import annotations

import csv
import os

from tools.sweep_validate import Sweep


def write_leaderboard(sweep: Sweep, rows: list[dict], output_dir: str) -> dict | None:
    sign = 1 if sweep.goal == "minimize" else -1
    # ranked trials (ran to their end, passed every check) by their metric; the others after them, never ranked
    ranked = sorted(rows, key=lambda r: (not r["ranked"], sign * (r[sweep.metric] or 0)))
    columns = list(dict.fromkeys(k for r in ranked for k in r))
    with open(os.path.join(output_dir, "leaderboard.csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(ranked)
    shown = [c for c in columns if c != "dir"]
    widths = {c: max(len(c), *(len(format_cell(r.get(c))) for r in ranked)) for c in shown}
    print("  ".join(c.ljust(widths[c]) for c in shown))
    for row in ranked:
        print("  ".join(format_cell(row.get(c)).ljust(widths[c]) for c in shown))
    best = next((r for r in ranked if r["ranked"]), None)
    swept = [p for p in sweep.config["parameters"] if len({repr(r.get(p)) for r in rows}) > 1]
    plot_leaderboard(sweep, rows, swept, output_dir)
    if best:
        print(
            f"best: {best['trial']} {sweep.metric}={best[sweep.metric]:.6g} with "
            + " ".join(f"{p}={best[p]}" for p in sweep.config["parameters"])
        )
    else:
        print(
            f"sweep: no trial ran to its end and passed every check, so there is no best ({len(rows)} not ranked)"
        )
    print(
        f"leaderboard: {os.path.join(output_dir, 'leaderboard.csv')}, {os.path.join(output_dir, 'leaderboard.png')}"
    )
    print(f"W&B runs (offline): upload with `wandb sync {output_dir}/*/wandb/offline-run-*`")
    return best


def format_cell(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def plot_leaderboard(sweep: Sweep, rows: list[dict], swept: list[str], output_dir: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry to leave behind

    shown = swept or list(sweep.config["parameters"])[:1]
    figure = Figure(figsize=(4.5 * max(len(shown), 1), 3.5))
    axes = figure.subplots(1, max(len(shown), 1), squeeze=False)
    for axis, param in zip(axes[0], shown, strict=False):
        xs = []
        for ranked, style in ((True, {"marker": "o", "label": "ranked"}),
                              (False, {"marker": "x", "color": "tab:red", "label": "not ranked (a check failed)"})):  # fmt: skip
            points = [(r[param], r[sweep.metric]) for r in rows if r["ranked"] == ranked
                      and r[sweep.metric] is not None and isinstance(r.get(param), int | float)]  # fmt: skip
            if points:
                axis.scatter(*zip(*points, strict=True), **style)
                xs += [p[0] for p in points]
        if xs and min(xs) > 0 and max(xs) / min(xs) > 10:
            axis.set_xscale("log")
        if any(not r["ranked"] and r[sweep.metric] is not None for r in rows):
            axis.legend(fontsize="small")
        axis.set(xlabel=param, ylabel=sweep.metric)
    figure.suptitle(f"{os.path.basename(sweep.path)}: {sweep.metric} ({sweep.goal}) per trial")
    figure.tight_layout()
    figure.savefig(os.path.join(output_dir, "leaderboard.png"), dpi=100)
