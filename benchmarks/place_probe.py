"""Do the policy's image tokens carry where they are? A ridge probe per layer (issue 33).

After the tower's naming phase the pointing loss put all of a head's attention on the named box among
eight while every click missed (docs/results.md, "Pointing at the named target"): the head finds the
target's token, and the click still has to be read off that token. Qwen2.5-VL's language model gives the
image tokens rotary positions only, which change how tokens attend, not what they carry, so a head that
attends to one token reads its content and not its place unless some layer wrote the place into it. This
probe asks whether one did: it draws held-out synthetic screens (`--levels`), runs each model over them
teacher-forced, takes every merged image token's hidden state at each depth of the language model as the
next layer reads it (after that layer's input norm: the input of layer 0, the vision tower's output, then
the input of each later layer, and the final norm's output), and fits a
ridge regression of the token's row and column on the grid (`grounding.place_targets`, in [-1, 1]) on
two thirds of the screens, scored (R^2) on the rest. 1 = the place is read exactly, 0 = no better than the
grid's mean; below 0 = the fit does not carry over to other screens.

    .venv/bin/python benchmarks/place_probe.py --model grounded-xs=assets/checkpoints/grounded-xs \\
        --model "naming phase=assets/checkpoints/grounded-xs:models/.grounded.staging/checkpoints/phase-0.pt"

`NAME=DIR[:STATE.pt]`: a checkpoint directory, optionally with the weights of a ground phase's training
checkpoint (`train_grounding`'s file, its "model" state) loaded over it; `init` builds a freshly
initialised xs policy (rope_theta 5, as the grounded base). Writes benchmarks/results/place_probe.{json,md}
(`--out`).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def ridge_r2(
    fit_x: torch.Tensor, fit_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor
) -> list[float]:
    """R^2 per column of `test_y` of a ridge regression (standardised features, lambda 10) fit on
    (`fit_x`, `fit_y`)."""
    mean, std = fit_x.mean(0), fit_x.std(0) + 1e-6
    ones = lambda x: torch.cat([(x - mean) / std, torch.ones(len(x), 1)], dim=1)  # noqa: E731
    a = ones(fit_x)
    w = torch.linalg.solve(a.T @ a + 10.0 * torch.eye(a.shape[1]), a.T @ fit_y)
    err = ((ones(test_x) @ w - test_y) ** 2).sum(0)
    return (1 - err / ((test_y - test_y.mean(0)) ** 2).sum(0)).tolist()


def token_states(policy, examples, system: str) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Per depth, per screen: the image tokens' hidden states as each decoder layer's attention reads them
    (after its input norm) and as the final norm puts them out; and per screen their places. The model runs
    as in training (`sequence_logprobs`, its rotary positions included)."""
    from arpo_core.offline.grounding import AttentionInputs, _encode, place_targets
    from arpo_core.policy.sequences import collate, sequence_logprobs

    lm = policy.model.model.language_model
    depths: list[list[torch.Tensor]] = [[] for _ in range(len(lm.layers) + 1)]
    places: list[torch.Tensor] = []
    out: list[torch.Tensor] = []
    hook = lm.norm.register_forward_hook(lambda module, args, states: out.append(states))
    policy.model.eval()
    try:
        for i in range(0, len(examples), 16):
            encoded = [_encode(policy, e, system) for e in examples[i : i + 16]]
            out.clear()
            with torch.no_grad(), AttentionInputs(policy, range(len(lm.layers))) as capture:
                sequence_logprobs(policy.model, collate(encoded, policy.pad_id, policy.image_token_id))
            seen = [capture.kept[d][0] for d in range(len(lm.layers))] + out[-1:]
            for b, enc in enumerate(encoded):
                positions, where = place_targets(policy, enc)
                places.append(where)
                for d in range(len(depths)):
                    depths[d].append(seen[d][b, positions].float())
    finally:
        hook.remove()
    return depths, places


