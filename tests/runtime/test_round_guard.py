"""A guarded round (issue 57): a device's owner bounds what a round's compute may take, a memory
ceiling and a time budget (runtime/guard.py, `splitedge device --max-round-memory-mb
--round-budget-s`); a round over either fails in one logged line, the device stays up and
answers the next round, and its edge counts it (`devices.failed`, the cloud's `failures`).
"""

from __future__ import annotations

import argparse
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from splitedge.methods.budget import checkpoint
from splitedge.methods.errors import RoundFailed
from splitedge.runtime import guard
from splitedge.runtime.guard import OverBudget, RoundGuard, allocation_failed
from splitedge.protocol.done import DoneInfo
from splitedge.runtime.records import failed_devices, phase_failures

from federation import Federation
from parts import cloud_ctx, device_ctx, method_for, plan_for, report, env


def test_a_compute_over_its_time_budget_fails_at_its_next_batch():
    # Prepare: a guard of 0.2 s; a loop of batches that each take 0.05 s
    g = RoundGuard(budget_s=0.2, who="device d0")
    batches = 0
    # Execute
    with pytest.raises(OverBudget) as failed:
        with g.round("round 3", deadline_s=60.0):
            for _ in range(100):
                checkpoint()
                batches += 1
                time.sleep(0.05)
    # Check: it stopped soon after the budget, saying what was exceeded and the flag that raises it
    assert failed.value.reason == "time" and isinstance(failed.value, RoundFailed)
    assert 4 <= batches < 20
    assert "round 3 exceeded its time budget of 0.2 s" in str(failed.value) and guard.TIME_FLAG in str(failed.value)
    checkpoint()  # outside a guarded round: nothing


def test_the_default_budget_is_the_rounds_deadline():
    g = RoundGuard()
    with g.round("round 1", deadline_s=0.1) as within:
        within.check()
        time.sleep(0.15)
        with pytest.raises(OverBudget, match="time budget of 0.1 s"):
            checkpoint()


