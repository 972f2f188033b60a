"""horovodrun on kolo: `horovodrun -np 4 -H a:2,b:2 python train.py` runs
on kolo's launcher (`kolo run`), and `horovod.runner.launch`'s functions
(`parse_args`, `_run`, `_run_elastic`, `run_commandline`) keep
horovodrun's names and meaning for code and tests that call them.

This module only translates: horovodrun's options become `kolo run`'s
(`_kolo_argv`), its tunables the `HOROVOD_*` variables the ranks read
(`config_parser`), and functions run through kolo.Executor
(`horovod.run`). Options kolo cannot honour (`--mpi`, `--jsrun`, MPI's
arguments) fail with an error that names them and what to use instead."""

import argparse
import json
import math
import os
import signal
import sys
import tempfile

from .common.util import config_parser
from .elastic import constants
from .elastic import driver as elastic_driver

_DESCRIPTION = "Horovod's launcher (horovodrun) on kolo: runs COMMAND as NP processes of a job."

# horovodrun's MPI-only options: what to do instead
_NOT_KOLO = {
    "use_mpi": ("--mpi", "kolo runs jobs with its own launcher and core (as Gloo does): drop --mpi"),
    "use_jsrun": ("--jsrun", "kolo starts ranks itself (local processes, ssh, Slurm or Ray): drop --jsrun"),
    "mpi_args": ("--mpi-args", "there is no mpirun under kolo: pass variables with -x NAME=VALUE"),
    "binding_args": ("--binding-args", "there is no mpirun under kolo to bind processes: drop --binding-args"),
}