def probe(policy, examples, system: str) -> list[dict]:
    """Per depth of the language model: {"depth", "row", "col"} held-out R^2."""
    depths, places = token_states(policy, examples, system)
    cut = 2 * len(examples) // 3
    fit_y, test_y = torch.cat(places[:cut]), torch.cat(places[cut:])
    out = []
    for d, states in enumerate(depths):
        row, col = ridge_r2(torch.cat(states[:cut]), fit_y, torch.cat(states[cut:]), test_y)
        out.append({"depth": d, "row": round(row, 3), "col": round(col, 3)})
    return out


def load(spec: str, tmp: Path):
    from arpo_core.policy.model import build_tiny_policy, load_policy

    if spec == "init":
        return build_tiny_policy(tmp / "init", size="xs", rope_theta=5.0)
    directory, _, state = spec.partition(":")
    policy = load_policy(ROOT / directory if not Path(directory).is_absolute() else directory)
    if state:
        policy.model.load_state_dict(torch.load(state, weights_only=False, map_location="cpu")["model"])
    return policy


def record_head(script: str) -> dict:
    """What a probe's record starts with: the command that re-runs it, the code's commit, date, machine."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {
        "command": shlex.join([".venv/bin/python", f"benchmarks/{script}", *sys.argv[1:]]),
        "code": commit.stdout.strip(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": platform.machine(),
    }


def model_args(ap: argparse.ArgumentParser, out: str) -> None:
    """The arguments every probe takes: `--model` (repeated), `--threads`, `--out` (default
    benchmarks/results/<out>)."""
    ap.add_argument("--model", action="append", required=True, help="NAME=DIR[:STATE.pt] or NAME=init")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / out))


def each_model(specs: list[str]):
    """(name, spec, policy, start time) for each `NAME=SPEC` of `specs`, loaded in turn (`load`)."""
    with tempfile.TemporaryDirectory() as tmp:
        for item in specs:
            name, _, spec = item.partition("=")
            t0 = time.perf_counter()
            yield name, spec, load(spec, Path(tmp)), t0


def table_head(title: str, record: dict, detail: str) -> list[str]:
    """A probe's markdown table's first lines: the title, then the command that re-ran it, its code and date,
    and `detail` (what it was run on)."""
    return [
        f"# {title}",
        "",
        f"`{record['command']}` (code {record['code']}, {record['date']}; {detail})",
        "",
    ]


def write_record(out: str, record: dict, lines: list[str]) -> None:
    """A probe's record as `<out>.json` and its table (`lines`) as `<out>.md`."""
    path = Path(out)
    path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def depth_name(d: int, layers: int) -> str:
    return f"layer {d}'s input" if d < layers else "final norm"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(ap, "place_probe")
    ap.add_argument(
        "--levels", default="boxes8,buttons8", help="synthetic levels of the screens, mixed evenly"
    )
    ap.add_argument("--screens", type=int, default=48, help="held-out screens (2/3 fit, 1/3 scored)")
    ap.add_argument("--seed", type=int, default=99)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from arpo_core.config import load_params
    from arpo_core.offline.grounding import synthetic_examples

    system = load_params(ROOT / "params.yaml").policy.system_prompt
    examples = synthetic_examples(args.screens, dict.fromkeys(args.levels.split(","), 1.0), seed=args.seed)
    rows = []
    for name, spec, policy, t0 in each_model(args.model):
        layers = policy.model.config.text_config.num_hidden_layers
        result = probe(policy, examples, system)
        for r in result:
            r["where"] = depth_name(r["depth"], layers)
        rows.append({"model": name, "spec": spec, "depths": result})
        print(json.dumps(rows[-1] | {"seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    record = record_head("place_probe.py") | {
        "screens": args.screens,
        "levels": args.levels,
        "models": rows,
    }
    lines = [
        *table_head(
            "Place probe: held-out R^2 of each image token's row / column (benchmarks/place_probe.py)",
            record,
            f"{args.screens} screens of {args.levels}, 2/3 fit, 1/3 scored",
        ),
        "| model | " + " | ".join(r["where"] for r in rows[0]["depths"]) + " |",
        "|---|" + "---|" * len(rows[0]["depths"]),
    ]
    for r in rows:
        cells = [f"{d['row']:.2f} / {d['col']:.2f}" for d in r["depths"]]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    write_record(args.out, record, lines)


if __name__ == "__main__":
    main()
