"""What every framework's Horovod API shares (upstream's
`horovod/common/basics.py` and `process_sets.py`): the process's one
Horovod core (kolo-horovod, Rust), init and shutdown, the topology and
process sets. `kolo.horovod.torch` and `kolo.horovod.tensorflow` are thin
over it; a process that imports both has one core, one init and the same
process sets in both. Each framework adds what it needs at init and
shutdown through `on_init` and `on_shutdown`."""

import atexit
import os
import threading

from kolo import _kolo, _rounds

from .exceptions import HorovodInternalError

# what horovod.torch and horovod.tensorflow export of this module as their
# own (each takes it with `from ..common.basics import *`)
__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "global_process_set",
    "remove_process_set",
    "init",
    "is_initialized",
    "shutdown",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "ccl_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "start_timeline",
    "stop_timeline",
]

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OPS = (Average, Sum, Adasum, Min, Max, Product)


# ---- process sets (horovod/common/process_sets.py) -------------------------


class ProcessSet:
    """A set of the job's processes that runs collectives among themselves:
    pass it to `init(process_sets=[...])` or `add_process_set`; once
    registered, `process_set_id` is its id on every rank."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError(
                "ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object"
            ) from None
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.ranks = ranks

    def _invalidate(self):
        self.process_set_id = None

    def size(self):
        """How many processes the set has; None until it is registered."""
        if self.process_set_id is None:
            return None
        ranks = _core().process_set_ranks(self.process_set_id)
        if ranks is None:
            raise ValueError("Process set does not exist or has not been registered.")
        return len(ranks)

    def rank(self):
        """This process's rank inside the set; None until it is registered."""
        if self.process_set_id is None:
            return None
        ranks = _core().process_set_ranks(self.process_set_id)
        if ranks is None:
            raise ValueError("Process set does not exist or has not been registered.")
        if rank() not in ranks:
            raise ValueError("Process is not part of provided process set.")
        return ranks.index(rank())

    def included(self):
        """Whether this process belongs to the set (None without ranks)."""
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _set_id(process_set, op):
    """The id of a registered set (upstream's message for one that is not)."""
    process_set = global_process_set if process_set is None else process_set
    if process_set.process_set_id is None:
        raise ValueError(f"{op}: Process set provided does not exist, or has not been registered.")
    return process_set.process_set_id


def add_process_set(process_set):
    """Registers a process set with every rank (each calls this alike and
    in the same order; needs `HOROVOD_DYNAMIC_PROCESS_SETS=1` or
    `init(process_sets="dynamic")`); the set, with its id."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    try:
        handle = _core().add_process_set(process_set.ranks)
        ((_, dims, _),) = handle.results()
    except _kolo.CollectiveError as e:
        raise HorovodInternalError(str(e)) from None
    process_set.process_set_id = dims[0]
    return process_set


def remove_process_set(process_set):
    """Removes a process set with every rank; whether it was removed."""
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    process_set._invalidate()
    try:
        handle = _core().remove_process_set(set_id)
        if handle is None:
            return False
        handle.results()
    except _kolo.CollectiveError as e:
        raise HorovodInternalError(str(e)) from None
    return True


# ---- init and topology -------------------------------------------------------


class _State:
    def __init__(self):
        self.core = None
        # an elastic round's communicator (in-place state moves over it)
        self.comm = None
        self.generation = 0
        self.ranks = None
        self.handles = {}
        # upstream's handle counter: 0 in a new process and after shutdown
        self.last_handle = 0
        self.lock = threading.Lock()
        self.atexit = False


_state = _State()


def _next_handle():
    """The next of upstream's handle ids, from 1 (again after a shutdown):
    every framework's submissions count on it, and an unnamed one is named
    by it (`_wire_name`)."""
    with _state.lock:
        _state.last_handle += 1
        return _state.last_handle


def _wire_name(kind, name, handle):
    """A collective's name as the core matches it: `kind.name`, or, unnamed,
    `kind.noname.handle` (so unnamed calls match in the order issued)."""
    return f"{kind}.{name}" if name is not None else f"{kind}.noname.{handle}"


# what each framework's module adds: checks before a core starts (raising
# leaves none behind), its set-up once the core runs, its teardown before
# the core stops (see on_init, on_shutdown)
_checks, _starts, _stops = [], [], []


def on_init(check=None, start=None):
    """Registers a framework's `check()`, called before a core starts, and
    `start(core)`, called once it runs (for every later init too)."""
    if check is not None and check not in _checks:
        _checks.append(check)
    if start is not None and start not in _starts:
        _starts.append(start)
        if _state.core is not None:
            start(_state.core)


def on_shutdown(stop):
    """Registers a framework's `stop(core)`, called when the core stops."""
    if stop not in _stops:
        _stops.append(stop)


