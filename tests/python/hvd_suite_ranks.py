"""A test suite as Horovod's own are written (unittest, `hvd.init()` in
every test, a `tearDown` that meets at a barrier and shuts Horovod down),
run by pytest in every rank of a `kolo run`: its first test fails on rank
1 only, leaving a collective of its own unmatched and skipping the barrier
the other ranks wait at. The tests after it must pass on every rank."""

import unittest

import horovod.torch as hvd
import torch


class Suite(unittest.TestCase):
    def tearDown(self):
        if hvd.is_initialized():
            hvd.barrier()
            hvd.shutdown()

    def test_1_fails_on_rank_1(self):
        hvd.init()
        if hvd.rank() == 1:
            hvd.allreduce_async(torch.ones(3), name="left_behind")
            raise AssertionError("rank 1 fails here")
        hvd.barrier()

    def test_2_collectives(self):
        hvd.init()
        n = hvd.size()
        self.assertTrue(torch.equal(hvd.allreduce(torch.ones(4), op=hvd.Sum), torch.full((4,), float(n))))
        self.assertEqual(hvd.allgather(torch.tensor([hvd.rank()])).tolist(), list(range(n)))

    def test_3_more_collectives(self):
        hvd.init()
        got = hvd.broadcast(torch.tensor([float(hvd.rank())]), root_rank=n_minus_1())
        self.assertEqual(got.item(), float(hvd.size() - 1))


def n_minus_1():
    return hvd.size() - 1
