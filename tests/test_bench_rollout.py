"""benchmarks/bench_rollout.py helpers (no Chromium, no model): job lists, the clicking generator wrapper,
the latency proxy, summaries, ratios and argument parsing."""

from __future__ import annotations

import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_rollout as br  # noqa: E402

from arpo_core.actions import parse_response  # noqa: E402
from arpo_core.config import load_params  # noqa: E402
from arpo_core.policy.generate import Generation  # noqa: E402
from arpo_core.policy.prompt import PromptInput  # noqa: E402


def test_make_jobs_cycles_tasks_with_distinct_seeds():
    jobs = br.make_jobs(["a", "b"], 5, first_seed=10)
    assert [j.task.task_id for j in jobs] == ["a", "b", "a", "b", "a"]
    assert [j.seed for j in jobs] == [10, 11, 12, 13, 14]
    assert all(j.task.domain == "miniwob" and j.task.backend == "miniwob" for j in jobs)


class Recorder:
    def __init__(self):
        self.calls = []

    def generate(self, batch, *, seeds, **kw):
        self.calls.append((len(batch), list(seeds)))
        return [Generation("garbage", (1, 2, 3), (-0.1, -0.2, -0.3), "length") for _ in batch]


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_clicking_generator_keeps_tokens_and_clicks_inside_the_model_image(one_at_a_time):
    inner = Recorder()
    gen = br.ClickingGenerator(inner, min_pixels=3136, max_pixels=448 * 448, one_at_a_time=one_at_a_time)
    batch = [PromptInput("Click", (Image.new("RGB", (160, 210)),), ()) for _ in range(3)]
    out = gen.generate(batch, seeds=[7, 8, 9], temperature=1.0, top_p=1.0, max_new_tokens=3)
    # one batched call, or three batch-1 calls, each prompt with its own seed
    assert inner.calls == ([(1, [7]), (1, [8]), (1, [9])] if one_at_a_time else [(3, [7, 8, 9])])
    assert gen.batch_sizes == [3]
    for g in out:
        assert g.token_ids == (1, 2, 3) and g.logprobs == (-0.1, -0.2, -0.3)
        (a,) = parse_response(g.text).actions
        # 160x210 -> smart_resize 168x224 model image
        assert a.kind == "click" and 0 <= a.point[0] < 168 and 0 <= a.point[1] < 224
    # the click follows the prompt's seed, not the call order
    again = gen.generate(batch[:1], seeds=[9], temperature=1.0, top_p=1.0, max_new_tokens=3)
    assert again[0].text == out[2].text


def test_timed_pool_records_latency_by_kind():
    class Pool:
        n = 2

        def __init__(self):
            self.pending = []

        def submit_reset(self, *a):
            f = Future()
            self.pending.append(f)
            return f

        submit_step = submit_evaluate = submit_reset

    pool = Pool()
    timed = br.TimedPool(pool)
    assert timed.n == 2
    f1, f2 = timed.submit_reset(0, None, 1), timed.submit_step(1, [])
    timed.submit_evaluate(0)
    assert timed.latency == {"reset": [], "step": [], "evaluate": []}  # nothing finished yet
    assert not f1.done()
    pool.pending[0].set_result("r")
    pool.pending[1].set_result("s")
    assert f1 is pool.pending[0]  # the pool's own futures: the loop waits on them with cf.wait
    assert f1.done() and f1.result() == "r" and f2.result() == "s"
    assert len(timed.latency["reset"]) == 1 and len(timed.latency["step"]) == 1
    assert timed.latency["evaluate"] == [] and timed.latency["reset"][0] >= 0


