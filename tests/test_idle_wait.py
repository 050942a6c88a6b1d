"""An idle device blocks on its inbox instead of waking every half second (10,000 devices in
four processes kept two cores busy switching threads), and stop() still ends it at once."""

from __future__ import annotations

import threading
import time

import numpy as np

from splitedge.runtime.node import IDLE_WAKE_S


def _device(quiet_warn_s):
    from splitedge.device.agent import DeviceAgent
    from splitedge.protocol.transport import LoopbackBus, LoopbackTransport

    return DeviceAgent(LoopbackTransport(LoopbackBus(), role="device", client_id="d0"), run="r", node_id="d0",
                       edge="e0", data=(np.zeros((2, 8, 8, 1), np.uint8), np.zeros(2, np.int64)),
                       quiet_warn_s=quiet_warn_s)


def test_an_idle_device_blocks_until_stopped_and_stop_wakes_it() -> None:
    agent = _device(quiet_warn_s=None)  # a sim's device: no quiet warning to time
    assert agent.idle_wait(0.5) == IDLE_WAKE_S
    waits: list[float] = []
    inner = agent.next_event
    agent.next_event = lambda timeout: (waits.append(timeout), inner(timeout))[1]  # type: ignore[method-assign]
    loop = threading.Thread(target=agent.run_forever, daemon=True)
    loop.start()
    time.sleep(0.3)
    stopping = time.monotonic()
    agent.stop()
    loop.join(IDLE_WAKE_S / 2)
    assert not loop.is_alive() and time.monotonic() - stopping < IDLE_WAKE_S / 2  # woken, not timed out
    assert waits and set(waits) == {IDLE_WAKE_S}
    assert agent.idle  # the wake-up left behind (if any) does not count as work


def test_a_device_polls_only_while_its_quiet_warning_can_come_due() -> None:
    agent = _device(quiet_warn_s=8.0)
    assert agent.idle_wait(0.5) == 0.5  # not heard from anyone yet: the warning is timed
    agent.enqueue("t", object())  # anything heard ends the warning's watch
    agent.next_event(0.0)
    assert agent.idle_wait(0.5) == IDLE_WAKE_S
