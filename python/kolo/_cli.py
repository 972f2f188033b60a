"""The `kolo` command of the Python package: kolo's Rust command line, whose
worker agents are this interpreter running `kolo._worker`."""

import signal
import sys

from . import _kolo


def main() -> None:
    # kolo handles SIGINT itself (the job's teardown, a second one hurries
    # it); Python's handler would also see it and raise KeyboardInterrupt
    # over kolo's exit code once kolo returns
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.exit(_kolo.main(sys.argv, sys.executable, ["-m", "kolo._worker"]))


if __name__ == "__main__":
    main()