def test_a_failed_allocation_fails_the_round_in_one_line():
    # numpy's MemoryError and torch's allocator RuntimeError both become OverBudget("memory")
    g = RoundGuard(memory_mb=300, who="device d1", hard=True)
    for exc in (MemoryError("Unable to allocate 2.00 GiB for an array with shape (268435456,)"),
                RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 419430400 bytes")):
        with pytest.raises(OverBudget) as failed:
            with g.round("round 2", deadline_s=60.0):
                raise exc
        text = str(failed.value)
        assert failed.value.reason == "memory" and "\n" not in text
        assert "round 2 ran out of memory under its ceiling of 300 MB" in text and guard.MEMORY_FLAG in text
        assert str(exc)[:20] in text  # what was asked
        assert failed.value.__cause__ is None and failed.value.__suppress_context__  # no traceback of the round
    with pytest.raises(RuntimeError, match="a bug"):  # any other error stays what it is
        with g.round("round 2", deadline_s=60.0):
            raise RuntimeError("a bug")
    assert not allocation_failed(ValueError("can't allocate memory"))


def test_without_an_rlimit_the_ceiling_bounds_the_resident_memory_per_batch():
    # a sim's devices share one process: the ceiling is checked against its resident memory
    held = guard.rss_mb()
    with pytest.raises(OverBudget, match="holds .* MB, over its memory ceiling of"):
        with RoundGuard(memory_mb=held / 2).round("round 1", deadline_s=60.0):
            checkpoint()
    with RoundGuard(memory_mb=held * 4 + 1024).round("round 1", deadline_s=60.0):
        checkpoint()


def test_flags_and_defaults():
    p = argparse.ArgumentParser()
    guard.add_arguments(p, "a round")
    args = p.parse_args([])
    g = RoundGuard.from_args(args, "device d0")
    assert g.memory_mb == pytest.approx(guard.default_memory_mb()) and g.budget_s is None
    assert 0.5 * guard.default_memory_mb() < g.memory_mb  # three quarters of the machine's RAM
    assert RoundGuard.from_args(args, "sim", process=False).memory_mb is None  # a sim: none by default
    g = RoundGuard.from_args(p.parse_args(["--max-round-memory-mb", "0", "--round-budget-s", "12"]), "device d0")
    assert g.memory_mb is None and g.budget_s == 12
    with pytest.raises(ValueError, match="--round-budget-s"):
        RoundGuard.from_args(p.parse_args(["--round-budget-s", "0"]), "device d0")
    with pytest.raises(ValueError, match="below what this device holds"):
        RoundGuard(memory_mb=1, who="device d0").limit_process()


def test_the_edge_counts_its_failed_devices_by_reason():
    infos = [DoneInfo(samples=10), DoneInfo(failed=True, reason="memory"), DoneInfo(failed=True, reason="time"),
             DoneInfo(failed=True), DoneInfo(failed=True, left="a backend the method cannot run")]
    assert failed_devices(infos) == {"memory": 1, "time": 1, "other": 1}
    edges = [report("e0", env("done", {"phase": "round", "info": {"devices": {"failed": {"memory": 1}}}}, sender="e0")),
             report("e1", env("done", {"phase": "round", "info": {"devices": {"failed": {"memory": 2, "time": 1}},
                                                                  "failed": True, "reason": "time"}}, sender="e1"))]
    assert phase_failures(edges) == {"memory": 3, "time": 1, "edge_time": 1}


def measured_round_s() -> float:
    """A FedAvg device round on digits (a larger shard than the test's devices hold), timed here
    and now: the machine's load decides the budgets below, not a fixed number of seconds. The
    second of two rounds: the rounds a budget must let through are a device's later ones (its
    first pays for torch's warm-up, and is the one the tests make overstay). On one thread, as
    a device runs (`--threads 1`)."""
    import torch

    from splitedge.methods.data.datasets import load_dataset

    (x, y), _, _ = load_dataset("digits")
    part = method_for("fedavg").device_part(device_ctx("fedavg"), (x[:800], y[:800]), "torch")
    part.version = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        list(part.run_round(plan_for(1, "fedavg")))
        started = time.monotonic()
        list(part.run_round(plan_for(2, "fedavg")))
        return time.monotonic() - started
    finally:
        torch.set_num_threads(threads)


HOOK = textwrap.dedent('''
    """Test-only (tests/runtime/test_round_guard.py), in the process of one node: its first round's compute
    allocates GUARD_TEST_ALLOC_MB (a device's first training batch), or overstays the time budget it
    runs under (GUARD_TEST_OVERSTAY: `train`, a device's first batch; `merge`, an edge's first
    merge; `evaluation`, the cloud's first evaluation)."""
    import os
    import time

    def overstay():
        from splitedge.methods import budget

        time.sleep(max(0.0, budget._local.check.ends - time.monotonic()) + 0.3)

    def once(module, name, before):
        real, first = getattr(module, name), [True]

        def hooked(*args, **kwargs):
            if first[0]:
                first[0] = False
                before()
            return real(*args, **kwargs)

        setattr(module, name, hooked)

    wanted = os.environ.get("GUARD_TEST_OVERSTAY", "")
    if os.environ.get("GUARD_TEST_ALLOC_MB"):
        import numpy as np

        from splitedge.methods import training

        # beyond the ceiling: the rlimit refuses it
        once(training, "train_step", lambda: np.empty(int(os.environ["GUARD_TEST_ALLOC_MB"]) * 2**20, dtype=np.uint8))
    elif wanted == "train":
        from splitedge.methods import training

        once(training, "train_step", overstay)
    elif wanted == "merge":
        from splitedge.runtime.mods import ModChain

        once(ModChain, "merge", overstay)
    elif wanted == "evaluation":
        from splitedge.methods.metrics import evaluate

        once(evaluate, "_evaluate", overstay)
''')


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line]