def _nics(deprecated):
    class Nics(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            names = [n for n in values.split(",") if n]
            setattr(namespace, self.dest, (getattr(namespace, self.dest) or set()) | set(names))

    return Nics


def _check_build_table():
    import importlib.util

    from .._version import __version__ as horovod_version
    from ..common import basics, util

    def have(module):
        return importlib.util.find_spec(module) is not None

    def mark(yes):
        return "[X]" if yes else "[ ]"

    lines = [
        f"Horovod v{horovod_version} (kolo {_kolo_version()}):",
        "",
        "Available Frameworks:",
        f"    {mark(have('tensorflow'))} TensorFlow",
        f"    {mark(have('torch'))} PyTorch",
        "    [ ] MXNet",
        "",
        "Available Controllers:",
        f"    {mark(basics.mpi_built())} MPI",
        f"    {mark(basics.gloo_built())} Gloo (kolo's core)",
        "",
        "Available Tensor Operations:",
        f"    {mark(util.nccl_built())} NCCL",
        "    [ ] DDL",
        "    [ ] CCL",
        f"    {mark(basics.mpi_built())} MPI",
        f"    {mark(basics.gloo_built())} Gloo (kolo's collectives)",
    ]
    return "\n".join(lines)


def _kolo_version():
    from kolo import __version__

    return __version__


class _CheckBuild(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_check_build_table())
        parser.exit()


def make_parser():
    """horovodrun's command line, its options by their own spellings."""
    p = argparse.ArgumentParser(prog="horovodrun", description=_DESCRIPTION, allow_abbrev=False)
    p.add_argument("-v", "--version", action="version", version=f"horovodrun on kolo {_kolo_version()}")
    p.add_argument(
        "-np",
        "--num-proc",
        "-num-proc",
        dest="num_proc",
        type=int,
        help="processes to run (default: the slots of the hosts)",
    )
    p.add_argument(
        "-cb",
        "--check-build",
        action=_CheckBuild,
        help="show which frameworks, controllers and operations this build has, and exit",
    )
    p.add_argument(
        "--disable-cache",
        action="store_true",
        dest="disable_cache",
        help="accepted: kolo keeps no cache of host checks",
    )
    p.add_argument(
        "--start-timeout",
        dest="start_timeout",
        type=int,
        help="seconds for every process to start and connect (default: HOROVOD_START_TIMEOUT or 30)",
    )
    p.add_argument(
        "--network-interfaces",
        "--network-interface",
        action=_nics(False),
        dest="nics",
        help="network interfaces for the job's traffic, comma-separated",
    )
    p.add_argument(
        "--output-filename",
        dest="output_filename",
        help="also write each rank's output to DIR/rank.N/stdout and stderr",
    )
    p.add_argument("--verbose", action="store_true", dest="verbose")
    p.add_argument("--config-file", dest="config_file", help="YAML file of tunables (horovodrun's sections)")
    p.add_argument("-p", "--ssh-port", dest="ssh_port", type=int)
    p.add_argument("-i", "--ssh-identity-file", dest="ssh_identity_file")
    p.add_argument(
        "-x",
        dest="env_vars",
        action="append",
        metavar="VAR[=VALUE]",
        help="kolo's: pass a variable to the ranks (its value here, or VALUE)",
    )
    t = p.add_argument_group("tunables (HOROVOD_* variables of the ranks)")
    t.add_argument("--fusion-threshold-mb", dest="fusion_threshold_mb", type=int)
    t.add_argument("--cycle-time-ms", dest="cycle_time_ms", type=float)
    t.add_argument("--cache-capacity", dest="cache_capacity", type=int)
    for name in ("hierarchical-allreduce", "hierarchical-allgather", "torus-allreduce"):
        dest = name.replace("-", "_")
        t.add_argument(f"--{name}", dest=dest, action="store_const", const=True)
        t.add_argument(f"--no-{name}", dest=dest, action="store_const", const=False)
    t.add_argument("--autotune", dest="autotune", action="store_const", const=True)
    t.add_argument("--no-autotune", dest="autotune", action="store_const", const=False)
    t.add_argument("--autotune-log-file", dest="autotune_log_file")
    t.add_argument("--autotune-warmup-samples", dest="autotune_warmup_samples", type=int)
    t.add_argument("--autotune-steps-per-sample", dest="autotune_steps_per_sample", type=int)
    t.add_argument("--autotune-bayes-opt-max-samples", dest="autotune_bayes_opt_max_samples", type=int)
    t.add_argument("--autotune-gaussian-process-noise", dest="autotune_gaussian_process_noise", type=float)
    t.add_argument("--timeline-filename", dest="timeline_filename")
    t.add_argument("--timeline-mark-cycles", dest="timeline_mark_cycles", action="store_const", const=True)
    t.add_argument("--no-timeline-mark-cycles", dest="timeline_mark_cycles", action="store_const", const=False)
    t.add_argument("--no-stall-check", dest="no_stall_check", action="store_const", const=True)
    t.add_argument("--stall-check", dest="no_stall_check", action="store_const", const=False)
    t.add_argument("--stall-check-warning-time-seconds", dest="stall_check_warning_time_seconds", type=int)
    t.add_argument("--stall-check-shutdown-time-seconds", dest="stall_check_shutdown_time_seconds", type=int)
    t.add_argument("--mpi-threads-disable", dest="mpi_threads_disable", action="store_const", const=True)
    t.add_argument("--no-mpi-threads-disable", dest="mpi_threads_disable", action="store_const", const=False)
    t.add_argument("--num-nccl-streams", dest="num_nccl_streams", type=int)
    t.add_argument("--thread-affinity", dest="thread_affinity", type=int)
    t.add_argument("--gloo-timeout-seconds", dest="gloo_timeout_seconds", type=int)
    t.add_argument("--tcp", dest="tcp_flag", action="store_true", help="NCCL_IB_DISABLE=1 in the ranks")
    t.add_argument("--log-level", dest="log_level", choices=["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"])
    t.add_argument(
        "--log-with-timestamp", "--no-log-hide-timestamp", dest="log_with_timestamp", action="store_const", const=True
    )
    t.add_argument(
        "--log-without-timestamp", "--log-hide-timestamp", dest="log_with_timestamp", action="store_const", const=False
    )
    t.add_argument(
        "-prefix-timestamp",
        "--prefix-output-with-timestamp",
        dest="prefix_output_with_timestamp",
        action="store_true",
        help="start each output line with the time",
    )
    e = p.add_argument_group("elastic (kolo's in-place elastic driver)")
    e.add_argument("--min-np", "--min-num-proc", "-min-num-proc", dest="min_num_proc", type=int)
    e.add_argument("--max-np", "--max-num-proc", "-max-num-proc", dest="max_num_proc", type=int)
    e.add_argument(
        "--slots-per-host",
        "--slots",
        dest="slots",
        type=int,
        help="slots of a host the discovery script prints without :slots",
    )
    e.add_argument("--elastic-timeout", dest="elastic_timeout", type=int)
    e.add_argument("--reset-limit", dest="reset_limit", type=int)
    e.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=int, nargs=2, metavar=("MIN", "MAX"))
    h = p.add_argument_group("hosts").add_mutually_exclusive_group()
    h.add_argument("-H", "--hosts", dest="hosts", help="host1:slots,host2:slots")
    h.add_argument("-hostfile", "--hostfile", dest="hostfile", help="a file of 'host slots=N' lines")
    h.add_argument("--host-discovery-script", dest="host_discovery_script")
    c = p.add_argument_group("controller").add_mutually_exclusive_group()
    c.add_argument("--gloo", dest="use_gloo", action="store_true", help="kolo's core (Gloo's place): the default")
    c.add_argument("--mpi", dest="use_mpi", action="store_true", help="not with kolo")
    c.add_argument("--jsrun", dest="use_jsrun", action="store_true", help="not with kolo")
    p.add_argument("--mpi-args", dest="mpi_args", help="not with kolo")
    p.add_argument("--binding-args", dest="binding_args", help="not with kolo")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each process runs")
    return p


