"""H-SFP parts in isolation: exact moment merge inside the real edge and cloud parts, the
consistency rule on the device, resend-on-change, and the served-triple rule at the cloud."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parts import cloud_ctx, device_ctx, edge_ctx, method_for, plan_for, wire
from splitedge.methods.data.datasets import load_dataset
from splitedge.methods.hsfp.method import HSFP
from splitedge.methods.moments import compute_moments, moments_to_body
from splitedge.methods.data.partition import dirichlet
from splitedge.methods.registry import register_method
from splitedge.methods.contract import DONE, Message, Report
from splitedge.protocol.errors import ProtocolError


class RecordingHSFP(HSFP):
    """H-SFP whose sampling hook records the merged moments each tier samples from."""

    merged: list = []

    def sample_features(self, merged, total, rng, parts=None):
        type(self).merged.append(merged)
        return super().sample_features(merged, total, rng, parts=parts)


register_method("hsfp-recording-test", RecordingHSFP)


def _closing(part, plan, reports):
    """A round's close as the runtime makes it: every message handed to the part as it arrived
    (edge/aggregator.py, cloud/coordinator.py), then aggregate() with the round's reports, which
    hold the same messages and are not walked again for them."""
    from splitedge.methods.contract import EdgePart

    for report in reports:
        for envs in report.messages.values():
            for env in envs:
                (part.on_device_message if isinstance(part, EdgePart) else part.on_edge_message)(env)
    return part.aggregate(plan, reports)


@pytest.fixture(scope="module")
def digits():
    torch.set_num_threads(1)
    return load_dataset("digits")


def _plan(r: int, *, slow_wc: bool = False, slow_we: bool = False, wc: int = 0, we: int = 0):
    average = [p for p, on in (("wc", slow_wc), ("we", slow_we)) if on]
    return plan_for(r, "hsfp", versions={"wc": wc, "we": we}, directives={"average": average})


_wire = wire


def _cloud(test, method: str = "hsfp", **kw):
    ctx = cloud_ctx(method, "cloud", test=test, **kw)
    return ctx.method.cloud_part(ctx)


def _edge(node: str = "e0", method: str = "hsfp", **kw):
    return (ctx := edge_ctx(method, node, **kw)).method.edge_part(ctx)


def _device(data, node: str = "d0", method: str = "hsfp", **kw):
    ctx = device_ctx(method, node, **kw)
    return ctx.method.device_part(ctx, data, "torch")


def _give_model(part, cloud) -> None:
    for msg in cloud.initial_messages():
        part.on_message(_wire(msg.kind, msg.body, "cloud", 0))


def _moments_report(device, round_: int = 1) -> Report:
    r = Report(device.ctx.node_id)
    body = moments_to_body(device.compute_moments(), dtype="f8", space="wc", versions={"wc": 0})
    r.messages["moments"] = [_wire("moments", body, device.ctx.node_id, round_)]
    return r


def test_edges_and_cloud_sample_from_the_exact_merge_of_what_they_received(digits):
    # Prepare: real W_c features of 6 Dirichlet shards under 2 real edges, and a real cloud
    (x, y), test, _ = digits
    RecordingHSFP.merged = []
    shards = dirichlet(y, 6, 0.5, np.random.default_rng(1))
    cloud = _cloud(test, "hsfp-recording-test", edge_samples=256, cloud_samples=256)
    edges = [_edge(f"e{g}", "hsfp-recording-test", edge_samples=256) for g in range(2)]
    # every class counts (min_class_count 1): the merge is compared with all the shards' images
    devices = [_device((x[i], y[i]), f"d{k}", min_class_count=1) for k, i in enumerate(shards)]
    for part in (*devices, *edges):
        _give_model(part, cloud)
    # Execute: each edge merges its three devices' messages (through the codec); the cloud merges both edges
    ups, edge_merged = [], []
    for g, e in enumerate(edges):
        ups.append(_closing(e, _plan(1), [_moments_report(d) for d in devices[g::2]]))
        edge_merged.append(RecordingHSFP.merged[-1])  # what the edge sampled from (W_c space)
    reports = []
    for g, up in enumerate(ups):
        r = Report(f"e{g}")
        r.messages["moments"] = [_wire(m.kind, m.body, f"e{g}") for m in up if m.kind == "moments"]
        reports.append(r)
    _closing(cloud, _plan(1), reports)
    # Assert: each edge sampled from the moments of its devices' pooled f4 features (1e-9 relative) ...
    for g, merged in enumerate(edge_merged):
        feats = [np.asarray(d.features(_inputs(d, x[i])), np.float64).reshape(len(i), -1)
                 for d, i in zip(devices[g::2], shards[g::2])]
        whole = compute_moments(np.concatenate(feats), np.concatenate([y[i] for i in shards[g::2]]))
        np.testing.assert_array_equal(merged.counts, whole.counts)
        np.testing.assert_allclose(merged.mean, whole.mean, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(merged.var, whole.var, rtol=1e-9, atol=1e-12)
    # ... and the cloud from the count-weighted combination of the two edges' W_e moments
    cloud_merged = RecordingHSFP.merged[-1]
    bodies = [r.messages["moments"][0].body for r in reports]
    counts = sum(_dense(b, "counts") for b in bodies)
    mean = sum(_dense(b, "counts")[:, None] * _dense(b, "mean") for b in bodies) / np.maximum(counts, 1)[:, None]
    present = counts > 0
    np.testing.assert_array_equal(cloud_merged.counts, counts[present])
    np.testing.assert_allclose(cloud_merged.mean, mean[present], rtol=1e-9, atol=1e-9)


def _dense(body, key):
    """A per-class array indexed by class id (zeros for absent classes)."""
    arr = np.asarray(body[key], dtype=np.float64)
    out = np.zeros((10, *arr.shape[1:]))
    out[np.asarray(body["classes"])] = arr
    return out


def _inputs(part, x):
    from splitedge.methods.data.preprocess import to_input

    return to_input(x, part.spec.mean, part.spec.std)


def test_device_moments_use_global_wc_and_are_resent_only_on_change(digits):
    # Prepare
    (x, y), _, _ = digits
    cloud = _cloud(digits[1])
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
    assert [m.kind for m in again] == ["moments"] and again[0].body["versions"] == {"wc": 1}


def test_every_round_resend_option(digits):
    (x, y), _, _ = digits
    cloud = _cloud(digits[1])
    dev = _device((x[:100], y[:100]), resend_moments="every-round", local_epochs=0)
    _give_model(dev, cloud)
    kinds = [[m.kind for m in dev.run_round(_plan(r)) if isinstance(m, Message)] for r in (1, 2, 3)]
    assert kinds == [["moments"]] * 3


def test_cloud_serves_previous_triple_until_head_trained_on_new_wc(digits):
    # Prepare: a cloud with moments from one edge at versions (0, 0)
    (x, y), test, _ = digits
    cloud = _cloud(test, ic=1, ie=100)
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((200, int(np.prod(cloud.model.we_shape)))) + np.repeat(np.arange(10), 20)[:, None]
    labels = np.repeat(np.arange(10), 20)

    def edge_report(wc_v: int, with_wc: bool) -> Report:
        report = Report("e0")
        body = moments_to_body(compute_moments(feats, labels), space="we", versions={"wc": wc_v, "we": 0})
        report.messages["moments"] = [_wire("moments", body, "e0")]
        if with_wc:
            w = {"part": "wc", "version": wc_v, "samples": 10, "weights": _perturbed(cloud.model.wc)}
            report.messages["weights"] = [_wire("weights", w, "e0")]
        return report

    # Execute: round 1 averages W_c (version 0 -> 1)
    out, metrics1 = _closing(cloud, _cloud_plan(cloud, 1), [edge_report(0, with_wc=True)])
    served_after_avg = {k: v.clone() for k, v in cloud.served.wc.state_dict().items()}
    # round 2: the edge still reports moments of W_c version 0 (stale): served triple must not change
    _, metrics2 = _closing(cloud, _cloud_plan(cloud, 2), [edge_report(0, with_wc=False)])
    stale_served = {k: v.clone() for k, v in cloud.served.wc.state_dict().items()}
    # round 3: moments of version 1 arrive; W_g trains on them and the new W_c is served
    _, metrics3 = _closing(cloud, _cloud_plan(cloud, 3), [edge_report(1, with_wc=False)])
    # Assert
    assert [m.body["version"] for m in out if m.kind == "weights"] == [1] and cloud.wc_version == 1
    assert all(torch.equal(served_after_avg[k], v) for k, v in stale_served.items())
    assert "head_loss" not in metrics2 and "head_loss" in metrics3
    assert cloud.served_versions == (1, 0)
    assert any(not torch.equal(served_after_avg[k], v) for k, v in cloud.served.wc.state_dict().items())
    assert metrics1["accuracy"] == metrics1["accuracy"]  # evaluated (not NaN) from round 1 on


def test_moments_are_taken_once_when_they_arrive_not_again_from_the_reports(digits, monkeypatch) -> None:
    """Issue 52, item 5: an edge and the cloud take a moments message when it arrives (decoded
    once) and do not walk the round's reports for it again; before, each tier handled every
    moments message twice and dropped the copy by its message id."""
    import splitedge.methods.hsfp.cloud as cloud_mod
    import splitedge.methods.hsfp.edge as edge_mod

    (x, y), test, _ = digits
    cloud, edge = _cloud(test), _edge(edge_samples=256)
    for msg in cloud.initial_messages():
        edge.on_message(_wire(msg.kind, msg.body, "cloud", 0))
    reports = _moment_reports(x, y, cloud)
    decoded = {"edge": 0, "cloud": 0}
    for mod, tier in ((edge_mod, "edge"), (cloud_mod, "cloud")):
        real = mod.moments_from_body
        monkeypatch.setattr(mod, "moments_from_body",
                            lambda body, _real=real, _tier=tier: (decoded.__setitem__(_tier, decoded[_tier] + 1),
                                                                   _real(body))[1])
    up = _closing(edge, _plan(1), reports)
    report = Report("e0")
    report.messages["moments"] = [_wire(m.kind, m.body, "e0") for m in up if m.kind == "moments"]
    _closing(cloud, _plan(1), [report])
    assert decoded == {"edge": 2, "cloud": 1}  # two devices' messages, one edge's
    # a report's message the part was never handed on arrival is not the round's: aggregate() does not read it
    stray = Report("d2")
    stray.messages["moments"] = [_wire("moments", reports[0].messages["moments"][0].body, "d2", 2)]
    edge.aggregate(_plan(2), [stray])
    assert edge.cache.keys() == {"d0", "d1"} and decoded["edge"] == 2


def _cloud_plan(cloud, r: int):
    """The round plan the runtime would announce from the cloud part's RoundSpec."""
    spec = cloud.plan(r)
    return plan_for(r, "hsfp", versions=spec.versions, directives=spec.directives)


