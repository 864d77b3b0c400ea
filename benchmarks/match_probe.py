"""Is the named word where the pointing head's query and keys could match it? Linear probes (issue 33).

The 2x lorem reader's naming head names MiniWoB's lorem-ipsum words on held-out `lorem8` screens (0.64 at
stage step 7,000) while its pointing head picks the named link no better than it did at the start (its mass
at x's first character 0.41 -> 0.45 in 5,000 steps; the fixed-word `links8`, the same layout, 0.53 cell
hits). A head's pick is a bilinear match of the query (the position that predicts x's first character) with
the keys (the image tokens), both read from the last decoder layer's input. This asks, per level and per
depth of the language model (each layer's attention input, after its input norm), which side lacks the
word, with probes fit on two thirds of the screens and scored on the rest:

- `query_name`: a ridge map of the query's state onto the named word's class (one-hot over the naming
  head's `lorem` vocabulary) picks the look-alike whose class scores highest: does the query know which
  word, in a form a linear map reads?
- `key_name`: the same map from each look-alike's image tokens (their mean state; fit on every
  look-alike) onto its own class, picking among the screen's words: does a screen token know its word?
- `match`: the two maps' outputs multiplied (query's by each look-alike's), the best pick: a linear match
  through the names, what one head's q.k could do with these states (beside the head's own pick at the
  last depth, `head_right`).
- `query_word`, `key_word`: as `query_name` and `key_name` onto the word's text instead (the mean input
  embedding of its tokens, as an instruction writes it after a space), nearest by cosine: the form a match
  tied to the language model's embeddings (`TiedNameHead`) would use.
- `token_name`, `token_match`: as `key_name` and `match` from each image token alone (a map fit on single
  tokens, each labelled with its look-alike's class): the share of tokens that name their own look-alike
  among the screen's words, and whether the one token the match scores highest lies in the target. A head
  attends token by token, so a word that only the tokens' mean carries is one it cannot find in one step.

Chance is the mean of 1/look-alikes. Words of several tokens have to be composed by the layers before the
query (lorem-ipsum words are 2-8 tokens of the tiny tokenizer; 41 of the 50 fixed words are one).

    .venv/bin/python benchmarks/match_probe.py --model "2x lorem=SNAPSHOT_DIR" --levels links8,lorem8

`NAME=DIR[:STATE.pt]` as in benchmarks/place_probe.py. Writes benchmarks/results/match_probe.{json,md}
(`--out`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


MEASURES = ("query_name", "key_name", "match", "query_word", "key_word", "token_name", "token_match")


def word_vector(policy, word: str) -> torch.Tensor:
    """The mean input embedding of `word`'s tokens as an instruction writes it after a space."""
    ids = policy.processor.tokenizer.encode(" " + word, add_special_tokens=False)
    return policy.model.get_input_embeddings().weight[ids].float().mean(0).detach()


def states(policy, examples, system: str) -> list[dict]:
    """Per screen with a click whose look-alikes all have a name: per depth the query's state (x's first
    character's) and each look-alike's mean token state, as the match loss reads them at the last layer
    (`grounding.match_items`), and every look-alike token's own state with its look-alike's index; the
    look-alikes' classes and word vectors, the target's index among them, and the last layer's head 0
    pick."""
    from arpo_core.offline import grounding as g
    from arpo_core.policy.heads import AttentionInputs

    names = g.name_vocab("lorem")
    depths = len(policy.model.model.language_model.layers)
    policy.model.eval()
    out = []
    for i in range(0, len(examples), 16):
        chunk = examples[i : i + 16]
        encoded = [g._encode(policy, e, system, 0.0) for e in chunk]
        batch = g.collate(encoded, policy.pad_id, policy.image_token_id).to(policy.device)
        spans = [g.point_spans(policy, enc, e) for enc, e in zip(encoded, chunk, strict=True)]
        with (
            torch.no_grad(),
            AttentionInputs(policy, range(depths)) as kept,
            g._PointCapture(policy, 1) as cap,
        ):
            g.sequence_logprobs(policy.model, batch)
            weights = cap.log_weights([q for q, _ in spans])
            items = [g.match_items(policy, kept.kept[d][0], encoded, chunk, "lorem") for d in range(depths)]
        for at_depths in zip(*items, strict=True):
            it, j = at_depths[0], at_depths[0].example
            e, enc = chunk[j], encoded[j]
            if len(e.named) < 2 or len(it.names) < len(e.named):  # a look-alike without a name
                continue
            q = g.point_spans(policy, enc, e, first=True)[0][0]
            tokens = [g.box_tokens(policy, enc, b) for b, _ in e.named]
            w = weights[j].exp()[spans[j][0].index(q)]
            flat = [t for ts in tokens for t in ts]
            out.append(
                {
                    "query": [d.queries[0] for d in at_depths],
                    "keys": [d.keys for d in at_depths],
                    "tokens": [kept.kept[d][0][j, flat].float() for d in range(depths)],
                    "owner": torch.tensor([k for k, ts in enumerate(tokens) for _ in ts]),
                    "classes": it.names,
                    "words": torch.stack([word_vector(policy, names[c]) for c in it.names.tolist()]),
                    "target": it.target,
                    "head": max(range(len(tokens)), key=lambda k: float(w[tokens[k]].sum())),
                }
            )
    return out


