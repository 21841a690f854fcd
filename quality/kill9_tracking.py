"""kill -9 a tiny training with tracking on at 20 random moments, resuming after each, and
print what MLflow's training-loss history holds against an uninterrupted run: kills, steps
checked, steps lost, steps doubled, values that differ (tests/tracking/test_kill9_tracking.py runs
the same with 4 kills). About 20-40 s a kill on 2 busy cores.

    DS_ACCELERATOR=cpu .venv/bin/python quality/kill9_tracking.py [--kills 20] [--seed 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.tracking import test_kill9_tracking as kill9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=20)
    args = parser.parse_args()
    kill9.STEPS = 4 * (args.kills + 3)  # a checkpoint every 4 steps, one per kill or more
    with tempfile.TemporaryDirectory() as tmp:
        f = kill9.kill_and_resume(Path(tmp), args.kills, args.seed)
    print(
        f"kills {f['kills']}  steps checked {f['steps']}  lost {f['lost']}  "
        f"doubled {f['doubled']}  wrong values {f['wrong']}  "
        f"killed attempts marked KILLED {f['killed_runs']}/{f['runs'] - 1}"
    )


if __name__ == "__main__":
    main()
