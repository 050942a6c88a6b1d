"""PROTOCOL.md is true to the wire: a federation's every message, captured at a real Mosquitto,
decodes and validates with the page's own tables (tests/protocol_doc.py, no splitedge schema),
and the page documents every kind the code registers, with the code's fields.

Two small runs (digits, 2 rounds, 4 devices, 2 edges) cover most kinds: H-SFP with a torch and
an ONNX device, balanced device-to-edge assignment and slow-scale averaging in round 2 (hello,
status, round, stop, assign, moments, weights, arrays, request, done), and CFLHKD
with two planted groups (logits, cluster moves, the teachers slot).
"""

from __future__ import annotations

import time

import pytest

from mqtt_capture import Capture
from protocol_doc import DOC, ProtocolDoc, Violation, check_message, table, block

RUNS = ("doc-hsfp", "doc-cflhkd")
NODES_PER_RUN = 4 + 2 + 1  # devices, edges, the cloud


@pytest.fixture(scope="module")
def doc() -> ProtocolDoc:
    return ProtocolDoc.load()


@pytest.fixture(scope="module")
def wire(mosquitto, tmp_path_factory) -> dict:
    """Run the two federations with a capture client listening; then read what stays retained."""
    import torch

    from splitedge.sim import SimSettings, run_sim

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("protocol-doc")
    capture = Capture(mosquitto, "doc-capture")
    try:
        run_sim(SimSettings(rounds=2, devices=4, edges=2, method="hsfp", backends=("torch", "onnx"), alpha=0.3,
                            broker=mosquitto.url, run=RUNS[0], out=out / "hsfp", deadline_s=60.0,
                            overrides={"assign": "balanced", "ic": 2, "ie": 2, "calibrate": "lda"}))
        run_sim(SimSettings(rounds=2, devices=4, edges=2, method="cflhkd", groups=2, broker=mosquitto.url,
                            run=RUNS[1], out=out / "cflhkd", deadline_s=60.0))
        time.sleep(0.5)  # the last PUBACKed frames reach the capture client
    finally:
        capture.close()
    after = Capture(mosquitto, "doc-after")  # a late joiner: what the broker keeps
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and sum(t.endswith("/up/status") for t, *_ in after.messages) < 2 * NODES_PER_RUN:
        time.sleep(0.05)
    time.sleep(0.3)
    after.close()
    return {"live": list(capture.messages), "retained": list(after.messages)}


def judge(doc: ProtocolDoc, messages) -> tuple[list[dict], list[str]]:
    envelopes, problems = [], []
    for topic, payload, retain, _ in messages:
        try:
            env = check_message(doc, topic, payload, retain)
        except Violation as exc:
            problems.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - a frame the page's layout cannot even parse
            problems.append(f"{topic}: {type(exc).__name__}: {exc}")
        else:
            if env is not None:
                envelopes.append({"topic": topic, "retain": retain, **env})
    return envelopes, problems


def test_every_captured_message_conforms_to_protocol_md(doc: ProtocolDoc, wire: dict) -> None:
    # Execute: judge every PUBLISH of both runs by the page's tables alone
    envelopes, problems = judge(doc, wire["live"])
    # Assert: nothing the page does not allow, and the runs did exercise the page
    assert not problems, f"{len(problems)} message(s) break PROTOCOL.md, e.g.:\n" + "\n".join(sorted(set(problems))[:15])
    assert {topic.split("/")[1] for topic, *_ in wire["live"]} == set(RUNS)
    assert all(qos == 1 for *_, qos in wire["live"]), "PROTOCOL.md: every message is QoS 1"
    seen = {e["k"] for e in envelopes}
    assert seen >= {"hello", "status", "round", "assign", "moments", "weights", "arrays", "logits",
                    "request", "done"}, seen
    segments = {e["topic"].split("/")[5] for e in envelopes}
    assert {"weights-wc", "weights-we", "weights-model", "arrays-teachers", "weights-calib"} <= segments, segments
    assert any(e["k"] == "round" and e["b"].get("phase") == "calibrate" for e in envelopes)  # calibration phases
    assert any(e["k"] == "arrays" and e["b"]["name"] == "head_stats" for e in envelopes)


def test_stop_announcements_are_retained_rounds_with_stop_true(wire: dict, doc: ProtocolDoc) -> None:
    envelopes, _ = judge(doc, wire["live"])
    stops = [e for e in envelopes if e["k"] == "round" and e["b"].get("stop")]
    for run in RUNS:
        mine = [e for e in stops if e["r"] == run]
        last = max(e["n"] for e in envelopes if e["r"] == run and e["k"] == "round" and not e["b"].get("stop"))
        assert {e["topic"].split("/")[2] for e in mine} == {"cloud", "edge"}, run  # the cloud's and its relays
        assert all(e["retain"] and e["n"] == last + 1 and e["b"]["versions"] == {} and e["b"]["directives"] == {}
                   and e["b"]["deadline_s"] == 1.0 for e in mine), mine


