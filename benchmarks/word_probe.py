"""Can the policy's image tokens tell the words apart? A linear probe (issue 33).

The reading curriculum's clicks pick the named word among look-alikes at chance, and reading examples
("Read the buttons ...") read almost no word. Either the words are not in the image tokens at all (the
vision tower and the visual resolution lose them), or they are and the language model has not learned to
use them. This probe tells the two apart: it draws the ground stage's word screens (`texts8`, Pillow's
sans at 10-14 px), takes the merged image tokens that the language model gets (the vision tower's output)
in a fixed window of screen around each word, and fits a linear classifier of which of the
`grounding.WORDS` it is, on screens other than the ones it is scored on. Chance is 1/len(WORDS).

    .venv/bin/python benchmarks/word_probe.py --model grounded-xs=assets/checkpoints/grounded-xs \\
        --model "grounded-xs 2x=assets/checkpoints/grounded-xs@134400" --model random=init

`NAME=DIR[@MIN_PIXELS]`: a checkpoint, optionally at another visual resolution; `init` builds a freshly
initialised xs policy (random features); `tower:LEVER` builds the vision tower of one of
`grounding_sweep.py`'s levers fresh and trains it, with a linear head on the same window, to name the word
directly on fresh screens for `--tower-seconds` (the tower's capacity to read when reading is what it is
taught, the policy's language model left out), then probes it like the others; `pixels` probes the pixels
of the 1x tokens' window themselves, `pixels-centred` a window of that size centred on the word (what a
probe reads without a token grid's offsets); `cnn` trains a small conv net on the 1x tokens' window of
pixels to name the word for `--tower-seconds` (what the window holds for an encoder that is the same at
every pixel offset; a vision tower is the same only at every 14-px patch), then probes its features.
`--level boxes8` asks for the boxes' colours instead (the control). `--tower-lr`: a tower's learning rate
(the results before 2026-12-05 were made at 1e-3, where a tower stays at the chance loss). Writes
benchmarks/results/word_probe.{json,md} (`--out`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arpo_core.offline.grounding import NAME_WINDOW_SCREEN_PX  # noqa: E402


def names_of(level: str) -> list[str]:
    """What a level's look-alikes are told apart by: colours (`boxes8`) or words (the word levels)."""
    from arpo_core.offline.grounding import COLORS, WORDS

    return sorted(COLORS) if level.startswith("box") else list(WORDS)


def word_items(n_screens: int, seed: int, level: str = "texts8") -> list[tuple]:
    """(screen image, name, screen box) for every look-alike on `n_screens` fresh screens of `level`."""
    from PIL import Image, ImageDraw

    from arpo_core.offline.grounding import LEVELS, SCREEN_H, SCREEN_W

    rng = random.Random(seed)
    items = []
    for _ in range(n_screens):
        img = Image.new("RGB", (SCREEN_W, SCREEN_H), (255, 255, 255))
        _, _, _, seen = LEVELS[level](rng, ImageDraw.Draw(img))
        items += [(img, word, box) for box, word in seen]
    return items


def token_features(policy, items: list[tuple], grad: bool = False) -> torch.Tensor:  # noqa: F821
    """The merged image tokens (the language model's image inputs) in the window around each word,
    concatenated in raster order (zeros off the image): (len(items), window tokens x hidden); with `grad`
    differentiable in the vision tower (`grounding.window_tokens`, what the ground stage's naming loss
    reads)."""
    from contextlib import nullcontext

    import torch

    from arpo_core.offline.grounding import SCREEN_H, SCREEN_W, window_tokens
    from arpo_core.policy.prompt import model_image_size

    mw, mh = model_image_size(SCREEN_W, SCREEN_H, policy.min_pixels, policy.max_pixels)
    sx, sy = mw / SCREEN_W, mh / SCREEN_H
    images: dict[int, tuple] = {}  # by image: (image, its boxes in model px, their places in `items`)
    for i, (img, _, box) in enumerate(items):
        _, boxes, at = images.setdefault(id(img), (img, [], []))
        boxes.append((box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy))
        at.append(i)
    with nullcontext() if grad else torch.no_grad():
        feats = window_tokens(policy, [v[0] for v in images.values()], [v[1] for v in images.values()])
    order = [i for v in images.values() for i in v[2]]
    return feats[torch.argsort(torch.tensor(order))]


