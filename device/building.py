"""What a device checks before it builds a method's part, and the part it builds: from its own
install, with its own data and settings (the wire names the method and its config, never code)."""

from __future__ import annotations

from typing import Any

from splitedge.methods.contract import DeviceContext, DevicePart, Method
from splitedge.methods.data.local import fits_model
from splitedge.runtime.node import status
from splitedge.runtime.parts import Misfit


def vet(device: Any, method: Method) -> None:
    """Misfit for a run this device can never take part in: the method has no device part for its
    backend (a thin device in a torch-only method), its data does not fit the model, or a mod it
    would run cannot (secure sums without `cryptography`)."""
    backends = method.device_backends()
    if isinstance(device.backend, str) and backends is not None and device.backend not in backends:
        raise Misfit(f"{method.name} has no device part for backend {device.backend!r} (it runs on "
                     f"{', '.join(backends)}); start this device with --backend {backends[0]} or join a run of a "
                     f"method its backend runs")
    misfit = fits_model(device.data[0], device.data[1], method.spec) or device.mods.vet(method)
    if misfit:
        raise Misfit(misfit)


def build_part(device: Any, method: Method) -> DevicePart[Any]:
    """The method's device part in this device's context; a DP run whose reports this device
    would send in the clear says so once."""
    if method.config.dp_sigma > 0 and not device.private_reports:
        status.warning("device %s: this run is differentially private, but this device's hello and round reports "
                       "carry %s in the clear; start it with --private-reports to keep them private too",
                       device.node_id, "its samples and losses" if device.hide_classes else
                       "the classes it holds, its samples and losses")
    ctx = DeviceContext(node_id=device.node_id, method=method, rng=device.rng, view=device.placement,
                        run=device.run_id, request=device.exchange.request, gather=device.exchange.gather,
                        min_class_count=device.min_class_count, train_chunk=device.train_chunk,
                        hide_classes=device.hide_classes, private_reports=device.private_reports,
                        compute=device.compute)
    return method.device_part(ctx, device.data, device.backend)
