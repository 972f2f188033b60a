"""`horovod.runner` on kolo: `horovod.run(fn, ...)` (`run`) runs a function
in every process of a job and returns their results, and `horovodrun`
(`launch`) runs commands, both on kolo's launcher."""

from .launch import _run


class _HorovodArgs:
    """horovodrun's arguments, as `horovod.run` fills them (every field
    `launch.parse_args` gives, unset)."""

    def __init__(self):
        from .launch import make_parser

        for action in make_parser()._actions:
            if action.dest not in ("help", "version"):
                setattr(self, action.dest, None)
        self.num_proc = 1
        self.command = None
        self.run_func = None
        self.executable = None
        self.nic = None


def run(
    func,
    args=(),
    kwargs=None,
    num_proc=None,
    min_num_proc=None,
    max_num_proc=None,
    slots=None,
    reset_limit=None,
    cooldown_range=None,
    hosts=None,
    hostfile=None,
    start_timeout=None,
    ssh_port=None,
    ssh_identity_file=None,
    disable_cache=None,
    output_filename=None,
    verbose=None,
    use_gloo=None,
    use_mpi=None,
    mpi_args=None,
    network_interfaces=None,
    executable=None,
    host_discovery_script=None,
    np=None,
    min_np=None,
    max_np=None,
):
    """Runs `func(*args, **kwargs)` in each of `num_proc` processes of a
    job (on `hosts`, `localhost:num_proc` by default) and returns every
    process's result, in rank order. With `min_num_proc` or
    `host_discovery_script` the job is elastic (kolo's in-place driver:
    the results are those of the last round's processes). A process that
    raises or dies ends the job with horovodrun's RuntimeError."""
    import warnings

    if np is not None:
        num_proc = np
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning, stacklevel=2)
    if min_np is not None:
        min_num_proc = min_np
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=2)
    if max_np is not None:
        max_num_proc = max_np
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=2)
    if kwargs is None:
        kwargs = {}
    if hosts and hostfile:
        raise ValueError("Argument hosts and hostfile only allow one provided.")
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")

    def wrapped_func():
        return func(*args, **kwargs)

    hargs = _HorovodArgs()
    hargs.num_proc, hargs.min_num_proc, hargs.max_num_proc, hargs.slots = num_proc, min_num_proc, max_num_proc, slots
    hargs.reset_limit, hargs.cooldown_range = reset_limit, cooldown_range
    hargs.hosts, hargs.hostfile, hargs.host_discovery_script = hosts, hostfile, host_discovery_script
    hargs.start_timeout, hargs.ssh_port, hargs.ssh_identity_file = start_timeout, ssh_port, ssh_identity_file
    hargs.mpi_args, hargs.disable_cache, hargs.output_filename = mpi_args, disable_cache, output_filename
    hargs.verbose, hargs.use_gloo, hargs.use_mpi = verbose, use_gloo, use_mpi
    hargs.nics = set(network_interfaces) if network_interfaces else None
    hargs.run_func = wrapped_func
    hargs.executable = executable
    return _run(hargs)


__all__ = ["run"]
