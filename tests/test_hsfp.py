"""H-SFP parts in isolation: exact moment merge across tiers through the codec, the consistency
rule on the device, resend-on-change, and the served-triple rule at the cloud."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitedge.methods.config import ModelSpec, to_config
from splitedge.methods.datasets import load_dataset
from splitedge.methods.hsfp.config import HSFPConfig
from splitedge.methods.hsfp.method import HSFP
from splitedge.methods.moments import compute_moments, merge_moments, moments_from_body, moments_to_body
from splitedge.methods.partition import dirichlet
from splitedge.methods.strategy import DONE, Message, NodeContext, Report, RoundPlan
from splitedge.protocol.codec import Envelope, decode, encode

SPEC = ModelSpec(model="cnn", num_classes=10, channels=1, image_size=8, mean=(0.3,), std=(0.4,))


@pytest.fixture(scope="module")
def digits():
    torch.set_num_threads(1)
    return load_dataset("digits")


def _config(**kw) -> dict:
    return {**to_config(SPEC), **to_config(HSFPConfig(**kw))}


def _plan(r: int, *, slow_wc: bool = False, slow_we: bool = False, wc: int = 0, we: int = 0, **kw) -> RoundPlan:
    return RoundPlan(round=r, method="hsfp", slow_wc=slow_wc, slow_we=slow_we, deadline_s=10.0,
                     wc_version=wc, we_version=we, config=_config(**kw))


def _wire(kind: str, body: dict, sender: str, r: int = 1) -> Envelope:
    """Through the real codec, as a message would travel."""
    return decode(encode(Envelope(kind=kind, run="t", round=r, sender=sender, body=body)))


def _device(data, node: str = "d0", **kw):
    ctx = NodeContext(node_id=node, config=_config(**kw), rng=np.random.default_rng(0))
    return HSFP.device_part(ctx, data, "torch")


def _give_model(part, cloud) -> None:
    for msg in cloud.initial_messages():
        part.on_message(_wire(msg.kind, msg.body, "cloud", 0))


def test_moments_merge_exactly_device_edge_cloud_through_the_wire(digits):
    # Prepare: real W_c features of 6 Dirichlet shards grouped under 2 edges
    (x, y), _, _ = digits
    shards = dirichlet(y, 6, 0.5, np.random.default_rng(1))
    cloud = HSFP.cloud_part(NodeContext("cloud", _config(), np.random.default_rng(0), {"test": digits[1]}))
    devices = [_device((x[i], y[i]), f"d{k}") for k, i in enumerate(shards)]
    for d in devices:
        _give_model(d, cloud)
    # Execute: f8 on the wire, merged at each edge, edge results merged at the cloud
    sent = [_wire("moments", moments_to_body(d.compute_moments(), dtype="f8"), d.ctx.node_id) for d in devices]
    edges = [merge_moments([moments_from_body(e.body) for e in sent[g::2]]) for g in range(2)]
    up = [_wire("moments", moments_to_body(m, dtype="f8"), f"e{g}") for g, m in enumerate(edges)]
    total = merge_moments([moments_from_body(e.body) for e in up])
    # Assert: equal to the moments of the pooled features (1e-9 relative)
    feats = np.concatenate([d.features(_inputs(d, x[i])).reshape(len(i), -1) for d, i in zip(devices, shards)])
    whole = compute_moments(feats, np.concatenate([y[i] for i in shards]))
    np.testing.assert_array_equal(total.counts, whole.counts)
    np.testing.assert_allclose(total.mean, whole.mean, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(total.var, whole.var, rtol=1e-9, atol=1e-12)


def _inputs(part, x):
    from splitedge.methods.preprocess import to_input

    return to_input(x, part.spec.mean, part.spec.std)


def test_device_moments_use_global_wc_and_are_resent_only_on_change(digits):
    # Prepare
    (x, y), _, _ = digits
    cloud = HSFP.cloud_part(NodeContext("cloud", _config(), np.random.default_rng(0), {"test": digits[1]}))
    dev = _device((x[:300], y[:300]))
    _give_model(dev, cloud)
    # Execute: two rounds of local training
    first = list(dev.run_round(_plan(1)))
    second = list(dev.run_round(_plan(2)))
    # Assert: moments in round 1 only; they are those of the untouched global W_c
    assert [m.kind for m in first if isinstance(m, Message)] == ["moments"] and first[-1] is DONE
    assert [m for m in second if isinstance(m, Message)] == []
    local = {k: v.clone() for k, v in dev.wc_local.state_dict().items()}
    assert any(not torch.equal(local[k], v) for k, v in dev.wc_global.state_dict().items())  # copy trained
    fresh = _device((x[:300], y[:300]), "d1")
    _give_model(fresh, cloud)
    np.testing.assert_allclose(dev.compute_moments().mean, fresh.compute_moments().mean, rtol=1e-6)
    # a slow round uploads the trained local copy; a new global version triggers a resend
    slow = [m for m in dev.run_round(_plan(3, slow_wc=True)) if isinstance(m, Message)]
    assert [m.kind for m in slow] == ["weights"] and slow[0].body["samples"] == 300
    new = dict(slow[0].body, version=1)
    dev.on_message(_wire("weights", new, "e0"))
    again = [m for m in dev.run_round(_plan(4, wc=1)) if isinstance(m, Message)]
    assert [m.kind for m in again] == ["moments"] and again[0].body["wc_version"] == 1


def test_every_round_resend_option(digits):
    (x, y), _, _ = digits
    cloud = HSFP.cloud_part(NodeContext("cloud", _config(), np.random.default_rng(0), {"test": digits[1]}))
    dev = _device((x[:100], y[:100]), resend_moments="every-round", local_epochs=0)
    _give_model(dev, cloud)
    kinds = [[m.kind for m in dev.run_round(_plan(r)) if isinstance(m, Message)] for r in (1, 2, 3)]
    assert kinds == [["moments"]] * 3


def test_cloud_serves_previous_triple_until_head_trained_on_new_wc(digits):
    # Prepare: a cloud with moments from one edge at versions (0, 0)
    (x, y), test, _ = digits
    ctx = NodeContext("cloud", _config(ic=1, ie=100), np.random.default_rng(0), {"test": test})
    cloud = HSFP.cloud_part(ctx)
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((200, int(np.prod(cloud.model.we_shape)))) + np.repeat(np.arange(10), 20)[:, None]
    labels = np.repeat(np.arange(10), 20)

    def edge_report(wc_v: int, with_wc: bool) -> Report:
        report = Report("e0")
        body = moments_to_body(compute_moments(feats, labels), wc_version=wc_v, we_version=0, space="we")
        report.messages["moments"] = [_wire("moments", body, "e0")]
        if with_wc:
            w = {"part": "wc", "version": wc_v, "samples": 10, "weights": _perturbed(cloud.model.wc)}
            report.messages["weights"] = [_wire("weights", w, "e0")]
        return report

    # Execute: round 1 averages W_c (version 0 -> 1)
    out, metrics1 = cloud.aggregate(cloud.plan(1), [edge_report(0, with_wc=True)])
    served_after_avg = {k: v.clone() for k, v in cloud.served.wc.state_dict().items()}
    # round 2: the edge still reports moments of W_c version 0 (stale): served triple must not change
    _, metrics2 = cloud.aggregate(cloud.plan(2), [edge_report(0, with_wc=False)])
    stale_served = {k: v.clone() for k, v in cloud.served.wc.state_dict().items()}
    # round 3: moments of version 1 arrive; W_g trains on them and the new W_c is served
    _, metrics3 = cloud.aggregate(cloud.plan(3), [edge_report(1, with_wc=False)])
    # Assert
    assert [m.body["version"] for m in out if m.kind == "weights"] == [1] and cloud.wc_version == 1
    assert all(torch.equal(served_after_avg[k], v) for k, v in stale_served.items())
    assert "head_loss" not in metrics2 and "head_loss" in metrics3
    assert cloud.served_versions == (1, 0)
    assert any(not torch.equal(served_after_avg[k], v) for k, v in cloud.served.wc.state_dict().items())
    assert metrics1["accuracy"] == metrics1["accuracy"]  # evaluated (not NaN) from round 1 on


def _perturbed(module) -> dict:
    from splitedge.models import state_to_numpy

    return {k: (v + 0.01 if v.dtype.kind == "f" else v) for k, v in state_to_numpy(module).items()}


def test_edge_merges_cached_moments_and_reports_we_moments(digits):
    # Prepare: an edge with two devices' moments (real counts), W_e version 0 delivered
    (x, y), test, _ = digits
    cloud = HSFP.cloud_part(NodeContext("cloud", _config(), np.random.default_rng(0), {"test": test}))
    edge = HSFP.edge_part(NodeContext("e0", _config(edge_samples=256), np.random.default_rng(0)))
    relayed = [m for msg in cloud.initial_messages() for m in edge.on_message(_wire(msg.kind, msg.body, "cloud", 0))]
    devices = [_device((x[i::2][:200], y[i::2][:200]), f"d{i}") for i in range(2)]
    reports = []
    for d in devices:
        _give_model(d, cloud)
        r = Report(d.ctx.node_id)
        r.messages["moments"] = [_wire("moments", moments_to_body(d.compute_moments()), d.ctx.node_id)]
        reports.append(r)
    # Execute: round 1 with moments; round 2 with none (on-change) must reuse the cache
    up1 = edge.aggregate(_plan(1), reports)
    up2 = edge.aggregate(_plan(2), [Report("d0"), Report("d1")])
    # Assert
    kinds = [m.topic_kind for m in relayed]
    assert "weights-wc" in kinds and "weights-we" not in kinds  # global W_c goes down, W_e stays
    for up in (up1, up2):
        (msg,) = [m for m in up if m.kind == "moments"]
        assert msg.body["space"] == "we" and int(msg.body["counts"].sum()) == 400
        assert msg.body["mean"].shape[1] == int(np.prod(edge.we_shape))


def test_edge_that_lost_moments_asks_devices_to_resend(digits):
    # Prepare: a fresh edge (as after a restart) in a steady W_c version, one device it never heard from
    (x, y), test, _ = digits
    cloud = HSFP.cloud_part(NodeContext("cloud", _config(), np.random.default_rng(0), {"test": test}))
    edge = HSFP.edge_part(NodeContext("e0", _config(edge_samples=128), np.random.default_rng(0)))
    dev = _device((x[:100], y[:100]), "d0", local_epochs=0)
    _give_model(dev, cloud)
    assert [m.kind for m in dev.run_round(_plan(1)) if isinstance(m, Message)] == ["moments"]  # lost on the way
    # Execute: the edge's first round asks nobody (a new version: devices send anyway), its second asks d0
    first = edge.on_round_open(_plan(2), {"d0"})
    second = edge.on_round_open(_plan(3), {"d0"})
    for msg in second:
        dev.on_message(_wire(msg.kind, msg.body, "e0", 3))
    resent = [m.kind for m in dev.run_round(_plan(3)) if isinstance(m, Message)]
    # Assert
    assert first == [] and [(m.kind, m.target) for m in second] == [("request", "d0")]
    assert resent == ["moments"]
    edge.on_device_message(_wire("moments", moments_to_body(dev.compute_moments()), "d0", 3))
    assert edge.on_round_open(_plan(4), {"d0"}) == []
