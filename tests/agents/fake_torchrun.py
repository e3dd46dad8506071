#!/usr/bin/env python3
"""A stand-in for `python -m torch.distributed.run` in the node launcher's fast tests: records how it was started,
spawns one "worker" child (like torchrun, in its own session), and on SIGTERM exits 0 after `HZ_FAKE_STOP_S`
(the time a real job takes to agree on a step and checkpoint). Run as `fake_torchrun.py -m torch.distributed.run ...`.
An in-place node (its spec names a store) also leaves, exiting 0, when its membership file says it is no member.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    record = Path(os.environ["HZ_FAKE_RECORD"])
    args = sys.argv[3:]  # after "-m torch.distributed.run"
    with record.open("a") as out:
        out.write(json.dumps({"pid": os.getpid(), "args": args, "spec": os.environ.get("HZ_RUN_SPEC"),
                              "marker": os.environ.get("HZ_NODE_ID")}) + "\n")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    stop_s = float(os.environ.get("HZ_FAKE_STOP_S", "0.2"))

    def on_term(*_: object) -> None:
        time.sleep(stop_s)
        worker.kill()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    if os.environ.get("HZ_FAKE_EXIT") is not None:
        worker.kill()
        sys.exit(int(os.environ["HZ_FAKE_EXIT"]))
    membership = _membership_file()
    while True:
        time.sleep(0.05)
        if membership is not None and membership.exists() and json.loads(membership.read_text())["member"] is False:
            worker.kill()
            sys.exit(0)


def _membership_file() -> Path | None:
    spec_path = os.environ.get("HZ_RUN_SPEC")
    if not spec_path:
        return None
    spec = json.loads(Path(spec_path).read_text())
    return Path(spec["control_dir"]) / "membership.json" if spec.get("store_endpoint") else None


if __name__ == "__main__":
    main()
