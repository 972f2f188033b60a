"""Every Store call of torch's own TCPStore client, against the store kolo
serves at MASTER_ADDR:MASTER_PORT (run under kolo run -np 1)."""

import os
from datetime import timedelta

import torch.distributed as dist

assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
store = dist.TCPStore(
    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=20)
)
store.set("k", "v1")
assert store.get("k") == b"v1"
assert store.add("n", 5) == 5 and store.add("n", -2) == 3
assert store.get("n") == b"3"
assert store.compare_set("k", "v1", "v2") == b"v2"
assert store.compare_set("k", "nope", "v3") == b"v2"
assert store.check(["k"]) and not store.check(["k", "missing"])
assert store.delete_key("n") and not store.delete_key("n")
store.append("k", "++")
assert store.multi_get(["k"]) == [b"v2++"]
store.multi_set(["a", "b"], ["1", "22"])
assert store.multi_get(["a", "b"]) == [b"1", b"22"]
try:
    store.wait(["never"], timedelta(milliseconds=200))
    raise AssertionError("the wait did not time out")
except dist.DistStoreError as e:
    assert "timeout" in str(e).lower(), e
store.set("after-timeout", "still works")
assert store.get("after-timeout") == b"still works"
store.queue_push("q", "x")
assert store.queue_len("q") == 1
assert store.queue_pop("q") == b"x"
assert sorted(k for k in store.list_keys() if not k.startswith("init")) == ["a", "after-timeout", "b", "k"], (
    store.list_keys()
)
clone = store.clone()
assert clone.get("a") == b"1"
print("every store call answered", flush=True)