@pytest.mark.usefixtures("mosquitto_binary")
def test_a_device_over_its_memory_ceiling_or_time_budget_fails_that_round_and_answers_the_next(tmp_path: Path):
    """Processes on a real broker: d1 asks for twice its memory ceiling in round 1 (the rlimit
    refuses it), d2 overstays its time budget in round 1; both fail that round in one line, the
    edge counts them, and both train round 2. The edge's first merge and the cloud's first
    evaluation overstay their budgets too: each is one line, and round 2 is whole."""
    from splitedge.protocol.broker import MosquittoBroker

    # Prepare: the budget from a round measured now; a ceiling far above what a torch device holds
    budget_s = max(5.0, 20 * measured_round_s())
    ceiling_mb = 4096
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(HOOK)
    with MosquittoBroker() as broker:
        budget = ["--round-budget-s", f"{budget_s:.1f}"]
        fed = Federation(tmp_path, broker.url, edges=1, devices=3, rounds=2,
                         extra=["--method", "fedavg", "--deadline", f"{4 * budget_s + 30:.0f}", *budget],
                         node_extra={"d1": ["--max-round-memory-mb", str(ceiling_mb)], "d2": budget, "e0": budget},
                         node_env={"d1": {"PYTHONPATH": str(hooks), "GUARD_TEST_ALLOC_MB": str(2 * ceiling_mb)},
                                   "d2": {"PYTHONPATH": str(hooks), "GUARD_TEST_OVERSTAY": "train"},
                                   "e0": {"PYTHONPATH": str(hooks), "GUARD_TEST_OVERSTAY": "merge"},
                                   "cloud": {"PYTHONPATH": str(hooks), "GUARD_TEST_OVERSTAY": "evaluation"}})
        try:
            # Execute
            fed.wait(timeout=300 + 8 * budget_s)
            metrics = fed.metrics()
            logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("d0", "d1", "d2", "e0", "cloud")}
        finally:
            fed.close()
    # Check: round 1 lost d1 (memory) and d2 (time), each in one line; round 2 had all three
    assert [r["round"] for r in metrics] == [1, 2], fed.logs()
    given = f"{float(f'{budget_s:.1f}'):g} s"
    assert metrics[0].get("failures") == {"memory": 1, "time": 1, "edge_time": 1}, metrics[0]
    assert metrics[0].get("evaluation_failed") == {"time": 1} and "accuracy" not in metrics[0], metrics[0]
    assert "failures" not in metrics[1] and "evaluation_failed" not in metrics[1] and metrics[1]["accuracy"] > 0.5
    (memory,) = error_lines(logs["d1"])
    assert f"round 1 ran out of memory under its ceiling of {ceiling_mb} MB" in memory, logs["d1"]
    assert guard.MEMORY_FLAG in memory and "Unable to allocate 8.00 GiB" in memory  # what was asked
    (late,) = error_lines(logs["d2"])
    assert f"round 1 exceeded its time budget of {given}" in late and guard.TIME_FLAG in late, logs["d2"]
    for name in ("d1", "d2"):
        assert "round 1 failed" in logs[name] and "round 2 done in" in logs[name], logs[name]
    assert not error_lines(logs["d0"]) and "round 2 done in" in logs["d0"]
    assert "closed with 3/3 devices (2 failed: memory 1, time 1)" in logs["e0"], logs["e0"]
    (merge,) = error_lines(logs["e0"])
    assert f"edge e0: round 1 merge failed: round 1 merge exceeded its time budget of {given}" in merge, logs["e0"]
    (evaluation,) = error_lines(logs["cloud"])
    assert f"evaluation skipped: round 1's evaluation exceeded its time budget of {given}" in evaluation, logs["cloud"]


def test_a_sim_passes_the_bounds_to_its_devices(tmp_path: Path, monkeypatch):
    """`splitedge sim --round-budget-s`: its devices share one process (threads named by their
    ids), each with its own budget; d1 overstays it in round 1 and trains round 2."""
    from splitedge.methods import budget, training
    from splitedge.sim import SimSettings, run_sim

    # Prepare: the budget from a round measured now; d1's first batch overstays it
    budget_s = max(5.0, 20 * measured_round_s())
    real, first = training.train_step, [True]

    def train_step(*args, **kwargs):
        import threading

        if first[0] and threading.current_thread().name == "d1":
            first[0] = False
            time.sleep(max(0.0, budget._local.check.ends - time.monotonic()) + 0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "train_step", train_step)
    # Execute
    run_sim(SimSettings(rounds=2, devices=2, edges=1, method="fedavg", out=tmp_path, round_budget_s=budget_s,
                        deadline_s=4 * budget_s + 30))
    # Check: round 1 lost d1 over time, round 2 had both
    import json

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0].get("failures") == {"time": 1} and "failures" not in records[1], records
    assert set(records[0]["device_costs"]) == {"d0"} and set(records[1]["device_costs"]) == {"d0", "d1"}


