"""`horovod.runner.util.network` by name. kolo's driver finds the address
its workers reach it at itself (the route to the hosts); `get_driver_ip`
is what that is for this machine's own jobs."""

import socket


def get_driver_ip(nics=None):
    """An IPv4 address of this machine (its hostname's)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
