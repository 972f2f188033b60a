"""The worker side of kolo.Executor: kolo's Rust agent calls these, in the
worker process, with pickled calls (cloudpickle) and sends back pickled
answers. Exceptions travel as answers, with their traceback."""

import os
import pickle
import sys
import traceback
import types

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
    kind, fn, args, kwargs = _load(payload)
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
    kind, fn, args, kwargs = _load(payload)
    try:
        value = fn(state) if kind == "execute" else fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the driver hears of every failure
        raise RuntimeError(f"{type(e).__name__}: {e}\n\nremote traceback:\n{traceback.format_exc()}") from None
    return _dumps((True, value))


# Each call's objects are its own, as with Ray: a call sees the function's
# globals, defaults and closure as the driver pickled them, whatever an
# earlier call did to its copies. Unpickling a function afresh is most of
# a short call's cost in a busy worker (cloudpickle rebuilds it in Python,
# from cold memory), so a call whose by-value state is all immutable is
# instead rebuilt from the last unpickling of the same bytes: a new
# function object, a copy of its globals, new closure cells. Anything
# mutable, or a by-value function or class it refers to, and the call is
# unpickled afresh every time.
_templates = {}
_TEMPLATES_MAX = 64
_TEMPLATE_MAX_BYTES = 64 * 1024


def _load(payload):
    """The call in `payload`: (kind, fn, args, kwargs), its objects its own."""
    template = _templates.get(payload)
    if template is None:
        call = cloudpickle.loads(payload)
        if len(payload) > _TEMPLATE_MAX_BYTES:
            return call
        try:
            template = _template(call)
        except Exception:  # noqa: BLE001 - a module's __getattr__, say: unpickle this call afresh each time
            template = None
        if len(_templates) >= _TEMPLATES_MAX:
            _templates.clear()
        _templates[payload] = template or False
        if template is None:
            return call
    elif template is False:
        return cloudpickle.loads(payload)
    # the template itself is never called: its state stays as unpickled
    kind, fn, args, kwargs, rebuild = template
    return kind, (_rebuilt(fn) if rebuild else fn), args, kwargs


def _template(call):
    """(kind, fn, args, kwargs, rebuild) if every call of these bytes can be
    made from this one unpickling; None otherwise."""
    kind, fn, args, kwargs = call
    if not (_immutable(args) and all(_immutable(v) for v in kwargs.values())):
        return None
    if _by_reference(fn):  # what each unpickling gives too
        return kind, fn, args, kwargs, False
    if type(fn) is not types.FunctionType:
        return None
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    state = [
        *(v for k, v in fn.__globals__.items() if k != "__builtins__"),
        *(fn.__defaults__ or ()),
        *(fn.__kwdefaults__ or {}).values(),
        *cells,
        *fn.__dict__.values(),
        *fn.__annotations__.values(),
    ]
    if not all(_immutable(v) for v in state):
        return None
    return kind, fn, args, kwargs, True


def _rebuilt(template):
    """A new function of `template`'s code with copies of its state."""
    closure = template.__closure__
    if closure is not None:
        closure = tuple(_copied_cell(cell) for cell in closure)
    fn = types.FunctionType(
        template.__code__, dict(template.__globals__), template.__name__, template.__defaults__, closure
    )
    fn.__qualname__ = template.__qualname__
    fn.__module__ = template.__module__
    fn.__doc__ = template.__doc__
    if template.__kwdefaults__ is not None:
        fn.__kwdefaults__ = dict(template.__kwdefaults__)
    if template.__annotations__:
        fn.__annotations__ = dict(template.__annotations__)
    if template.__dict__:
        fn.__dict__.update(template.__dict__)
    return fn


def _copied_cell(cell):
    try:
        return types.CellType(cell.cell_contents)
    except ValueError:  # an empty cell stays empty
        return types.CellType()


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, range, type(...), type(NotImplemented)})


def _immutable(value, depth=0):
    """Whether `value` cannot change, or is the same object in every
    unpickling (a module, or a class or function pickled by reference)."""
    kind = type(value)
    if kind in _ATOMS:
        return True
    if kind is tuple or kind is frozenset:
        return depth < 8 and all(_immutable(v, depth + 1) for v in value)
    if kind is types.ModuleType:
        return sys.modules.get(value.__name__) is value
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return _by_reference(value)
    return False


def _by_reference(value):
    """Whether `value` is what its module and qualified name import here:
    cloudpickle pickles such objects by name, not by value."""
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return False
    found = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found is value
