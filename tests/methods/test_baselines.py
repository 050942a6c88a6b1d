"""Baselines on the same runtimes and wire: FedAvg, SplitFed (SFLv1), FedProto.

End-to-end runs go through `splitedge.sim.run_sim` (embedded amqtt broker, 4 devices, 2 edges,
digits); unit tests check the parts that must be exact: the FedProto loss, the prototype mean
over devices across tiers, FedAvg's weighted average at the edge, and the device agent's
`request` facility that SplitFed's mid-round wait is built on.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parts import device_ctx, edge_ctx, env, plan_for, report, shipped_methods
from splitedge.methods.contract import Message

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("amqtt")


def sim(tmp_path: Path, method: str, rounds: int, **overrides) -> dict:
    import torch

    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    s = SimSettings(rounds=rounds, devices=4, edges=2, method=method, out=tmp_path / method, deadline_s=60.0,
                    run=f"test-{method}-{tmp_path.name}", overrides=dict(overrides))
    return run_sim(s)


# -- every registered method, end to end over MQTT -------------------------------------------
@pytest.mark.parametrize("method", shipped_methods())
def test_method_learns_over_broker(tmp_path, method):
    # Execute
    summary = sim(tmp_path, method, rounds=3)
    # Assert
    assert len(summary["accuracy_per_round"]) == 3
    assert summary["final_accuracy"] > summary["chance"] == 0.1
    assert summary["device_up_bytes_per_device_per_round"] > 0
    assert (tmp_path / method / "metrics.jsonl").exists()


def test_the_representation_report_comes_every_report_every_rounds_and_after_the_last(tmp_path):
    """Effective rank and spectrum keep every test sample's features and take an SVD: the cloud
    measures them every `report_every` rounds and after the last (issue 58, item 2); accuracy
    and dead units every round."""
    from splitedge.methods.fedavg.config import FedAvgConfig

    # Execute
    sim(tmp_path, "fedavg", rounds=3, report_every=2)
    # Assert
    rows = [json.loads(line) for line in (tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert ["effective_rank" in r for r in rows] == ["spectrum" in r for r in rows] == [False, True, True]
    assert all("accuracy" in r and 0 <= r["dead_units"] <= 1 for r in rows)
    assert math.isclose(rows[1]["effective_rank"], math.exp(-sum(p * math.log(p) for p in rows[1]["spectrum"] if p > 1e-12)))
    with pytest.raises(ValueError, match="report_every must be >= 1"):
        FedAvgConfig(report_every=0)


def test_method_lookup_is_torch_free():
    # Prepare: a fresh interpreter, so other tests' imports cannot hide a leak
    code = ("import json, sys\nfrom splitedge.methods.registry import get_method, list_methods\n"
            "for m in list_methods():\n    get_method(m).Config()\n"
            "import splitedge.methods.fedavg.edge, splitedge.methods.fedproto.edge, splitedge.methods.fedproto.cloud\n"
            "print(json.dumps('torch' in sys.modules))")
    # Execute
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # Assert: method entries, and the numpy-only edges/cloud, never import torch
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) is False


# -- SplitFed ---------------------------------------------------------------------------------
def test_splitfed_moves_activations_and_gradients(tmp_path):
    from splitedge.methods.data.datasets import load_dataset

    # Execute
    summary = sim(tmp_path, "splitfed", rounds=2)
    # Assert: per-batch traffic went through the broker both ways
    kinds = summary["device_bytes_by_kind"]
    act, grad = kinds["out"]["activations"], kinds["in"]["gradients"]
    assert act["payload"] > 0 and grad["payload"] > 0
    assert act["messages"] == grad["messages"]
    # ... and costs about one W_c output per sample (cnn on 8x8 digits: 32 x 4 x 4 f4 + an i8 label)
    train, _, _ = load_dataset("digits")
    samples = 2 * len(train[1])  # two rounds of one local epoch (at most one sample per device dropped)
    per_sample = act["payload"] / samples
    assert 32 * 4 * 4 * 4 + 8 <= per_sample <= 1.05 * (32 * 4 * 4 * 4 + 8)
    assert grad["payload"] / samples == pytest.approx(32 * 4 * 4 * 4, rel=0.05)
    assert summary["final_accuracy"] > 0.5


def test_splitfed_edge_returns_the_activation_gradient_per_device():
    import torch
    import torch.nn.functional as F

    from splitedge.methods.splitfed.edge import SplitFedEdge
    from splitedge.methods.torch_utils import build_split
    from splitedge.models import state_to_numpy
    from parts import SPEC

    # Prepare: an edge holding the global W_e/W_g (version 0) and one batch of activations
    edge = SplitFedEdge(edge_ctx("splitfed", "e0"))
    model = build_split(SPEC)
    for part in ("we", "wg"):
        edge.on_message(env("weights", {"part": part, "version": 0, "samples": 0,
                                        "weights": state_to_numpy(model.part(part))}, sender="cloud"))
    x = np.random.default_rng(1).normal(size=(4, *model.wc_shape)).astype(np.float32)
    y = np.array([0, 1, 2, 3], dtype=np.int64)
    # Execute
    replies = edge.on_device_message(env("activations", {"batch": 7, "x": x, "y": y}, sender="d3"))
    edge.on_device_message(env("activations", {"batch": 0, "x": x, "y": y}, sender="d4"))
    # Assert: the reply targets the sender and is dL/dx of the global server side (before its step)
    xt = torch.tensor(x, requires_grad=True)
    model.train()
    F.cross_entropy(model.wg(model.we(xt)), torch.from_numpy(y)).backward()
    (reply,) = replies
    assert reply.kind == "gradients" and reply.to.node == "d3" and reply.body["batch"] == 7
    np.testing.assert_allclose(reply.body["grad"], xt.grad.numpy(), rtol=1e-4, atol=1e-7)
    assert sorted(edge.copies) == ["d3", "d4"]  # SFLv1: one server-side copy per device
    out = edge.aggregate(plan_for(versions={"model": 0}), [])
    assert sorted(m.body["part"] for m in out) == ["we", "wg"] and all(m.body["samples"] == 8 for m in out)


def test_agent_request_waits_for_matching_reply_and_defers_the_rest():
    import splitedge.methods.splitfed.kinds  # noqa: F401  (registers activations and gradients, as a lookup does)
    from splitedge.device.agent import DeviceAgent
    from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

    # Prepare: a device in round 2 whose inbox holds a model, a stale reply, then the real one
    agent = DeviceAgent(LoopbackTransport(LoopbackBus(), role="device", client_id="d0"), run="r", node_id="d0",
                        edge="e0", data=(np.zeros((2, 8, 8, 1), np.uint8), np.zeros(2, np.int64)))
    agent.round = 2
    weights = env("weights", {"part": "wc", "version": 1, "samples": 0, "weights": {}}, sender="e0", round_=2)
    grad = np.zeros((1, 2), np.float32)
    for e in (weights, env("gradients", {"batch": 4, "grad": grad}, "e0", 2),
              env("gradients", {"batch": 5, "grad": grad}, "e0", 2)):
        agent.enqueue("t", e)
    body = {"batch": 5, "x": np.zeros((1, 2), np.float32), "y": np.zeros(1, np.int64)}
    # Execute
    reply = agent.exchange.request(Message("activations", body), "gradients", timeout=2.0)
    # Assert
    assert reply.body["batch"] == 5 and agent.exchange.stale_replies == 1
    assert agent.next_event(0.0)[1] is weights  # deferred events come back after the round
    with pytest.raises(TimeoutError):
        agent.exchange.request(Message("activations", body), "gradients", timeout=0.2)


# -- FedAvg -----------------------------------------------------------------------------------
def test_fedavg_edge_weighted_average_is_exact():
    from splitedge.methods.fedavg.edge import FedAvgEdge

    # Prepare: two devices with 1 and 3 samples, one stale update trained from an old model
    edge = FedAvgEdge(edge_ctx("fedavg", "e0"))
    def update(w, counter, samples, version=4):
        return env("weights", {"part": "model", "version": version, "samples": samples,
                               "weights": {"w": np.array(w, np.float32), "bn.n": np.array(counter, np.int64)}})
    reports = [report("d0", update([1.0, 2.0], 3, 1)), report("d1", update([5.0, -2.0], 7, 3)),
               report("d2", update([100.0, 100.0], 9, 50, version=3))]
    # Execute
    (msg,) = edge.aggregate(plan_for(versions={"model": 4}), reports)
    # Assert: (1 * [1, 2] + 3 * [5, -2]) / 4 = [4, -1]; counters take the max; samples add up
    assert msg.kind == "weights" and msg.body["part"] == "model" and msg.body["version"] == 4
    assert msg.body["samples"] == 4
    np.testing.assert_array_equal(msg.body["weights"]["w"], np.array([4.0, -1.0], np.float32))
    assert int(msg.body["weights"]["bn.n"]) == 7


def test_fedavg_device_waits_for_the_announced_model():
    from splitedge.methods.torch_utils import build_split
    from splitedge.models import state_to_numpy
    from parts import SPEC

    # Prepare
    ctx = device_ctx("fedavg", "d0")
    device = ctx.method.device_part(ctx, (np.zeros((4, 8, 8, 1), np.uint8), np.arange(4)), "torch")
    weights = state_to_numpy(build_split(SPEC))
    # Execute / Assert
    assert not device.ready(plan_for(versions={"model": 0}))
    device.on_message(env("weights", {"part": "model", "version": 0, "samples": 0, "weights": weights}, "e0"))
    assert device.ready(plan_for(versions={"model": 0})) and not device.ready(plan_for(versions={"model": 1}))


# -- FedProto ---------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction, distance", [("sq_l2", 6.0), ("mse", 3.0)])
def test_fedproto_loss_hand_computed(reduction, distance):
    import torch

    from splitedge.methods.fedproto.loss import fedproto_loss

    # Prepare: class 2 has no global prototype, so sample 2 adds nothing
    features = torch.tensor([[1.0, 2.0], [3.0, 4.0], [7.0, 7.0]])
    labels = torch.tensor([0, 1, 2])
    protos = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    has_proto = torch.tensor([True, True, False])
    logits = torch.zeros(3, 3)
    # Execute
    loss = fedproto_loss(logits, features, labels, protos, has_proto, lam=1.0, reduction=reduction)
    # Assert: CE of uniform logits = ln 3; squared distances 5 and 13 over a batch of 3 -> 6 (or 3 per dim)
    assert float(loss) == pytest.approx(math.log(3) + distance)


def test_fedproto_edge_then_cloud_is_the_unweighted_mean_over_devices():
    from splitedge.methods.fedproto.protos import merge_protos

    # Prepare: five devices with random class subsets, split 3 / 2 across two edges
    rng = np.random.default_rng(0)
    devices = []
    for _ in range(5):
        classes = np.sort(rng.choice(6, size=rng.integers(1, 6), replace=False)).astype(np.int64)
        devices.append((classes, rng.integers(1, 50, len(classes)), rng.normal(size=(len(classes), 4))))
    ones = [(c, np.ones(len(c), np.int64), m) for c, _, m in devices]
    # Execute: edges average their devices unweighted and forward devices-per-class as counts
    edges = [merge_protos(ones[:3]), merge_protos(ones[3:])]
    classes, devices_per_class, means = merge_protos(edges)
    # Assert: same as the mean over all five devices at once, for every class
    direct = merge_protos(ones)
    np.testing.assert_array_equal(classes, direct[0])
    np.testing.assert_array_equal(devices_per_class, direct[1])
    np.testing.assert_allclose(means, direct[2], rtol=1e-12)
    for i, c in enumerate(classes.tolist()):
        holders = [m[list(cl).index(c)] for cl, _, m in devices if c in cl]
        np.testing.assert_allclose(means[i], np.mean(holders, axis=0), rtol=1e-12)


def test_device_sgd_steps_exactly_like_torch_optim_sgd() -> None:
    """PlainSGD (no torch.optim import on devices) gives bitwise the same weights as torch.optim.SGD
    with momentum and weight decay, over several steps of a conv net with BatchNorm."""
    import torch

    from splitedge.methods.torch_utils import sgd
    from splitedge.models import create_split

    def train(make_opt) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = create_split("cnn", num_classes=10, in_channels=3, image_size=8)
        opt = make_opt(model.parameters())
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            x, y = torch.randn(6, 3, 8, 8, generator=gen), torch.randint(0, 10, (6,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    ours = train(lambda ps: sgd(ps, 0.05, momentum=0.9, weight_decay=5e-4))
    ref = train(lambda ps: torch.optim.SGD(list(ps), lr=0.05, momentum=0.9, weight_decay=5e-4))
    start = train(lambda ps: sgd(ps, 0.0, momentum=0.0, weight_decay=0.0))
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert not all(torch.equal(a, b) for a, b in zip(ours, start))  # the steps did move the weights
