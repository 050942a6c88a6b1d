"""What a SplitFed device checks of its inbound messages, for the torch and the thin part alike (torch-free)."""

from __future__ import annotations

from typing import Any, Mapping

from splitedge.methods.checks import check_weights
from splitedge.protocol.errors import ProtocolError


def check_wc_message(env: Any, specs: Mapping[str, Any], wc_shape: tuple[int, ...]) -> None:
    """W_c weight maps must fit this model's W_c, gradients W_c's output shape (ProtocolError)."""
    if env.kind == "weights":
        check_weights(env.body, specs, part="wc", source="parent")  # only the cloud sends a device W_c
    elif env.kind == "gradients" and env.body["grad"].shape[1:] != tuple(wc_shape):
        raise ProtocolError("state.shape", f"gradient of shape {env.body['grad'].shape[1:]}, W_c gives {tuple(wc_shape)}")