def pixel_features(
    items: list[tuple], model_size: tuple[int, int] = (168, 224), unit: int = 28, centred: bool = False
):
    """The references: the pixels (grey, 0..1) of exactly the 1x tokens' window, in the 1x model frame
    (`model_size`, tokens of `unit` px), what an encoder of those tokens starts from; with `centred` a
    window of the same size centred on the word instead (no offset against a token grid)."""
    import numpy as np
    import torch

    from arpo_core.offline.grounding import SCREEN_H, SCREEN_W, name_window

    sx, sy = model_size[0] / SCREEN_W, model_size[1] / SCREEN_H
    feats, frames = [], {}
    for img, _, box in items:
        if id(img) not in frames:
            frames[id(img)] = img.convert("L").resize(model_size, resample=3)  # bicubic, as the processor
        mbox = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        r0, c0, nh, nw = name_window(mbox, (sx, sy), unit)
        x0, y0 = c0 * unit, r0 * unit
        if centred:
            x0 = round((box[0] + box[2]) / 2 * sx - nw * unit / 2)
            y0 = round((box[1] + box[3]) / 2 * sy - nh * unit / 2)
        crop = frames[id(img)].crop((x0, y0, x0 + nw * unit, y0 + nh * unit))  # off the frame: black
        feats.append(torch.from_numpy(np.asarray(crop, dtype=np.float32).ravel() / 255.0))
    return torch.stack(feats)


def probe(x_train, y_train, x_test, y_test, classes: int, steps: int = 400, hidden: int = 0) -> dict:
    """Multinomial logistic regression, or with `hidden` > 0 a one-hidden-layer MLP (GELU, dropout 0.2),
    on standardised features (AdamW, weight decay, full batch) -> train and held-out accuracy."""
    import torch

    mean, std = x_train.mean(0), x_train.std(0).clamp(min=1e-6)
    xtr, xte = (x_train - mean) / std, (x_test - mean) / std
    torch.manual_seed(0)
    d = xtr.shape[1]
    if hidden:
        net = torch.nn.Sequential(
            torch.nn.Dropout(0.2),
            torch.nn.Linear(d, hidden),
            torch.nn.GELU(),
            torch.nn.Linear(hidden, classes),
        )
    else:
        net = torch.nn.Linear(d, classes)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2 if not hidden else 3e-3, weight_decay=1e-2)
    net.train()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xtr), y_train).backward()
        opt.step()
    net.eval()
    with torch.no_grad():
        return {
            "train_acc": float((net(xtr).argmax(1) == y_train).float().mean()),
            "test_acc": float((net(xte).argmax(1) == y_test).float().mean()),
        }


def name_for(
    features,
    head,
    params,
    seconds: float,
    level: str,
    lr: float,
    clip: float | None,
    batch_screens: int,
    seed: int,
) -> dict:
    """Train `head(features(items))` to name each look-alike (cross-entropy, AdamW over `params`) on
    `batch_screens` fresh screens of `level` a step for `seconds`, the gradient norm clipped at `clip`;
    returns the steps, seconds per step, last loss and lr (a taught encoder's record)."""
    import torch

    index = {w: i for i, w in enumerate(names_of(level))}
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    t0, steps, loss = time.perf_counter(), 0, None
    while time.perf_counter() - t0 < seconds:
        items = word_items(batch_screens, seed=seed * 10**6 + steps, level=level)
        y = torch.tensor([index[w] for _, w, _ in items])
        loss = torch.nn.functional.cross_entropy(head(features(items)), y)
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        steps += 1
    secs = time.perf_counter() - t0
    return {
        "tower_steps": steps,
        "tower_s_per_step": round(secs / max(steps, 1), 3),
        "tower_last_loss": None if loss is None else round(loss.item(), 4),
        "tower_lr": lr,
    }


def train_tower(
    policy, seconds: float, level: str = "texts8", batch_screens: int = 8, lr: float = 3e-4, seed: int = 3
) -> dict:
    """Train `policy`'s vision tower and a linear head on its window tokens to name the look-alike
    (cross-entropy, the gradient norm clipped at 1) on fresh screens of `level` for `seconds`; returns
    `name_for`'s record."""
    import torch

    width = token_features(policy, word_items(1, seed=10**6, level=level)).shape[1]
    head = torch.nn.Linear(width, len(names_of(level)))
    visual = policy.model.model.visual
    visual.train()
    record = name_for(
        lambda items: token_features(policy, items, grad=True),
        head,
        [*visual.parameters(), *head.parameters()],
        seconds,
        level,
        lr,
        1.0,
        batch_screens,
        seed,
    )
    visual.eval()
    return record