def test_the_clouds_evaluation_over_its_bounds_is_skipped_in_one_line(caplog):
    """The cloud guards its evaluation of a round's model (`splitedge cloud --round-budget-s`,
    none by default; `--max-round-memory-mb`): one over either is skipped with one logged line,
    the merge goes on and the model is left as it was."""
    from splitedge.methods import budget
    from splitedge.methods.data.datasets import load_dataset
    from splitedge.methods.metrics.evaluate import evaluate
    from parts import SPEC

    _, test, _ = load_dataset("digits")
    part = method_for("fedavg").cloud_part(cloud_ctx("fedavg", test=test))
    part.model.train()
    measured = evaluate(part.model, test, SPEC)  # no guard: measured as before
    assert 0 <= measured["accuracy"] <= 1
    for bounded in (RoundGuard(budget_s=1e-9, who="cloud"), RoundGuard(memory_mb=1, who="cloud")):
        caplog.clear()
        with budget.evaluations(lambda: bounded.round("round 4's evaluation", deadline_s=60.0)):
            assert evaluate(part.model, test, SPEC) == {}
        (line,) = [r for r in caplog.records if r.levelname == "ERROR"]
        assert line.getMessage().startswith("evaluation skipped: round 4's evaluation") and line.exc_info is None
        assert part.model.training  # its mode restored
        assert sum(bounded.failures.values()) == 1  # what the coordinator records as evaluation_failed
    assert evaluate(part.model, test, SPEC) == measured  # outside the block: unguarded again


def test_the_cloud_has_no_time_budget_by_default():
    p = argparse.ArgumentParser()
    guard.add_arguments(p, "the cloud's evaluation", untimed=True)
    g = RoundGuard.from_args(p.parse_args([]), "cloud", untimed=True)
    assert g.budget_s == float("inf") and "no time budget" in g.describe()
    with g.round("round 1's evaluation", deadline_s=0.0):
        checkpoint()


def test_the_thin_trainer_checks_the_budget_at_every_batch_it_loads():
    # the thin trainer (methods/thin/trainer.py) loads each batch through to_input, where the check is
    from splitedge.methods.thin.trainer import load_batch
    from parts import SPEC

    images = np.zeros((4, 8, 8, 1), dtype=np.uint8)
    with RoundGuard(budget_s=1e-9).round("round 2", deadline_s=60.0):
        with pytest.raises(OverBudget, match="round 2 exceeded its time budget"):
            load_batch(images, np.arange(2), SPEC.mean, SPEC.std)
    assert load_batch(images, np.arange(2), SPEC.mean, SPEC.std).shape == (2, 1, 8, 8)


def test_a_default_ceiling_below_what_the_process_holds_is_raised_an_owners_is_refused():
    # in a process of its own: the rlimit it sets must not bound the test's
    import subprocess
    import sys

    code = textwrap.dedent('''
        import argparse
        from splitedge.runtime import guard
        p = argparse.ArgumentParser()
        guard.add_arguments(p, "a round")
        g = guard.RoundGuard.from_args(p.parse_args([]), "device d0")
        g.memory_mb = 1.0  # a small machine's default, under what the process holds
        g.limit_process()
        held = guard.data_mb()
        assert g.hard and g.memory_mb >= held * 1.5, (g.memory_mb, held)
        try:
            guard.RoundGuard.from_args(p.parse_args(["--max-round-memory-mb", "1"]), "device d0").limit_process()
        except ValueError as exc:
            print(exc)
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--max-round-memory-mb 1 is below what this device holds before any round" in out.stdout
