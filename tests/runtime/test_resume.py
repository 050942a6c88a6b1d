"""What a restarted cloud or edge resumes from: part state without pickle, the cloud's commit
point, metrics past it dropped, a later checkpoint never overwritten, and a user's mismatch
said in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from splitedge.cloud import resume
from splitedge.methods import snapshot
from splitedge.methods.registry import create_method, default_config
from splitedge.methods.contract import CloudContext, Kept, Placement, RoundPlan

from parts import SPEC, shipped_methods

TEST = (np.zeros((4, 8, 8, 1), np.uint8), np.arange(4) % 10)


def _cloud(name: str, seed: int, extra: tuple[str, ...] = ()):
    """The method's cloud part; with `extra`, of a subclass declaring those attributes too (as a
    method extending another's part does)."""
    method = create_method(name, default_config(name, SPEC))
    ctx = CloudContext(node_id="cloud", method=method, rng=np.random.default_rng(seed),
                       test=TEST, rounds=3, out_dir=None, run="r")
    part = method.cloud_part(ctx)
    if extra:
        base = type(part)
        part.__class__ = type(base.__name__, (base,), {"__annotations__": {name: Kept[int] for name in extra}})
    return part


def _same(a, b) -> None:
    """Two snapshots hold equal values (arrays compared exactly)."""
    assert type(a) is type(b) or (isinstance(a, (int, float)) and isinstance(b, (int, float))), (a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("name", shipped_methods())
def test_every_cloud_part_comes_back_from_its_snapshot_bytes(name: str) -> None:
    import torch

    # Prepare: a part whose models moved away from their initial weights
    part = _cloud(name, seed=0, extra=("extra_counter",))
    for module in [v for v in vars(part).values() if isinstance(v, torch.nn.Module)]:
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.5)
    part.extra_counter = 7  # any plain attribute a method adds and declares
    saved = snapshot.dumps(part.resume_state())
    # Execute: a fresh part (other seed) takes the bytes back
    fresh = _cloud(name, seed=1, extra=("extra_counter",))
    fresh.restore_state(snapshot.loads(saved))
    # Assert: it holds exactly what was saved
    _same(snapshot.loads(saved), snapshot.loads(snapshot.dumps(fresh.resume_state())))
    assert fresh.extra_counter == 7


def test_an_optimiser_keeps_training_the_restored_model_in_place() -> None:
    import torch

    part = _cloud("hsfp", seed=0)
    loss = part.model.wg(torch.randn(2, *part.model.we_shape)).sum()
    loss.backward()
    part.opt.step()  # Adam now has moments
    fresh = _cloud("hsfp", seed=1)
    fresh.restore_state(snapshot.loads(snapshot.dumps(part.resume_state())))
    # the optimiser's parameters are still the model's own, and its moments came back
    assert fresh.opt.param_groups[0]["params"][0] is next(fresh.model.wg.parameters())
    state = next(iter(fresh.opt.state.values()))
    assert float(state["exp_avg"].abs().sum()) > 0


def test_snapshot_values_round_trip_and_foreign_classes_are_refused() -> None:
    gen = np.random.default_rng(5)
    gen.random(3)
    value = {"t": (1, "a"), "s": {2, 3}, "m": {(1, 2): np.arange(3, dtype=np.uint16)}, "p": Placement(edge="e1"),
             "big": 2**100, "g": gen, "plan": RoundPlan(round=2, method="x", deadline_s=1.0, config={})}
    back = snapshot.from_plain(snapshot.loads(snapshot.dumps(snapshot.to_plain(value))))
    assert back["t"] == (1, "a") and back["s"] == {2, 3} and back["p"] == Placement(edge="e1")
    assert back["big"] == 2**100 and back["plan"].round == 2
    np.testing.assert_array_equal(back["m"][(1, 2)], np.arange(3))
    assert back["g"].random() == gen.random()
    with pytest.raises(snapshot.SnapshotError, match="not splitedge's"):
        snapshot.from_plain({"__t": "dc", "cls": "os:system", "fields": {}})
    with pytest.raises(snapshot.SnapshotError, match="not a readable state file"):
        snapshot.loads(b"\xc1garbage")


def test_metrics_past_the_committed_round_are_dropped(tmp_path: Path) -> None:
    lines = [json.dumps({"round": r, "accuracy": 0.5}) for r in (1, 2, 3)] + ['{"round": 4, "acc']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    history = resume.committed_history(tmp_path, 2)
    assert [h["round"] for h in history] == [1, 2]
    assert [json.loads(x)["round"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_a_checkpoint_of_a_later_round_is_not_overwritten(tmp_path: Path) -> None:
    from safetensors import safe_open

    from splitedge.runtime.outputs import save_checkpoint

    path = tmp_path / "model.safetensors"
    save_checkpoint(path, {"w": np.ones(2, np.float32)}, {"round": "5", "method": "x"})
    save_checkpoint(path, {"w": np.zeros(2, np.float32)}, {"round": "3", "method": "x"})
    with safe_open(str(path), framework="numpy") as fh:
        assert fh.metadata()["round"] == "5" and fh.get_tensor("w")[0] == 1
    save_checkpoint(path, {"w": np.zeros(2, np.float32)}, {"round": "6", "method": "x"})
    with safe_open(str(path), framework="numpy") as fh:
        assert fh.metadata()["round"] == "6"


def test_a_resume_with_other_arguments_is_one_line_that_says_what_differs(tmp_path: Path) -> None:
    state = resume.CloudState(run="r", method="hsfp", config={"a": 1}, seed=0, session="s", round=3)
    resume.save(tmp_path, state)
    saved = resume.load(tmp_path)
    ok = dict(out=tmp_path, run="r", method="hsfp", config={"a": 1}, seed=0, rounds=5)
    resume.check_same_run(saved, **ok)
    for change, needle in ((dict(seed=1), "--seed 1 differs"), (dict(method="fedavg"), "--method fedavg"),
                           (dict(config={"a": 2}), "other method settings"), (dict(rounds=3), "finished after round 3")):
        with pytest.raises(ValueError, match=needle) as err:
            resume.check_same_run(saved, **{**ok, **change})
        assert "\n" not in str(err.value) and "--overwrite" in str(err.value)