def train_cnn(seconds: float, level: str = "texts8", batch_screens: int = 8, lr: float = 1e-3, seed: int = 3):
    """The reference a token grid is measured against: a small conv net (3 x 3 convolutions, 32-64-64
    channels, max-pooling) on the pixels of exactly the 1x tokens' window (`pixel_features`), trained like a
    tower to name the look-alike on fresh screens for `seconds` (no clip). Returns (its features before the
    last linear map, as a function of items, and `name_for`'s record)."""
    import torch

    h, w = NAME_WINDOW_SCREEN_PX[1], NAME_WINDOW_SCREEN_PX[0]  # the 1x window: 2 x 3 tokens of 28 px
    torch.manual_seed(seed)
    body = torch.nn.Sequential(
        *(torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2)),
        *(torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2)),
        *(torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveMaxPool2d((2, 3))),
        torch.nn.Flatten(),
    )
    head = torch.nn.Linear(64 * 6, len(names_of(level)))

    def pixels(items):
        return 1 - pixel_features(items).reshape(-1, 1, h, w)  # ink as 1

    params = [*body.parameters(), *head.parameters()]
    record = name_for(
        lambda items: body(pixels(items)), head, params, seconds, level, lr, None, batch_screens, seed
    )
    body.eval()

    def features(items):
        with torch.no_grad():
            return body(pixels(items))

    return features, record


def load(spec: str, workdir: Path):
    from arpo_core.policy.model import build_tiny_policy, load_policy

    path, _, pixels = spec.partition("@")
    if path == "init":
        return build_tiny_policy(workdir / "init", size="xs")
    if path.startswith("tower:"):
        import grounding_sweep

        return grounding_sweep.build(path.removeprefix("tower:"), workdir / path.replace(":", "-"))
    return load_policy(path, min_pixels=int(pixels) if pixels else None)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True, help="NAME=DIR[@MIN_PIXELS] or NAME=init")
    ap.add_argument("--train-screens", type=int, default=600)
    ap.add_argument("--test-screens", type=int, default=200)
    ap.add_argument("--steps", type=int, default=400, help="probe optimiser steps")
    ap.add_argument("--hidden", type=int, default=256, help="the MLP probe's hidden width")
    ap.add_argument("--tower-seconds", type=float, default=300.0, help="training time of a tower:LEVER")
    ap.add_argument(
        "--tower-lr",
        type=float,
        default=3e-4,
        help="a tower:LEVER's learning rate (1e-3 stays at the chance loss; results before 2026-12-05 used it)",
    )
    ap.add_argument(
        "--level", default="texts8", help="the screens: a word level, or boxes8 (colours) as a control"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "word_probe"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = names_of(args.level)
    train = word_items(args.train_screens, seed=1, level=args.level)
    test = word_items(args.test_screens, seed=2, level=args.level)
    index = {w: i for i, w in enumerate(names)}
    y_train = torch.tensor([index[w] for _, w, _ in train])
    y_test = torch.tensor([index[w] for _, w, _ in test])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in (m.split("=", 1) for m in args.model):
            t0, trained = time.perf_counter(), {}
            if spec == "cnn":
                features, trained = train_cnn(args.tower_seconds, level=args.level)
                x_train, x_test = features(train), features(test)
            elif spec in ("pixels", "pixels-centred"):
                centred = spec == "pixels-centred"
                x_train, x_test = (
                    pixel_features(train, centred=centred),
                    pixel_features(test, centred=centred),
                )
            else:
                policy = load(spec, Path(tmp))
                if spec.startswith("tower:"):
                    trained = train_tower(policy, args.tower_seconds, level=args.level, lr=args.tower_lr)
                x_train, x_test = token_features(policy, train), token_features(policy, test)
            row = {"model": name, "spec": spec, "features": x_train.shape[1]}
            row |= probe(x_train, y_train, x_test, y_test, len(names), args.steps)
            mlp = probe(x_train, y_train, x_test, y_test, len(names), args.steps, hidden=args.hidden)
            row |= {f"mlp_{k}": v for k, v in mlp.items()} | trained
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    record = {
        "benchmark": "word_probe",
        "level": args.level,
        "words": len(names),
        "chance": round(1 / len(names), 4),
        "train_words": len(train),
        "test_words": len(test),
        "window_screen_px": NAME_WINDOW_SCREEN_PX,
        "rows": rows,
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    md = [
        "# Word probe (issue 33): are the words in the image tokens?\n",
        f"A linear probe on the merged image tokens in a {NAME_WINDOW_SCREEN_PX[0]}x{NAME_WINDOW_SCREEN_PX[1]} screen-px "
        f"window around each look-alike of `{args.level}` screens; {len(names)} names (chance "
        f"{1 / len(names):.3f}); {len(train)} training items, {len(test)} held-out items on other screens.\n",
        f"Held-out accuracy of a linear probe and of an MLP probe ({args.hidden} hidden); train accuracy in "
        "brackets.\n",
        "| model | features | linear | MLP |",
        "|---|---|---|---|",
        *(
            f"| {r['model']} | {r['features']} | {r['test_acc']:.2f} ({r['train_acc']:.2f}) | "
            f"{r['mlp_test_acc']:.2f} ({r['mlp_train_acc']:.2f}) |"
            for r in rows
        ),
    ]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