def _perturbed(module) -> dict:
    from splitedge.models import state_to_numpy

    return {k: (v + 0.01 if v.dtype.kind == "f" else v) for k, v in state_to_numpy(module).items()}


def _moment_reports(x, y, cloud, **settings) -> list:
    """Two devices (every other image, 200 each) with the cloud's W_c v0: their moments as the
    reports an edge's round gathers."""
    reports = []
    for i in range(2):
        d = _device((x[i::2][:200], y[i::2][:200]), f"d{i}", **settings)
        _give_model(d, cloud)
        r = Report(d.ctx.node_id)
        r.messages["moments"] = [_wire("moments", moments_to_body(d.compute_moments(), versions={"wc": 0}),
                                       d.ctx.node_id)]
        reports.append(r)
    return reports


def test_edge_merges_cached_moments_and_reports_we_moments(digits):
    # Prepare: an edge with two devices' moments (real counts), W_e version 0 delivered
    (x, y), test, _ = digits
    cloud = _cloud(test)
    edge = _edge(edge_samples=256)
    initial = cloud.initial_messages()
    for msg in initial:
        assert edge.on_message(_wire(msg.kind, msg.body, "cloud", 0)) == []
    reports = _moment_reports(x, y, cloud)
    # Execute: round 1 with moments; round 2 with none (on-change) must reuse the cache
    up1 = _closing(edge, _plan(1), reports)
    up2 = _closing(edge, _plan(2), [Report("d0"), Report("d1")])
    # Assert
    routes = {(m.body.get("part"), m.kind): (m.to.role, m.slot) for m in initial}
    assert routes[("wc", "weights")] == ("devices", "wc") and routes[("we", "weights")] == ("children", "we")
    assert edge.we_version == 0  # the edge took the global W_e; W_c is for its devices
    for up in (up1, up2):
        (msg,) = [m for m in up if m.kind == "moments"]
        assert msg.body["space"] == "we" and int(msg.body["counts"].sum()) == 400
        assert msg.body["mean"].shape[1] == int(np.prod(edge.we_shape))


