"""The `kolo` command of the Python package: kolo's Rust command line, whose
worker agents are this interpreter running `kolo._worker`."""

import sys

from . import _kolo


def main() -> None:
    sys.exit(_kolo.main(sys.argv, sys.executable, ["-m", "kolo._worker"]))


if __name__ == "__main__":
    main()
