"""`python -m splitedge.sim.worker SETTINGS.json`: one worker process of `splitedge sim --workers N`
(its share of the devices; splitedge.sim.run_worker). The parent writes the settings file."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from splitedge.malloc import cap_arenas

    cap_arenas()  # before any thread starts, as the splitedge command does (splitedge/malloc.py)
    from splitedge.sim import SimSettings, run_worker

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m splitedge.sim.worker SETTINGS.json (started by splitedge sim --workers N)",
              file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    spec["out"] = Path(spec["out"]) if spec.get("out") else None
    spec["backends"] = tuple(spec["backends"])
    spec["plugins"] = tuple(spec.get("plugins", ()))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("splitedge.status").setLevel(logging.INFO)
    run_worker(SimSettings(**spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