def test_an_edge_whose_devices_withheld_every_class_trains_nothing_and_says_so(digits, caplog):
    """Devices of 5 images each (10,000 on CIFAR-10) hold fewer than min_class_count of every
    class, so each sends moments without a class: the edge's merge is empty. It used to stop on
    an AssertionError ("no samples") in every such edge; now it trains nothing, sends no moments
    and says why in one line, and the round goes on."""
    from splitedge.methods.moments import ClassMoments

    (x, y), test, _ = digits
    cloud = _cloud(test)
    edge = _edge()
    _give_model(edge, cloud)
    empty = moments_to_body(ClassMoments.empty(int(np.prod(edge.wc_shape))), dtype="f4", space="wc",
                            versions={"wc": 0})
    reports = []
    for d in ("d0", "d1"):
        reports.append(Report(d))
        reports[-1].messages["moments"] = [_wire("moments", empty, d, 1)]
    with caplog.at_level("WARNING"):
        up = _closing(edge, _plan(1), reports)
    assert [m for m in up if m.kind == "moments"] == []
    assert edge.round_info() == {"merged": 2, "no_classes": 1}
    assert "none of its 2 devices sent a class's statistics" in caplog.text and "min_class_count=10" in caplog.text


def test_edge_that_lost_moments_asks_devices_to_resend(digits):
    # Prepare: a fresh edge (as after a restart) in a steady W_c version, one device it never heard from
    (x, y), test, _ = digits
    cloud = _cloud(test)
    edge = _edge(edge_samples=128)
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
    assert first == [] and [(m.kind, m.to.node) for m in second] == [("request", "d0")]
    assert resent == ["moments"]
    edge.on_device_message(_wire("moments", moments_to_body(dev.compute_moments(), versions={"wc": 0}), "d0", 3))
    assert edge.on_round_open(_plan(4), {"d0"}) == []