def ridge(x: torch.Tensor, y: torch.Tensor, lam: float = 10.0):
    """A ridge map x -> y (standardised x, intercept), returned as a function."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    ones = lambda a: torch.cat([(a - mean) / std, torch.ones(len(a), 1)], dim=1)  # noqa: E731
    a = ones(x)
    w = torch.linalg.solve(a.T @ a + lam * torch.eye(a.shape[1]), a.T @ y)
    return lambda z: ones(z) @ w


def depth_probe(rows: list[dict], d: int, classes: int) -> dict:
    """The pick rates of the module at depth `d`: maps fit on the first two thirds of `rows`, scored on
    the rest."""
    cut = 2 * len(rows) // 3
    fit, held = rows[:cut], rows[cut:]
    onehot = lambda c: torch.nn.functional.one_hot(c, classes).float()  # noqa: E731
    q_name = ridge(
        torch.stack([r["query"][d] for r in fit]),
        onehot(torch.stack([r["classes"][r["target"]] for r in fit])),
    )
    k_name = ridge(torch.cat([r["keys"][d] for r in fit]), onehot(torch.cat([r["classes"] for r in fit])))
    q_word = ridge(
        torch.stack([r["query"][d] for r in fit]), torch.stack([r["words"][r["target"]] for r in fit])
    )
    k_word = ridge(torch.cat([r["keys"][d] for r in fit]), torch.cat([r["words"] for r in fit]))
    t_name = ridge(
        torch.cat([r["tokens"][d] for r in fit]), onehot(torch.cat([r["classes"][r["owner"]] for r in fit]))
    )
    cos = torch.nn.functional.cosine_similarity
    counts = dict.fromkeys(MEASURES, 0.0)
    for r in held:
        t, c = r["target"], r["classes"]
        qs, ks = q_name(r["query"][d][None])[0], k_name(r["keys"][d])
        counts["query_name"] += int(qs[c].argmax()) == t
        counts["key_name"] += float((ks[:, c].argmax(1) == torch.arange(len(c))).float().mean())
        counts["match"] += int((ks @ qs).argmax()) == t
        counts["query_word"] += int(cos(r["words"], q_word(r["query"][d][None])).argmax()) == t
        kw = k_word(r["keys"][d])
        counts["key_word"] += float(
            (cos(kw[:, None], r["words"][None], dim=-1).argmax(1) == torch.arange(len(c))).float().mean()
        )
        ts = t_name(r["tokens"][d])
        counts["token_name"] += float((ts[:, c].argmax(1) == r["owner"]).float().mean())
        counts["token_match"] += int(r["owner"][int((ts @ qs).argmax())]) == t
    return {"depth": d} | {k: round(v / len(held), 3) for k, v in counts.items()}


def probe(rows: list[dict], depths: int) -> dict:
    """Chance, the head's pick and `depth_probe` at every depth, on the scored third."""
    from arpo_core.offline.grounding import name_vocab

    held = rows[2 * len(rows) // 3 :]
    return {
        "screens": len(rows),
        "chance": round(sum(1 / len(r["classes"]) for r in held) / len(held), 3),
        "head_right": round(sum(r["head"] == r["target"] for r in held) / len(held), 3),
        "depths": [depth_probe(rows, d, len(name_vocab("lorem"))) for d in range(depths)],
    }


def main() -> None:
    from place_probe import each_model, model_args, record_head, table_head, write_record

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(ap, "match_probe")
    ap.add_argument("--levels", default="links8,lorem8", help="synthetic levels, each probed apart")
    ap.add_argument(
        "--screens", type=int, default=600, help="held-out screens per level (2/3 fit, 1/3 scored)"
    )
    ap.add_argument("--seed", type=int, default=4321)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from arpo_core.config import load_params
    from arpo_core.offline.grounding import SCREEN_H, SCREEN_W, model_image_size, synthetic_examples

    system = load_params(ROOT / "params.yaml").policy.system_prompt
    models = []
    for name, spec, policy, t0 in each_model(args.model):
        size = model_image_size(SCREEN_W, SCREEN_H, policy.min_pixels, policy.max_pixels)
        depths = policy.model.config.text_config.num_hidden_layers
        levels = {}
        for level in args.levels.split(","):
            exs = synthetic_examples(args.screens, {level: 1.0}, seed=args.seed, model_size=size)
            levels[level] = probe(states(policy, exs, system), depths)
        models.append({"model": name, "spec": spec, "levels": levels})
        print(json.dumps(models[-1] | {"seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    record = record_head("match_probe.py") | {"screens": args.screens, "seed": args.seed, "models": models}
    lines = [
        *table_head(
            "Where the named word is: query, keys, match (benchmarks/match_probe.py)",
            record,
            f"{args.screens} screens per level, seed {args.seed}, 2/3 fit, 1/3 scored; picks among the screen's"
            " look-alikes",
        ),
        "| model | level | chance | head_right | depth | " + " | ".join(MEASURES) + " |",
        "|---|---|---|---|---|" + "---|" * len(MEASURES),
    ]
    for m in models:
        for level, r in m["levels"].items():
            for d in r["depths"]:
                cells = " | ".join(f"{d[k]:.2f}" for k in MEASURES)
                lines.append(
                    f"| {m['model']} | {level} | {r['chance']:.2f} | {r['head_right']:.2f} | layer {d['depth']}'s"
                    f" input | {cells} |"
                )
    write_record(args.out, record, lines)


if __name__ == "__main__":
    main()
