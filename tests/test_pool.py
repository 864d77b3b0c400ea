"""EnvPool on real MiniWoB/Chromium workers, with the process backend and the Ray backend."""

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from proctools import alive, pids_naming

from arpo_core.actions import Action, parse_response, to_screen
from arpo_core.envs.base import TaskSpec
from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env
from arpo_core.envs.miniwob.oracles import model_size
from arpo_core.envs.pool import EnvPool

REPO = Path(__file__).resolve().parents[1]
FACTORY = functools.partial(make_miniwob_env, episode_time_limit_s=60)


def task(name: str) -> TaskSpec:
    return TaskSpec("miniwob", name)


def wait_gone(pids, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def wait_removed(path: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not os.path.exists(path)


def oracle_actions(pool: EnvPool, i: int) -> list[Action]:
    reply = pool.submit_call(i, "oracle_reply").result()
    assert reply.error is None
    return to_screen(parse_response(reply.value).actions, model_size(), (160, 210))


def env_processes(pool: EnvPool, i: int) -> tuple[list[int], str]:
    """(chromedriver + chromium pids, browser profile dir) of env i."""
    pids = pool.submit_call(i, "browser_pids").result().value
    profile = pool.submit_call(i, "profile_dir").result().value
    return pids, profile


@pytest.fixture(scope="module")
def ray_session():
    import ray

    # a custom resource, as on the reference's CPU env nodes; every Ray-backed pool below asks for it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, resources={"env_node": 1.0})
    yield ray
    ray.shutdown()


@pytest.fixture(params=["process", pytest.param("ray", marks=pytest.mark.slow)])
def backend(request):
    if request.param == "ray":
        request.getfixturevalue("ray_session")
    return request.param


def make_pool(factory, n, backend="process", **kw) -> EnvPool:
    """EnvPool; Ray-backed pools ask for the custom resource, as env actors would on env nodes."""
    if backend == "ray":
        kw.setdefault("ray_resources", {"env_node": 0.01})
    return EnvPool(factory, n, backend=backend, **kw)


def test_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        make_pool(FACTORY, 1, backend="threads")


def test_parallel_episodes_and_evaluation_overlapping_steps(backend):
    with make_pool(FACTORY, 2, backend=backend) as pool:
        res = pool.reset([(0, task("click-test"), 1), (1, task("enter-text"), 2)])
        assert [res[i].error for i in (0, 1)] == [None, None]
        assert res[0].observation.instruction == "Click the button."
        assert res[1].observation.screenshot.size == (160, 210)
        out = pool.step({0: oracle_actions(pool, 0), 1: oracle_actions(pool, 1)})
        assert out[0].done and not out[1].done
        # env 0 is evaluated while env 1 keeps stepping (futures API)
        ev0 = pool.submit_evaluate(0)
        steps = 1
        while not out[1].done:
            out = pool.step({1: oracle_actions(pool, 1)})
            steps += 1
        assert steps == 3  # click field, type, click Submit
        assert ev0.result().score == 1.0
        assert pool.evaluate([1])[1].score == 1.0
        assert pool.restarts() == [0, 0]


def test_killed_browser_is_detected_and_replaced(backend):
    with make_pool(FACTORY, 2, backend=backend) as pool:
        pool.reset([(0, task("click-test"), 0), (1, task("click-test"), 0)])
        old_worker = pool.worker_pids()[0]
        browser, _ = env_processes(pool, 0)
        for p in browser:
            os.kill(p, signal.SIGKILL)
        out = pool.step({0: [Action("click", point=(5, 205))], 1: [Action("click", point=(5, 205))]})
        assert out[0].done and "browser failure" in out[0].error
        assert out[1].error is None and not out[1].done
        again = pool.reset([(0, task("click-test"), 3)])[0]
        assert again.error is None and again.observation.instruction == "Click the button."
        assert pool.restarts() == [1, 0]
        faults = pool.fault_counts()  # every fault counted (issue 18)
        assert (faults["browser_crashes"], faults["worker_restarts"]) == (1, 1), faults
        assert sum(faults.values()) == 2
        assert pool.task_fault_counts() == {("miniwob", "click-test"): faults}
        assert pool.worker_pids()[0] != old_worker
        assert wait_gone([old_worker]) == []
        out = pool.step({0: oracle_actions(pool, 0), 1: oracle_actions(pool, 1)})
        assert out[0].done and out[1].done
        assert [r.score for r in pool.evaluate([0, 1]).values()] == [1.0, 1.0]


def test_sigkilled_worker_takes_its_browser_along_and_is_replaced(backend):
    with make_pool(FACTORY, 1, backend=backend) as pool:
        pool.reset([(0, task("click-test"), 0)])
        worker = pool.worker_pids()[0]
        browser, profile = env_processes(pool, 0)
        os.kill(worker, signal.SIGKILL)  # no chance to clean up: the reaper must do it
        assert wait_gone(browser) == []
        assert wait_gone(pids_naming(profile)) == []
        assert wait_removed(profile)
        out = pool.step({0: [Action("click", point=(80, 120))]})[0]
        assert out.done and "worker" in out.error
        assert pool.reset([(0, task("click-test"), 0)])[0].error is None
        assert pool.restarts() == [1]
        faults = pool.fault_counts()
        assert (faults["worker_crashes"], faults["worker_restarts"], sum(faults.values())) == (1, 1, 2), (
            faults
        )


@pytest.mark.parametrize("when", ["before_reset", "before_close"])
def test_a_browser_killed_between_calls_is_counted_once(backend, when, caplog):
    """The env replaces a browser that died before a reset by itself, and finds one that died after the
    last call when it closes: both are one `browser_crashes` fault (issue 18), in the same warning line."""
    import logging

    with caplog.at_level(logging.WARNING, logger="arpo.envs"):
        pool = make_pool(FACTORY, 1, backend=backend)
        try:
            pool.reset([(0, task("click-test"), 0)])
            worker = pool.worker_pids()[0]
            browser, _ = env_processes(pool, 0)
            for p in browser:
                os.kill(p, signal.SIGKILL)
            assert wait_gone(browser) == []
            if when == "before_reset":
                again = pool.reset([(0, task("click-test"), 1)])[0]
                assert again.error is None and again.observation.instruction == "Click the button."
                assert pool.worker_pids()[0] == worker  # the env healed itself: no worker replaced
                assert env_processes(pool, 0)[0]  # a new browser
        finally:
            pool.close()
    faults = pool.fault_counts()
    assert (faults["browser_crashes"], sum(faults.values())) == (1, 1), faults
    lines = [r.getMessage() for r in caplog.records if r.name == "arpo.envs"]
    assert len(lines) == 1 and "browser_crashes" in lines[0] and f"worker {worker}" in lines[0], lines


@pytest.mark.parametrize("wait_for_death", [True, False], ids=["dead", "dying"])
def test_every_fault_is_one_warning_line_and_a_dead_worker_is_counted_at_close(caplog, wait_for_death):
    """`dying`: close() runs while the killed worker may still be exiting (not yet reapable by poll())."""
    import logging

    with caplog.at_level(logging.WARNING, logger="arpo.envs"):
        pool = make_pool(FACTORY, 1)
        pool.reset([(0, task("click-test"), 0)])
        worker = pool.worker_pids()[0]
        os.kill(worker, signal.SIGKILL)  # dies between calls: only close() can notice
        if wait_for_death:
            assert wait_gone([worker]) == []
        pool.close()
    assert pool.fault_counts()["worker_crashes"] == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "arpo.envs"]
    assert len(lines) == 1 and "worker_crashes" in lines[0] and "miniwob/click-test" in lines[0], lines


def test_close_leaves_no_process(backend):
    pool = make_pool(FACTORY, 2, backend=backend)
    pool.reset([(i, task("click-test"), i) for i in range(2)])
    workers = pool.worker_pids()
    procs = [env_processes(pool, i) for i in range(2)]
    browsers = [p for pids, _ in procs for p in pids]
    assert all(alive(p) for p in workers) and browsers
    pool.close()
    assert wait_gone(workers + browsers) == []
    for _, profile in procs:
        assert wait_gone(pids_naming(profile)) == []
        assert wait_removed(profile)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit_step(0, [])


def test_a_killed_worker_group_leaves_no_process_crash_handlers_included(monkeypatch):
    """Chromium's crash handlers re-parent to init and name neither the env nor its profile: they only
    carry the environment, and the browser's reaper kills them by its mark (miniwob_env.py,
    decision "Process hygiene"), so SIGKILL of the worker's group (a timeout, a second Ctrl-C) leaves nothing
    behind."""
    import uuid

    from test_interrupt import _cmdline, marked

    marker = uuid.uuid4().hex
    monkeypatch.setenv("ARPO_TEST_MARK", marker)
    pool = make_pool(FACTORY, 1)
    try:
        pool.reset([(0, task("click-test"), 0)])
        worker = pool.worker_pids()[0]
        handlers = [p for p in marked(marker) if b"chrome_crashpad_handler" in _cmdline(p)]
        assert handlers and all(os.getpgid(p) != worker for p in handlers), handlers  # outside the group
        for p in handlers:  # as a handler that never notices its browser died (CI: one outlived a run)
            os.kill(p, signal.SIGSTOP)
        os.killpg(worker, signal.SIGKILL)
        assert wait_gone(marked(marker)) == [], [_cmdline(p)[:120] for p in marked(marker)]
    finally:
        pool.close()


def test_env_close_kills_the_crash_handlers_of_a_killed_browser():
    """Without a pool (the compare stage's probe): close() after the browser died kills its crash
    handlers too, found by the mark chromedriver's environment gives every process of the browser."""
    from test_interrupt import _cmdline

    from arpo_core.envs.miniwob.miniwob_env import BROWSER_MARK, MiniWoBEnv, pids_with_env

    env = MiniWoBEnv()
    try:
        env.reset(task("click-test"), seed=0)
        mine = pids_with_env(BROWSER_MARK, env.profile_dir())
        handlers = [p for p in mine if b"chrome_crashpad_handler" in _cmdline(p)]
        assert handlers and set(handlers).isdisjoint(env.browser_pids()), (handlers, env.browser_pids())
        for p in handlers:  # as handlers that never notice their browser died
            os.kill(p, signal.SIGSTOP)
        for p in env.browser_pids():
            if b"chromedriver" not in _cmdline(p):
                os.kill(p, signal.SIGKILL)
    finally:
        env.close()
    assert wait_gone(mine) == [], [_cmdline(p)[:120] for p in mine]


@pytest.mark.slow
def test_hung_step_times_out_kills_group_and_recovers(backend):
    hang = functools.partial(make_miniwob_env, wait_s=30.0)
    with make_pool(hang, 1, backend=backend, step_timeout_s=2.0) as pool:
        pool.reset([(0, task("click-test"), 0)])
        worker = pool.worker_pids()[0]
        browser, _ = env_processes(pool, 0)
        t0 = time.monotonic()
        out = pool.step({0: [Action("wait")]})[0]
        assert out.done and "timed out" in out.error
        assert time.monotonic() - t0 < 20
        assert wait_gone([worker, *browser]) == []
        assert pool.reset([(0, task("click-test"), 0)])[0].error is None
        assert pool.restarts() == [1]
        faults = pool.fault_counts()
        assert (faults["timeouts"], faults["worker_restarts"], sum(faults.values())) == (1, 1, 2), faults


@pytest.mark.slow
def test_reset_retries_then_reports_env_error(backend):
    broken = functools.partial(make_miniwob_env, chromedriver="/nonexistent/chromedriver")
    with make_pool(broken, 1, backend=backend, reset_retries=2) as pool:
        res = pool.reset([(0, task("click-test"), 0)])[0]
        assert res.done and res.observation is None
        assert "reset failed 2 times" in res.error
        assert pool.restarts() == [1]
        faults = pool.fault_counts()
        assert (
            faults["reset_retries"] == 1 and faults["reset_failures"] == 1 and faults["worker_restarts"] == 1
        )
        assert faults["env_errors"] == 2  # the browser could not start, once per try


PARENT = """
import functools, json, sys, time
from arpo_core.envs.base import TaskSpec
from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env
from arpo_core.envs.pool import EnvPool
backend = sys.argv[1]
if backend == "ray":
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, resources={"env_node": 1.0})
res = {"env_node": 0.01} if backend == "ray" else None
pool = EnvPool(functools.partial(make_miniwob_env), 2, backend=backend, ray_resources=res)
pool.reset([(i, TaskSpec("miniwob", "click-test"), i) for i in range(2)])
procs = [(pool.submit_call(i, "browser_pids").result().value,
          pool.submit_call(i, "profile_dir").result().value) for i in range(2)]
print(json.dumps({"workers": pool.worker_pids(), "procs": procs}), flush=True)
time.sleep(600)
"""


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def test_parent_sigkill_leaves_no_orphans(tmp_path, backend):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(PARENT))
    parent = subprocess.Popen(
        [sys.executable, str(script), backend], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    started: list[int] = []
    try:
        line = parent.stdout.readline()
        assert line, "parent exited before reporting its pids"
        started = descendants(parent.pid)
        info = json.loads(line)
        pids = info["workers"] + [p for pids, _ in info["procs"] for p in pids]
        assert all(alive(p) for p in info["workers"])
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_gone(pids, timeout_s=20) == []
        for _, profile in info["procs"]:
            assert wait_gone(pids_naming(profile), timeout_s=10) == []
            assert wait_removed(profile)
    finally:
        parent.kill()
        parent.wait()
        # Ray's own agents (dashboard / runtime-env) outlive a SIGKILLed driver; they are not the
        # pool's, but this test started them, so it removes them.
        for p in started:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_benchmark_script_runs_and_records(tmp_path):
    out = tmp_path / "env_pool.json"
    cmd = [sys.executable, "benchmarks/bench_env_pool.py", "--sizes", "1", "--steps", "2", "--runs", "1"]
    subprocess.run([*cmd, "--out", str(out)], cwd=REPO, check=True, timeout=120, capture_output=True)
    record = json.loads(out.read_text())
    (row,) = record["results"]
    assert row["n_envs"] == 1 and row["steps_per_s_median"] > 0
    assert record["machine"]["cpu_count"] == os.cpu_count() and record["date_utc"]


SEQUENTIAL_RAY_POOLS = """
import functools, sys
from arpo_core.envs.base import TaskSpec
from arpo_core.envs.miniwob.miniwob_env import make_miniwob_env
from arpo_core.envs.pool import EnvPool
for i in range(2):  # two stages in one process: the first pool starts Ray, the second reuses it
    pool = EnvPool(functools.partial(make_miniwob_env), 1, backend="ray")
    res = pool.reset([(0, TaskSpec("miniwob", "click-test"), i)])[0]
    assert res.error is None, res.error
    pool.close()
    print("pool", i, "ok", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_survives_the_pool_that_started_it(tmp_path):
    """pool._ensure_ray: Ray started by one pool's worker thread died with that thread, so the next
    stage's pool (same process) failed to reach GCS or hung."""
    script = tmp_path / "two_pools.py"
    script.write_text(SEQUENTIAL_RAY_POOLS)
    out = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "pool 1 ok" in out.stdout


def test_an_env_whose_owner_is_killed_leaves_no_process():
    """The ground and compare stages use a MiniWoBEnv without the pool; a second Ctrl-C or a SIGKILL of
    that process gives close() no chance, and its browser's reaper kills what carries the mark."""
    from test_interrupt import _cmdline

    from arpo_core.envs.miniwob.miniwob_env import BROWSER_MARK, pids_with_env

    code = (
        "from arpo_core.envs.base import TaskSpec\n"
        "from arpo_core.envs.miniwob.miniwob_env import MiniWoBEnv\n"
        "import time\n"
        "env = MiniWoBEnv()\n"
        "env.reset(TaskSpec(domain='miniwob', task_id='click-test', backend='miniwob'), seed=0)\n"
        "print(env.profile_dir(), flush=True)\n"
        "time.sleep(120)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        profile = owner.stdout.readline().strip()
        assert profile, "the env did not start"
        mine = pids_with_env(BROWSER_MARK, profile)
        handlers = [p for p in mine if b"chrome_crashpad_handler" in _cmdline(p)]
        assert handlers, [_cmdline(p)[:80] for p in mine]
        for p in handlers:  # as handlers that never notice their browser died
            os.kill(p, signal.SIGSTOP)
        owner.kill()
        owner.wait(timeout=10)
        assert wait_gone(mine) == [], [_cmdline(p)[:120] for p in mine if alive(p)]
        assert wait_removed(profile)
    finally:
        owner.kill()
