"""Replay-buffer memory per stored trajectory: PNG bytes + token ids (this project) vs the processor's
fp32 pixel tensors that the reference code keeps (docs/method.md §1), for MiniWoB and 1920x1080 screens.

    .venv/bin/python benchmarks/bench_replay_memory.py        # writes benchmarks/results/replay_memory.json

The 1080p screenshot is a real Chromium rendering of a dense local page (text, form widgets, a table,
an image-like gradient): desktop screenshots compress far less than a blank frame, so a synthetic
one would flatter PNG. The MiniWoB screenshot is a real episode frame. Sizes are measured, not derived:
the PNG is encoded, the Parquet file is written and its size on disk read back, and the pixel tensor
is what `Qwen2VLImageProcessorPil` returns for the same image (the reference stores those).
"""

from __future__ import annotations

import datetime as dt
import io
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image
from transformers import Qwen2VLImageProcessorPil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arpo_core.trajectory import Step, Trajectory, png_bytes, write_trajectories  # noqa: E402

STEPS = 15  # the reference keeps every screenshot of a 15-step trajectory


def dense_page_html() -> str:
    rows = "".join(
        f"<tr><td>{i}</td><td>item-{i * 37 % 1000}</td><td>{i * 3.14159:.3f}</td><td>status {'ok' if i % 3 else 'fail'}</td></tr>"
        for i in range(60)
    )
    para = " ".join(f"word{i % 97}" for i in range(900))
    return f"""<html><body style="font-family:sans-serif;margin:10px">
<div style="height:60px;background:linear-gradient(90deg,#1e3c72,#2a5298,#e96443);color:white;font-size:28px">
Settings - Document editor - File Edit View Insert Format Tools Help</div>
<div style="display:flex"><div style="width:300px">{"".join(f"<p><input type=checkbox {'checked' if i % 2 else ''}> option {i}</p>" for i in range(25))}</div>
<div style="width:900px"><p>{para}</p><table border=1>{rows}</table></div>
<div style="width:600px;height:900px;background:radial-gradient(circle,#f6d365,#fda085,#5ee7df,#b490ca)"></div></div>
</body></html>"""


def chromium_screenshot(html: str, size=(1920, 1080)) -> Image.Image:
    with tempfile.TemporaryDirectory() as d:
        page = Path(d) / "page.html"
        page.write_text(html)
        out = Path(d) / "shot.png"
        subprocess.run(
            [
                "/usr/lib/chromium/chromium",
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--disable-background-networking",
                f"--user-data-dir={d}/profile",
                f"--window-size={size[0]},{size[1]}",
                "--hide-scrollbars",
                f"--screenshot={out}",
                page.as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        return Image.open(out).convert("RGB")


def miniwob_screenshot() -> Image.Image:
    from arpo_core.envs.base import TaskSpec
    from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv

    env = MiniWoBEnv()
    try:
        return env.reset(TaskSpec(domain="miniwob", task_id="click-checkboxes"), seed=0).screenshot
    finally:
        env.close()


def measure(name: str, img: Image.Image, min_pixels: int, max_pixels: int, reply_tokens: int = 40) -> dict:
    proc = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    pix = proc(images=[img], return_tensors="pt")["pixel_values"]
    tensor_bytes = pix.numel() * pix.element_size()
    png = png_bytes(img)
    steps = [
        Step(
            step_idx=i,
            screenshot_png=png,
            screen_w=img.width,
            screen_h=img.height,
            response_text="Thought: click the item.\nAction: click(start_box='(100,200)')",
            response_token_ids=list(range(reply_tokens)),
        )
        for i in range(STEPS)
    ]
    traj = Trajectory("bench", "train", 1, "bench", name, "do it", steps)
    with tempfile.TemporaryDirectory() as d:
        parquet = Path(d) / "t.parquet"
        write_trajectories(parquet, [traj])
        parquet_bytes = parquet.stat().st_size
    ours = len(png) * STEPS + reply_tokens * 4 * STEPS
    ref = tensor_bytes * STEPS
    return {
        "screen": list(img.size),
        "pixel_tensor_shape": list(pix.shape),
        "png_bytes_per_screenshot": len(png),
        "pixel_tensor_bytes_per_screenshot": tensor_bytes,
        "ours_bytes_per_trajectory_in_memory": ours,
        "ours_parquet_bytes_per_trajectory_on_disk": parquet_bytes,
        "reference_bytes_per_trajectory": ref,
        "ratio_reference_over_ours": ref / ours,
        "steps_per_trajectory": STEPS,
    }


def main() -> None:
    buf = io.StringIO()
    results = {
        "miniwob_160x210": measure("miniwob", miniwob_screenshot(), 3136, 200704),
        "desktop_1920x1080": measure("desktop", chromium_screenshot(dense_page_html()), 256, 2116800),
    }
    out = {
        "benchmark": "replay_memory",
        "command": "python benchmarks/bench_replay_memory.py",
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}",
        "note": "PNG of screenshots + reply token ids (int32) vs fp32 processor pixel tensors, 15 steps",
        "results": results,
    }
    print(buf.getvalue(), json.dumps(out, indent=2))
    path = ROOT / "benchmarks" / "results" / "replay_memory.json"
    path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
