"""Plots and report tables of bench.serve results (pure functions of its JSON)."""

from __future__ import annotations

from pathlib import Path

PANELS = (("TTFT p50 (ms)", lambda r: r["ttft_ms"]["50"]), ("TTFT p90 (ms)", lambda r: r["ttft_ms"]["90"]),
          ("TPOT p50 (ms)", lambda r: r["tpot_ms"]["50"]), ("ITL p99 (ms)", lambda r: r["itl_ms"]["99"]),
          ("output tok/s", lambda r: r["output_throughput"]), ("goodput (req/s in SLO)", lambda r: r["request_goodput"]),
          ("goodput, tight SLO (req/s)", lambda r: under_slo(r, TIGHT_SLO)[0]))


# Goodput is reported under two SLOs: the one vLLM's tool checks while it runs (results["slo"]) and a
# tighter one a latency-sensitive user would set, computed afterwards from each request's figures.
TIGHT_SLO = {"ttft_ms": 1000.0, "tpot_ms": 25.0}


def _num_sent(row: dict) -> int:
    return (row.get("completed") or 0) + (row.get("failed") or 0)


def share_in_slo(row: dict) -> float:
    """Share of the requests sent (a failed one is not in SLO) that met the run's SLO."""
    sent = _num_sent(row)
    return row["slo_attainment"] * (row.get("completed") or 0) / sent if sent else row["slo_attainment"]


def under_slo(row: dict, slo: dict) -> tuple[float, float]:
    """(goodput req/s, share of requests sent in SLO) of one point, from its per-request [TTFT, TPOT, ITL] ms."""
    requests = row.get("requests") or []
    good = sum(1 for ttft, tpot, _ in requests if ttft <= slo["ttft_ms"] and tpot <= slo["tpot_ms"])
    sent = max(_num_sent(row), len(requests))
    return (good / row["duration"] if row.get("duration") else 0.0), (good / sent if sent else 0.0)


def best_goodput_under(rows: list[dict], slo: dict, min_attainment: float = 0.9) -> tuple[float, float]:
    """best_goodput for another SLO than the one the run checked."""
    scored = [(row["point"], *under_slo(row, slo)) for row in rows]
    good_rates = [point for point, _, share in scored if share >= min_attainment]
    return (max(good_rates) if good_rates else 0.0), max((goodput for _, goodput, _ in scored), default=0.0)


def best_goodput(rows: list[dict], min_attainment: float = 0.9) -> tuple[float, float]:
    """(highest offered rate with >= min_attainment of requests in SLO, best measured goodput req/s)."""
    good_rates = [r["point"] for r in rows if r["load"] == "rate" and share_in_slo(r) >= min_attainment]
    return (max(good_rates) if good_rates else 0.0), max((r["request_goodput"] or 0.0) for r in rows)


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for workload in results["workloads"]:
        rows = [r for r in results["rows"] if r["workload"] == workload["name"]]
        if not rows:
            continue
        fig, axes = plt.subplots(2, 4, figsize=(19, 8))
        axes.flat[-1].axis("off")
        for ax, (title, value) in zip(axes.flat, PANELS):
            for system in results["systems"]:
                points = sorted((r["point"], value(r)) for r in rows if r["system"] == system and r.get("completed"))
                if points:
                    ax.plot(*zip(*points), marker="o", label=system)
            ax.set_title(title)
            ax.set_xlabel("Poisson request rate (req/s)" if workload["load"] == "rate" else "concurrency")
            ax.grid(alpha=0.3)
        axes.flat[0].legend()
        fig.suptitle(f"{workload['name']}: {workload['description']} ({results['machine']['num_cpus']} cores, "
                     f"SLO TTFT <= {results['slo']['ttft_ms']:g} ms, TPOT <= {results['slo']['tpot_ms']:g} ms)")
        fig.tight_layout()
        path = out_dir / f"serve_{results['profile']}_{workload['name']}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def tables_markdown(results: dict) -> str:
    lines = [f"Profile `{results['profile']}`, {results['machine']['date']}, {results['machine']['processor']}, "
             f"{results['machine']['num_cpus']} cores. SLO: TTFT <= {results['slo']['ttft_ms']:g} ms and "
             f"TPOT <= {results['slo']['tpot_ms']:g} ms.", ""]
    for workload in results["workloads"]:
        rows = [r for r in results["rows"] if r["workload"] == workload["name"]]
        lines += [f"**{workload['name']}** — {workload['description']}, {workload['num_prompts']} prompts per point",
                  "", "| system | " + workload["load"] + " | out tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p99 ms "
                  "| ITL p99 ms | goodput req/s | in SLO |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if not r.get("completed"):
                lines.append(f"| {r['system']} | {r['point']:g} | every request failed | - | - | - | 0.00 | 0% |")
                continue
            failed = f" ({r['failed']} failed)" if r.get("failed") else ""
            lines.append(
                f"| {r['system']}{failed} | {r['point']:g} | {_fmt(r['output_throughput'])} | "
                f"{_fmt(r['ttft_ms']['50'])} / {_fmt(r['ttft_ms']['90'])} / {_fmt(r['ttft_ms']['99'])} | "
                f"{_fmt(r['tpot_ms']['50'])} / {_fmt(r['tpot_ms']['99'])} | {_fmt(r['itl_ms']['99'])} | "
                f"{r['request_goodput']:.2f} | {share_in_slo(r):.0%} |")
        if workload["load"] == "rate":
            tight = f"TTFT <= {TIGHT_SLO['ttft_ms']:g} ms, TPOT <= {TIGHT_SLO['tpot_ms']:g} ms"
            lines += ["", f"| system | highest rate with >= 90% in SLO | best goodput req/s | same under {tight} |",
                      "|---|---|---|---|"]
            for system in results["systems"]:
                system_rows = [r for r in rows if r["system"] == system]
                if system_rows:
                    rate, goodput = best_goodput(system_rows)
                    tight_rate, tight_goodput = best_goodput_under(system_rows, TIGHT_SLO)
                    lines.append(f"| {system} | {rate:g} | {goodput:.2f} | {tight_rate:g} / {tight_goodput:.2f} |")
        lines += ["", f"![{workload['name']}](serve_{results['profile']}_{workload['name']}.png)", ""]
    return "\n".join(lines)


def write_report_tables(results: dict, report_path: Path) -> None:
    """Rewrites the report's generated block for this profile, keeping the text around it."""
    begin = f"<!-- serve:{results['profile']}:begin (generated by python -m bench.serve) -->"
    end = f"<!-- serve:{results['profile']}:end -->"
    block = f"{begin}\n{tables_markdown(results)}\n{end}"
    text = report_path.read_text() if report_path.exists() else "# Serving tables (bench.serve; REPORT.md reads them)\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    report_path.write_text(text)
