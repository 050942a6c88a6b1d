"""Which torch device a node computes on (`--device auto|cpu|cuda|cuda:N` of every role and the sim).

Resolved once, when a node starts, so that asking for a GPU torch cannot see is one line before any
work. Parts get the result through their context (NodeContext.compute) after their method had its
say (`Method.runs_on_cuda`): a method whose parts are not ported computes on the CPU, and is refused
when the operator named the GPU. Bit-for-bit reproducibility is a CPU promise: CUDA kernels are
not deterministic, so a run on `auto` with a GPU present is not equal to one with `--device cpu`.

Torch-free at import (a thin device imports the contract, which imports this): torch is imported
only to resolve a request other than `cpu`.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEVICE_HELP = ("torch device for training and evaluation: auto (CUDA when torch sees a GPU, else the CPU), cpu, "
               "cuda or cuda:N; runs are bit-for-bit reproducible on the CPU only")
_REQUEST = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class Compute:
    """A resolved device: "cpu", "cuda" or "cuda:N", and whether the operator named the GPU
    (`asked`) or `auto` found it."""

    device: str = "cpu"
    asked: bool = False

    def for_method(self, name: str, runs_on_cuda: bool) -> "Compute":
        """What the parts of method `name` compute on: this device, or the CPU for a method not
        ported to CUDA. A GPU named by the operator is then a ValueError (one line); one that
        `auto` found is left unused, and the log says so once per method."""
        if runs_on_cuda or self.device == "cpu":
            return self
        if self.asked:
            raise ValueError(cpu_only(name))
        if name not in _said:
            _said.add(name)
            log.warning("method %s runs on the CPU only so far: its parts leave the GPU (%s) unused", name, self.device)
        return CPU


CPU = Compute()
_said: set[str] = set()  # methods the log already said run on the CPU only


def cpu_only(name: str) -> str:
    """The one line refusing `--device cuda` for a method whose parts are not ported."""
    return f"method {name} runs on the CPU only so far; use --device cpu or auto"


def add_argument(p: argparse.ArgumentParser) -> None:
    """`--device` of every role and the sim (default auto)."""
    p.add_argument("--device", default="auto", metavar="auto|cpu|cuda[:N]", help=DEVICE_HELP)


def check_request(value: str) -> str:
    """`value` if it is a --device request (auto, cpu, cuda, cuda:N); else a ValueError naming them."""
    if not _REQUEST.fullmatch(value):
        raise ValueError(f"--device takes auto, cpu, cuda or cuda:N, got {value!r}")
    return value


def resolve_for(request: str, method: str, runs_on_cuda: bool) -> Compute:
    """`request` resolved for a node that knows its method at start (the cloud, a sim, a peer
    device): a GPU named for a method not ported to it is refused in one line now, not when the
    parts are built; `auto` says once that the method leaves it unused. The parts narrow it
    themselves (`Method._placed`)."""
    resolved = resolve(request)
    resolved.for_method(method, runs_on_cuda)
    return resolved


def resolve(request: str) -> Compute:
    """The device `request` names on this machine: `auto` is CUDA when torch sees a GPU, else the
    CPU (without torch installed: the CPU); `cuda` or `cuda:N` that torch cannot see is a ValueError
    saying what to use instead."""
    check_request(request)
    if request == "cpu":
        return CPU
    try:
        import torch
    except ImportError:
        if request == "auto":
            return CPU
        raise ValueError(f"--device {request}: torch is not installed; use --device cpu or auto") from None
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if request == "auto":
        return Compute("cuda") if seen else CPU
    if not seen:
        raise ValueError(f"--device {request}: torch sees no CUDA device (a CPU-only torch, or no driver); "
                         f"use --device cpu or auto")
    index = int(request.split(":")[1]) if ":" in request else 0
    if index >= seen:
        raise ValueError(f"--device {request}: torch sees {seen} CUDA device{'s' if seen > 1 else ''} "
                         f"(cuda:0{f'..cuda:{seen - 1}' if seen > 1 else ''}); use one of them, cpu or auto")
    return Compute(request, asked=True)
