"""horovodrun's tunables as the `HOROVOD_*` variables the ranks read
(`set_env_from_args`), and its YAML config file (`set_args_from_config`)."""

# (argument, variable, how the value is written); a None argument sets nothing
_MB = 1024 * 1024


def _flag(value):
    return "1" if value else "0"


def _not(value):
    return "0" if value else "1"


_TUNABLES = [
    ("fusion_threshold_mb", "HOROVOD_FUSION_THRESHOLD", lambda v: str(int(v * _MB))),
    ("cycle_time_ms", "HOROVOD_CYCLE_TIME", str),
    ("cache_capacity", "HOROVOD_CACHE_CAPACITY", str),
    ("hierarchical_allreduce", "HOROVOD_HIERARCHICAL_ALLREDUCE", _flag),
    ("hierarchical_allgather", "HOROVOD_HIERARCHICAL_ALLGATHER", _flag),
    ("torus_allreduce", "HOROVOD_TORUS_ALLREDUCE", _flag),
    ("no_stall_check", "HOROVOD_STALL_CHECK_DISABLE", _flag),
    ("stall_check_warning_time_seconds", "HOROVOD_STALL_CHECK_TIME_SECONDS", str),
    ("stall_check_shutdown_time_seconds", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str),
    ("mpi_threads_disable", "HOROVOD_MPI_THREADS_DISABLE", _flag),
    ("num_nccl_streams", "HOROVOD_NUM_NCCL_STREAMS", str),
    ("thread_affinity", "HOROVOD_THREAD_AFFINITY", str),
    ("gloo_timeout_seconds", "HOROVOD_GLOO_TIMEOUT_SECONDS", str),
    ("log_level", "HOROVOD_LOG_LEVEL", str),
    ("log_with_timestamp", "HOROVOD_LOG_HIDE_TIME", _not),
]
# set only when autotune is on, or a timeline asked for
_AUTOTUNE = [
    ("autotune", "HOROVOD_AUTOTUNE", _flag),
    ("autotune_log_file", "HOROVOD_AUTOTUNE_LOG", str),
    ("autotune_warmup_samples", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", str),
    ("autotune_steps_per_sample", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", str),
    ("autotune_bayes_opt_max_samples", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", str),
    ("autotune_gaussian_process_noise", "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", str),
]
_TIMELINE = [
    ("timeline_filename", "HOROVOD_TIMELINE", str),
    ("timeline_mark_cycles", "HOROVOD_TIMELINE_MARK_CYCLES", _flag),
]


def _put(env, args, table):
    for arg, variable, write in table:
        value = getattr(args, arg, None)
        if value is not None:
            env[variable] = write(value)


def set_env_from_args(env, args):
    """Writes the variables the arguments ask for into `env` (a dict); the
    arguments not given leave theirs as they are. Returns `env`."""
    _put(env, args, _TUNABLES)
    if getattr(args, "autotune", None):
        _put(env, args, _AUTOTUNE)
    if getattr(args, "timeline_filename", None):
        _put(env, args, _TIMELINE)
    if getattr(args, "tcp_flag", None):
        env["NCCL_IB_DISABLE"] = "1"
    return env


# config file sections: (section, key) -> argument
_CONFIG = {
    ("params", "fusion_threshold_mb"): "fusion_threshold_mb",
    ("params", "cycle_time_ms"): "cycle_time_ms",
    ("params", "cache_capacity"): "cache_capacity",
    ("params", "hierarchical_allreduce"): "hierarchical_allreduce",
    ("params", "hierarchical_allgather"): "hierarchical_allgather",
    ("params", "torus_allreduce"): "torus_allreduce",
    ("autotune", "enabled"): "autotune",
    ("autotune", "log_file"): "autotune_log_file",
    ("autotune", "warmup_samples"): "autotune_warmup_samples",
    ("autotune", "steps_per_sample"): "autotune_steps_per_sample",
    ("autotune", "bayes_opt_max_samples"): "autotune_bayes_opt_max_samples",
    ("autotune", "gaussian_process_noise"): "autotune_gaussian_process_noise",
    ("timeline", "filename"): "timeline_filename",
    ("timeline", "mark_cycles"): "timeline_mark_cycles",
    ("stall_check", "warning_time_seconds"): "stall_check_warning_time_seconds",
    ("stall_check", "shutdown_time_seconds"): "stall_check_shutdown_time_seconds",
    ("library_options", "mpi_threads_disable"): "mpi_threads_disable",
    ("library_options", "num_nccl_streams"): "num_nccl_streams",
    ("library_options", "thread_affinity"): "thread_affinity",
    ("library_options", "gloo_timeout_seconds"): "gloo_timeout_seconds",
    ("logging", "level"): "log_level",
    ("logging", "with_timestamp"): "log_with_timestamp",
}


def set_args_from_config(args, config, override_args):
    """Fills the arguments from a parsed config file (`--config-file`),
    except those given on the command line (`override_args`)."""
    if not isinstance(config, dict):
        raise ValueError(f"the config file must hold a mapping of sections, found {type(config).__name__}")
    for section, values in config.items():
        if section == "stall_check" and isinstance(values, dict) and "enabled" in values:
            if "no_stall_check" not in override_args:
                args.no_stall_check = not values["enabled"]
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            arg = _CONFIG.get((section, key))
            if arg is None:
                if (section, key) != ("stall_check", "enabled"):
                    raise ValueError(f"the config file's {section}.{key} is not a horovodrun setting")
                continue
            if arg not in override_args:
                setattr(args, arg, value)


def validate_config_args(args):
    """Non-negative numbers where horovodrun wants them."""
    for name in (
        "fusion_threshold_mb",
        "cycle_time_ms",
        "cache_capacity",
        "autotune_warmup_samples",
        "autotune_steps_per_sample",
        "autotune_bayes_opt_max_samples",
        "stall_check_warning_time_seconds",
        "stall_check_shutdown_time_seconds",
        "num_nccl_streams",
        "thread_affinity",
        "gloo_timeout_seconds",
    ):
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    noise = getattr(args, "autotune_gaussian_process_noise", None)
    if noise is not None and not 0 <= noise <= 1:
        raise ValueError(f"autotune_gaussian_process_noise={noise} must be in [0, 1]")