def test_after_a_clean_run_every_retained_status_is_offline_and_every_retained_topic_is_documented(
        doc: ProtocolDoc, wire: dict) -> None:
    envelopes, problems = judge(doc, wire["retained"])
    assert not problems, problems[:10]
    status = {(e["r"], e["s"]): e["b"]["state"] for e in envelopes if e["k"] == "status"}
    assert len(status) == 2 * NODES_PER_RUN, sorted(status)
    assert set(status.values()) == {"offline"}, {k: v for k, v in status.items() if v != "offline"}
    assert all(e["retain"] for e in envelopes)


def test_every_registered_kind_is_documented_with_the_codes_fields(doc: ProtocolDoc) -> None:
    """Not used to decode anything: a drift alarm between the code's registry and the page."""
    from splitedge.methods.registry import get_method, list_methods
    from splitedge.protocol.schema import get_schema, registered_kinds

    for name in list_methods():  # a method's package registers its own kinds when looked up
        get_method(name)
    kinds = {k for k in registered_kinds() if not k.startswith("test_")}
    assert kinds == set(doc.kinds), (kinds ^ set(doc.kinds))
    for kind in kinds:
        schema = get_schema(kind)
        documented = {n: f.required for n, f in doc.kinds[kind].items() if n != "*"}
        assert documented == {n: not spec.optional for n, spec in schema.fields.items()}, kind
        assert ("*" in doc.kinds[kind]) == (schema.extra is not None), kind


def test_the_done_record_is_documented_with_the_codes_fields(doc: ProtocolDoc) -> None:
    """The done info's tables (and the nested ones) list the record's fields, each optional, and
    the kind's `info` row names the record."""
    from splitedge.protocol.done import DONE_INFO

    schemas = {"done.info": DONE_INFO, "done.devices": DONE_INFO.fields["devices"].schema,
               "done.scores": DONE_INFO.fields["scores"].schema}
    assert set(doc.records) == set(schemas)
    for name, schema in schemas.items():
        assert {n: f.required for n, f in doc.records[name].items()} == dict.fromkeys(schema.fields, False), name
    assert doc.kinds["done"]["info"].type.ref == "done.info"


def test_every_kind_of_the_routes_table_has_a_field_table(doc: ProtocolDoc) -> None:
    for route in doc.routes:
        assert route.segment.split("-", 1)[0] in doc.kinds, route
    assert {r.tier for r in doc.routes} == {"device", "edge", "cloud"}
    assert {r.direction for r in doc.routes} == {"up", "down", "peer"}


def test_the_checker_rejects_frames_a_page_with_a_row_removed_does_not_allow(doc: ProtocolDoc, wire: dict) -> None:
    # Prepare: a captured moments frame, a cloud status and a stop announcement (all good by the page)
    frames = {}
    for topic, payload, retain, _ in wire["live"]:
        env = check_message(doc, topic, payload, retain) if payload else None
        if env is None:
            continue
        key = (env["k"], topic.split("/")[2], bool(env["b"].get("stop")) if env["k"] == "round" else None)
        frames.setdefault(key, (topic, payload, retain))
    moments, cloud_status = frames[("moments", "device", None)], frames[("status", "cloud", None)]
    # Execute / Assert: the page without `moments.session` refuses a moments frame (it carries one)
    with pytest.raises(Violation, match="session"):
        check_message(doc.without_field("moments", "session"), *moments)
    # ... without the cloud's `up status` route, the cloud's status
    with pytest.raises(Violation, match="no documented route"):
        check_message(doc.without_route(tier="cloud", direction="up"), *cloud_status)
    # ... and a frame whose retain flag differs from the routes table
    topic, payload, retain = frames[("round", "cloud", True)]
    with pytest.raises(Violation, match="retain"):
        check_message(doc, topic, payload, not retain)


def test_a_page_with_an_unknown_type_or_constraint_is_refused() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert table(block(text, "kind:status"))[0]["constraints"] == "one of online, offline"
    with pytest.raises(Violation, match="unknown constraint"):
        ProtocolDoc.parse(text.replace("one of online, offline", "either online or offline"))
    with pytest.raises(Violation, match="unknown type"):
        ProtocolDoc.parse(text.replace("| `samples` | int | yes |", "| `samples` | integer | yes |", 1))


def test_protocol_md_has_the_sections_an_operator_needs() -> None:
    text = DOC.read_text(encoding="utf-8")
    for heading in ("## Authentication and authorisation", "### Signatures", "### The stop announcement",
                    "### Liveness", "### Retained slots at a glance"):
        assert heading in text, heading
    assert "/out" not in text.split("<!-- kinds-table:begin -->")[0], "there is no `out` direction"