def parse_args(argv=None):
    """horovodrun's arguments (of `sys.argv` unless given), with a
    `--config-file`'s values for the tunables not given on the line."""
    parser = make_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    args.run_func = None
    args.executable = None
    args.nic = None
    if args.config_file:
        given = {k for k, v in vars(args).items() if v is not None}
        config_parser.set_args_from_config(args, _load_config(args.config_file), given)
    config_parser.validate_config_args(args)
    return args


def _load_config(path):
    try:
        import yaml
    except ImportError:
        raise ValueError(f"--config-file {path}: reading it needs PyYAML (pip install pyyaml)") from None
    with open(path) as f:
        return yaml.safe_load(f) or {}


class _JobFailed(RuntimeError):
    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


_FAILED = (
    "Horovod detected that one or more processes exited with non-zero status, thus causing the job to be "
    "terminated. The first process to do so was:\n{}"
)


def _refuse_mpi(args):
    for dest, (option, instead) in _NOT_KOLO.items():
        if getattr(args, dest, None):
            raise ValueError(f"horovodrun {option}: {instead}")


def _is_elastic(args):
    return getattr(args, "host_discovery_script", None) is not None or getattr(args, "min_num_proc", None) is not None


def _start_timeout(args):
    if getattr(args, "start_timeout", None):
        return args.start_timeout
    return int(os.getenv("HOROVOD_START_TIMEOUT", "30"))


def _elastic_timeout(args):
    if getattr(args, "elastic_timeout", None) is not None:
        return args.elastic_timeout
    return float(os.getenv("HOROVOD_ELASTIC_TIMEOUT", elastic_driver.ELASTIC_TIMEOUT_SECS))


def _env(args):
    """The variables the tunables ask for (set on top of what passes through)."""
    return config_parser.set_env_from_args({}, args)


