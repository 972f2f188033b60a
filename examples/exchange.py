"""A small distributed job for `kolo run`: every rank meets the others on the
job's rendezvous server the way Gloo does (PUT its own key, poll GET for
everyone else's, DELETE when done), then reports what it learned.

    kolo run --engine local -np 4 -H node-a:2,node-b:2 -- python3 examples/exchange.py
"""
import http.client
import os
import socket
import time

rank = int(os.environ["HOROVOD_RANK"])
size = int(os.environ["HOROVOD_SIZE"])
node = os.environ["HOROVOD_HOSTNAME"]
conn = http.client.HTTPConnection(os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
                                  int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]))


def request(method, path, body=None):
    conn.request(method, path, body=body)
    response = conn.getresponse()
    return response.status, response.read()


me = f"{node}/{socket.gethostname()}/pid {os.getpid()}"
request("PUT", f"/global/{rank}", me.encode())
deadline = time.monotonic() + float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "30"))
peers = []
for other in range(size):
    while True:
        status, value = request("GET", f"/global/{other}")
        if status == 200:
            peers.append(value.decode())
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: rank {other} never showed up")
        time.sleep(0.01)
request("DELETE", f"/global/{rank}")
print(f"rank {rank}/{size} local {os.environ['LOCAL_RANK']}/{os.environ['LOCAL_WORLD_SIZE']} "
      f"cross {os.environ['HOROVOD_CROSS_RANK']}/{os.environ['HOROVOD_CROSS_SIZE']} on {node}: "
      f"met {len(peers)} ranks")
