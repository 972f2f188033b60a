"""How a worker turns a pickled call into objects (kolo._remote): every
call's objects are its own, as when each call is unpickled afresh, also
where the worker rebuilds a repeated call from an earlier unpickling
instead of running cloudpickle again."""

import os
import sys

import cloudpickle
import pytest

from kolo import _remote

COUNTER = 0
SEEN = []


def calls_of(fn, times=3, args=(), kwargs=None):
    """The results of running the pickled call `times` times, as a worker does."""
    payload = cloudpickle.dumps(("run", fn, tuple(args), dict(kwargs or {})))
    results = []
    for _ in range(times):
        kind, loaded, a, k = _remote._load(payload)
        results.append(loaded(*a, **k))
    return payload, results


def rebuilt(payload):
    """Whether the worker rebuilds this call instead of unpickling it."""
    return bool(_remote._templates.get(payload))


@pytest.fixture(autouse=True)
def no_templates():
    _remote._templates.clear()
    yield
    _remote._templates.clear()


def test_a_repeated_call_is_rebuilt_with_its_own_function_globals_and_cells():
    def bump_global():
        global COUNTER
        COUNTER += 1
        return COUNTER

    start = 10

    def bump_closure():
        nonlocal start
        start += 1
        return start

    def who():
        return (bump_global.__name__ if False else None, os.getpid())

    for fn, first in [(bump_global, 1), (bump_closure, 11)]:
        payload, results = calls_of(fn)
        assert results == [first] * 3, fn.__name__
        assert rebuilt(payload), fn.__name__
    assert COUNTER == 0 and start == 10  # the driver's own objects are untouched
    payload, results = calls_of(who)
    assert results == [(None, os.getpid())] * 3 and not rebuilt(payload)  # `who` names a by-value function


def test_functions_and_arguments_holding_mutable_objects_are_unpickled_afresh_each_time():
    def append(to):
        to.append(1)
        return len(to)

    def append_default(to=[]):  # noqa: B006 - the point of the test
        to.append(1)
        return len(to)

    def append_global():
        SEEN.append(1)
        return len(SEEN)

    bag = []

    def append_closure():
        bag.append(1)
        return len(bag)

    cases = [(append, ([],)), (append_default, ()), (append_global, ()), (append_closure, ())]
    for fn, args in cases:
        payload, results = calls_of(fn, args=args)
        assert results == [1, 1, 1], fn.__name__
        assert not rebuilt(payload), fn.__name__
    assert SEEN == [] and bag == []


def test_functions_pickled_by_reference_and_immutable_arguments_are_shared():
    payload, results = calls_of(os.getpid)
    assert results == [os.getpid()] * 3 and rebuilt(payload)
    payload, results = calls_of(
        lambda a, b=None: (a, b), args=[(1, "x", 2.5, None, b"y")], kwargs={"b": frozenset({3})}
    )
    assert results == [((1, "x", 2.5, None, b"y"), frozenset({3}))] * 3 and rebuilt(payload)
    loads = [_remote._load(payload)[1] for _ in range(2)]
    assert loads[0] is not loads[1] and loads[0].__code__ is loads[1].__code__
    assert loads[0].__globals__ is not loads[1].__globals__


def test_what_it_keeps_is_bounded():
    for n in range(_remote._TEMPLATES_MAX * 2):
        calls_of(lambda n=n: n, times=1)
    assert len(_remote._templates) <= _remote._TEMPLATES_MAX
    payload, results = calls_of(lambda big=b"x" * (_remote._TEMPLATE_MAX_BYTES + 1): len(big), times=2)
    assert results == [_remote._TEMPLATE_MAX_BYTES + 1] * 2 and payload not in _remote._templates


def test_a_function_whose_module_cannot_be_looked_into_is_unpickled_afresh(monkeypatch):
    import types

    odd = types.ModuleType("kolo_test_odd_module")

    def refuse(name):
        raise ImportError(f"no {name} here")

    monkeypatch.setitem(sys.modules, "kolo_test_odd_module", odd)

    def fn():
        return 7

    fn.__module__, fn.__qualname__ = "kolo_test_odd_module", "fn"
    payload = cloudpickle.dumps(("run", fn, (), {}))  # by value: the module has no fn
    # in the worker, looking into the module raises something else than AttributeError
    odd.__getattr__ = refuse
    for _ in range(2):
        kind, loaded, args, kwargs = _remote._load(payload)
        assert loaded(*args, **kwargs) == 7
    assert not rebuilt(payload)
