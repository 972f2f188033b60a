"""Tries one of a job's stores as a client would: `http ADDR PORT` PUTs
and GETs /global/intruder on the Horovod-compatible store (raw HTTP, as
Gloo's client speaks it), `torch ADDR PORT` sets and gets `intruder` with
torch's own TCPStore client. Prints `wrote` when both worked, or
`refused: WHY`."""

import socket
import sys


def http(addr, port):
    def request(text):
        with socket.create_connection((addr, port), timeout=10) as s:
            s.sendall(text.encode())
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
                if b"\r\n\r\n" in reply:
                    break
            return reply.decode(errors="replace")

    put = request(f"PUT /global/intruder HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 1\r\n\r\nx")
    if not put.startswith("HTTP/1.1 200"):
        return f"refused: PUT answered {put[:40]!r}"
    got = request(f"GET /global/intruder HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
    return "wrote" if got.startswith("HTTP/1.1 200") else f"refused: GET answered {got[:40]!r}"


def torch_store(addr, port):
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
    store.set("intruder", "x")
    return "wrote" if store.get("intruder") == b"x" else "refused: read back something else"


if __name__ == "__main__":
    kind, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    try:
        print(http(addr, port) if kind == "http" else torch_store(addr, port), flush=True)
    except Exception as e:  # what the client says is the answer
        print(f"refused: {type(e).__name__}: {e}".replace("\n", " "), flush=True)
