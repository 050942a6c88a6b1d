"""`splitedge sim --broker-tree`: one Mosquitto per edge site, each bridged to a cloud Mosquitto,
the topology deploy/ describes, so that a simulation crosses the brokers a deployment has.

Each site's bridge is deploy/mosquitto/edge-site.conf's, narrowed to its own edge: it carries
`splitedge/<run>/edge/<E>/up/#` out and the cloud's downlink `splitedge/<run>/cloud/+/down/#`
in, nothing else, so device traffic stays on its site and no message can loop between bridges
(a site forwards only its own edge's topics, and only the cloud's come back in). An edge and
its devices use their site broker; the cloud uses the cloud broker. Every broker's own byte
and message counters ($SYS) are read at the end.
"""

from __future__ import annotations

from splitedge.protocol.broker import MosquittoBroker, read_sys

BRIDGE_READY_S = 20.0
SYS_TOPICS = ("bytes/received", "bytes/sent", "messages/received", "messages/sent")


def bridge_conf(run: str, edge: str, cloud_port: int) -> str:
    """The bridge section of a site broker for one edge (deploy's, with per-edge topics)."""
    return "\n".join([
        "max_packet_size 68157440",
        f"connection splitedge-cloud-{edge}",
        f"address 127.0.0.1:{cloud_port}",
        f"remote_clientid splitedge-bridge-{run}-{edge}",
        f"local_clientid splitedge-bridge-{run}-{edge}-local",
        f"topic splitedge/{run}/edge/{edge}/up/# out 1",
        f"topic splitedge/{run}/cloud/+/down/# in 1",
        "cleansession true", "try_private true", "bridge_protocol_version mqttv311",
        "start_type automatic", "restart_timeout 1 5", "keepalive_interval 30", "notifications true", ""])


class BrokerTree:
    """A cloud Mosquitto and one bridged site Mosquitto per edge; a context manager."""

    def __init__(self, run: str, edges: list[str]) -> None:
        self.run, self.edge_ids = run, edges
        self.cloud = MosquittoBroker(extra_conf="max_packet_size 68157440\nmax_connections -1\n")
        self.sites: dict[str, MosquittoBroker] = {}

    def __enter__(self) -> "BrokerTree":
        try:
            self.cloud.start()
            for e in self.edge_ids:
                self.sites[e] = MosquittoBroker(extra_conf="max_connections -1\n" +
                                                bridge_conf(self.run, e, self.cloud.port)).start()
            self._wait_for_bridges()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for broker in [*self.sites.values(), self.cloud]:
            broker.stop()

    def site_url(self, edge: str) -> str:
        return self.sites[edge].url

    def _wait_for_bridges(self) -> None:
        """Until every site's bridge says it is connected (its notification topic on the cloud)."""
        def up(values: dict[str, str]) -> list[str]:
            return [t for t, v in values.items() if t.endswith("/state") and v == "1"]

        states = read_sys(self.cloud.url, "$SYS/broker/connection/#", timeout=BRIDGE_READY_S,
                          done=lambda values: len(up(values)) >= len(self.sites))
        if len(up(states)) < len(self.sites):
            raise RuntimeError(f"only {len(up)} of {len(self.sites)} site bridges connected to the cloud broker within "
                               f"{BRIDGE_READY_S:g} s: {self.cloud.log_tail()}")

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes and messages each broker received and sent (its $SYS counters)."""
        out = {}
        for name, broker in [("cloud", self.cloud), *((f"site-{e}", b) for e, b in self.sites.items())]:
            wanted = [f"$SYS/broker/{t}" for t in SYS_TOPICS]
            values = read_sys(broker.url, "$SYS/broker/#", timeout=5.0, done=lambda v: all(t in v for t in wanted))
            out[name] = {t.replace("/", "_"): int(float(values[f"$SYS/broker/{t}"])) for t in SYS_TOPICS
                         if f"$SYS/broker/{t}" in values}
        return out
