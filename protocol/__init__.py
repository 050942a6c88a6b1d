"""splitedge wire protocol: envelope codec, array ext type, body schemas, topics, transports.

numpy + msgpack (+ paho in the transport modules) only: this package never imports torch.
Importing it registers the built-in message kinds (protocol/kinds.py).
"""

from .errors import ProtocolError
from .arrays import EXT_ARRAY, dtype_name, pack_array, unpack_array
from .codec import DEFAULT_MAX_BYTES, PROTOCOL_VERSION, Envelope, decode, encode
from .schema import (
    ALL_DTYPES, FLOAT_DTYPES, Array, Bool, Bytes, Data, Field, Float, Int, List, Map, Number, Scalar,
    Schema, Str, get_schema, register_kind, registered_kinds, validate_body,
)
from . import kinds  # noqa: F401 - registers the built-in kinds

# Transport-side exports (topics, accounting, transport, mqtt, broker) are added below.
from . import topics  # noqa: E402 - topics.topic/parse/pattern/matches
from .topics import Topic, pattern, topic  # noqa: E402
from .accounting import ByteCounters, publish_packet_bytes  # noqa: E402
from .transport import Handler, LoopbackBus, LoopbackTransport, Transport, wait_for  # noqa: E402
from .mqtt import MqttTransport  # noqa: E402

# The brokers (asyncio, subprocess) load on first use: a device process never runs one, and
# each module it does not import is memory a Pi-class device keeps (protocol/broker.py).
_BROKER_NAMES = ("EmbeddedBroker", "MosquittoBroker", "serve_forever", "start_embedded_broker")


def __getattr__(name: str):
    if name in _BROKER_NAMES:
        from . import broker

        return getattr(broker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
