"""What crosses from Python to the Rust core is typed: a submission is
checked when it is made (op, element type by numpy's names, reduce op),
and every front end names element types alike."""

import numpy as np
import pytest

from kolo import _kolo


def test_a_submission_is_checked_when_made_and_says_what_it_is():
    a = np.ones((2, 3), dtype=np.float32)
    s = _kolo.Submission("allreduce", "grad.0", "float32", list(a.shape), (a.ctypes.data, a.nbytes), reduce_op=1)
    assert s.name == "grad.0"
    assert "grad.0" in repr(s) and "float32" in repr(s) and "[2, 3]" in repr(s)
    with pytest.raises(ValueError, match="Tensor type bf16 is not supported"):
        _kolo.Submission("allreduce", "x", "bf16", [1], (0, 0))
    with pytest.raises(ValueError, match="unknown Horovod op 'allreduse'"):
        _kolo.Submission("allreduse", "x", "float32", [1], (0, 0))
    with pytest.raises(ValueError, match="unknown reduction op 9"):
        _kolo.Submission("allreduce", "x", "float32", [1], (0, 0), reduce_op=9)
    with pytest.raises(TypeError):
        # the memory is (address, bytes), not a bare address
        _kolo.Submission("allreduce", "x", "float32", [1], 0)


def test_a_submission_goes_through_the_core_and_a_tuple_does_not():
    core = _kolo.HorovodCore.single()
    try:
        a = np.arange(4, dtype=np.float64)
        out = np.empty_like(a)
        s = _kolo.Submission(
            "allreduce", "sum", "float64", [4], (a.ctypes.data, a.nbytes), output=(out.ctypes.data, out.nbytes)
        )
        core.submit(0, [s], (a, out)).results()
        assert out.tolist() == a.tolist()
        with pytest.raises(TypeError):
            core.submit(
                0, [("allreduce", "t", "float64", [4], -1, 0, 1, 1.0, 1.0, (a.ctypes.data, a.nbytes), None, [])]
            )
    finally:
        core.shutdown()


def test_every_front_end_names_element_types_as_numpy_does():
    torch = pytest.importorskip("torch")
    from kolo.horovod.common import numpy_ops
    from kolo.horovod.torch import ops

    import kolo.torch

    names = set(ops._REDUCIBLE.values()) | set(kolo.torch._DTYPES.values()) | set(numpy_ops._TYPES.values())
    assert all(np.dtype(n) is not None for n in names - {"bfloat16"}), names
    assert kolo.torch._DTYPES[torch.bfloat16] == ops._REDUCIBLE[torch.bfloat16] == "bfloat16"