def test_ie_zero_keeps_we_as_initialised(digits):
    # Prepare: ie = 0, and an edge with two devices' moments
    (x, y), test, _ = digits
    cloud = _cloud(test, ie=0)
    edge = _edge(edge_samples=256, ie=0)
    for msg in cloud.initial_messages():
        edge.on_message(_wire(msg.kind, msg.body, "cloud", 0))
    before = {k: v.clone() for k, v in edge.we_local.state_dict().items()}
    reports = _moment_reports(x, y, cloud, ie=0)
    # Execute
    up = _closing(edge, _plan(1), reports)
    # Assert: the edge still reports its W_e moments, trained nothing, and no round averages W_e
    assert [m.kind for m in up] == ["moments"]
    assert all(torch.equal(before[k], v) for k, v in edge.we_local.state_dict().items())
    assert all("we" not in cloud.plan(r).directives["average"] for r in range(1, 41))
    assert "wc" in cloud.plan(5).directives["average"]
    with pytest.raises(ValueError, match="ie >= 0"):
        method_for("hsfp", ie=-1)
    # hsfp-cal, the recommended variant, keeps W_e as initialised unless told otherwise
    assert method_for("hsfp-cal").config.ie == 0 and method_for("hsfp").config.ie == 10


def test_edges_train_we_on_the_federations_wc_moments_when_asked(digits):
    """edge_features="global": each edge sends its W_c merge up, the cloud merges the edges' and
    sends that to every edge, and from the next round an edge whose devices hold only half the
    classes trains W_e on all of them, while its W_e moments still describe its own devices."""
    # Prepare: edge e0's devices hold digits 0-4, e1's 5-9; a cloud and edges that ask for it
    (x, y), test, _ = digits
    settings = {"edge_features": "global", "edge_samples": 256, "mixture": True, "class_balanced": True}
    cloud = _cloud(test, **settings)
    edges = {e: _edge(e, "hsfp-recording-test", **settings) for e in ("e0", "e1")}
    reports = {}
    for e, classes in (("e0", y < 5), ("e1", y >= 5)):
        _give_model(edges[e], cloud)
        reports[e] = []
        for i in range(2):
            d = _device((x[classes][i::2][:150], y[classes][i::2][:150]), f"{e}d{i}", **settings)
            _give_model(d, cloud)
            r = Report(d.ctx.node_id)
            r.messages["moments"] = [_wire("moments", moments_to_body(d.compute_moments(), versions={"wc": 0}),
                                           d.ctx.node_id)]
            reports[e].append(r)

    def close(round_: int, device_reports: dict) -> list:
        up = []
        for e, edge in edges.items():
            edge.on_round_open(_plan(round_), {r.sender for r in device_reports[e]})
            r = Report(e)
            sent_up = _closing(edge, _plan(round_), device_reports[e])
            for msg in [*sent_up, Message("done", {"phase": "round", "info": {"method": edge.round_info()}})]:
                env = _wire(msg.kind, msg.body, e, round_)
                cloud.check(env, "child")  # what the cloud's runtime validates first
                r.messages.setdefault(msg.kind, []).append(env)
            up.append(r)
        out, metrics = _closing(cloud, _plan(round_), up)
        for msg in out:
            for edge in edges.values():
                if msg.kind == "moments":
                    env = _wire(msg.kind, msg.body, "cloud", round_)
                    edge.check(env, "parent")
                    edge.on_message(env)
        return [m for m in out if m.kind == "moments"], metrics

    # Execute: round 1 (own moments, merges sent up), round 2 (the federation's merge is here)
    RecordingHSFP.merged = []
    sent, metrics1 = close(1, reports)
    first = list(RecordingHSFP.merged)
    RecordingHSFP.merged = []
    again, metrics2 = close(2, {e: [Report(r.sender) for r in rs] for e, rs in reports.items()})
    # Assert: the cloud sent one merge of every device's moments to the edges, once
    assert len(sent) == 1 and sent[0].to.role == "children" and sent[0].slot == "wc_global"
    assert sent[0].body["classes"].tolist() == list(range(10)) and again == []
    assert int(sent[0].body["counts"].sum()) == 600
    assert metrics1["edges_global"] == 0 and metrics2["edges_global"] == 2
    # round 1 trained each edge on its own five classes; round 2 on all ten; reports stay own
    assert [m.classes.tolist() for m in first[:2]] == [list(range(5))] * 2
    assert [len(m.classes) for m in RecordingHSFP.merged] == [10, 5, 10, 5]
    # without the setting, neither tier takes the other's W_c moments
    plain_edge, plain_cloud = _edge("e9"), _cloud(test)
    env = _wire("moments", sent[0].body, "cloud", 2)
    with pytest.raises(ProtocolError, match="edge_features"):
        plain_edge.check(env, "parent")
    with pytest.raises(ProtocolError):
        plain_cloud.check(_wire("moments", sent[0].body, "e0", 2), "child")
    # a merge claiming a W_c version the round has not announced is refused before it is kept
    ahead = {**sent[0].body, "versions": {"wc": 7}}
    with pytest.raises(ProtocolError):
        edges["e0"].check(_wire("moments", ahead, "cloud", 2), "parent")


