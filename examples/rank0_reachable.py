"""Checks that every rank can reach rank 0's host at JAX_COORDINATOR_ADDRESS,
where JAX's process 0 opens its coordinator: rank 0 listens there, every
other rank connects. (PyTorch's store is kolo's own, at MASTER_ADDR.)
Run it under kolo: kolo run -np 4 -- python3 examples/rank0_reachable.py"""
import os
import socket
import time

rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
host, port = os.environ["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)
addr, port = host.strip("[]"), int(port)
if rank == 0:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("", port))
    server.listen(size)
    server.settimeout(30)
    for _ in range(size - 1):
        conn, _ = server.accept()
        conn.sendall(b"ok")
        conn.close()
    print(f"rank 0 on {socket.gethostname()} served {size - 1} ranks at {addr}:{port}")
else:
    deadline = time.time() + 30
    while True:
        try:
            with socket.create_connection((addr, port), timeout=5) as conn:
                assert conn.recv(2) == b"ok"
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    print(f"rank {rank} on {socket.gethostname()} reached rank 0 at {addr}:{port}")