def test_summarize_and_median():
    m = {
        "time/rollout_s": 10.0,
        "time/env_wait_s": 4.0,
        "time/inference_s": 5.0,
        "time/other_s": 1.0,
        "rollout/env_utilization": 0.7,
        "rollout/mean_batch": 3.5,
        "rollout/generate_calls": 9.0,
    }
    s = br.summarize(m, n_steps=30, n_episodes=8)
    assert s["env_steps_per_s"] == 3.0 and s["episodes_per_s"] == 0.8
    assert (s["env_frac"], s["inference_frac"], s["other_frac"]) == (0.4, 0.5, 0.1)
    assert (s["env_utilization"], s["mean_batch"], s["generate_calls"]) == (0.7, 3.5, 9.0)
    med = br.median_summary([{"x": 1.0}, {"x": 5.0}, {"x": 2.0}])
    assert med == {"x": 2.0}


def row(backend: str, n: int, mode: str, pause: float | None = None, **fields) -> dict:
    """A results row as bench_pool writes it (`step_pause_s` left out like an older record's when None)."""
    r = {"backend": backend, "n_envs": n, "mode": mode, **fields}
    if pause is not None:
        r["step_pause_s"] = pause
    return r


def test_ratios():
    res = [
        row("process", 8, "sync", env_steps_per_s=10.0, env_utilization=0.4),
        row("process", 8, "async", env_steps_per_s=13.0, env_utilization=0.6),
        row("process", 4, "sync", env_steps_per_s=8.0, env_utilization=0.5),
        row("ray", 8, "sync", env_steps_per_s=5.0, env_utilization=0.3),
        row("ray", 8, "async", env_steps_per_s=6.0, env_utilization=0.5),
        row("process", 8, "sync", 0.5, env_steps_per_s=4.0, env_utilization=0.5),
        row("process", 8, "async", 0.5, env_steps_per_s=6.0, env_utilization=0.9),
    ]
    assert br.ratios(res) == {
        "async_over_sync_8_pause0.5": 1.5,
        "utilization_async_8_pause0.5": 0.9,
        "utilization_sync_8_pause0.5": 0.5,
        "async_over_sync_8": 1.3,
        "utilization_async_8": 0.6,
        "utilization_sync_8": 0.4,
        "ray_async_over_sync_8": 1.2,
        "ray_utilization_async_8": 0.5,
        "ray_utilization_sync_8": 0.3,
    }  # n=4 has no async run: no ratio


def test_bounds_come_from_the_sync_runs():
    res = [
        row("process", 8, "sync", 0.0, machine_cpu_busy=0.8, inference_frac=0.25),
        row("process", 8, "async", 0.0, machine_cpu_busy=0.95, inference_frac=0.9),
        row("process", 8, "sync", 0.5, machine_cpu_busy=0.5, inference_frac=0.2),
        row("ray", 8, "sync", machine_cpu_busy=0.1, inference_frac=0.1),
    ]
    assert br.bounds(res) == {
        "cpu_bound_8": 1.25,
        "gen_hidden_8": 1.333,
        "cpu_bound_8_pause0.5": 2.0,
        "gen_hidden_8_pause0.5": 1.25,
    }


def test_parse_args():
    a = br.parse_args(["--envs", "1,2", "--backends", "ray", "--episodes", "8", "--batch-wait", "0.05"])
    assert a.envs == [1, 2] and a.backends == ["ray"] and a.episodes == 8 and a.batch_wait == 0.05
    d = br.parse_args([])
    assert d.modes == ["sync", "async"] and d.envs == [4, 8, 16] and not d.one_at_a_time
    params = load_params(ROOT / "params.yaml").policy  # the pipeline's prompt by default
    assert d.step_pauses == [0.0] and (d.history_images, d.system_prompt) == (
        params.history_images,
        params.system_prompt,
    )
    a = br.parse_args(["--step-pauses", "0,0.5", "--history-images", "all"])
    assert a.step_pauses == [0.0, 0.5] and a.history_images is None
    with pytest.raises(SystemExit):
        br.parse_args(["--backends", "thread"])
    with pytest.raises(SystemExit):
        br.parse_args(["--modes", "batched"])