def _env_int(*names, default):
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return default


def _static_sets(process_sets):
    """`init`'s process sets as rank lists, with upstream's checks."""
    if process_sets is None:
        return [], []
    if process_sets == "dynamic":
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
        return [], []
    sets = [ps if isinstance(ps, ProcessSet) else ProcessSet(ps) for ps in process_sets]
    seen = []
    for i, ps in enumerate(sets):
        if ps.ranks is None:
            raise ValueError("kolo's Horovod builds process sets from lists of ranks, not MPI communicators")
        if ps.ranks in seen or ps.ranks == []:
            raise ValueError(
                f"Horovod could not be initialized because process_sets entry number {i} is a duplicate: {ps}"
            )
        seen.append(ps.ranks)
    return sets, seen


def init(comm=None, process_sets=None):
    """Starts Horovod's core on the job's ranks (idempotent). Inside a kolo
    job: every rank of it; elsewhere: one process alone, as Horovod without
    a rendezvous. `process_sets`: sets registered now (a list of
    `ProcessSet`s or rank lists), or "dynamic" to add them later."""
    if _state.core is not None:
        if not _state.core.restartable:
            return
        # the job shut this core down (a peer's shutdown, a stall past its
        # shutdown time): a new one starts with the ranks that init again,
        # as after this rank's own shutdown
        shutdown()
    if comm is not None:
        raise ValueError(
            "init(comm=...) takes MPI communicators; kolo's Horovod runs on kolo's collectives: call init()"
        )
    sets, ranks = _static_sets(process_sets)
    # checked before a core starts, so that bad input leaves none behind
    for check in _checks:
        check()
    try:
        if _rounds.in_place_job():
            # an in-place elastic job: the next round this process has a
            # place in, with its ranks there (`hvd.elastic.run` re-inits
            # each round); the core gets a communicator of its own
            while True:
                joined = _rounds.join("hvd.init")
                try:
                    core = _rounds._the_worker("hvd.init").horovod_core(ranks)
                    break
                except _kolo.MembershipError:
                    # the round ended while its core started (a peer died,
                    # hosts came or went): init takes the next one
                    continue
            _state.comm = joined.comm
            _state.ranks = (
                joined.rank,
                joined.size,
                joined.local_rank,
                joined.local_size,
                joined.cross_rank,
                joined.cross_size,
            )
        else:
            core = _join_job(ranks)
    except _kolo.CollectiveError as e:
        raise HorovodInternalError(str(e)) from None
    _state.core = core
    _state.generation += 1
    _state.handles.clear()
    for start in _starts:
        start(core)
    global_process_set.ranks = list(range(core.size))
    for ps in sets:
        ps.process_set_id = core.process_set_id(ps.ranks)
    if not _state.atexit:
        atexit.register(_stop, "its process is exiting", exiting=True)
        _state.atexit = True