def test_pre_relu_rectifies_what_every_tier_samples():
    """pre_relu: the moments describe features before the ReLU, so the sampler applies it;
    without the setting samples of the same moments keep their negative values."""
    rng = np.random.default_rng(0)
    m = compute_moments(rng.normal(-0.2, 1.0, (400, 6)), np.arange(400) % 4)
    plain, _ = method_for("hsfp").sample_features(m, 500, np.random.default_rng(1))
    rect, _ = method_for("hsfp", pre_relu=True).sample_features(m, 500, np.random.default_rng(1))
    assert (plain < 0).mean() > 0.4
    np.testing.assert_array_equal(rect, np.maximum(plain, 0))


@pytest.mark.parametrize("pre_relu", [False, True])
def test_paper_form_sends_moments_of_the_locally_trained_wc_every_round(digits, pre_relu):
    """moments_of="local" (issue 28): the device trains, then sends the moments of its own W_c
    copy, every round; checked against the per-class means of that copy's outputs by hand."""
    from splitedge.methods.data.preprocess import to_input
    from splitedge.methods.moments import moments_from_body
    from splitedge.models import pre_activation

    (x, y), _, _ = digits
    x, y = x[:200], y[:200]
    cloud = _cloud(digits[1], pre_relu=pre_relu)
    dev = _device((x, y), moments_of="local", pre_relu=pre_relu)
    _give_model(dev, cloud)
    for r in (1, 2):
        sent = [m for m in dev.run_round(_plan(r)) if isinstance(m, Message)]
        assert [m.kind for m in sent] == ["moments"]  # every round, not only when W_c changed
        got = moments_from_body(sent[0].body)
        module = (pre_activation(dev.wc_local) if pre_relu else dev.wc_local).eval()
        with torch.no_grad():
            feats = module(torch.from_numpy(to_input(x, dev.spec.mean, dev.spec.std))).reshape(len(y), -1).numpy()
        for k, c in enumerate(got.classes.tolist()):
            np.testing.assert_allclose(got.mean[k], feats[y == c].astype(np.float64).mean(axis=0), rtol=1e-4, atol=1e-5)
        assert got.counts.tolist() == [int((y == c).sum()) for c in got.classes.tolist()]
    assert (feats < 0).any() == pre_relu
    assert not np.allclose(got.mean, dev.compute_moments().mean, atol=1e-4)  # not the global W_c's


