"""Plot decode-step time against distinct adapters (PEFT ``adapter_names`` vs peft_csgmv) from bench_e2e JSON files.

python -m peft_csgmv.plot results/e2e_1b.json results/e2e_8b.json --out docs/decode_vs_distinct.png
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def plot_decode_vs_distinct(datasets: list[dict], out: str) -> None:
    """One panel per benchmark result (``{"meta": ..., "results": [...]}``): decode-step ms against distinct
    adapters for PEFT ``adapter_names`` and peft_csgmv, with the base model and PEFT one adapter as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), squeeze=False)
    for ax, data in zip(axes[0], datasets):
        rows = {r["row"]: r for r in data["results"]}
        model = data["meta"].get("label") or data["meta"]["args"]["model"]
        for prefix, style, color in (("PEFT adapter_names", "o-", "C0"), ("peft_csgmv", "s-", "C1")):
            pts = sorted(
                (int(m.group(1)), r["decode_ms"])
                for name, r in rows.items()
                if (m := re.fullmatch(re.escape(prefix) + r", (\d+) distinct", name))
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=prefix)
        for name, style in (("base model, no LoRA", ":"), ("PEFT one adapter", "--")):
            if name in rows:
                ax.axhline(rows[name]["decode_ms"], linestyle=style, color="gray", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("distinct adapters in a batch of %d" % data["meta"]["args"]["batch"])
        ax.set_ylabel("decode step (ms)")
        date = data["meta"].get("date", "")[:16].replace("T", " ")
        ax.set_title(f"{model}, {data['meta']['device']}, {date}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--out", default="decode_vs_distinct.png")
    args = p.parse_args(argv)
    datasets = []
    for path in args.files:
        with open(path) as f:
            datasets.append(json.load(f))
    plot_decode_vs_distinct(datasets, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
