"""Started by kolo as a worker agent (`python -m kolo._worker`): kolo's Rust
agent serves the driver and exits; it never returns here."""

import os

from . import _hooks, _kolo

if os.environ.get(_kolo.ENV["PYTHON_HOOKS"], "1") != "0":
    _hooks.install()
    _hooks.count_progress()

_kolo.serve_worker()
raise SystemExit("kolo._worker is started by kolo on each host as a worker agent; run the `kolo` command instead")
