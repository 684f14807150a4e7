"""``tandem scale RUN_DIR --actors N``: the request goes into the run directory, and the running driver
takes it (``runtime/fleet.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

from launch.config import ConfigError


def scale_fleet(run_dir: str, actors: int) -> int:
    """``tandem scale``: the request goes into the run directory; the running driver takes it (runtime/fleet.py)."""
    from runtime.fleet import FleetError, request_size
    from runtime.run_lock import RunDirBusy, RunLock

    root = Path(run_dir)
    try:
        request_size(root, actors)
    except FleetError as exc:
        raise ConfigError(str(exc)) from None
    try:
        RunLock.acquire(root).release()  # free: nobody trains in it now
    except RunDirBusy:
        pass
    else:
        print(
            f"tandem: error: {root} is not running (a run starts with resources.actors.count): resume it with "
            f"resources.actors.count={actors}",
            file=sys.stderr,
        )
        return 2
    print(f"asked {root} for {actors} generation actor(s); its console and logs/driver.log say when they are in")
    return 0
