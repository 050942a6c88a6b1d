"""splitedge wire protocol: envelope codec, array ext type, body schemas, topics, transports.

numpy + msgpack (+ paho in the transport modules) only: this package never imports torch.
Importing it registers the built-in message kinds (protocol/kinds.py).
"""

from .errors import ProtocolError
from .arrays import EXT_ARRAY, dtype_name, pack_array, unpack_array
from .codec import DEFAULT_MAX_BYTES, PROTOCOL_VERSION, Envelope, decode, encode
from .schema import (
    ALL_DTYPES, FLOAT_DTYPES, Array, Bool, Bytes, Data, Field, Float, Int, Map, Number, Scalar,
    Schema, Str, get_schema, register_kind, registered_kinds, validate_body,
)
from . import kinds  # noqa: F401 - registers the built-in kinds

# Transport-side exports (topics, accounting, transport, mqtt, broker) are added below.
