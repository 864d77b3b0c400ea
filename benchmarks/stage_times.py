"""Wall time of each pipeline stage (issue 9, item 5), collected from a finished run's metrics files.

Every stage writes `time/<stage>_s` into `metrics/details/<stage>.json` (flows/runner.py; older runs: into
`metrics/<stage>.json`, read too); this script gathers
them, in pipeline order, into one results file with the params that sized the run. Run it after a
pipeline run in the project directory, e.g.

    make run && .venv/bin/python benchmarks/stage_times.py --label "make run (defaults)"
    .venv/bin/arpo run --preset recorded && .venv/bin/python benchmarks/stage_times.py \
        --label "recorded preset" --preset recorded --out benchmarks/results/stage_times_recorded.json

Stages without a metrics file are listed under `missing` (not run in that directory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arpo_core.config import load_params, to_dict  # noqa: E402
from arpo_core.infra.fileio import atomic_write_json  # noqa: E402
from flows.spec import STAGE_NAMES  # noqa: E402


def collect(metrics_dir: Path) -> tuple[dict[str, float], list[str]]:
    """(stage -> seconds in pipeline order, stages without a metrics file or time key)."""
    times: dict[str, float] = {}
    missing: list[str] = []
    for name in STAGE_NAMES:
        # the summary file, or its breakdown beside it (metrics/details/, where runs put timings now)
        value = None
        for path in (metrics_dir / f"{name}.json", metrics_dir / "details" / f"{name}.json"):
            if value is None and path.exists():
                value = json.loads(path.read_text()).get(f"time/{name}_s")
        if value is None:
            missing.append(name)
        else:
            times[name] = round(float(value), 1)
    return times, missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", type=Path, default=ROOT / "metrics")
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--preset", default=None)
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[])
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stage_times.json")
    args = ap.parse_args(argv)

    times, missing = collect(args.metrics)
    p = to_dict(load_params(args.params, args.overrides, preset=args.preset))
    doc = {
        "label": args.label,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_avg_at_end": list(os.getloadavg()),
        },
        "stage_s": times,
        "total_s": round(sum(times.values()), 1),
        "missing": missing,
        "sizing": {
            k: p[k]
            for k in (
                "env",
                "init_policy",
                "demos",
                "sft",
                "baseline",
                "train",
                "rft",
                "dpo",
                "kto",
                "evaluate",
            )
        },
    }
    atomic_write_json(args.out, doc)
    print(json.dumps({"stage_s": times, "missing": missing}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
