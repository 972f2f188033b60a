"""The elastic driver's tunables, by horovodrun's names. kolo's driver (in
Rust) runs the job; `horovod.runner.launch._run_elastic` and
`horovod.run` read these when they start one, so a patched value is
honoured: `DISCOVER_HOSTS_FREQUENCY_SECS` is the seconds between two
runs of the discovery script (`kolo run --discovery-interval`),
`ELASTIC_TIMEOUT_SECS` the elastic timeout when neither
`--elastic-timeout` nor `HOROVOD_ELASTIC_TIMEOUT` gives one."""

DISCOVER_HOSTS_FREQUENCY_SECS = 1.0
ELASTIC_TIMEOUT_SECS = 600