def test_without_the_private_head_supcon_trains_w_c_on_its_pooled_features(digits):
    """proj_head=false (issue 28, the paper's device): no device-only head, SupCon sees the
    pooled W_c features themselves, and W_c still learns from it."""
    from torch import nn

    (x, y), _, _ = digits
    cloud = _cloud(digits[1])
    dev = _device((x[:200], y[:200]), proj_head=False)
    assert isinstance(dev.head, nn.Identity) and isinstance(_device((x[:20], y[:20]), node="d1").head, nn.Sequential)
    _give_model(dev, cloud)
    before = {k: v.clone() for k, v in dev.wc_local.state_dict().items()}
    list(dev.run_round(_plan(1)))
    moved = [k for k, v in dev.wc_local.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert moved, "W_c did not train"
    out = dev.forward(_one_batch(dev))
    assert torch.equal(out["z"], out["features"])


def _one_batch(dev):
    from splitedge.methods.data.preprocess import to_input
    from splitedge.methods.training import Batch

    x = torch.from_numpy(to_input(dev.data[0][:8], dev.spec.mean, dev.spec.std))
    y = torch.from_numpy(np.asarray(dev.data[1][:8], dtype=np.int64))
    return Batch(x, y, {"gen": torch.Generator().manual_seed(0)})