def _kolo_argv(args, elastic, outcome_file):
    """`kolo run`'s arguments for horovodrun's."""
    argv = ["kolo", "run", "--outcome-file", outcome_file]
    if args.num_proc is not None:
        argv += ["-np", str(args.num_proc)]
    if getattr(args, "hosts", None):
        argv += ["-H", args.hosts]
    elif getattr(args, "hostfile", None):
        argv += ["--hostfile", args.hostfile]
    argv += ["--start-timeout", str(_start_timeout(args))]
    if args.nics:
        argv += ["--nics", ",".join(sorted(args.nics))]
    if args.output_filename:
        argv += ["--output-filename", args.output_filename]
    if getattr(args, "prefix_output_with_timestamp", False):
        argv.append("--prefix-output-with-timestamp")
    if args.ssh_port:
        argv += ["--ssh-port", str(args.ssh_port)]
    if args.ssh_identity_file:
        argv += ["--ssh-identity-file", args.ssh_identity_file]
    if args.verbose:
        argv.append("-v")
    if elastic:
        argv += [
            "--in-place",
            "--min-np",
            str(args.min_num_proc or args.num_proc),
            "--elastic-timeout",
            str(math.ceil(_elastic_timeout(args))),
            "--discovery-interval",
            str(elastic_driver.DISCOVER_HOSTS_FREQUENCY_SECS),
        ]
        if args.max_num_proc is not None:
            argv += ["--max-np", str(args.max_num_proc)]
        if args.host_discovery_script:
            argv += ["--host-discovery-script", args.host_discovery_script]
        if args.slots is not None:
            argv += ["--slots-per-host", str(args.slots)]
        if args.reset_limit is not None:
            argv += ["--reset-limit", str(args.reset_limit)]
        if args.cooldown_range:
            low, high = args.cooldown_range
            argv += ["--cooldown-range", f"{low}:{high}"]
    for name, value in sorted(_env(args).items()):
        argv += ["--env", f"{name}={value}"]
    for var in getattr(args, "env_vars", None) or []:
        argv += ["-x", var]
    if not args.command:
        raise ValueError(
            "horovodrun: no command to run: put it after the options, e.g. horovodrun -np 2 python train.py"
        )
    return argv + ["--"] + list(args.command)


def _run_command(args, elastic):
    """Runs horovodrun's command on kolo's launcher; how it ended (the
    dict `kolo run --outcome-file` writes)."""
    from kolo import _kolo

    _refuse_mpi(args)
    with tempfile.TemporaryDirectory(prefix="horovodrun-") as private:  # 0700
        outcome_file = os.path.join(private, "outcome.json")
        code = _kolo.main(_kolo_argv(args, elastic, outcome_file), sys.executable, ["-m", "kolo._worker"])
        try:
            with open(outcome_file) as f:
                ended = json.load(f)
        except (OSError, ValueError):
            ended = {"exit_code": code, "error": "kolo's launcher ended before the job (see its message above)"}
    ended["exit_code"] = code
    return ended


def _raise_for(ended, reset_limit):
    """Raises horovodrun's error for a job that did not succeed."""
    code = ended["exit_code"]
    if code == 0:
        return
    stopped = ended.get("stopped")
    if stopped and stopped[0] == "reset_limit":
        raise _JobFailed(constants.RESET_LIMIT_EXCEEDED_MESSAGE.format(reset_limit) + f" (kolo: {stopped[1]})", code)
    if ended.get("error"):
        raise _JobFailed(f"horovodrun: {ended['error']}", code)
    if ended.get("interrupted_by"):
        raise _JobFailed(f"horovodrun: the job was stopped by {ended['interrupted_by']}", code)
    if ended.get("failed"):
        rank, host, how = ended["failed"]
        first = f"Process name: {rank}\nExit code: {code}\n(kolo: rank {rank} on host {host} {how})"
    elif stopped:
        first = f"(kolo: the elastic job stopped: {stopped[1]})"
    else:
        first = f"(kolo: the job exited with {code})"
    raise _JobFailed(_FAILED.format(first), code)


def _run_static(args):
    if args.run_func:
        return _run_function(args, elastic=False)
    _raise_for(_run_command(args, elastic=False), None)
    return None


def _run_elastic(args):
    """An elastic job on kolo's in-place elastic driver: the hosts of
    `--host-discovery-script`, or `-H` (at least two, as horovodrun
    asks)."""
    _check_elastic_hosts(args)
    if args.run_func:
        return _run_function(args, elastic=True)
    _raise_for(_run_command(args, elastic=True), args.reset_limit)
    return None


