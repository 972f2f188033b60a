"""kolo's exceptions that Horovod's API names (`horovod.common.exceptions`
re-exports these same classes): kolo's framework-free core raises them
(an in-place round's hosts changed), so they live below every framework
and below kolo's Horovod."""


class HorovodInternalError(RuntimeError):
    """A collective failed: a peer died or disagreed about the call. Elastic
    jobs restore the last commit and go on."""


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts came or went; `skip_sync` when only removals happened."""

    def __init__(self, skip_sync=False):
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync
