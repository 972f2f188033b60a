"""kolo's Ray bridge in the driver's own Python: where this process is
connected to Ray already (a horovod.ray script calls `ray.init()` before
it makes its executor), the Ray engine runs its bridge on a thread here
instead of in a new Python that must import Ray and connect (about half
a second of a 16-worker start on one node)."""

import os
import threading


def start(source, requests_fd, answers_fd):
    """Runs the bridge's `source` (the engine's own) on a daemon thread,
    reading requests from `requests_fd` and answering on `answers_fd`
    through copies of its own (the engine closes the ones it passed). It
    ends at the end of its requests."""
    # "__main__", as under `python -c`: Ray pickles the launcher class by value
    namespace = {"__name__": "__main__", "_kolo_in_process": True}
    exec(compile(source, "<kolo ray bridge>", "exec"), namespace)
    # os.dup's copies are not inherited by the agents this bridge starts
    requests = os.fdopen(os.dup(requests_fd), "r")
    answers = os.fdopen(os.dup(answers_fd), "w", buffering=1)
    threading.Thread(
        target=namespace["main"], args=(requests, answers, True), name="kolo-ray-bridge", daemon=True
    ).start()