def _run(args):
    """Runs what `args` say (horovodrun's arguments, or `horovod.run`'s
    `_HorovodArgs`): a command (None, or horovodrun's RuntimeError) or
    a function (every rank's result, in rank order)."""
    _refuse_mpi(args)
    if not any(getattr(args, name, None) for name in ("hosts", "hostfile", "host_discovery_script")):
        if args.num_proc:
            args.hosts = f"localhost:{args.num_proc}"
    if _is_elastic(args):
        return _run_elastic(args)
    return _run_static(args)


def _run_function(args, elastic):
    """`horovod.run`: `args.run_func` in every process, through kolo.Executor."""
    import kolo

    for name, what in (("ssh_port", "ssh_port"), ("output_filename", "output_filename"), ("hostfile", "hostfile")):
        if getattr(args, name, None):
            raise ValueError(
                f"horovod.run({what}=...) is not supported by kolo's horovod.run yet: use horovodrun "
                f"(kolo run) for a command, or leave {what} out"
            )
    executable = getattr(args, "executable", None)
    if executable and os.path.realpath(executable) != os.path.realpath(sys.executable):
        raise ValueError(
            f"horovod.run(executable={executable!r}): kolo's workers are this Python "
            f"({sys.executable}); run horovod.run from the Python you want the workers to be"
        )
    settings = kolo.Executor.create_settings(
        timeout_s=_start_timeout(args),
        ssh_identity_file=args.ssh_identity_file,
        nics=set(args.nics) if args.nics else None,
    )
    env = _env(args)
    if elastic:
        executor = kolo.Executor(
            settings,
            hosts=args.hosts,
            min_workers=args.min_num_proc or args.num_proc,
            max_workers=args.max_num_proc,
            reset_limit=args.reset_limit,
            cooldown_range=tuple(args.cooldown_range) if args.cooldown_range else None,
            elastic_timeout=_elastic_timeout(args),
            host_discovery_script=args.host_discovery_script,
            discovery_interval=elastic_driver.DISCOVER_HOSTS_FREQUENCY_SECS,
        )
    else:
        executor = kolo.Executor(settings, num_workers=args.num_proc, hosts=args.hosts)
    try:
        executor.start(extra_env_vars=env)
        if elastic:
            return executor.run(args.run_func)
        return executor.run(args.run_func, fail_fast=True)
    except kolo.JobStopped as e:
        if getattr(e, "kind", None) == "reset_limit":
            raise RuntimeError(constants.RESET_LIMIT_EXCEEDED_MESSAGE.format(args.reset_limit) + f" (kolo: {e})") from e
        raise RuntimeError(_FAILED.format(f"(kolo: {e})")) from e
    except (kolo.WorkerError, kolo.WorkerLost) as e:
        raise RuntimeError(_FAILED.format(f"(kolo: {e})")) from e
    except RuntimeError as e:
        if "task failed on rank" not in str(e):
            raise
        raise RuntimeError(_FAILED.format(f"(kolo: {e})")) from e
    finally:
        executor.shutdown()


def run_commandline():
    """The `horovodrun` command: exits with the job's exit code."""
    # kolo handles SIGINT itself (the job's teardown; a second one hurries it)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        args = parse_args()
        _refuse_mpi(args)
        if not any((args.hosts, args.hostfile, args.host_discovery_script)) and args.num_proc:
            args.hosts = f"localhost:{args.num_proc}"
        elastic = _is_elastic(args)
        if elastic:
            _check_elastic_hosts(args)
        ended = _run_command(args, elastic)
    except ValueError as e:
        print(f"horovodrun: error: {e}", file=sys.stderr)
        sys.exit(2)
    # kolo has said how the job ended
    sys.exit(ended["exit_code"])


def _check_elastic_hosts(args):
    """horovodrun's rule: an elastic job's hosts come from a discovery
    script, or `-H` names at least two."""
    if args.host_discovery_script:
        return
    if not args.hosts:
        raise ValueError("One of --host-discovery-script, --hosts, or --hostnames must be provided")
    if len([h for h in args.hosts.split(",") if h]) < 2:
        raise ValueError("Cannot run in fault tolerance mode with fewer than 2 hosts.")


main = run_commandline

if __name__ == "__main__":
    run_commandline()