def _join_job(sets):
    in_job = bool(os.environ.get(_kolo.ENV["SECRET"])) and _kolo.ENV["RANK"] in os.environ
    # Horovod's collectives wait as long as their peers take (rank 0 saving
    # a checkpoint, say); a peer that dies is noticed at once all the same.
    # KOLO_COMM_TIMEOUT_SECONDS bounds the wait; else torch's 30 minutes.
    timeout = float(os.environ.get(_kolo.ENV["COMM_TIMEOUT_SECONDS"]) or 1800)
    core = _kolo.HorovodCore.from_env(_state.generation, timeout, sets) if in_job else _kolo.HorovodCore.single(sets)
    size, rank = core.size, core.rank
    _state.ranks = (
        rank,
        size,
        _env_int("HOROVOD_LOCAL_RANK", "LOCAL_RANK", default=0 if size == 1 else rank),
        _env_int("HOROVOD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", default=1 if size == 1 else size),
        _env_int("HOROVOD_CROSS_RANK", default=0),
        _env_int("HOROVOD_CROSS_SIZE", default=1),
    )
    return core


def shutdown():
    """Stops the core with every rank; `init()` may be called again."""
    _stop("hvd.shutdown() was called")


def _stop(reason, exiting=False):
    """`shutdown`, saying why in every rank's errors for pending work
    (`exiting`: this process ends, so no peer waits for it to init again)."""
    core, _state.core = _state.core, None
    _state.ranks = None
    _state.handles.clear()
    _state.last_handle = 0
    global_process_set.ranks = []
    if core is not None:
        core.shutdown(reason, exiting)
        for stop in _stops:
            stop(core)
    comm, _state.comm = _state.comm, None
    if comm is not None:
        _rounds.leave()


def is_initialized():
    return _state.core is not None


def _ranks():
    if _state.ranks is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state.ranks


def _core():
    if _state.core is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state.core


def rank():
    return _ranks()[0]


def size():
    return _ranks()[1]


def local_rank():
    return _ranks()[2]


def local_size():
    return _ranks()[3]


def cross_rank():
    return _ranks()[4]


def cross_size():
    return _ranks()[5]


def mpi_enabled():
    return False


def mpi_built():
    return False


def gloo_enabled():
    return is_initialized()


def gloo_built():
    return True


def ddl_built():
    return False


def ccl_built():
    return False


def mpi_threads_supported():
    raise ValueError("Horovod has not been built with MPI support (kolo's Horovod runs on kolo's collectives).")


def start_timeline(file_path, mark_cycles=False):
    """Records Horovod's timeline into `file_path` from now on (rank 0
    writes it; the job must have started with `HOROVOD_TIMELINE` set,
    `DYNAMIC` to record nothing until now); `mark_cycles`: a
    `CYCLE_START` mark per cycle of the core."""
    _core().start_timeline(os.fspath(file_path), bool(mark_cycles))


def stop_timeline():
    """Stops recording the timeline and finishes its file."""
    _core().stop_timeline()


# ---- checks shared by every framework ----------------------------------------


def _op_of(average, op, default=Average):
    if average is not None and op is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        return Average if average else Sum
    op = default if op is None else op
    if op not in _OPS:
        raise ValueError(f"unknown op {op}: use hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max or hvd.Product")
    return op


def _check_adasum(process_set, device_tensors=False):
    """Upstream's refusals for an Adasum reduction, before it is submitted:
    only the global set, only a power-of-two number of ranks. kolo's
    Adasum runs in the core, on host memory."""
    process_set = global_process_set if process_set is None else process_set
    if process_set.process_set_id != 0:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    if device_tensors:
        raise NotImplementedError(
            "kolo's Adasum reduces tensors in host memory: move the tensors to the CPU (tensor.cpu()) first"
        )
    n = size()
    if n & (n - 1):
        raise NotImplementedError(
            f"Running Adasum with non-power of 2 ranks is not supported yet (this job has {n} ranks: "
            "run it on a power-of-two number of ranks, or use op=hvd.Average)"
        )


def predivide_scales(op, gradient_predivide_factor):
    """`(prescale, postscale)` of upstream's gradient_predivide_factor: an
    average divides by the factor before the sum and multiplies after."""
    if op == Average and gradient_predivide_factor != 1.0:
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0
