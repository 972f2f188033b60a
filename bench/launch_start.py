#!/usr/bin/env python3
"""`horovodrun -np 16 true` against `kolo run -np 16 true` and `mpirun -np 16
true` (Open MPI, from ../shared/bench/anchors), alternating, with the
`kolo` and `horovodrun` commands beside this Python (the venv kolo was
installed into): `python bench/launch_start.py [ROUNDS]`."""

import os
import statistics
import subprocess
import sys
import time

here = os.path.dirname(sys.executable)
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")
commands = {
    "kolo run": [os.path.join(here, "kolo"), "run", "-np", "16", "true"],
    "horovodrun": [os.path.join(here, "horovodrun"), "-np", "16", "true"],
    "mpirun": ["mpirun", "-np", "16", "--bind-to", "none", "true"],
}
times = {name: [] for name in commands}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 7):
    for name, command in commands.items():
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, env=env)
        if done.returncode != 0:
            sys.exit(f"{name} failed: {done.stderr.decode(errors='replace')[-500:]}")
        times[name].append(time.perf_counter() - started)
for name, taken in times.items():
    print(f"{name:>10}: median {statistics.median(taken) * 1e3:7.1f} ms  min {min(taken) * 1e3:7.1f}  "
          f"max {max(taken) * 1e3:7.1f}")
