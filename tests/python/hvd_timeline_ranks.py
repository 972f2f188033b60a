"""A rank of kolo's Horovod timeline tests, started by `kolo run`: `python
hvd_timeline_ranks.py SCENARIO PATH`. The test reads the timeline file
PATH (rank 0's) once the job is done; each scenario prints `ok <scenario>`."""

import sys
import time


def torch_ops():
    """Under HOROVOD_TIMELINE=PATH: a fused group, a straggler, a cached
    name, a broadcast and an allgather."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    n = hvd.size()
    # one group: negotiated together, fused through the fusion buffer
    grads = [torch.full((8,), float(i)) for i in range(3)]
    out = hvd.grouped_allreduce(grads, name="group", op=hvd.Sum)
    assert all(torch.equal(o, g * n) for o, g in zip(out, grads))
    # rank 1 comes late: its request reaches the coordinator last
    if hvd.rank() == 1:
        time.sleep(0.5)
    late = hvd.allreduce(torch.ones(3), name="late", op=hvd.Sum)
    assert torch.equal(late, torch.full((3,), float(n)))
    # the same name again and again: from the response cache
    for _ in range(3):
        hvd.allreduce(torch.ones(2, 2), name="steady")
    hvd.broadcast(torch.arange(4.0), root_rank=0, name="weights")
    hvd.allgather(torch.ones(hvd.rank() + 1, 2), name="rows")
    hvd.shutdown()


def torch_dynamic():
    """Under HOROVOD_TIMELINE=DYNAMIC: only what runs between start and
    stop is recorded; misuse raises upstream's errors."""
    import torch

    import horovod.torch as hvd

    path = sys.argv[2]
    try:
        hvd.start_timeline(path)
        raise AssertionError("start_timeline before init did not raise")
    except ValueError as e:
        assert str(e) == "Horovod has not been initialized; use hvd.init().", e
    hvd.init()
    hvd.allreduce(torch.ones(2), name="before")
    if hvd.rank() == 0:
        bad = "/nonexistent-kolo-dir/timeline.json"
        try:
            hvd.start_timeline(bad)
            raise AssertionError("an unwritable timeline file did not raise")
        except ValueError as e:
            assert bad in str(e), e
    hvd.start_timeline(path, mark_cycles=True)
    hvd.start_timeline(path, mark_cycles=True)  # the same file goes on
    hvd.allreduce(torch.ones(2), name="during")
    hvd.stop_timeline()
    hvd.stop_timeline()  # stopped already: nothing to do
    hvd.allreduce(torch.ones(2), name="after")
    hvd.shutdown()
    try:
        hvd.stop_timeline()
        raise AssertionError("stop_timeline after shutdown did not raise")
    except ValueError as e:
        assert "hvd.init()" in str(e), e


def torch_disabled():
    """Without HOROVOD_TIMELINE, start_timeline says how to enable it."""
    import horovod.torch as hvd

    hvd.init()
    try:
        hvd.start_timeline(sys.argv[2])
        raise AssertionError("start_timeline without HOROVOD_TIMELINE did not raise")
    except ValueError as e:
        assert str(e) == "Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.", e
    hvd.shutdown()


def tf_ops():
    """TensorFlow's ops go through the same core and the same timeline."""
    import tensorflow as tf

    import horovod.tensorflow as hvd

    hvd.init()
    total = hvd.allreduce(tf.ones([4]), name="tfgrad", op=hvd.Sum)
    assert float(total.numpy()[0]) == hvd.size()
    hvd.shutdown()


if __name__ == "__main__":
    scenario = sys.argv[1]
    globals()[scenario]()
    print(f"ok {scenario}", flush=True)
