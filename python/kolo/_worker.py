"""Started by kolo as a worker agent (`python -m kolo._worker`): kolo's Rust
agent serves the driver and exits; it never returns here."""

from . import _kolo

_kolo.serve_worker()
raise SystemExit("kolo._worker is started by kolo on each host as a worker agent; run the `kolo` command instead")
