"""The worker side of kolo.Executor: kolo's Rust agent calls these, in the
worker process, with pickled calls (cloudpickle) and sends back pickled
answers. Exceptions travel as answers, with their traceback."""

import os
import pickle
import sys
import traceback

import cloudpickle


def create(args, env):
    """The worker's state: an instance of start()'s executable_cls, or None."""
    os.environ.update(env)
    # the driver's import path first (pickle.loads imports what it names)
    driver_path, executable = pickle.loads(args)
    sys.path.extend(p for p in driver_path if p not in sys.path)
    cls, cls_args, cls_kwargs = cloudpickle.loads(executable)
    return cls(*cls_args, **cls_kwargs) if cls is not None else None


def _dumps(answer):
    """Plain data with the C pickler (several times faster); what it can
    only name, not rebuild on the other side (functions and classes made
    at run time), with cloudpickle, by value."""
    try:
        return pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - anything plain pickle refuses
        return cloudpickle.dumps(answer)


def call(state, payload):
    """Runs one pickled call: `fn(state)` for execute, `fn(*args, **kwargs)` for run."""
    # unpickled afresh each time, as Ray does: a call's objects are its own
    kind, fn, args, kwargs = cloudpickle.loads(payload)
    try:
        value = fn(state) if kind == "execute" else fn(*args, **kwargs)
        return _dumps((True, value))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the driver
        remote_traceback = traceback.format_exc()
        try:
            exception = cloudpickle.dumps(e)
            cloudpickle.loads(exception)
        except Exception:  # noqa: BLE001 - an exception that does not pickle goes as text
            exception = None
        return cloudpickle.dumps((False, (f"{type(e).__name__}: {e}", remote_traceback, exception)))


def call_elastic(state, payload):
    """A call of an elastic job: the pickled value, or, if the function
    raised, an exception carrying its traceback (the process failed)."""
    kind, fn, args, kwargs = cloudpickle.loads(payload)
    try:
        value = fn(state) if kind == "execute" else fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the driver hears of every failure
        raise RuntimeError(f"{type(e).__name__}: {e}\n\nremote traceback:\n{traceback.format_exc()}") from None
    return _dumps((True, value))
